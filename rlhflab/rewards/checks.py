"""What an evaluation checks beside the optimised reward: `eval.correct` (or, when every
held-out answer is a number, the numeric rule: GSM8K's ``#### N`` for ``#### N`` answers,
the response's ``#### N`` or else its last number for plain ones) and the eval-only `eval.rewards`.

These live with the rewards, below generation, so that the reward preflight, the held-out
evaluation (`rlhflab.evaluate`), `rlhflab eval` and `rlhflab tpo` share one rule;
`rlhflab.evaluate` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from rlhflab.rewards.gsm8k import extract_answer, ground_truth, parse_number
from rlhflab.rewards.plugins import call_plugin, load_function


@dataclass
class EvalChecks:
    """What an evaluation measures beside the optimised reward (built from `eval:`)."""

    correct: Callable | None = None   # fn(prompt, response, example) -> bool, or batched
    correct_name: str = ""            # its spec, for messages and the samples file
    rewards: dict = field(default_factory=dict)  # metric name -> scorer, logged as eval/<name>


def build_eval_checks(eval_cfg, device="cpu", fmt=None, tokenizer=None) -> EvalChecks:
    """The `eval:` section as checks: the correctness function and the eval-only scorers
    (`fmt`, `tokenizer` as in `rewards.build_source`)."""
    from rlhflab.rewards import build_source

    if eval_cfg is None:
        return EvalChecks()
    correct = load_function(eval_cfg.correct, eval_cfg.plugin_dir) if eval_cfg.correct else None
    rewards = {s.metric_name(): build_source(s, device, eval_cfg.plugin_dir, fmt, tokenizer) for s in eval_cfg.rewards}
    return EvalChecks(correct, eval_cfg.correct or "", rewards)


def has_numeric_answers(rows: Sequence[dict]) -> bool:
    """True when every row has an `answer` whose final part parses as a number: GSM8K's
    ``... #### 72`` or a plain ``72``."""
    return bool(rows) and all("answer" in r and parse_number(ground_truth(str(r["answer"]))) is not None
                              for r in rows)


def _hash_form(answer) -> bool:
    return "####" in str(answer)


def numeric_rule(rows: Sequence[dict]) -> str:
    """The words for the numeric rule these rows get: GSM8K answers (``#### N``) are judged
    by the number after ``####`` in the response; plain-number answers by the response's
    ``#### N`` or, without one, its last number."""
    hashed = sum(_hash_form(r["answer"]) for r in rows)
    if hashed == len(rows):
        return "the GSM8K checker (the number after '####' in the response; every held-out answer is '#### N')"
    if hashed == 0:
        return ("the plain-number checker (the response's '#### N', else its last number; every held-out answer "
                "is a plain number)")
    return (f"the numeric checker (the GSM8K checker on the {hashed} '#### N' answers; the response's '#### N', "
            f"else its last number, on the {len(rows) - hashed} plain-number ones)")


def read_number(response: str, answer) -> str | None:
    """The number the numeric rule reads in `response` for this reference `answer`: the one
    after ``####``; for a plain-number answer, else the response's last number. None: unparsed."""
    found = extract_answer(response, fallback_last_number=not _hash_form(answer))
    return found if found is not None and parse_number(found) is not None else None


def numeric_correct(response: str, answer) -> bool:
    """The numeric rule: the number read (`read_number`) equals the reference's (100 == 100.0)."""
    found = read_number(response, answer)
    return found is not None and parse_number(found) == parse_number(ground_truth(str(answer)))


def accuracy_rule(checks: EvalChecks | None, rows: Sequence[dict]) -> str | None:
    """What eval/accuracy will be on these rows, in words; None when it is not logged."""
    if checks is not None and checks.correct is not None:
        return f"eval.correct ({checks.correct_name})"
    if has_numeric_answers(rows):
        return numeric_rule(rows)
    return None


def judge(checks: EvalChecks | None, prompts: Sequence[str], responses: Sequence[str],
          examples: Sequence[dict]) -> list[bool] | None:
    """One bool per response by `accuracy_rule`'s rule; None when no rule applies."""
    if checks is not None and checks.correct is not None:
        values = call_plugin(checks.correct, checks.correct_name, prompts, responses, examples, what="check")
        return [v == 1.0 for v in values]
    if has_numeric_answers(examples):
        return [numeric_correct(r, e["answer"]) for r, e in zip(responses, examples)]
    return None
