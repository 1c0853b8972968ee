"""Pieces every trainer shares: seeding, optimizer and schedule, output folder, timing,
and the end of a run (logger, plots, peak memory, train_result.json, before/after table)."""

from __future__ import annotations

import json
import math
import os
import random
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from rlhflab.errors import TrainingDiverged, UserError
from rlhflab.metrics import plot_metrics


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)


def choose_cpu_matmul(mode: str) -> str:
    """`model.cpu_matmul` for this process (rlhflab/models/cpu_matmul.py): "onednn" or "torch"."""
    from rlhflab.models.cpu_matmul import set_cpu_matmul

    try:
        return set_cpu_matmul(mode)
    except ValueError as exc:
        raise UserError(str(exc)) from None


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


# What a run writes at its top level: a folder holding any of RUN_MARKERS (or a step_N/
# checkpoint) holds another run, which a new run must not mix into or overwrite.
RUN_MARKERS = ("final", "metrics.jsonl", "train_result.json")
RUN_OUTPUTS = RUN_MARKERS + ("effective_config.yaml", "eval", "plots", "peak_memory_mb.txt", "tensorboard")
# A restarted run's old logs, kept beside the new one (`prepare_output_dir`).
STOPPED_LOGS = ("metrics.jsonl", "tensorboard")


def stopped_before_first_checkpoint(out: str | Path) -> bool:
    """Whether `out` holds a run that died before its first checkpoint (out of memory,
    Ctrl-C, a preempted node): its metrics.jsonl, but no step_N/, no final/ and no
    train_result.json (an effective_config.yaml, plots/, eval/ and `step_K.tmp/` debris
    may be there). Nothing of it can be resumed."""
    from rlhflab.models.checkpoint import checkpoint_steps

    out = Path(out)
    return ((out / "metrics.jsonl").is_file() and not checkpoint_steps(out)
            and not any((out / n).exists() for n in RUN_MARKERS if n != "metrics.jsonl"))


# Folders this process writes a run into, each held open under an exclusive flock until the
# process ends (a SIGKILL releases it too): a live run is never taken for a stopped one.
_HELD: dict[str, int] = {}


def _hold(out: Path) -> None:
    """Hold `out` for this process (an flock on the folder itself; where the file system has
    no locks, nothing)."""
    key = str(out.resolve())
    if key in _HELD:
        return
    try:
        import fcntl

        fd = os.open(key, os.O_RDONLY)
    except (ImportError, OSError):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _HELD[key] = fd
    except OSError:  # held by another process (refused before this), or no locks here
        os.close(fd)


def _in_use(out: Path) -> bool:
    """Whether another live process holds `out` (`_hold`)."""
    key = str(out.resolve())
    if key in _HELD:
        return False  # this process: an earlier run of it, finished
    try:
        import fcntl

        fd = os.open(key, os.O_RDONLY)
    except (ImportError, OSError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no locks on this file system
        return False
    finally:
        os.close(fd)  # closing drops the shared lock
    return False


def check_output_dir(path: str | Path, *, resume: bool = False, overwrite: bool = False,
                     resumable: bool = True, config=None) -> Path:
    """Refuse to start a new run in a folder that holds another run; touches nothing.

    Another run is a `step_N/` checkpoint or any of final/, metrics.jsonl,
    train_result.json (SFT and RM save no step_N/ by default). `resume` (continuing that
    run) and `overwrite` (training.overwrite=true: replacing it) are the ways in.
    `resumable` says whether the trainer has --resume, for the message. Leftover
    `step_N.tmp/` folders of a save cut short are debris, not checkpoints.

    A run that stopped before its first checkpoint (`stopped_before_first_checkpoint`)
    is let in when its effective_config.yaml equals `config` (this run's typed config or
    resolved tree; keys such as logging.progress_bar aside): the same command run again
    starts it over (`prepare_output_dir`). With another config, or no `config` given, it
    is refused with a message saying that nothing there can be resumed.
    """
    from rlhflab.config.loader import config_differences
    from rlhflab.models.checkpoint import checkpoint_steps

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"training.output_dir {out} is a file; choose a folder")
    if resume or overwrite or not out.exists():
        return out
    steps = checkpoint_steps(out)
    found = [n + ("/" if (out / n).is_dir() else "") for n in RUN_MARKERS if (out / n).exists()]
    start_over = "start over with training.overwrite=true (it replaces that run)"
    if steps:
        names = ", ".join(p.name + "/" for p in steps[-3:])
        cont = (f"continue it with --resume {out}/step_N (newest: {steps[-1].name}), " if resumable else "")
        raise UserError(f"output folder {out} already holds checkpoints ({names}) of another run; {cont}"
                        f"{start_over}, or choose another training.output_dir")
    if stopped_before_first_checkpoint(out):
        if _in_use(out):
            raise UserError(f"output folder {out} holds a run that is still going (another process is writing it, "
                            f"with no checkpoint yet); wait for it or stop it, or choose another "
                            f"training.output_dir")
        saved = out / "effective_config.yaml"
        differ = config_differences(saved, config) if config is not None else None
        if differ == []:
            return out  # the same run again: prepare_output_dir starts it over
        if config is None:
            why = ""
        elif differ is None:
            why = " (it has no readable effective_config.yaml, so it cannot be told to be this same run)"
        else:
            shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
            why = f" with another config ({shown} differ{'s' if len(differ) == 1 else ''})"
        raise UserError(f"output folder {out} holds a run that stopped before its first checkpoint{why}: "
                        f"nothing there can be resumed; start over with training.overwrite=true (its "
                        f"metrics.jsonl is replaced), or choose another training.output_dir")
    if found:
        raise UserError(f"output folder {out} already holds another run ({', '.join(found)}) and no checkpoint "
                        f"to resume; {start_over}, or choose another training.output_dir")
    return out


def _keep_stopped_logs(out: Path) -> list[str]:
    """Rename a stopped run's logs (STOPPED_LOGS) to `<name>.stopped-<when it last wrote,
    UTC><suffix>`, beside the new run's; returns the new names."""
    kept = []
    for name in STOPPED_LOGS:
        old = out / name
        if not old.exists():
            continue
        stem, dot, suffix = name.partition(".")
        when = time.strftime("%Y%m%d-%H%M%S", time.gmtime(old.stat().st_mtime))
        new, n = out / f"{stem}.stopped-{when}{dot}{suffix}", 1
        while new.exists():
            n += 1
            new = out / f"{stem}.stopped-{when}-{n}{dot}{suffix}"
        old.rename(new)
        kept.append(new.name)
    return kept


def prepare_output_dir(path: str | Path, resume: bool = False, overwrite: bool = False,
                       resumable: bool = True, config=None) -> Path:
    """`check_output_dir`, then create the folder; call it once the config is valid and the
    model has loaded, so a run that fails before leaves no trace.

    Removes `step_N.tmp/` debris; with `overwrite` (and not resuming) also the previous
    run's outputs (RUN_OUTPUTS and step_N/ folders; nothing else in the folder). A run of
    the same `config` that stopped before its first checkpoint is started over, with one
    line saying so: its metrics.jsonl (and tensorboard/) are kept beside the new ones as
    `metrics.stopped-<UTC time>.jsonl`, its eval/ and plots/ removed.
    """
    import shutil

    from rlhflab.models.checkpoint import checkpoint_steps, save_debris

    out = check_output_dir(path, resume=resume, overwrite=overwrite, resumable=resumable, config=config)
    if out.is_dir():
        old = list(save_debris(out))
        if overwrite and not resume:
            old += checkpoint_steps(out) + [out / n for n in RUN_OUTPUTS if (out / n).exists()]
        elif not resume and stopped_before_first_checkpoint(out):
            kept = _keep_stopped_logs(out)
            old += [out / n for n in ("eval", "plots", "peak_memory_mb.txt") if (out / n).exists()]
            print(f"{out} holds this same run, stopped before its first checkpoint: starting it over "
                  f"(its log kept as {', '.join(kept)})", flush=True)
        for p in old:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    _hold(out)
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
    """train_result.json: the run's summary fields, in the order given, then the float32
    matmul library the run used on a CPU (`cpu_matmul`: "onednn" or "torch", what
    `model.cpu_matmul` resolved to; rlhflab/models/cpu_matmul.py)."""
    from rlhflab.models.cpu_matmul import cpu_matmul

    fields = {**fields, "cpu_matmul": cpu_matmul()}
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


def check_resume_dir(resume: str | Path | None, *, method: str | None = None, lora: bool | None = None,
                     critic: str = "none", world_size: int | None = None, fsdp: bool | None = None,
                     deepspeed: bool | None = None) -> Path | None:
    """The `--resume` folder as a Path (None when not resuming); it must hold trainer state.

    With `method` and `lora` given (the config's), the whole of
    `rlhflab.models.checkpoint.check_resume` runs: the state loads, the recorded method,
    LoRA, `critic` layout (value_head, separate or none), `world_size`, `fsdp` and `deepspeed` match, and the
    files that layout needs are there. Call it before anything is written.
    """
    from rlhflab.models.checkpoint import STATE_FILE, check_not_debris, check_resume

    if resume is None:
        return None
    path = Path(resume)
    check_not_debris(path)
    if not (path / STATE_FILE).is_file():
        raise UserError(f"--resume {path}: no {STATE_FILE} there; point it at a step_N/ folder")
    if method is not None and lora is not None:
        check_resume(path, method=method, lora=lora, critic=critic, world_size=world_size, fsdp=fsdp,
                     deepspeed=deepspeed)
    return path


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


def make_doctor(enabled: bool, max_grad_norm: float | None, kl_knob: str = "ppo.kl_coeff", *,
                method: str = "rl", lr_knob: str | None = None):
    """The training doctor of a run, or None when `logging.doctor` is off. `method` (sft,
    rm, dpo, or an RL method's name) picks its rules and the section its advice names;
    `lr_knob` is the key a diverging run is told to lower (default <method>.learning_rate)."""
    if not enabled:
        return None
    from rlhflab.doctor import Doctor

    return Doctor(max_grad_norm=max_grad_norm, kl_knob=kl_knob, method=method, lr_knob=lr_knob)


def log_step(logger, doctor, step: int, metrics: dict) -> None:
    """Phase 6's bookkeeping: the step's metrics to every sink, then the doctor's new
    findings printed above the progress bar. A "stop" finding (a non-finite loss or
    gradient norm) raises `TrainingDiverged` after the row is written, before anything
    is saved, so the newest checkpoint on disk is the last good one."""
    logger.log(step, metrics)
    if doctor is None:
        return
    from tqdm import tqdm

    for finding in doctor.observe(step, metrics):
        if finding.stop:
            raise TrainingDiverged(f"step {step}: {finding.message}")
        tqdm.write(str(finding))
