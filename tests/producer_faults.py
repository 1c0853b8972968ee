"""Producer processes that fail on purpose, for tests/test_async_rollouts.py (no tests
here): each wraps `rlhflab.rollout.service.producer_main` and breaks at one message. They
are module-level functions, so the 'spawn' start method can find them by name."""

from __future__ import annotations

import os
import signal
import time

from rlhflab.rollout.service import producer_main


class _Inbox:
    """The producer's inbox, with `on(message)` called on each message it reads."""

    def __init__(self, inbox, on):
        self.inbox, self.on = inbox, on

    def get(self, *args, **kwargs):
        message = self.inbox.get(*args, **kwargs)
        self.on(message)
        return message


def killed_at_second_request(spec, inbox, outbox):
    """SIGKILLs itself when the second step is asked for (as the OOM killer would)."""
    seen = []

    def on(message):
        if message[0] == "request":
            seen.append(message[1])
            if len(seen) == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    producer_main(spec, _Inbox(inbox, on), outbox)


def stalls_at_first_push(spec, inbox, outbox):
    """Hangs for good on the weights of version 1 (a push that never completes)."""

    def on(message):
        if message[0] == "weights" and message[1] >= 1:
            time.sleep(3600)

    producer_main(spec, _Inbox(inbox, on), outbox)


def vllm_push_skips_a_tensor(spec, inbox, outbox):
    """The vLLM engine in the producer: its start-up push whole, every later one without
    one MLP matrix (which the engine then keeps from before: a stale tensor, no error)."""
    from rlhflab.rollout import vllm as vllm_backend

    real, pushes = vllm_backend.policy_weights, []

    def broken(model):
        pushes.append(1)
        for name, tensor in real(model):
            if len(pushes) == 1 or name != "model.layers.0.mlp.down_proj.weight":
                yield name, tensor

    vllm_backend.policy_weights = broken
    producer_main(spec, inbox, outbox)
