"""The run context every trainer enters: `run = start_run(cfg, "sft", ...)`.

A trainer is its numbered loop; around it the context owns, once for every method:

- the process group and ranks (`engine.dist`, the one module that knows about ranks),
  torch threads (set at the start, the caller's count put back at the finish) and the seeds;
- the output folder: another run there is refused before anything loads
  (`folders.check_output_dir`), the folder is made and held once the model and the data
  have loaded (`open`), the effective config written (a resume keeps the run's record and
  writes a changed config beside it as `effective_config.resume_step_N.yaml`);
- the metrics and their sinks (`rlhflab.metrics`) and the doctor that reads each row;
- checkpoint save and resume (`rlhflab.models.checkpoint`), rank 0 writing;
- the finish: plots, peak memory, train_result.json, the result's printout.

What a run sets in its caller's process (torch's thread count, the open metrics sinks) is
undone in one place, `Run.close`: at the end of `finish`, and, when a trainer raises (a
bad row, a reward plug-in that fails, Ctrl-C), by `entry_point`, the decorator on every
trainer's entry function. What the run already wrote (metrics.jsonl rows, checkpoints)
stays as it is; a failed run writes no train_result.json.

Rank-0-only work goes through it (`log`, `print`, `save`, `on_main`), so a trainer never
tests the rank. In one process every call is the plain thing it names.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
import warnings
from contextlib import nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from rlhflab import cpu
from rlhflab.errors import TrainingDiverged
from rlhflab.run.finish import TrainResult, finish_run, format_metrics, write_train_result
from rlhflab.run.folders import check_output_dir, check_resume_dir, prepare_output_dir


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)


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


@dataclass
class Run:
    """One training run's process, folder, sinks and finish (module docstring)."""

    cfg: Any                      # the typed run config (training, logging, model sections)
    method: str                   # the command and config section: sft, rm, classifier, dpo, ppo, ...
    dist: Any                     # engine.dist.Dist
    device: torch.device
    record: Any                   # what effective_config.yaml holds: the resolved tree, or cfg
    resume_dir: Path | None = None
    quiet: bool = False
    out_dir: Path = Path(".")
    start_step: int = 0
    logger: Any = None
    doctor: Any = None
    history: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    threads_before: int = 0       # torch's thread count when the run began: put back by close()
    closing: list[Callable[[], None]] = field(default_factory=list)  # what stops with the run (a vLLM engine)

    # ---------------------------------------------------------------- rank 0's share
    @property
    def silent(self) -> bool:
        """Nothing printed here: quiet, or not the main process."""
        return self.quiet or not self.dist.is_main

    def print(self, *args, **kwargs) -> None:
        """`print` on the main process of a run that is not quiet."""
        if not self.silent:
            print(*args, **kwargs)

    def write(self, text: str) -> None:
        """A line above the progress bar (main process, not quiet)."""
        if not self.silent:
            from tqdm import tqdm
            tqdm.write(text)

    def on_main(self, fn: Callable[[], Any], module: torch.nn.Module | None = None, default: Any = None) -> Any:
        """`fn()` on the main process (its result there, `default` elsewhere); with `module`
        its whole weights are held on every rank meanwhile (FSDP), so rank 0 can evaluate
        or save it. A UserError raised there is raised on every rank."""
        with self.dist.holding(module, "whole") if module is not None else nullcontext():
            return self.dist.on_main(fn, default)

    def progress(self, total: int, initial: int = 0, desc: str | None = None):
        """The run's progress bar (shown on the main process when logging.progress_bar and
        stderr is a terminal: a piped log gets no carriage-return frames)."""
        import sys

        from tqdm import tqdm

        tty = getattr(sys.stderr, "isatty", lambda: False)()
        return tqdm(total=total, initial=initial, desc=desc or self.method, dynamic_ncols=True,
                    disable=self.silent or not self.cfg.logging.progress_bar or not tty)

    # ---------------------------------------------------------------- models
    def adopt(self, module: torch.nn.Module, trained: bool = True) -> torch.nn.Module:
        """A model this run trains (or, `trained=False`, only runs): the CPU-only speed
        tricks applied as model.* asks when the device is a CPU (`rlhflab.cpu.apply`);
        on any other device it is returned as it is."""
        cpu.apply(module, self.cfg.model, self.device, trained=trained)
        return module

    def adopt_models(self, models) -> None:
        """`adopt` for a policy run's models (actor trained, a reference copy frozen)."""
        cpu.apply_to_models(models, self.cfg.model)

    # ---------------------------------------------------------------- folder and sinks
    def restore(self, optimizer, scheduler, module: torch.nn.Module, rank_streams: bool = False) -> int:
        """Resuming: the checkpoint's optimizer, scheduler and random states, loaded in
        place; returns its step (0 on a fresh run). `rank_streams`: on a fresh run under
        several processes each rank gets its own torch random stream."""
        from rlhflab.models.checkpoint import restore_trainer_state

        dist = self.dist
        if self.resume_dir is not None:
            self.start_step = restore_trainer_state(
                self.resume_dir, optimizer, scheduler, rank=dist.rank,
                load_optimizer=lambda st: dist.load_optimizer(module, optimizer, st, self.resume_dir))
        elif rank_streams and dist.distributed:  # the seeded sampler does not use it
            torch.manual_seed(self.cfg.training.seed * 1_000_003 + dist.rank)
        return self.start_step

    def open(self, max_grad_norm: float | None = None, *, kl_knob: str = "ppo.kl_coeff",
             lr_knob: str | None = None, doctor: bool = True) -> Path:
        """Once the model and the data have loaded: the output folder made (another run's
        debris cleared, this same run stopped early started over) and held, the effective
        config written, the metrics logger and the doctor started (main process)."""
        from rlhflab.config import save_effective_config
        from rlhflab.metrics import MetricsLogger

        t, lg, resuming = self.cfg.training, self.cfg.logging, self.resume_dir is not None
        self.out_dir = self.dist.on_main(lambda: prepare_output_dir(t.output_dir, resume=resuming,
                                                                    overwrite=t.overwrite, config=self.record),
                                         Path(t.output_dir))

        def sinks() -> None:
            save_effective_config(self.record, self.out_dir, resume_from=self.resume_dir)
            self.logger = MetricsLogger(self.out_dir, lg.report_to, lg.run_name, lg.wandb_project,
                                        config=dataclasses.asdict(self.cfg), resume=resuming,
                                        resume_step=self.start_step if resuming else None)
            if doctor:
                self.doctor = make_doctor(lg.doctor, max_grad_norm, kl_knob, method=self.method, lr_knob=lr_knob)

        self.dist.on_main(sinks)
        return self.out_dir

    def log(self, step: int, metrics: dict) -> None:
        """A step's metrics: kept in the history (every rank), written to every sink and
        read by the doctor (main process), which may stop the run."""
        self.history.append({"step": step, **metrics})
        if self.logger is not None:
            log_step(self.logger, self.doctor, step, metrics)

    def log_start(self, metrics: dict | None, show: bool = True) -> None:
        """The starting model's evaluation as step 0 (the doctor's starting point, not a
        step of its rules); `show` prints it as "step 0 (before training)"."""
        if not metrics:
            return
        if self.logger is not None:
            self.logger.log(0, metrics)
        if self.doctor is not None:
            self.doctor.observe(0, metrics)
        if show:
            self.print("step 0 (before training): " + format_metrics(metrics))

    # ---------------------------------------------------------------- checkpoints
    def save(self, write: Callable[[], None], module: torch.nn.Module | None = None,
             folder: Path | None = None) -> None:
        """`write()` on the main process (module's whole weights held meanwhile); then,
        when `folder` is a step_N/ checkpoint, the oldest beyond
        training.keep_last_checkpoints are removed."""
        from rlhflab.models.checkpoint import prune_checkpoints

        def write_and_prune() -> None:
            write()
            if folder is not None and folder.name.startswith("step_"):
                prune_checkpoints(self.out_dir, self.cfg.training.keep_last_checkpoints)

        self.on_main(write_and_prune, module)

    def save_checkpoint(self, folder: Path, step: int, *, module: torch.nn.Module, actor, tokenizer,
                        optimizer, scheduler, state_prefix: str | None = None, rank_rng: bool = False,
                        hold: bool = True, check: Callable[[], None] | None = None,
                        more: Callable[[Path], None] | None = None) -> None:
        """A resumable checkpoint (`models.checkpoint.save_checkpoint`): the full weights
        and optimizer state gathered from `module` (as the strategy wraps it; its state keys
        under `state_prefix` when it wraps the actor), every rank's random state when
        `rank_rng`, DeepSpeed's partitions; `check()` first (the forward pass finite).
        With `training.save_only_model` the weights alone: no optimizer, scheduler or random
        state is gathered or written, so it cannot be resumed."""
        from rlhflab.models.checkpoint import rng_state, save_checkpoint, state_part

        dist = self.dist
        only_model = self.cfg.training.save_only_model
        if only_model:
            optimizer = scheduler = None
            rank_rng = False
        rng = dist.gather(rng_state()) if rank_rng else None  # every rank's random state, for an exact resume
        state, optimizer_state = dist.full_state(module, optimizer)  # FSDP: gathered to rank 0
        if only_model:  # DeepSpeed's pointer to its own optimizer checkpoint: not written either
            optimizer_state = None
        engine_state = None if only_model else dist.stage_engine_state(module, folder)  # DeepSpeed's partitions
        if state_prefix is not None:
            state = state_part(state, state_prefix)

        def write() -> None:
            if check is not None:
                check()
            save_checkpoint(folder, actor, tokenizer, optimizer=optimizer, scheduler=scheduler, step=step,
                            method=self.method, rank_rng=rng if dist.distributed else None, state=state,
                            optimizer_state=optimizer_state, engine_state=engine_state, more=more)

        self.save(write, module if hold else None, folder)

    # ---------------------------------------------------------------- finish
    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def result(self, cls: type = TrainResult, **kwargs) -> TrainResult:
        """The run's result object (`cls`, a TrainResult), sharing the run's history."""
        return cls(self.out_dir, self.out_dir / "final", history=self.history, world_size=self.dist.world_size,
                   is_main=self.dist.is_main, **kwargs)

    def end(self, result: TrainResult, plot_groups: dict[str, list[str]] | None, eval_after: dict | None,
            steps: int, **facts) -> TrainResult:
        """`finish` for a trainer that counts steps (SFT, RM, classifier): the result's last
        evaluation, steps and seconds set, train_result.json holding them and `facts`."""
        result.eval_after, result.steps, result.seconds = eval_after or None, steps, self.seconds
        self.finish(plot_groups, eval_before=result.eval_before, eval_after=result.eval_after, steps=steps,
                    **facts, seconds=result.seconds)
        return result

    def finish(self, plot_groups: dict[str, list[str]] | None, **fields) -> None:
        """The end of the run: the logger closed, plots/ drawn (logging.plots),
        peak_memory_mb.txt and train_result.json (`fields` in their order, then world_size)
        written on the main process; every rank leaves together."""
        def write() -> None:
            logger, self.logger = self.logger, None  # closed here, once
            finish_run(logger, self.out_dir, self.device, self.cfg.logging.plots, plot_groups)
            write_train_result(self.out_dir, **fields, world_size=self.dist.world_size)

        self.dist.on_main(write)
        self.dist.barrier()
        self.close()

    def close(self, failed: bool = False) -> None:
        """Undo what the run set in its process, on this rank alone (no collective: the
        other ranks may not be here): the metrics sinks closed (the rows written stay; W&B
        marks the run failed when `failed`, i.e. the trainer raised) and
        torch's thread count put back to the caller's, so a run in a notebook or a script
        leaves that process as it found it; and what the run started that would outlive it
        (`on_close`: the vLLM engine and its memory) stopped. `finish` ends with it;
        `entry_point` calls it when a trainer raises. A second call does nothing."""
        logger, self.logger = self.logger, None
        threads, self.threads_before = self.threads_before, 0
        closing, self.closing = self.closing, []
        try:
            for stop in reversed(closing):
                stop()
        finally:
            try:
                if logger is not None:
                    logger.close(failed=failed)
            finally:
                if threads:
                    torch.set_num_threads(threads)

    def on_close(self, stop: Callable[[], None]) -> None:
        """Have `close` call `stop` (last registered, first called)."""
        self.closing.append(stop)


# The runs started under the innermost `entry_point` call (None outside one).
_entered: ContextVar[list[Run] | None] = ContextVar("rlhflab_entered_runs", default=None)


def entry_point(train: Callable) -> Callable:
    """The decorator on every trainer's entry function: when `train` raises anything (a
    UserError, a diverged run, KeyboardInterrupt), each run it started is closed
    (`Run.close`: sinks closed, the caller's thread count back) and the exception goes on
    to the caller unchanged. A run that returns has closed itself in `finish`."""

    @functools.wraps(train)
    def entered(*args, **kwargs):
        runs: list[Run] = []
        token = _entered.set(runs)
        try:
            return train(*args, **kwargs)
        except BaseException:
            for run in reversed(runs):
                try:
                    run.close(failed=True)
                except Exception as exc:  # the run's own exception is the one the caller must see
                    warnings.warn(f"closing the failed {run.method} run also raised {type(exc).__name__}: {exc}",
                                  stacklevel=2)
            raise
        finally:
            _entered.reset(token)

    return entered


def quiet_bars() -> None:
    """No progress frames into a piped log: when stderr is no terminal, transformers' own bars
    (loading weights, writing shards) are switched off, as the run's is (`Run.progress`)."""
    import sys

    if not getattr(sys.stderr, "isatty", lambda: False)():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def start_run(cfg, method: str, *, effective=None, resume: str | Path | None = None, quiet: bool = False,
              resumable: bool = False, backend: str | None = None, critic: str = "none",
              local: dict[str, int] | None = None, preflight: Callable[[bool], None] | None = None) -> Run:
    """Enter a run: the process group, the CPU-only speed settings, the checks that come
    before anything loads or is written (the `--resume` checkpoint: it loads, its method,
    LoRA, critic and world size match; an output folder holding another run is refused),
    the seeds, then the run's torch thread count (a check that fails leaves the caller's).
    Under `entry_point` the run is closed if the trainer raises.

    `resumable`: the trainer has --resume. `backend`: a policy method's generation backend
    (None: not a policy method). `local`: global counts that must divide among the
    processes, by config key (a one-line error otherwise). `preflight(silent)`: checks of
    the method's own that come first (a policy run's reward plug-ins, each called once)."""
    from rlhflab.engine.dist import check_strategy, default_threads, init_dist
    from rlhflab.models.load import resolve_device
    from rlhflab.models.precision import check_mixed_precision

    t = cfg.training
    lora = bool(getattr(getattr(cfg, "lora", None), "enabled", False))
    quiet_bars()
    dist = init_dist(t.device)
    for key, n in (local or {}).items():
        dist.local(n, key)
    if preflight is not None:
        preflight(quiet or not dist.is_main)
    check_strategy(dist, lora, method, backend or "hf", rl=backend is not None)
    device = dist.device or resolve_device(t.device)
    matmul = cpu.setup_process(device, cfg.cpu)  # the CPU-only speed settings; on CUDA the plain path
    resume_dir = None
    if resumable:
        # Every rank reads the checkpoint (its weights, its own random state): each checks it.
        resume_dir = dist.everywhere(lambda: check_resume_dir(
            resume, method=method, lora=lora, critic=critic, world_size=dist.world_size,
            fsdp=dist.strategy == "fsdp", deepspeed=dist.strategy == "deepspeed"),
            "; every machine must see the --resume folder at this path")
    record = effective if effective is not None else cfg  # the run's effective_config.yaml
    # The output folder is rank 0's (it alone writes it): rank 0's view of it decides.
    dist.on_main(lambda: check_output_dir(t.output_dir, resume=resume_dir is not None, overwrite=t.overwrite,
                                          resumable=resumable, config=record))
    seed_everything(t.seed)
    check_mixed_precision(t.mixed_precision, device)
    # The run's thread count last, once every check has passed: from here `Run.close` puts
    # the caller's back (at the finish, or through `entry_point` when the trainer raises).
    run = Run(cfg, method, dist, device, record, resume_dir, quiet, Path(t.output_dir),
              threads_before=torch.get_num_threads())
    set_threads(t.num_threads or default_threads(dist, t.device))
    if matmul == "onednn":  # not torch's own float32 linears (other rounding): said once, as train_result.json records it
        run.print(f"float32 linear layers: oneDNN (cpu.matmul: {cfg.cpu.matmul}; "
                  "cpu.matmul=torch for torch's own; docs/cpu_matmul.md)")
    entered = _entered.get()
    if entered is not None:
        entered.append(run)
    return run
