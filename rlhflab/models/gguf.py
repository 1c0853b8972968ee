"""Import a GGUF file (llama.cpp's format) as a plain Hugging Face model folder.

`rlhflab import-gguf FILE --out DIR` reads the file with transformers' own GGUF loader,
which dequantizes every tensor (Q4_1, Q4_K, ...) to float32, and writes a folder that
every rlhflab command reads like any `save_pretrained` folder:

    config.json, model.safetensors        the weights, in --dtype (float32 by default)
    tokenizer.json, tokenizer_config.json the tokenizer, with its chat template when the
    chat_template.jinja                   file carries one (tokenizer.chat_template); it
                                          adds the BOS when the file says so (add_bos_token)
    generation_config.json                eos_token_id lists the end-of-turn token
                                          (<|im_end|>, <end_of_turn>, ...) and the EOS
    import_info.json                      source file, its SHA-256, dtype, architecture

Why a new model is built: a model loaded with ``gguf_file=`` is marked as quantized and
refuses `save_pretrained`, so the folder is written from a model built from the same
config with the loaded state dict. The weights are the dequantized values exactly; the
folder's logits equal transformers' GGUF load (tests/test_real_model.py).

A `.gguf` path given as a model (`model.name_or_path`, `--model`) is imported once into
a cache folder, `$RLHFLAB_GGUF_CACHE/<sha256[:12]>-<name>/` (default
``~/.cache/rlhflab/gguf``), by `cached_import`; `rlhflab.models.load` calls it.

The `gguf` package is an optional extra (``pip install 'rlhflab[gguf]'``), imported only here.
Bad input (not a GGUF file, a truncated one, an architecture transformers cannot
dequantize, no `gguf` package, an --out folder that already holds files) is a one-line
`UserError` naming the file and the fix; a failed import leaves no half-written folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, NamedTuple

from rlhflab.errors import UserError

MAGIC = b"GGUF"
CACHE_ENV = "RLHFLAB_GGUF_CACHE"
DTYPES = ("float32", "bfloat16")
# End-of-turn tokens of the chat formats in use, looked up by name in the vocabulary when
# the file has no tokenizer.ggml.eot_token_id: ChatML (SmolLM2, Qwen), Gemma, Llama 3, Phi-3.
END_OF_TURN_NAMES = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")
INSTALL_HINT = "pip install 'rlhflab[gguf]' (or pip install gguf)"
# The architectures rlhflab reads from GGUF (import-gguf, transformers' loader) and writes to
# it (export-gguf, llama.cpp's converter): GGUF general.architecture -> the Hugging Face
# class. Mistral is written as "llama"; tests/test_gguf_export.py checks both sides.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "stablelm": "StableLmForCausalLM", "gpt2": "GPT2LMHeadModel",
                 "falcon": "FalconForCausalLM", "bloom": "BloomForCausalLM", "starcoder2": "Starcoder2ForCausalLM",
                 "nemotron": "NemotronForCausalLM"}


class GGUFHeader(NamedTuple):
    """What is read from a GGUF file before any weight is loaded."""

    architecture: str
    n_tensors: int
    eos_id: int | None
    eot_id: int | None       # end of turn, from tokenizer.ggml.eot_token_id or a known name
    pad_id: int | None
    tokens: list[str]
    add_bos: bool = False    # tokenizer.ggml.add_bos_token: text starts with the BOS (Gemma)


class ImportResult(NamedTuple):
    out_dir: Path
    sha256: str
    architecture: str
    n_params: int
    stop_ids: list[int]


def cache_root() -> Path:
    """Where `.gguf` model paths are imported: $RLHFLAB_GGUF_CACHE or ~/.cache/rlhflab/gguf."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rlhflab" / "gguf"


def is_gguf_path(name_or_path: str | os.PathLike) -> bool:
    return str(name_or_path).lower().endswith(".gguf")


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _import_gguf_package():
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it too)
    except ImportError:
        return None
    return gguf


def _field(reader, key: str):
    """A scalar or string field of the GGUF metadata, or None (works on gguf 0.10 and later)."""
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    part = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(part).decode("utf-8", errors="replace")
    return part.tolist()[0]


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Check that `path` is a whole GGUF file of an architecture transformers can load."""
    return _read(path)[0]


def _read(path: str | os.PathLike) -> tuple[GGUFHeader, Any]:
    """`read_header`'s header and the `gguf.GGUFReader` it was read with."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"{path}: no such GGUF file; check the path")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != MAGIC:
        raise UserError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF'); "
                        f"give a .gguf file as written by llama.cpp's converters")
    gguf = _import_gguf_package()
    if gguf is None:
        raise UserError(f"{path}: reading GGUF files needs the `gguf` package, which is not installed; {INSTALL_HINT}")
    size = path.stat().st_size
    seen: dict[str, int] = {}

    class Reader(gguf.GGUFReader):
        """gguf's reader, noting where the tensors end (from the tensor table, read before the
        data) so a file cut inside its tensor data is named as such, not by numpy's reshape."""

        def _build_tensors(self, start_offs, fields):
            try:
                ends = []
                for fl in fields:
                    dims, raw_dtype, offset = fl.parts[3], fl.parts[4], fl.parts[5]
                    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_dtype[0]))]
                    n_elems = 1
                    for d in dims.tolist():
                        n_elems *= int(d)
                    ends.append(int(start_offs) + int(offset[0]) + n_elems * type_size // block)
                seen["end"] = max(ends, default=0)
            except Exception:  # a table this code cannot read: gguf's own error follows
                pass
            return super()._build_tensors(start_offs, fields)

    try:
        reader = Reader(str(path))
    except Exception as exc:  # numpy reshape / dtype errors from a file that ends early
        if seen.get("end", 0) > size:
            raise UserError(f"{path}: truncated GGUF file ({size:,} bytes, its tensors end at byte {seen['end']:,}); "
                            f"download or copy it again") from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{path}: truncated or damaged GGUF file ({size:,} bytes; {first}); "
                        f"download or copy it again") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise UserError(f"{path}: truncated GGUF file ({size:,} bytes, its tensors end at byte {end:,}); "
                        f"download or copy it again")
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise UserError(f"{path}: the GGUF file names no general.architecture; it cannot be imported")
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if arch not in GGUF_SUPPORTED_ARCHITECTURES or arch not in ARCHITECTURES:
        import transformers

        known = ", ".join(a for a in ARCHITECTURES if a in GGUF_SUPPORTED_ARCHITECTURES)
        if arch in GGUF_SUPPORTED_ARCHITECTURES:
            raise UserError(f"{path}: architecture {arch!r} is not a causal LM rlhflab imports and exports (it "
                            f"does: {known}); convert the original model with save_pretrained instead")
        raise UserError(f"{path}: architecture {arch!r} cannot be dequantized by transformers "
                        f"{transformers.__version__} (rlhflab imports and exports: {known}); convert the original "
                        f"model with save_pretrained instead, or use a newer transformers")
    tok_field = reader.fields.get("tokenizer.ggml.tokens")
    tokens = [bytes(tok_field.parts[i]).decode("utf-8", errors="replace") for i in tok_field.data] if tok_field else []
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is None:
        index = {t: i for i, t in enumerate(tokens)}
        eot = next((index[n] for n in END_OF_TURN_NAMES if n in index), None)
    return GGUFHeader(arch, len(reader.tensors), _field(reader, "tokenizer.ggml.eos_token_id"), eot,
                      _field(reader, "tokenizer.ggml.padding_token_id"), tokens,
                      bool(_field(reader, "tokenizer.ggml.add_bos_token"))), reader


@contextmanager
def _parsed_once(gguf, path: Path, reader):
    """Inside the block, `gguf.GGUFReader(path)` of this file returns `reader`, the one
    already built, and `gguf.get_tensor_name_map` builds each architecture's name map once.
    transformers' GGUF load builds a reader of the file for the tokenizer, the config and
    the weights, each parsing every metadata field again (SmolLM2's 49,152-token vocabulary
    and merges: about 2 s of CPU each), and a name map for every module of the model (397
    for SmolLM2, about 7 ms each); it only reads them. Other files, or other arguments,
    get a reader of their own."""
    build, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    path = path.resolve()
    maps: dict = {}

    def reader_of(file, *args, **kwargs):
        if not args and not kwargs and Path(file).resolve() == path:
            return reader
        return build(file, *args, **kwargs)

    def name_map_of(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = name_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader_of, name_map_of
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = build, name_map


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file; give a new folder")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out}: the folder exists and is not empty; give a new folder, or remove it first")


def stop_ids_of(header: GGUFHeader) -> list[int]:
    """The ids generation stops at: the end-of-turn token first, then the EOS (no repeats)."""
    ids: list[int] = []
    for i in (header.eot_id, header.eos_id):
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    return ids


def import_gguf(file: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32",
                quiet: bool = False, on_load: Callable[[Any, Any], None] | None = None) -> ImportResult:
    """Write `file` (a .gguf) as a Hugging Face folder at `out`; see the module docstring.

    `on_load(model, tokenizer)`, when given, is called with transformers' own GGUF load
    (float32) before the folder is built from it: a caller that compares the folder with
    that load (tests/test_real_model.py) need not load the file a second time. The folder
    is built from the same tensors, config and tokenizer, which the import goes on to
    change: a caller that keeps them keeps a copy."""
    src = Path(file).expanduser().resolve()
    out = Path(out).expanduser()
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose {' or '.join(DTYPES)}")
    _check_out(out)
    header, reader = _read(src)
    say = (lambda *a: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    say(f"importing {src.name} ({header.architecture}, {header.n_tensors} tensors): dequantizing every tensor "
        f"to float32 and writing {out}")
    digest = sha256_of(src)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _parsed_once(_import_gguf_package(), src, reader):
            tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
            loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    except Exception as exc:  # an unsupported quantization type, a tokenizer model transformers lacks, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{src}: transformers {transformers.__version__} could not load this GGUF file ({first}); "
                        f"convert the original model with save_pretrained instead") from None
    if on_load is not None:
        on_load(loaded, tok)
    if header.add_bos and tok.bos_token_id is not None and tok("a").input_ids[:1] != [tok.bos_token_id]:
        # transformers' GGUF tokenizer drops the file's add_bos_token; Gemma without its
        # BOS answers "The capital of France is" with " France. The The The ..."
        tok.add_bos_token = True
    # The GGUF-loaded model refuses save_pretrained (it is marked quantized): rebuild it.
    config = loaded.config
    for key in ("quantization_config",):
        if hasattr(config, key):
            delattr(config, key)
    # Built on the meta device and given the loaded tensors (assign): no random init of
    # weights that are overwritten at once.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()  # assign gave the tied embedding and LM head two Parameters
    del loaded
    empty = [k for k, v in model.state_dict().items() if v.is_meta]
    if empty:
        raise UserError(f"{src}: the GGUF file holds no weights for {empty[:3]} ({len(empty)} tensors); "
                        f"it cannot be imported")
    model.to(getattr(torch, dtype))
    stops = stop_ids_of(header)
    gen = model.generation_config
    if stops:
        gen.eos_token_id = stops if len(stops) > 1 else stops[0]
    pad = header.pad_id if header.pad_id is not None else (stops[-1] if stops else None)
    if pad is not None:
        gen.pad_token_id = int(pad)
    n_params = sum(p.numel() for p in model.parameters())

    # Write beside the target and rename at the end: an interrupted import leaves no
    # folder that looks finished.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.importing-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        gen.save_pretrained(tmp)
        from rlhflab.models.checkpoint import usual_modes

        usual_modes(tmp)  # model.safetensors 0644 like the rest, not safetensors' 0600
        import gguf

        info = {"source": str(src), "sha256": digest, "dtype": dtype, "architecture": header.architecture,
                "parameters": n_params, "stop_token_ids": stops,
                "stop_tokens": [header.tokens[i] for i in stops if i < len(header.tokens)],
                "chat_template": bool(getattr(tok, "chat_template", None)),
                "transformers": transformers.__version__, "gguf": getattr(gguf, "__version__", None)
                or _dist_version("gguf")}
        (tmp / "import_info.json").write_text(json.dumps(info, indent=2) + "\n")
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ImportResult(out, digest, header.architecture, n_params, stops)


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cached_import(file: str | os.PathLike) -> Path:
    """The folder a `.gguf` model path stands for, imported on first use (float32).

    The folder is named by the file's content (`<sha256[:12]>-<stem>`), so a changed file
    gets a new folder, and a finished folder (import_info.json present) is reused.
    """
    src = Path(file).expanduser()
    if not src.is_file():
        raise UserError(f"model path {str(file)!r}: no such GGUF file; check the path "
                        f"(or import a folder with `rlhflab import-gguf FILE --out DIR`)")
    digest = sha256_of(src)
    folder = cache_root() / f"{digest[:12]}-{src.stem}"
    if (folder / "import_info.json").is_file():
        return folder
    if folder.is_dir():  # not finished (import_info.json is written last): import again
        shutil.rmtree(folder)
    try:
        import_gguf(src, folder)
    except (OSError, UserError):
        if (folder / "import_info.json").is_file():  # another process imported it meanwhile
            return folder
        raise
    print(f"imported {src} into {folder} (set {CACHE_ENV} to choose the folder)", file=sys.stderr, flush=True)
    return folder


# ---- `rlhflab import-gguf` ------------------------------------------------------------

def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Import a GGUF file (llama.cpp's format, e.g. a model from the package registry) as a "
                          "Hugging Face folder: dequantized weights, tokenizer with its chat template, and a "
                          "generation config that stops at the end-of-turn token.")
    parser.add_argument("file", help="the .gguf file")
    parser.add_argument("--out", required=True, help="a new (or empty) folder to write")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="dtype of the saved weights (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    res = import_gguf(args.file, args.out, dtype=args.dtype)
    print(f"imported {args.file} ({res.architecture}, {res.n_params / 1e6:.1f}M parameters, stop ids "
          f"{res.stop_ids}) into {res.out_dir}")
    return 0
