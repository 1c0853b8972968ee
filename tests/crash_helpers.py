"""A run stopped on purpose right after it logged a step, for the resume tests
(tests/test_checkpoint.py, tests/test_async_rollouts.py; no tests here)."""

from __future__ import annotations

from typing import Callable

import pytest

from rlhflab.metrics import MetricsLogger


def stop_after_logging(monkeypatch, step: int, train: Callable[[], object]) -> None:
    """Call `train()` with `MetricsLogger.log` raising KeyboardInterrupt just after it wrote
    the row of `step` (a run killed after that step was logged, before the next checkpoint
    could be saved); fails unless the run stops so, and puts the real `log` back."""
    real_log = MetricsLogger.log

    def log_then_stop(self, logged_step, metrics):
        real_log(self, logged_step, metrics)
        if logged_step == step:
            raise KeyboardInterrupt

    monkeypatch.setattr(MetricsLogger, "log", log_then_stop)
    try:
        with pytest.raises(KeyboardInterrupt):
            train()
    finally:
        monkeypatch.setattr(MetricsLogger, "log", real_log)
