"""A run sets torch's thread count for itself (`training.num_threads`) and puts the
caller's count back when it finishes, so training in a notebook or a script leaves the
rest of that process as it found it."""

from __future__ import annotations

import torch


def test_a_run_trains_on_its_threads_and_puts_the_callers_count_back(ppo_cfg, torch_threads, monkeypatch):
    from rlhflab.trainers.ppo import train

    torch_threads(2)
    real_set, calls = torch.set_num_threads, []

    def recording_set(n: int) -> None:
        calls.append(n)
        real_set(n)

    monkeypatch.setattr(torch, "set_num_threads", recording_set)
    res = train(ppo_cfg("training.num_threads=1", "training.total_steps=1"), quiet=True)
    assert [h["step"] for h in res.history] == [1]
    assert calls[0] == 1 and calls[-1] == 2  # the run's own count first, the caller's last
    assert torch.get_num_threads() == 2
