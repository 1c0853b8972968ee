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
