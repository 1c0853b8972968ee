"""Crashes: a run SIGKILLed at random moments and resumed from its newest checkpoint each
time ends bit-identical to an uninterrupted run, with each metrics row once.

The CLI runs in a subprocess (`python -m rlhflab ppo|grpo ...`), as a user's run would.
Kills fall at random moments once the first checkpoint exists: during a step, during a
save (leaving a `step_N.tmp/`), during the final save or the metrics write. (A kill before
the first checkpoint leaves nothing to resume: the same command starts that run over by
itself, tests/test_run_restart.py.)
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhflab.metrics import read_metrics
from rlhflab.models.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5
VOLATILE = ("time/", "perf/")  # wall-clock metrics differ between any two runs


def _args(method: str, model: Path, data: Path, out: Path) -> list[str]:
    common = [f"model.name_or_path={model}", f"dataset.path={data / 'train.jsonl'}",
              f"dataset.eval_path={data / 'test.jsonl'}", f"training.output_dir={out}",
              f"training.total_steps={STEPS}", "training.save_interval=1", f"training.eval_interval={STEPS}",
              "generation.max_new_tokens=8", "dataset.num_eval_samples=8", "logging.progress_bar=false",
              "logging.plots=false", "logging.doctor=false", "training.num_threads=1"]
    if method == "ppo":
        extra = ["ppo.rollout_samples=8", "ppo.batch_size=8", "ppo.mini_batch_size=4", "ppo.epochs=2"]
    else:
        extra = ["grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.batch_size=16", "grpo.mini_batch_size=8",
                 "grpo.gradient_accumulation_steps=1", "grpo.epochs=1"]
    return [method, "--config", str(ROOT / "configs" / f"{method}_debug.yaml"), *common, *extra]


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    with log.open("a") as fh:
        return subprocess.Popen([sys.executable, "-m", "rlhflab", *args], cwd=ROOT, env=env,
                                stdout=fh, stderr=subprocess.STDOUT)


def _newest_step(out: Path) -> int:
    newest = latest_checkpoint(out)
    return int(newest.name[5:]) if newest is not None else 0


def _run_with_kills(args: list[str], out: Path, log: Path, seed: int, max_kills: int = 3) -> int:
    """Run, SIGKILL at a random moment, resume from the newest checkpoint; returns the kills.

    Each attempt picks a later point to die at: a little after a random next checkpoint
    appears (in the step after it, or the save of the next one), or while final.tmp/ is
    being written. The first target is a step checkpoint, so at least one kill lands, and
    each resume starts from a newer checkpoint, so the loop ends.
    """
    rng = random.Random(seed)
    kills, resume = 0, []
    while True:
        proc = _start([*args[:3], *resume, *args[3:]], log)
        done = _newest_step(out)
        later = [f"step_{k}" for k in range(done + 1, STEPS)] + ([] if kills == 0 else ["final.tmp"])
        if kills < max_kills and later:
            target = out / rng.choice(later)
            while proc.poll() is None and not target.exists():
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.6) if target.name != "final.tmp" else 0.0)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
                resume = ["--resume", str(latest_checkpoint(out))]
                continue
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        return kills


def _steady(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ppo", "grpo"])
def test_killed_and_resumed_run_equals_an_uninterrupted_one(method, tiny_model_dir, arith_dir, tmp_path):
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    # The uninterrupted run goes on beside the killed ones (one thread each: the 2 cores of
    # CI are both used); the two share nothing but the read-only model and task.
    uninterrupted = _start(_args(method, tiny_model_dir, arith_dir, ref), tmp_path / "ref.log")
    try:
        kills = _run_with_kills(_args(method, tiny_model_dir, arith_dir, crashed), crashed,
                                tmp_path / "crashed.log", seed=0 if method == "ppo" else 1)
    finally:
        assert uninterrupted.wait(timeout=600) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    assert kills >= 1
    # The weights (and the value head, for PPO) are bit-identical.
    names = ["model.safetensors"] + (["value_head.safetensors"] if method == "ppo" else [])
    for name in names:
        assert (crashed / "final" / name).read_bytes() == (ref / "final" / name).read_bytes(), name
    # metrics.jsonl holds each step once, with the uninterrupted run's values.
    got, want = read_metrics(crashed / "metrics.jsonl"), read_metrics(ref / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, *range(1, STEPS + 1)]
    assert _steady(got) == _steady(want)
    # Nothing half-written is left over.
    assert not list(crashed.glob("*.tmp")) and not list(crashed.glob("*.old"))
