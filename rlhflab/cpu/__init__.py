"""The CPU-only settings, in one place, applied by the run context (`rlhflab.run`) when the
training device is a CPU and never otherwise; their config is the `cpu:` section.

    setup_process(device, cpu_cfg)     once per process, before the models load:
        - the float32 linear library (`cpu.matmul`: oneDNN or torch's own; rlhflab/cpu/matmul.py,
          docs/cpu_matmul.md); on another device a `cpu.matmul` other than auto is refused
        - glibc's malloc hands every freed block of 4 MiB or more back to the system
          (`map_large_allocations`: about 10% less resident memory at Qwen2.5-0.5B's size)
    apply(module, model_cfg, device)   on each model a run trains or scores with:
        - `nn.Linear` layers switched to `FastLinear` when oneDNN was chosen
    share_prompt(device, setting)      read by the engine's scoring and update passes
        (engine/scoring.group_layout): `<method>.layout: auto` computes a group's prompt once
        (the shared layout) on a CPU, where its FLOPs are the cost, and runs padded rows
        elsewhere (a GPU at 135M is paced by kernel launches, not FLOPs; bench/NOTES.md)
    apply_default_wait()               how idle OpenMP threads wait (rlhflab/openmp.py); it
        must run before torch is imported, so the command line calls it, not the context.

A CPU-only setting stays only where it saves at least 10% of a shipped SmolLM2 recipe's step on
the CPU it targets: oneDNN linears do on an AMD EPYC (about a third of a step). The critic's
worker thread, the lean RMSNorm, the inverse-CDF token draw and the allocator switch did not
and were removed (issue 51; bench/NOTES.md).

Standard library only at import time: the CLI imports `apply_default_wait` before torch.
"""

from __future__ import annotations

from typing import NamedTuple

from rlhflab.openmp import apply_default_wait, default_wait, describe  # noqa: F401  (re-exported)

MMAP_THRESHOLD_BYTES = 4 << 20   # blocks this large get their own mapping, unmapped when freed
_M_MMAP_THRESHOLD = -3           # mallopt's parameter number (<malloc.h>)

# The float32 linear library this process chose ("onednn" or "torch"; None: not chosen yet).
# The one process-wide matmul setting: ops/ has none, and the models' FastLinear layers
# (installed by `apply` only when this is "onednn") carry it into the forward passes.
_matmul: str | None = None


class Applied(NamedTuple):
    """What `apply` changed on one module."""

    linears: int          # nn.Linear layers switched to FastLinear (oneDNN)


NOTHING = Applied(0)


def on_cpu(device) -> bool:
    return getattr(device, "type", str(device)) == "cpu"


def setup_process(device, cpu_cfg=None) -> str:
    """The process-wide CPU settings for a run on `device` (see the module docstring);
    returns the float32 linear library in use: "onednn" or "torch"."""
    from rlhflab.errors import UserError

    mode = getattr(cpu_cfg, "matmul", "auto")
    if not on_cpu(device):
        if mode != "auto":
            raise UserError(f"cpu.matmul: {mode} is a CPU setting and this run trains on "
                            f"{getattr(device, 'type', device)}; remove cpu.matmul (docs/cpu_matmul.md)")
        return set_matmul("torch")  # the plain library path; FastLinear is never used
    try:
        mode = set_matmul(mode)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    map_large_allocations(device)
    return mode


def share_prompt(device, setting) -> bool:
    """Whether a group's prompt is computed once for its responses in the scoring and update
    passes (`<method>.layout: auto` asks "auto": on a CPU only); true and false as set."""
    return on_cpu(device) if setting == "auto" else bool(setting)


def set_matmul(mode: str) -> str:
    """Choose this process's float32 linear library from `cpu.matmul` (auto, onednn,
    torch; `cpu.matmul.resolve`); returns the resolved one, "onednn" or "torch"."""
    from rlhflab.cpu.matmul import resolve

    global _matmul
    _matmul = resolve(mode)
    return _matmul


def matmul_library() -> str:
    """The float32 linear library in use: "onednn" or "torch" (torch's own when no run chose
    one yet); train_result.json records it."""
    return _matmul if _matmul is not None else set_matmul("torch")


def apply(module, model_cfg=None, device="cpu", *, trained: bool = True) -> Applied:
    """The per-model CPU settings on `module` (a causal LM, a sequence classifier, an
    `ActorCritic`): its linear layers on oneDNN where `cpu.matmul` chose it; nothing unless
    `device` is a CPU. Call it after LoRA is attached (the adapter's own layers are switched
    too). Value heads keep torch's own linear. (`model_cfg` and `trained` are kept for the
    callers; no setting depends on them any more.)"""
    if module is None or not on_cpu(device):
        return NOTHING
    from rlhflab.cpu.matmul import use_fast_linears

    critic = getattr(module, "critic", None)
    heads = [h for h in (getattr(module, "value_head", None), getattr(critic, "value_head", None)) if h is not None]
    held = [(m, m.__class__) for head in heads for m in head.modules()]  # value heads keep torch's own
    linears = use_fast_linears(module) if matmul_library() == "onednn" else 0
    for m, cls in held:
        if m.__class__ is not cls:
            m.__class__ = cls
            linears -= 1
    return Applied(linears)


def apply_to_models(models, model_cfg) -> None:
    """`apply` on a policy run's models (`models.setup.PolicyModels`): the actor (policy and
    critic) as trained, a reference copy as frozen."""
    apply(models.actor, model_cfg, models.device)
    reference = getattr(models, "reference", None)
    ref_model = getattr(reference, "model", None)
    if ref_model is not None and ref_model is not getattr(models.actor, "policy", None):
        apply(ref_model, model_cfg, models.device, trained=False)


def map_large_allocations(device=None, threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Have glibc serve every allocation of `threshold` bytes or more from its own
    mapping, which `free` returns to the system; True when set (glibc only, else a no-op;
    a device other than the CPU: a no-op).

    glibc's default threshold moves: each time a mapped block is freed it rises to that
    block's size (up to 32 MiB), and later blocks below it come from the heap, whose freed
    space is given back only from its top. A training step frees and re-allocates
    hundreds of 1-32 MiB gradients and activations, so freed memory stays resident: at
    Qwen2.5-0.5B's size, 1.15 GiB at the second optimizer step's peak (11.20 GiB above
    the baseline, 10.04-10.05 GiB with this: bench/real_scale.py). The cost is a page
    fault per fresh page of such blocks (about 3% more CPU time over that step; keeping
    freed blocks instead gained 5-6% on SmolLM2's shipped steps, under the 10% rule).
    Process-wide; calling it again is harmless.
    """
    return _mallopt(device, {_M_MMAP_THRESHOLD: threshold})


def _mallopt(device, settings: dict[int, int]) -> bool:
    """glibc's `mallopt(param, value)` for each setting; True when every one was taken.
    A device other than the CPU, or no glibc (macOS, Windows): nothing, False."""
    if device is not None and not on_cpu(device):
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in settings.items())
