"""The CPU-only speed seam: every trick fitted to training on a CPU, in one place, applied
by the run context (`rlhflab.run`) when the training device is a CPU and never otherwise.

    setup_process(device, model_cfg)   once per process, before the models load:
        - the float32 linear library (`model.cpu_matmul`: oneDNN or torch's own;
          rlhflab/models/cpu_matmul.py, docs/cpu_matmul.md)
        - how glibc's malloc treats freed blocks (`model.cpu_allocator`): `reuse` keeps
          those below 256 MiB and never trims the heap (`reuse_freed_blocks`: no fresh
          pages to fault in after the first step), `release` hands every block of 4 MiB
          or more back to the system when freed (`map_large_allocations`: the least
          resident memory, a page fault per fresh page; bench/real_scale.py)
    apply(module, model_cfg, device)   on each model a run trains or scores with:
        - `nn.Linear` layers switched to `FastLinear` when oneDNN was chosen
        - RMSNorms switched to the lean `RMSNormFn` (`model.lean_norm`; trained models only)
        - a separate critic's pass beside the policy's in a worker thread
          (`model.critic_overlap`, engine/overlap.py; trained actor-critics only)
    fast_draw(device, gen_cfg)         read by the hf rollout backend when it is built:
        - sampled tokens drawn by inverse transform, one uniform number per row
          (`generation.fast_draw`, rollout/hf.py), not torch.multinomial's one per
          vocabulary entry: the same distribution, other tokens for a given seed
    share_prompt(device, setting)      read by the engine's scoring and update passes
        (engine/scoring.shared_group_size): `share_prompt: auto` (the group
        methods' sections) computes a group's prompt once on a CPU, where its FLOPs are the
        cost, and once per response elsewhere (a GPU at 135M is paced by kernel launches,
        which the shared prompt's second pass doubles; bench/NOTES.md)
    apply_default_wait()               how idle OpenMP threads wait (rlhflab/openmp.py); it
        must run before torch is imported, so the command line calls it, not the context.

On any other device (CUDA) `setup_process` sets the plain library path (torch's own float32
linears) and does nothing else, and `apply` changes nothing: no module is swapped and no
thread is started. `model.lean_mlp` (half the MLP's saved activations on any device) is a
model option, not part of this seam (`models.lean.make_lean`).

Which tricks are on by default is decided by one rule: a trick stays on only where it
saves at least 10% of a real model's step time or memory on a CPU (bench/cpu_tricks.py on
SmolLM2-135M-Instruct's PPO and GRPO steps; the tables are in docs/cpu_matmul.md, "Each
CPU trick on a real model"). By that rule oneDNN linears are on where they pay: the default
`model.cpu_matmul: auto` picks them on non-Intel CPUs with AVX-512 (a third off a step on an
AMD EPYC) and torch's MKL on Intel's (where oneDNN was slower); the lean RMSNorm
(`model.lean_norm: true`), the critic's worker thread (`model.critic_overlap: true`) and the
inverse-CDF draw (`generation.fast_draw: true`) are opt-in; and `model.cpu_allocator` stays
`release` (it changes no number a run computes, and keeps 10% of the memory at
Qwen2.5-0.5B's size resident no longer), with `reuse` opt-in (-4% to +6% off SmolLM2's shipped
steps, 2-14% off their updates, 23% off a 0.5B step, for more resident memory;
docs/cpu_matmul.md).

Standard library only at import time: the CLI imports `apply_default_wait` before torch.
"""

from __future__ import annotations

from typing import NamedTuple

from rlhflab.openmp import apply_default_wait, default_wait, describe  # noqa: F401  (re-exported)

MMAP_THRESHOLD_BYTES = 4 << 20   # release: blocks this large get their own mapping, unmapped when freed
REUSE_BELOW_BYTES = 256 << 20    # reuse: blocks below this come from the heap; freed, they stay for reuse
_M_TRIM_THRESHOLD = -1           # mallopt's parameter numbers (<malloc.h>)
_M_MMAP_THRESHOLD = -3
_NEVER = -1                      # M_TRIM_THRESHOLD's value that turns trimming off

# The float32 linear library this process chose ("onednn" or "torch"; None: not chosen yet).
# The one process-wide matmul setting: ops/ has none, and the models' FastLinear layers
# (installed by `apply` only when this is "onednn") carry it into the forward passes.
_matmul: str | None = None


class Applied(NamedTuple):
    """What `apply` changed on one module."""

    linears: int          # nn.Linear layers switched to FastLinear (oneDNN)
    norms: int            # RMSNorms switched to the lean RMSNormFn
    critic_overlap: bool  # the separate critic's pass runs in the worker thread


NOTHING = Applied(0, 0, False)


def on_cpu(device) -> bool:
    return getattr(device, "type", str(device)) == "cpu"


def setup_process(device, model_cfg=None) -> str:
    """The process-wide CPU settings for a run on `device` (see the module docstring);
    returns the float32 linear library in use: "onednn" or "torch"."""
    from rlhflab.errors import UserError

    if not on_cpu(device):
        return set_matmul("torch")  # the plain library path; FastLinear is never used
    try:
        mode = set_matmul(getattr(model_cfg, "cpu_matmul", "torch"))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    set_allocator(getattr(model_cfg, "cpu_allocator", "release"), device)
    return mode


def fast_draw(device, gen_cfg) -> bool:
    """Whether the hf backend draws its sampled tokens by inverse transform
    (`generation.fast_draw`, `rollout.hf.InverseCDFDraw`) instead of `generate`'s
    torch.multinomial: on a CPU only, where multinomial's exponential per vocabulary entry
    costs most; never on another device."""
    return on_cpu(device) and bool(getattr(gen_cfg, "fast_draw", False))


def share_prompt(device, setting) -> bool:
    """Whether a group's prompt is computed once for its responses in the scoring and update
    passes (`<method>.share_prompt`): true and false as set; auto on a CPU only."""
    return on_cpu(device) if setting == "auto" else bool(setting)


def set_matmul(mode: str) -> str:
    """Choose this process's float32 linear library from `model.cpu_matmul` (auto, onednn,
    torch; `models.cpu_matmul.resolve`); returns the resolved one, "onednn" or "torch"."""
    from rlhflab.models.cpu_matmul import resolve

    global _matmul
    _matmul = resolve(mode)
    return _matmul


def matmul_library() -> str:
    """The float32 linear library in use: "onednn" or "torch" (torch's own when no run chose
    one yet); train_result.json records it."""
    return _matmul if _matmul is not None else set_matmul("torch")


def apply(module, model_cfg, device, *, trained: bool = True) -> Applied:
    """The per-model CPU tricks on `module` (a causal LM, a sequence classifier, an
    `ActorCritic`), as `model_cfg` asks; nothing unless `device` is a CPU. Call it after
    LoRA is attached (the adapter's own layers are switched too). `trained=False` (a
    frozen reference, a scorer) switches the linear layers only."""
    if module is None or not on_cpu(device):
        return NOTHING
    from rlhflab.models.cpu_matmul import use_fast_linears
    from rlhflab.models.lean import lean_norms

    critic = getattr(module, "critic", None)
    heads = [h for h in (getattr(module, "value_head", None), getattr(critic, "value_head", None)) if h is not None]
    held = [(m, m.__class__) for head in heads for m in head.modules()]  # value heads keep torch's own
    linears = use_fast_linears(module) if matmul_library() == "onednn" else 0
    for m, cls in held:
        if m.__class__ is not cls:
            m.__class__ = cls
            linears -= 1
    norms = lean_norms(module) if trained and getattr(model_cfg, "lean_norm", False) else 0
    overlap = False
    if trained and critic is not None and hasattr(module, "critic_overlap"):
        module.critic_overlap = overlap = bool(getattr(model_cfg, "critic_overlap", False))
    return Applied(linears, norms, overlap)


def apply_to_models(models, model_cfg) -> None:
    """`apply` on a policy run's models (`models.setup.PolicyModels`): the actor (policy and
    critic) as trained, a reference copy as frozen."""
    apply(models.actor, model_cfg, models.device)
    reference = getattr(models, "reference", None)
    ref_model = getattr(reference, "model", None)
    if ref_model is not None and ref_model is not getattr(models.actor, "policy", None):
        apply(ref_model, model_cfg, models.device, trained=False)


def set_allocator(mode: str, device=None) -> bool:
    """glibc's malloc setting that `model.cpu_allocator: mode` names: `reuse`
    (`reuse_freed_blocks`) or `release` (`map_large_allocations`); True when set (see
    those two for a device other than the CPU and for no glibc)."""
    if mode == "reuse":
        return reuse_freed_blocks(device)
    if mode == "release":
        return map_large_allocations(device)
    raise ValueError(f"cpu_allocator {mode!r}: choose reuse or release")


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
    fault per fresh page of such blocks (about 3% more CPU time over that step).
    Process-wide; calling it again is harmless.
    """
    return _mallopt(device, {_M_MMAP_THRESHOLD: threshold})


def reuse_freed_blocks(device=None, limit: int = REUSE_BELOW_BYTES) -> bool:
    """Have glibc serve every allocation below `limit` bytes from its heap, keep freed
    space there for the next allocation and never trim the heap; True when set (glibc
    only, else a no-op; a device other than the CPU: a no-op).

    A training step allocates and frees the same activations and gradients over and over
    (on SmolLM2: 8 MiB MLP products, 64 MiB chunks of logits, the 108 MiB embedding
    gradient). Mapped on their own (`map_large_allocations`) each comes back as fresh
    pages, one page fault per 4 KiB; here they reuse pages the process already has. The
    heap is not trimmed either: a step's passes grow and shrink it by gigabytes, and with
    glibc's trimming each regrowth was fresh pages again (1.4-1.8 million faults a
    separate-critic PPO step on SmolLM2 with a 256 MiB trim threshold, none without). The
    peak resident set is the same either way (trimming only lowers it between peaks); the
    cost is the memory fragmentation keeps resident, and the heap staying at its
    high-water mark until the process ends. Blocks of `limit` bytes and more, the largest
    gradients of bigger models, are still mapped and given back at once. Process-wide (a
    later `map_large_allocations` pins the mmap threshold again and leaves trimming off).
    """
    return _mallopt(device, {_M_MMAP_THRESHOLD: limit, _M_TRIM_THRESHOLD: _NEVER})


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
