"""A run sets torch's thread count for itself (`training.num_threads`) and puts the
caller's count back when it finishes or raises, so training in a notebook or a script
leaves the rest of that process as it found it."""

from __future__ import annotations

import pytest
import torch

from rlhflab.errors import UserError


@pytest.fixture
def wandb_runs(monkeypatch):
    """A stand-in `wandb` module (W&B itself is not installed here, and would go online):
    each `init` returns a run that records the exit code `finish` was given."""
    import sys
    import types

    runs: list[dict] = []

    class FakeRun:
        def __init__(self, **kwargs):
            self.record = {"init": kwargs, "logged": 0, "exit_code": None}
            runs.append(self.record)

        def log(self, metrics, step=None):
            self.record["logged"] += 1

        def finish(self, exit_code=None, quiet=None):
            self.record["exit_code"] = exit_code

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: FakeRun(**kw)))
    return runs


def test_a_run_trains_on_its_threads_and_puts_the_callers_count_back(ppo_cfg, torch_threads, monkeypatch,
                                                                       wandb_runs):
    from rlhflab.trainers.ppo import train

    torch_threads(2)
    real_set, calls = torch.set_num_threads, []

    def recording_set(n: int) -> None:
        calls.append(n)
        real_set(n)

    monkeypatch.setattr(torch, "set_num_threads", recording_set)
    res = train(ppo_cfg("training.num_threads=1", "training.total_steps=1", "logging.report_to=[wandb]"),
                quiet=True)
    assert [h["step"] for h in res.history] == [1]
    assert calls[0] == 1 and calls[-1] == 2  # the run's own count first, the caller's last
    assert torch.get_num_threads() == 2
    assert len(wandb_runs) == 1 and wandb_runs[0]["exit_code"] == 0  # W&B shows it finished


# A reward plug-in that works through step 1 and raises at step 2: it raises once the run's
# metrics.jsonl holds a row (step 1's, written before step 2's rollout is scored; the
# preflight call comes before the folder exists).
FLAKY = '''
from pathlib import Path

METRICS = Path({metrics!r})


def score(prompt, response, example):
    if METRICS.is_file() and METRICS.read_text().strip():
        raise {exc}
    return len(response) / 10
'''


def _open_files_under(folder) -> list[str]:
    """The files under `folder` this process holds open (Linux: /proc/self/fd); the folder
    itself is not counted (a run holds it under an flock until the process ends, by design:
    rlhflab/run/folders.py)."""
    import os

    fd_dir = "/proc/self/fd"
    held = []
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:  # closed between the listing and the read
            continue
        if target.startswith(f"{folder}{os.sep}"):
            held.append(target)
    return held


@pytest.mark.parametrize("exc, caught, message", [
    # An exception in the plug-in reaches the caller as the plug-in's one-line UserError.
    ('ValueError("reward server down")', UserError, r"raised ValueError: reward server down"),
    # Ctrl-C (not an Exception) passes through as it is.
    ('KeyboardInterrupt("stopped at step 2")', KeyboardInterrupt, r"^stopped at step 2$"),
])
def test_a_run_that_raises_mid_way_still_puts_the_callers_count_back(ppo_cfg, torch_threads, tmp_path, exc,
                                                                      caught, message, monkeypatch, wandb_runs):
    """A run that raises at step 2 (here its reward plug-in) undoes what it set in the
    caller's process as a finished run does, and leaves what it wrote: the exception
    reaches the caller unchanged, torch's thread count is the caller's again, metrics.jsonl
    is closed and holds step 1's row, W&B marks the run failed (not finished), and the
    generation backend is closed (vLLM's frees its engine; recorded here on the hf backend)."""
    from rlhflab.metrics import read_metrics
    from rlhflab.rollout.hf import HFBackend
    from rlhflab.trainers.ppo import train

    closed = []
    monkeypatch.setattr(HFBackend, "close", lambda self: closed.append(type(self).__name__))

    out = tmp_path / "run"
    plugin = tmp_path / f"flaky_{caught.__name__}.py"
    plugin.write_text(FLAKY.format(metrics=str(out / "metrics.jsonl"), exc=exc))
    torch_threads(2)
    with pytest.raises(caught, match=message) as failed:  # kept, as a notebook keeps its last traceback
        train(ppo_cfg("training.num_threads=1", "training.total_steps=3",
                      f"reward.sources=[{{type: rule, name: '{plugin}:score'}}]", "logging.report_to=[wandb]",
                      out_dir=out), quiet=True)
    assert torch.get_num_threads() == 2  # the run trained on 1
    assert failed.tb is not None and _open_files_under(out) == []  # closed, not left to the garbage collector
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1] and "rollout/reward_mean" in rows[0]
    assert not (out / "train_result.json").exists()  # a failed run is not reported as finished
    assert closed == ["HFBackend"]  # once
    assert len(wandb_runs) == 1 and wandb_runs[0]["logged"] >= 1 and wandb_runs[0]["exit_code"] == 1
