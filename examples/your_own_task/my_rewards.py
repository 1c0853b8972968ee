"""The word-reversal task's reward and correctness check, as rlhflab plug-ins.

The configs name them `my_rewards:score` and `my_rewards:exact`. `example` is the dataset
row as rlhflab passes it: every field of the row ({"word", "reversed"}) plus `answer`, a
copy of the field `dataset.answer_field` names (here `reversed`).
"""


def score(prompt: str, response: str, example: dict) -> float:
    """1.0 for the exact reversal; 0.1 for the right letters in a wrong order; else 0."""
    got, want = response.strip(), example["answer"]
    if got == want:
        return 1.0
    if sorted(got) == sorted(want):
        return 0.1
    return 0.0


def exact(prompt: str, response: str, example: dict) -> bool:
    """eval/accuracy: the response is the word reversed, exactly."""
    return response.strip() == example["answer"]
