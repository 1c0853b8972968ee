"""Guess-the-number: the environment of the example, named in the config as
``guess_env:GuessTheNumber`` (found beside the config; no PYTHONPATH).

The model guesses a secret number from 1 to `high`; a wrong guess is answered "higher" or
"lower" and costs 0.1, the right one ends the episode with reward 1. An episode's return
is therefore 1 - 0.1 x (wrong guesses), or -0.1 x (turns) when it never finds the number.
"""

import re

from rlhflab.envs import StepResult


class GuessTheNumber:
    def __init__(self, high: int = 10):
        self.high = high

    def reset(self, example):
        self.secret = int(example["secret"])
        return [{"role": "user", "content": f"I am thinking of a number from 1 to {self.high}. Guess it."}]

    def step(self, messages, assistant_text):
        found = re.findall(r"\d+", assistant_text)
        if not found:
            return StepResult([{"role": "user", "content": "Say a number."}], -0.1, False)
        guess = int(found[-1])
        if guess == self.secret:
            return StepResult(None, 1.0, True)
        return StepResult([{"role": "user", "content": "higher" if guess < self.secret else "lower"}], -0.1, False)


def no_reward(prompt: str, response: str, example: dict) -> float:
    """The run's reward source: nothing beyond the environment's turn rewards."""
    return 0.0
