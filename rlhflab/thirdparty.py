"""Side effects of third-party libraries that a run does not need, kept out; standard library only.

DeepSpeed. accelerate's `extract_model_from_parallel`, which transformers'
`save_pretrained` calls on every save (a tiny model, an SFT `final/`, a PPO checkpoint),
imports deepspeed whenever it is installed, only to ask whether the model is a
`DeepSpeedEngine`. On a machine without a GPU that import prints

    [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. ...

(and takes about a second), in runs that use no DeepSpeed strategy at all. A model can
only be a `DeepSpeedEngine` once deepspeed has been imported, so "is deepspeed imported
already?" answers accelerate's question exactly, without the import:
`defer_deepspeed()` makes `accelerate.utils.other` ask that instead of "is deepspeed
installed?", when that module loads. Under a DeepSpeed launch (`accelerate launch` with
`distributed_type: DEEPSPEED` sets ACCELERATE_USE_DEEPSPEED) nothing is changed:
accelerate imports deepspeed itself there, as it must.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_ACCELERATE_OTHER = "accelerate.utils.other"


def _deepspeed_imported() -> bool:
    return "deepspeed" in sys.modules


def _ask_imported(module) -> None:
    module.is_deepspeed_available = _deepspeed_imported


class _OnLoad(importlib.abc.MetaPathFinder):
    """Finds `accelerate.utils.other` as Python would, and patches it once it has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _ACCELERATE_OTHER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _ask_imported(module)

        spec.loader.exec_module = exec_module  # this spec's own loader instance
        return spec


def defer_deepspeed() -> None:
    """Keep deepspeed unimported unless a DeepSpeed strategy runs (module docstring).
    Call before anything imports accelerate; calling it again does nothing more."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").strip().lower() in ("1", "true", "yes"):
        return
    loaded = sys.modules.get(_ACCELERATE_OTHER)
    if loaded is not None:
        _ask_imported(loaded)
    elif not any(isinstance(f, _OnLoad) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnLoad())


# DeepSpeed's name for its CPU accelerator's shared-memory all-reduce op (ShareMemCommBuilder.NAME).
SHM_OP = "deepspeed_shm_comm"


def skip_deepspeed_shm_op() -> None:
    """DeepSpeed on a CPU: do not build the shared-memory all-reduce op.

    When DeepSpeed starts its process group on a CPU it compiles that op with g++ (about
    20 s, once per machine and per virtual environment: the build is keyed on the
    installed paths). Only `inference_all_reduce` uses it (DeepSpeed's tensor-parallel
    inference layers); training reduces through torch.distributed's gloo group, and
    `inference_all_reduce` itself falls back to that group without the op. Marked
    incompatible before the group starts, the op is neither built nor loaded. Call it
    before accelerate starts a DeepSpeed process group; imports deepspeed."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_OP] = False
