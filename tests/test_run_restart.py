"""A run folder keeps its record across restarts.

- A resumed run never rewrites the run's `effective_config.yaml`; a config that differs
  on resume is written beside it as `effective_config.resume_step_N.yaml`, so a resume
  that fails (a full disk at its first save) leaves the record byte for byte.
- A run that died before its first checkpoint (its metrics.jsonl, maybe its config,
  plots/, eval/ and `step_K.tmp/` debris; no step_N/, final/ or train_result.json) is
  started over by the same command, with one line saying so and its old log kept as
  `metrics.stopped-<UTC time>.jsonl`; another config is refused with a message that says
  nothing there can be resumed and that training.overwrite=true starts over.
"""

from __future__ import annotations

import calendar
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlhflab import cli
from rlhflab.config.loader import config_differences, save_effective_config
from rlhflab.errors import UserError
from rlhflab.metrics import read_metrics
from rlhflab.models import checkpoint
from rlhflab.trainers.common import check_output_dir, prepare_output_dir, stopped_before_first_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def cfg(lr: float = 1e-4, progress_bar: bool = True, overwrite: bool = False):
    return OmegaConf.create({"grpo": {"learning_rate": lr, "group_size": 4},
                             "training": {"output_dir": "x", "overwrite": overwrite},
                             "logging": {"progress_bar": progress_bar}})


# --------------------------------------------------------------------------------------
# effective_config.yaml on resume
# --------------------------------------------------------------------------------------
def test_a_resume_never_rewrites_the_record_and_puts_a_changed_config_beside_it(tmp_path):
    out = tmp_path / "run"
    first = save_effective_config(cfg(), out)
    assert first == out / "effective_config.yaml"
    record = first.read_bytes()
    os.utime(first, (1_000_000_000, 1_000_000_000))  # any rewrite would move the mtime

    # The same config (a progress bar aside): nothing is written at all.
    for same in (cfg(), cfg(progress_bar=False)):
        assert save_effective_config(same, out, resume_from=out / "step_2") == first
        assert first.read_bytes() == record and first.stat().st_mtime == 1_000_000_000
        assert sorted(p.name for p in out.iterdir()) == ["effective_config.yaml"]

    # Another learning rate: recorded beside the run's config, which stays as it was.
    beside = save_effective_config(cfg(lr=2e-4), out, resume_from=out / "step_2")
    assert beside == out / "effective_config.resume_step_2.yaml"
    assert OmegaConf.load(beside).grpo.learning_rate == 2e-4
    assert first.read_bytes() == record and first.stat().st_mtime == 1_000_000_000

    # Without resume_from (a new run, the folder cleared by overwrite) it is written as before.
    save_effective_config(cfg(lr=3e-4), out)
    assert OmegaConf.load(first).grpo.learning_rate == 3e-4


def test_config_differences_names_the_keys_and_skips_the_neutral_ones(tmp_path):
    saved = save_effective_config(cfg(), tmp_path)
    assert config_differences(saved, cfg(progress_bar=False, overwrite=True)) == []
    assert config_differences(saved, cfg(lr=5e-4)) == ["grpo.learning_rate"]
    assert config_differences(tmp_path / "missing.yaml", cfg()) is None


# --------------------------------------------------------------------------------------
# A run that stopped before its first checkpoint
# --------------------------------------------------------------------------------------
def stopped_run(out: Path, config) -> bytes:
    """A folder as a run killed in its first steps leaves it; returns its log's bytes."""
    save_effective_config(config, out)
    log = b'{"step": 0, "eval/accuracy": 0.25}\n{"step": 1, "loss": 0.5}\n'
    (out / "metrics.jsonl").write_bytes(log)
    when = calendar.timegm((2026, 11, 26, 10, 15, 7, 0, 0, 0))  # 2026-11-26 10:15:07 UTC: its last write
    os.utime(out / "metrics.jsonl", (when, when))
    for debris in ("step_2.tmp", "plots", "eval"):
        (out / debris).mkdir()
        (out / debris / "x").write_text("x")
    return log


def test_the_same_command_starts_a_stopped_run_over_and_keeps_its_log(tmp_path, capsys):
    out = tmp_path / "run"
    log = stopped_run(out, cfg())
    assert stopped_before_first_checkpoint(out)
    assert check_output_dir(out, config=cfg(progress_bar=False)) == out  # the same run: let in, nothing touched
    assert (out / "metrics.jsonl").read_bytes() == log
    prepare_output_dir(out, config=cfg())
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed == [f"{out} holds this same run, stopped before its first checkpoint: starting it over "
                       f"(its log kept as metrics.stopped-20261126-101507.jsonl)"]
    assert sorted(p.name for p in out.iterdir()) == ["effective_config.yaml", "metrics.stopped-20261126-101507.jsonl"]
    assert (out / "metrics.stopped-20261126-101507.jsonl").read_bytes() == log
    assert not stopped_before_first_checkpoint(out)

    # Stopped a second time within the same second: the second log gets its own name.
    (out / "metrics.jsonl").write_bytes(log)
    os.utime(out / "metrics.jsonl", (calendar.timegm((2026, 11, 26, 10, 15, 7, 0, 0, 0)),) * 2)
    prepare_output_dir(out, config=cfg())
    assert (out / "metrics.stopped-20261126-101507-2.jsonl").read_bytes() == log


def test_a_stopped_run_with_another_config_is_refused_and_untouched(tmp_path):
    out = tmp_path / "run"
    stopped_run(out, cfg())
    before = tree(out)
    tail = ("nothing there can be resumed; start over with training.overwrite=true (its metrics.jsonl is "
            "replaced), or choose another training.output_dir")
    with pytest.raises(UserError) as err:
        prepare_output_dir(out, config=cfg(lr=5e-4))
    assert str(err.value) == (f"output folder {out} holds a run that stopped before its first checkpoint with "
                              f"another config (grpo.learning_rate differs): {tail}")
    with pytest.raises(UserError) as err:  # a trainer that does not pass its config
        check_output_dir(out)
    assert str(err.value) == f"output folder {out} holds a run that stopped before its first checkpoint: {tail}"
    (out / "effective_config.yaml").unlink()
    before.pop("effective_config.yaml")
    with pytest.raises(UserError, match="it has no readable effective_config.yaml"):
        check_output_dir(out, config=cfg())
    assert tree(out) == before
    assert prepare_output_dir(out, overwrite=True, config=cfg(lr=5e-4)) == out  # the way in it names
    assert list(out.iterdir()) == []


def test_a_run_still_going_is_not_taken_for_a_stopped_one(tmp_path):
    # The same command started twice: the second must not restart (and rename the log of)
    # the first, which holds its folder until it ends (a SIGKILL releases it too).
    out = tmp_path / "run"
    log = stopped_run(out, cfg())
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"), str(out)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError) as err:
            prepare_output_dir(out, config=cfg())
        assert str(err.value) == (f"output folder {out} holds a run that is still going (another process is "
                                  f"writing it, with no checkpoint yet); wait for it or stop it, or choose another "
                                  f"training.output_dir")
        assert (out / "metrics.jsonl").read_bytes() == log
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    prepare_output_dir(out, config=cfg())  # killed: its folder is free, and the run starts over
    assert not (out / "metrics.jsonl").exists() and list(out.glob("metrics.stopped-*.jsonl"))
    prepare_output_dir(out, config=cfg())  # this process's own hold never blocks it


@pytest.mark.parametrize("marker", ["final", "train_result.json", "step_3"])
def test_a_finished_or_checkpointed_run_is_still_refused_with_the_same_config(tmp_path, marker):
    out = tmp_path / "run"
    stopped_run(out, cfg())
    (out / marker).mkdir() if marker != "train_result.json" else (out / marker).write_text("{}")
    with pytest.raises(UserError, match="already holds"):
        check_output_dir(out, config=cfg())


# --------------------------------------------------------------------------------------
# End to end: a real GRPO run, killed and restarted; a resume whose save fails
# --------------------------------------------------------------------------------------
def grpo_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["grpo", "--config", str(ROOT / "configs" / "grpo_debug.yaml"), f"model.name_or_path={model}",
            f"dataset.path={data / 'train.jsonl'}", f"dataset.eval_path={data / 'test.jsonl'}",
            f"training.output_dir={out}", "generation.max_new_tokens=8", "dataset.num_eval_samples=8",
            "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.batch_size=16", "grpo.mini_batch_size=8",
            "grpo.gradient_accumulation_steps=1", "logging.progress_bar=false", "logging.plots=false",
            "logging.doctor=false", "training.num_threads=1", *extra]


@pytest.mark.slow
def test_a_grpo_run_killed_before_its_first_checkpoint_restarts_by_itself(tiny_model_dir, arith_dir, tmp_path,
                                                                           capsys):
    out = tmp_path / "run"
    args = grpo_args(tiny_model_dir, arith_dir, out, "training.total_steps=2", "training.save_interval=0",
                     "training.eval_interval=2")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen([sys.executable, "-m", "rlhflab", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # SIGKILL as soon as the step-0 evaluation is logged: no checkpoint, no final/ yet
        deadline = time.monotonic() + 300
        while proc.poll() is None and not (out / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert stopped_before_first_checkpoint(out), sorted(p.name for p in out.iterdir())
    before = tree(out)

    # Another learning rate: refused, with what happened and the way out; nothing touched.
    assert cli.main([*args, "grpo.learning_rate=5e-4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"error: output folder {out} holds a run that stopped before its first checkpoint with another "
                   f"config (grpo.learning_rate differs): nothing there can be resumed; start over with "
                   f"training.overwrite=true (its metrics.jsonl is replaced), or choose another training.output_dir")
    assert tree(out) == before

    # The same command again: starts over, says so once, keeps the old log beside the new one.
    assert cli.main(args) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "stopped before its first checkpoint" in line]
    assert len(said) == 1 and said[0].startswith(f"{out} holds this same run") and "starting it over" in said[0]
    (old_log,) = out.glob("metrics.stopped-*.jsonl")
    assert old_log.read_bytes() == before["metrics.jsonl"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    assert (out / "final" / "model.safetensors").is_file() and (out / "train_result.json").is_file()


@pytest.mark.slow
def test_a_resume_whose_save_fails_keeps_the_record_and_the_checkpoint(tiny_model_dir, arith_dir, tmp_path,
                                                                       capsys, monkeypatch):
    out = tmp_path / "run"
    args = grpo_args(tiny_model_dir, arith_dir, out, "training.total_steps=2", "training.save_interval=1",
                     "training.eval_interval=0")
    assert cli.main(args) == 0
    record = (out / "effective_config.yaml").read_bytes()
    final = tree(out / "final")  # the last step saves final/ only

    def full(*a, **k):  # torch.save of trainer_state.pt on a full disk (as a 45 MiB tmpfs gives it)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 7301056 vs 7300944")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    capsys.readouterr()
    assert cli.main([args[0], "--resume", str(out / "step_1"), *args[1:], "grpo.learning_rate=2e-4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: cannot save the checkpoint {out / 'final'}: a file could not be written in full "
                       f"(the disk is full or a file-size limit is set); free some disk space (or point "
                       f"training.output_dir at a larger disk) and run again; the previous final/ is intact")
    assert (out / "effective_config.yaml").read_bytes() == record  # the run's record, byte for byte
    assert OmegaConf.load(out / "effective_config.resume_step_1.yaml").grpo.learning_rate == 2e-4
    assert tree(out / "final") == final
    assert not list(out.glob("*.tmp"))
