"""Pieces the trainers' loops share: optimizer and schedule, held-out splits, timing, and
the divergence checks. What surrounds a loop (ranks, seeds, folders, sinks, the finish)
is the run context's (`rlhflab.run`); its names stay importable from here."""

from __future__ import annotations

import math
import random
import time
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from rlhflab.errors import TrainingDiverged, UserError
from rlhflab.run.context import log_step, make_doctor, seed_everything, set_threads  # noqa: F401
from rlhflab.run.finish import (TrainResult, finish_run, format_metrics, peak_memory_mb,  # noqa: F401
                                print_before_after, write_train_result)
from rlhflab.run.folders import (RUN_MARKERS, RUN_OUTPUTS, STOPPED_LOGS, check_output_dir,  # noqa: F401
                                 check_resume_dir, prepare_output_dir, stopped_before_first_checkpoint)


def make_optimizer(params: list[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   use_8bit: bool = False) -> torch.optim.Optimizer:
    """AdamW; 8-bit AdamW (bitsandbytes) when asked for and CUDA is present."""
    # `params`: parameters, or param groups (dicts with "params" and their own "lr")
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if not tensors:
        raise UserError("no trainable parameters; check lora.enabled / lora.target_modules")
    if use_8bit:
        on_cuda = any(p.is_cuda for p in tensors)
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
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in tensors)
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


def warmup_of(sec, total_steps: int) -> int:
    """The warm-up in optimizer steps, from the two names every training section has for it:
    `warmup_steps` when set (> 0), else `warmup_ratio` of `total_steps` (rounded down)."""
    return sec.warmup_steps if sec.warmup_steps > 0 else int(sec.warmup_ratio * total_steps)


def make_optimization(params: list[torch.nn.Parameter], sec, total_optimizer_steps: int):
    """AdamW (fused; 8-bit when asked for and possible) and its schedule from a section
    with the usual optimizer fields (learning_rate, weight_decay, adam_*, use_8bit_adam,
    warmup_steps or warmup_ratio, lr_schedule, min_learning_rate): PPO, GRPO, RLOO and DPO sections."""
    optimizer = make_optimizer(params, sec.learning_rate, sec.weight_decay,
                               (sec.adam_beta1, sec.adam_beta2), sec.adam_eps, sec.use_8bit_adam)
    scheduler = make_scheduler(optimizer, total_optimizer_steps, warmup_of(sec, total_optimizer_steps),
                               sec.lr_schedule, sec.min_learning_rate)
    return optimizer, scheduler


def train_and_held_out(d, read: Callable[[str, str, str | None], list], seed: int,
                       unit: str = "rows") -> tuple[list, list]:
    """The training and held-out rows of a data section (SFT's `data`, the reward
    model's): `read(source, split, subset)` reads one file or hub split.

    Held out: `d.eval_path`, else the hub's `d.eval_split`, else a seeded share
    `d.eval_fraction` of the training rows (at least one), else none; `d.num_samples` and
    `d.num_eval_samples` cut the two lists. `unit` names the rows in the error message.
    """
    source = d.path or d.name
    train = read(source, d.split, d.subset)
    if d.num_samples is not None:
        train = train[: d.num_samples]
    if d.eval_path:
        held = read(d.eval_path, "train", None)
    elif d.path is None and d.eval_split:
        held = read(d.name, d.eval_split, d.subset)
    elif d.eval_fraction > 0:
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        n_eval = max(1, int(round(len(train) * d.eval_fraction)))
        if n_eval >= len(train):
            raise UserError(f"{source}: {len(train)} {unit} leave nothing to train on after holding out "
                            f"eval_fraction={d.eval_fraction}; lower data.eval_fraction or give data.eval_path")
        held_idx = set(order[:n_eval])
        held = [row for i, row in enumerate(train) if i in held_idx]
        train = [row for i, row in enumerate(train) if i not in held_idx]
    else:
        held = []
    if d.num_eval_samples is not None:
        held = held[: d.num_eval_samples]
    return train, held


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


# --------------------------------------------------------------------------------------
# The end of a run
# --------------------------------------------------------------------------------------
def last_eval(history: list[dict]) -> dict[str, float] | None:
    """The eval/* metrics of the last history row that has any; None when none has."""
    evals = [h for h in history if any(k.startswith("eval/") for k in h)]
    if not evals:
        return None
    return {k: v for k, v in evals[-1].items() if k.startswith("eval/")}


# --------------------------------------------------------------------------------------
# Divergence: a non-finite loss, gradient or forward pass stops the run with one line
# --------------------------------------------------------------------------------------
def make_probe_batch(tokenizer, texts: list[str], device: torch.device | str) -> dict[str, torch.Tensor]:
    """A small fixed batch (input_ids, attention_mask, each (B, L)) for `check_finite_model`:
    a few of the run's own prompts or texts, tokenized once at the start."""
    if not texts:
        raise ValueError("make_probe_batch needs at least one text")
    enc = tokenizer(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)
    return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}


def diverged(step: int, what: str, knob: str, lr: float | None) -> TrainingDiverged:
    """The one-line stop of a run at `step`, in the doctor's wording (`divergence_message`)."""
    from rlhflab.doctor import divergence_message

    return TrainingDiverged(f"step {step}: {divergence_message(what, knob, lr)}")


def check_finite_step(step: int, *, loss: float | None = None, grad_norm: float | None = None,
                      knob: str = "the learning rate", lr: float | None = None) -> None:
    """The doctor's stop rule on one step: raise `TrainingDiverged` when the loss or the
    (pre-clip) gradient norm is not finite. Call it after backward and before
    `optimizer.step()`, so a NaN gradient never reaches the weights. `knob` is the config
    key to lower (e.g. sft.learning_rate)."""
    from rlhflab.doctor import GRAD_NORM, stop_if_diverged

    stop_if_diverged(step, {"loss": loss, GRAD_NORM: grad_norm}, knob=knob, lr=lr)


@torch.no_grad()
def check_finite_model(model: torch.nn.Module, probe_batch: dict[str, torch.Tensor], *, step: int,
                       knob: str = "the learning rate", lr: float | None = None) -> None:
    """Raise `TrainingDiverged` when `model`'s forward pass on `probe_batch` (from
    `make_probe_batch`) gives a logit that is not finite. Call it before every save, so
    the newest checkpoint is always one that can still generate; a weight that blew up
    (learning rate far too high) shows here even when the last loss was finite."""
    was_training = model.training
    model.eval()
    try:
        logits = model(**probe_batch).logits
    finally:
        model.train(was_training)
    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).sum())
        raise diverged(step, f"the model's forward pass gives {bad} non-finite logits on a probe batch, "
                              f"so this step is not saved", knob, lr)


def clip_and_step(params: list, optimizer, scheduler, max_grad_norm: float | None, *, step: int, knob: str,
                  dist=None) -> float:
    """The end of one optimizer step: the global gradient norm clipped to `max_grad_norm`
    (None: measured only; over every rank with `dist`), the run stopped in one line naming
    `knob` when that norm is not finite (before the weights move), then the optimizer and
    the schedule step and the gradients are cleared. Returns the norm before clipping."""
    lr = optimizer.param_groups[0]["lr"]
    max_norm = max_grad_norm if max_grad_norm is not None else float("inf")
    grad_norm = (dist.clip_grad_norm_(params, max_norm) if dist is not None
                 else float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
    check_finite_step(step, grad_norm=grad_norm, knob=knob, lr=lr)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


# --------------------------------------------------------------------------------------
# The command line of a trainer that takes a config and overrides (SFT, RM, classifier)
# --------------------------------------------------------------------------------------
def add_config_parser(parser, stem: str, example: str) -> None:
    """`rlhflab <command> --config FILE [key=value ...]`."""
    parser.add_argument("--config", required=True, help=f"YAML config, e.g. configs/{stem}_debug.yaml")
    parser.add_argument("overrides", nargs="*", help=f"dotted overrides, e.g. {example}")


def run_config_command(args, schema, train, headline: Callable) -> int:
    """Load the config (file, then overrides), train, print `headline(result)` and the
    before/after table (main process)."""
    from rlhflab.config import load_config

    cfg, effective = load_config(args.config, schema, args.overrides)
    res = train(cfg, effective=effective)
    res.report(headline(res))
    return 0


def config_entry_points(schema, train, *, stem: str, example: str, headline: Callable):
    """`add_parser` and `run` of a trainer with `--config` and overrides: `train(cfg,
    effective=...)` on the loaded config, then `headline(result)` and the before/after table."""

    def add_parser(parser) -> None:
        add_config_parser(parser, stem, example)

    def run(args) -> int:
        return run_config_command(args, schema, train, headline)

    return add_parser, run


# --------------------------------------------------------------------------------------
# Token-budget micro-batches (sft/rm/dpo.mini_batch_tokens)
# --------------------------------------------------------------------------------------
def cut_rows_by_tokens(lengths: list[int], budget: int, dist=None) -> list[list[int]]:
    """An optimizer step's rows (their real-token counts `lengths`: this rank's share) cut
    into micro-batches of at most `budget` tokens each: the rows from the longest to the
    shortest (stable), each joining the current micro-batch while the sum stays within the
    budget, else starting the next (so a padded pass pads little). Deterministic; a row
    longer than the budget gets a micro-batch of its own. The loss normaliser stays the
    whole step's, so the update equals the row-cut one to float rounding. (The PPO family's
    cut is the same.) Under several processes (`dist`) every rank makes as many
    micro-batches as the rank that needs most (its largest ones split in two): the
    data-parallel passes must pair up, and FSDP's and ZeRO-3's gather in each forward."""
    from rlhflab.engine.minibatch import cut_by_tokens

    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    ordered = [lengths[i] for i in order]
    cut = cut_by_tokens(ordered, budget)
    if dist is not None and dist.distributed:
        n = int(dist.max(len(cut)))  # at most this rank's rows: every rank holds as many
        if n > len(cut):
            cut = cut_by_tokens(ordered, budget, parts=n)
    return [[order[j] for j in mb] for mb in cut]
