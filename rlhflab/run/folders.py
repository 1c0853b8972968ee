"""The output folder of a run: refused when it holds another run, started over when it
holds this same run stopped before its first checkpoint, held under an flock while a
run writes it; and the `--resume` folder's checks. Rank 0 alone calls what writes."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rlhflab.errors import UserError


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


def check_resume_dir(resume: str | Path | None, *, method: str | None = None, lora: bool | None = None,
                     critic: str = "none", world_size: int | None = None, fsdp: bool | None = None,
                     deepspeed: bool | None = None) -> Path | None:
    """The `--resume` folder as a Path (None when not resuming); it must hold trainer state.

    With `method` and `lora` given (the config's), the whole of
    `rlhflab.models.checkpoint.check_resume` runs: the state loads, the recorded method,
    LoRA, `critic` layout (value_head, separate or none), `world_size`, `fsdp` and `deepspeed` match, and the
    files that layout needs are there. Call it before anything is written.
    """
    from rlhflab.models.checkpoint import STATE_FILE, check_not_debris, check_resume, no_state_message

    if resume is None:
        return None
    path = Path(resume)
    check_not_debris(path)
    if not (path / STATE_FILE).is_file():
        raise UserError(no_state_message(path))
    if method is not None and lora is not None:
        check_resume(path, method=method, lora=lora, critic=critic, world_size=world_size, fsdp=fsdp,
                     deepspeed=deepspeed)
    return path
