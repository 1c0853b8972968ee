"""Pieces every trainer shares: seeding, optimizer and schedule, output folder, timing,
and the end of a run (logger, plots, peak memory, train_result.json, before/after table)."""

from __future__ import annotations

import json
import math
import random
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from rlhflab.errors import UserError
from rlhflab.metrics import plot_metrics


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)


def make_optimizer(params: list[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   use_8bit: bool = False) -> torch.optim.Optimizer:
    """AdamW; 8-bit AdamW (bitsandbytes) when asked for and CUDA is present."""
    if not params:
        raise UserError("no trainable parameters; check lora.enabled / lora.target_modules")
    if use_8bit:
        on_cuda = any(p.is_cuda for p in params)
        try:
            import bitsandbytes as bnb  # noqa: F401
            have_bnb = True
        except ImportError:
            have_bnb = False
        if on_cuda and have_bnb:
            return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        why = "no CUDA device" if not on_cuda else "bitsandbytes is not installed (pip install 'rlhflab[bnb]')"
        warnings.warn(f"use_8bit_adam: {why}; using torch AdamW instead", stacklevel=2)
    # The fused kernel updates every parameter in one pass (CPU and CUDA); same result as
    # the per-tensor loop, several times faster for many small tensors.
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                             fused=fused or None)


def make_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                   schedule: str = "constant", min_lr: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then constant, cosine or linear decay down to `min_lr`."""
    base = optimizer.param_groups[0]["lr"]
    floor = min_lr / base if base > 0 else 0.0
    total = max(total_steps, 1)

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
        if schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if schedule == "linear":
            return floor + (1 - floor) * (1 - progress)
        raise ValueError(f"unknown lr schedule {schedule!r}")

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_optimization(params: list[torch.nn.Parameter], sec, total_optimizer_steps: int):
    """AdamW (fused; 8-bit when asked for and possible) and its schedule from a section
    with the usual optimizer fields (learning_rate, weight_decay, adam_*, use_8bit_adam,
    warmup_steps, lr_schedule, min_learning_rate): PPO, GRPO, RLOO and DPO sections."""
    optimizer = make_optimizer(params, sec.learning_rate, sec.weight_decay,
                               (sec.adam_beta1, sec.adam_beta2), sec.adam_eps, sec.use_8bit_adam)
    scheduler = make_scheduler(optimizer, total_optimizer_steps, sec.warmup_steps, sec.lr_schedule,
                               sec.min_learning_rate)
    return optimizer, scheduler


class Timer:
    """Accumulates wall time per phase: `with timer("generate"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{k}": v for k, v in self.seconds.items()}


def prepare_output_dir(path: str | Path, resume: bool = False) -> Path:
    """Create the run folder; refuse to mix a new run into an old one's step_N/ folders."""
    out = Path(path)
    if out.exists() and not resume and any(out.glob("step_*")):
        raise UserError(f"output folder {out} already holds checkpoints (step_*/); choose another "
                        f"training.output_dir, delete it, or continue with --resume {out}/step_N")
    out.mkdir(parents=True, exist_ok=True)
    return out


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    except ImportError:  # pragma: no cover
        return float("nan")


# --------------------------------------------------------------------------------------
# The end of a run
# --------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    """What a training run returns: where its outputs went and what it measured."""

    output_dir: Path
    final_dir: Path
    history: list[dict] = field(default_factory=list)
    eval_before: dict | None = None
    eval_after: dict | None = None
    samples_per_s: float = 0.0    # episodes (RL), pairs (DPO) or rows (SFT, RM) per second of training
    unit: str = "episodes"
    world_size: int = 1
    is_main: bool = True                       # False on the other processes of a multi-process run
    extra: dict = field(default_factory=dict)  # method-specific facts for train_result.json
    models: object | None = None               # the trained models, for callers in the same process
    state: dict = field(default_factory=dict)  # other in-process objects (e.g. DPO's reference cache)

    def report(self, skip_missing: bool = False) -> None:
        """Print the end-of-run summary and write train_result.json (the main process only)."""
        if not self.is_main:
            return
        print(f"done: {self.output_dir} (final model in {self.final_dir}); "
              f"{self.samples_per_s:.2f} {self.unit}/s")
        print_before_after(self.eval_before, self.eval_after, skip_missing)
        write_train_result(self.output_dir, eval_before=self.eval_before, eval_after=self.eval_after,
                           **{f"{self.unit}_per_s": self.samples_per_s}, world_size=self.world_size,
                           **self.extra)


def format_metrics(metrics: dict[str, float]) -> str:
    """`k=v, ...` with three decimals: the "step 0 (before training)" line."""
    return ", ".join(f"{k}={v:.3f}" for k, v in metrics.items())


def last_eval(history: list[dict]) -> dict[str, float] | None:
    """The eval/* metrics of the last history row that has any; None when none has."""
    evals = [h for h in history if any(k.startswith("eval/") for k in h)]
    if not evals:
        return None
    return {k: v for k, v in evals[-1].items() if k.startswith("eval/")}


def finish_run(logger, out_dir: Path, device: torch.device, plots: bool,
               plot_groups: dict[str, list[str]] | None = None) -> None:
    """Close the metrics logger, draw plots/ when asked, write peak_memory_mb.txt."""
    logger.close()
    if plots:
        plot_metrics(logger.path, out_dir / "plots", plot_groups)
    (out_dir / "peak_memory_mb.txt").write_text(f"{peak_memory_mb(device):.1f}\n")


def write_train_result(out_dir: Path, **fields) -> None:
    """train_result.json: the run's summary fields, in the order given."""
    (out_dir / "train_result.json").write_text(json.dumps(fields, indent=2))


def print_before_after(before: dict | None, after: dict | None, skip_missing: bool = False) -> None:
    """`  key: before -> after` per final eval metric; nothing unless both are there.

    A key the starting evaluation lacks prints as nan, or is skipped with `skip_missing`.
    """
    if not (before and after):
        return
    for k in after:
        if skip_missing and k not in before:
            continue
        print(f"  {k}: {before.get(k, float('nan')):.3f} -> {after[k]:.3f}")


def check_resume_dir(resume: str | Path | None) -> Path | None:
    """The `--resume` folder as a Path (None when not resuming); it must hold trainer state."""
    from rlhflab.models.checkpoint import STATE_FILE

    if resume is None:
        return None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise UserError(f"--resume {path}: no {STATE_FILE} there; point it at a step_N/ folder")
    return path


def make_doctor(enabled: bool, max_grad_norm: float | None, kl_knob: str = "ppo.kl_coeff"):
    """The training doctor for an RL loop, or None when `logging.doctor` is off."""
    if not enabled:
        return None
    from rlhflab.doctor import Doctor

    return Doctor(max_grad_norm=max_grad_norm, kl_knob=kl_knob)


def log_step(logger, doctor, step: int, metrics: dict) -> None:
    """Phase 6's bookkeeping: the step's metrics to every sink, and the doctor's new
    findings printed above the progress bar."""
    logger.log(step, metrics)
    if doctor is not None:
        from tqdm import tqdm

        for finding in doctor.observe(step, metrics):
            tqdm.write(str(finding))
