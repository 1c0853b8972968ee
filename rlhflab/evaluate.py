"""Held-out evaluation with greedy decoding: accuracy (GSM8K-style tasks) and mean reward.

`rlhflab eval --model PATH --data test.jsonl` runs it from the command line.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhflab.data.prompts import PromptExample
from rlhflab.rewards.gsm8k import is_correct
from rlhflab.rollout import generate


@dataclass
class EvalResult:
    accuracy: float | None  # fraction correct by the GSM8K checker; None when rows lack answers
    reward_mean: float
    samples: list[dict] = field(default_factory=list)

    @classmethod
    def from_samples(cls, samples: list[dict]) -> "EvalResult":
        """The result of samples decoded elsewhere (e.g. gathered from several processes)."""
        correct = [s["correct"] for s in samples if "correct" in s]
        acc = sum(correct) / len(correct) if correct and len(correct) == len(samples) else None
        reward = sum(s["score"] for s in samples) / len(samples) if samples else 0.0
        return cls(acc, reward, list(samples))

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        out = {f"{prefix}reward_mean": self.reward_mean}
        if self.accuracy is not None:
            out[f"{prefix}accuracy"] = self.accuracy
        return out


@torch.no_grad()
def evaluate_policy(model, tokenizer, examples: list[PromptExample], scorer, *,
                    max_new_tokens: int, max_prompt_length: int | None = None,
                    batch_size: int = 64) -> EvalResult:
    """Greedy responses to every example, scored; keeps every response for inspection."""
    roll = generate(model, tokenizer, [e.prompt for e in examples], max_new_tokens=max_new_tokens,
                    greedy=True, max_prompt_length=max_prompt_length, batch_size=batch_size,
                    examples=[e.row for e in examples])
    scores = scorer.score(roll.prompts, roll.responses, roll.examples)
    has_answer = all("answer" in e.row for e in examples)
    correct = [is_correct(r, str(e.row["answer"])) for r, e in zip(roll.responses, examples)] if has_answer else None
    samples = [{"prompt": p, "response": r, "score": float(s),
                **({"correct": c} if correct is not None else {})}
               for p, r, s, c in zip(roll.prompts, roll.responses, scores.tolist(),
                                     correct or [None] * len(examples))]
    acc = sum(correct) / len(correct) if correct else None
    return EvalResult(acc, float(scores.mean()) if len(scores) else 0.0, samples)


def save_samples(result: EvalResult, path: str | Path, limit: int | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for s in result.samples[:limit]:
            fh.write(json.dumps(s) + "\n")
    return path


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model folder or hub name")
    parser.add_argument("--data", required=True, help="jsonl/json/parquet/csv with question and answer fields")
    parser.add_argument("--prompt-field", default="question")
    parser.add_argument("--answer-field", default="answer")
    from rlhflab.data.arith import PROMPT_TEMPLATE

    parser.add_argument("--template", default=PROMPT_TEMPLATE,
                        help="how a question is shown to the model; {prompt} is replaced (default: the "
                             "arithmetic task's, %(default)r)")
    from rlhflab.cliargs import count

    parser.add_argument("--max-new-tokens", type=count(), default=32, help="longest answer (default: %(default)s)")
    parser.add_argument("--limit", type=count(), default=None, help="first N rows only (default: all)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--reward", default="gsm8k", help="registered rule reward name")


def run(args: argparse.Namespace) -> int:
    from rlhflab.config.schema import DatasetConfig
    from rlhflab.data.prompts import load_prompts
    from rlhflab.models.load import load_model
    from rlhflab.rewards import RuleScorer, resolve_rule

    model, tok = load_model(args.model, device=args.device)
    ds = DatasetConfig(path=None, eval_path=args.data, prompt_field=args.prompt_field,
                       answer_field=args.answer_field, prompt_template=args.template,
                       num_eval_samples=args.limit)
    examples = load_prompts(ds, tok, split="eval")
    res = evaluate_policy(model, tok, examples, RuleScorer(resolve_rule(args.reward)),
                          max_new_tokens=args.max_new_tokens)
    if res.accuracy is not None:
        print(f"accuracy     {res.accuracy:.3f}")
    print(f"reward_mean  {res.reward_mean:.3f}   ({len(examples)} examples)")
    for s in res.samples[:3]:
        print(f"--- {s['prompt']!r}\n    {s['response']!r}  score={s['score']}")
    return 0
