"""What an evaluation checks beside the optimised reward: `eval.correct` (or the GSM8K
checker when every held-out answer is a number) and the eval-only `eval.rewards`.

These live with the rewards, below generation, so that the reward preflight, the held-out
evaluation (`rlhflab.evaluate`), `rlhflab eval` and `rlhflab tpo` share one rule;
`rlhflab.evaluate` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from rlhflab.rewards.gsm8k import ground_truth, is_correct, parse_number
from rlhflab.rewards.plugins import call_plugin, load_function


@dataclass
class EvalChecks:
    """What an evaluation measures beside the optimised reward (built from `eval:`)."""

    correct: Callable | None = None   # fn(prompt, response, example) -> bool, or batched
    correct_name: str = ""            # its spec, for messages and the samples file
    rewards: dict = field(default_factory=dict)  # metric name -> scorer, logged as eval/<name>


def build_eval_checks(eval_cfg, device="cpu") -> EvalChecks:
    """The `eval:` section as checks: the correctness function and the eval-only scorers."""
    from rlhflab.rewards import build_source

    if eval_cfg is None:
        return EvalChecks()
    correct = load_function(eval_cfg.correct, eval_cfg.plugin_dir) if eval_cfg.correct else None
    rewards = {s.metric_name(): build_source(s, device, eval_cfg.plugin_dir) for s in eval_cfg.rewards}
    return EvalChecks(correct, eval_cfg.correct or "", rewards)


def has_numeric_answers(rows: Sequence[dict]) -> bool:
    """True when every row has an `answer` whose final part parses as a number (GSM8K-style)."""
    return bool(rows) and all("answer" in r and parse_number(ground_truth(str(r["answer"]))) is not None
                              for r in rows)


def accuracy_rule(checks: EvalChecks | None, rows: Sequence[dict]) -> str | None:
    """What eval/accuracy will be on these rows, in words; None when it is not logged."""
    if checks is not None and checks.correct is not None:
        return f"eval.correct ({checks.correct_name})"
    if has_numeric_answers(rows):
        return "the GSM8K checker (every held-out answer is a number)"
    return None


def judge(checks: EvalChecks | None, prompts: Sequence[str], responses: Sequence[str],
          examples: Sequence[dict]) -> list[bool] | None:
    """One bool per response by `accuracy_rule`'s rule; None when no rule applies."""
    if checks is not None and checks.correct is not None:
        values = call_plugin(checks.correct, checks.correct_name, prompts, responses, examples, what="check")
        return [v == 1.0 for v in values]
    if has_numeric_answers(examples):
        return [is_correct(r, str(e["answer"])) for r, e in zip(responses, examples)]
    return None
