"""Held-out evaluation: mean reward, accuracy, and checks you choose.

What each metric means:

- ``eval/reward_mean``: the optimised reward (``reward.sources``) on the held-out prompts.
- ``eval/accuracy``: the fraction of responses your ``eval.correct`` function calls right.
  Without one, the GSM8K checker, but only when every held-out row has an ``answer``
  whose final part (after ``####``) is a number; otherwise no accuracy is logged at all,
  never a misleading 0 (`accuracy_rule` says which applies).
- ``eval/<metric>``: each ``eval.rewards`` source, measured and never optimised: the true
  check beside a learned reward, so reward hacking shows (the doctor warns about it).

The trainers evaluate with greedy decoding (`evaluate_policy`). `rlhflab eval --model PATH
--data test.jsonl [--correct my_rewards:exact]` runs the same evaluation from the command
line (`evaluate_sampled`, through the one `rlhflab.rollout.sampler.Sampler`), greedy by
default or sampled (``--sample --temperature T``), with either generation backend:
``--backend hf`` (Hugging Face ``generate``) or ``--backend vllm`` (a vLLM engine on the
model folder; docs/rollout_backends.md). Prompts are rendered by the trainers' function
and rule (``--use-chat-template auto|true|false``, auto by default: a tokenizer with a
chat template is asked as a chat model), and ``--batch-size`` and
``--max-prompt-length`` default to the trainers' ``training.eval_batch_size`` and
``dataset.max_prompt_length``: on the same model, rows and settings, `rlhflab eval` prints
the numbers the training loop's held-out evaluation logs (tests/test_sampler.py).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from rlhflab.data.prompts import PromptExample
from rlhflab.rewards.checks import (EvalChecks, accuracy_rule, build_eval_checks,  # noqa: F401 (re-exported)
                                    has_numeric_answers, judge)
from rlhflab.rewards.plugins import load_function
from rlhflab.rollout import Rollout


@dataclass
class EvalResult:
    accuracy: float | None  # fraction correct (eval.correct or the GSM8K checker); None when neither applies
    reward_mean: float
    samples: list[dict] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)  # eval.rewards means, by metric name

    @classmethod
    def from_samples(cls, samples: list[dict], extra: Sequence[str] = ()) -> "EvalResult":
        """The result of samples decoded elsewhere (e.g. gathered from several processes);
        `extra` names the eval-only rewards each sample carries."""
        correct = [s["correct"] for s in samples if "correct" in s]
        acc = sum(correct) / len(correct) if correct and len(correct) == len(samples) else None
        reward = sum(s["score"] for s in samples) / len(samples) if samples else 0.0
        means = {k: sum(s[k] for s in samples) / len(samples) for k in extra} if samples else {}
        return cls(acc, reward, list(samples), means)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        out = {f"{prefix}reward_mean": self.reward_mean}
        if self.accuracy is not None:
            out[f"{prefix}accuracy"] = self.accuracy
        out.update({f"{prefix}{k}": v for k, v in self.extra.items()})
        return out


@torch.no_grad()
def evaluate_policy(model, tokenizer, examples: list[PromptExample], scorer, *,
                    max_new_tokens: int, max_prompt_length: int | None = None,
                    batch_size: int = 64, checks: EvalChecks | None = None) -> EvalResult:
    """Greedy responses to every example, scored by the reward and by `checks`; keeps
    every response (with its score, correctness and eval-only rewards) for inspection.
    The examples are rendered already (`load_prompts`)."""
    from rlhflab.rollout.sampler import Sampler, Sampling

    sampler = Sampler(tokenizer, model=model, max_prompt_length=max_prompt_length)
    return evaluate_sampled(sampler, examples, scorer, Sampling(max_new_tokens, greedy=True),
                            batch_size=batch_size, checks=checks)


@torch.no_grad()
def evaluate_sampled(sampler, examples: list[PromptExample], scorer, sampling, *, batch_size: int = 64,
                     checks: EvalChecks | None = None, seed: int | None = None) -> EvalResult:
    """`evaluate_policy` with any `Sampler` (a model folder on hf or vLLM) and `Sampling`:
    what `rlhflab eval` runs, and the trainers through `evaluate_policy`."""
    roll = sampler.sample([e.prompt for e in examples], sampling, examples=[e.row for e in examples],
                          batch_size=batch_size, seed=seed)
    return score_rollout(roll, scorer, checks)


def score_rollout(roll: Rollout, scorer, checks: EvalChecks | None = None) -> EvalResult:
    """The evaluation of responses already generated (by either backend): the reward's
    mean, accuracy by `accuracy_rule`, the eval-only rewards, and every sample."""
    scores = scorer.score(roll.prompts, roll.responses, roll.examples)
    correct = judge(checks, roll.prompts, roll.responses, roll.examples)
    extra_scores = {name: s.score(roll.prompts, roll.responses, roll.examples).float()
                    for name, s in (checks.rewards.items() if checks is not None else [])}
    samples = []
    for i, (p, r, s) in enumerate(zip(roll.prompts, roll.responses, scores.tolist())):
        sample = {"prompt": p, "response": r, "score": float(s)}
        if correct is not None:
            sample["correct"] = correct[i]
        sample.update({name: float(v[i]) for name, v in extra_scores.items()})
        samples.append(sample)
    # The means as the trainers' evaluation takes them from its gathered samples, to the last bit.
    return EvalResult.from_samples(samples, extra=tuple(extra_scores))


def save_samples(result: EvalResult, path: str | Path, limit: int | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for s in result.samples[:limit]:
            fh.write(json.dumps(s) + "\n")
    return path


def add_parser(parser: argparse.ArgumentParser) -> None:
    from rlhflab.config.schema import DatasetConfig, TrainingConfig

    parser.add_argument("--model", required=True, help="model folder or hub name")
    parser.add_argument("--data", required=True, help="jsonl/json/parquet/csv of held-out rows")
    parser.add_argument("--prompt-field", default="question")
    parser.add_argument("--answer-field", default="answer", help="copied into example['answer'] for the checks")
    from rlhflab.data.arith import PROMPT_TEMPLATE

    parser.add_argument("--template", default=PROMPT_TEMPLATE,
                        help="how a question is shown to the model; {prompt} is replaced (default: the "
                             "arithmetic task's, %(default)r)")
    from rlhflab.cliargs import count
    from rlhflab.generate import add_chat_template_option

    add_chat_template_option(parser)
    parser.add_argument("--max-new-tokens", type=count(), default=32, help="longest answer (default: %(default)s)")
    parser.add_argument("--max-prompt-length", type=count(), default=DatasetConfig.max_prompt_length,
                        help="prompts longer than this (in tokens) are cut from the left, as the trainers' "
                             "dataset.max_prompt_length (default: %(default)s)")
    parser.add_argument("--limit", type=count(), default=None, help="first N rows only (default: all)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--reward", default="gsm8k",
                        help="reward: a registered rule (gsm8k), module:function or path/to/file.py:function")
    parser.add_argument("--correct", default=None,
                        help="accuracy: module:function or file.py:function returning True when a response is "
                             "right; default: the GSM8K checker when every answer is a number, else none")
    parser.add_argument("--samples", default=None, help="write every response (jsonl) here")
    parser.add_argument("--batch-size", type=count(), default=TrainingConfig.eval_batch_size,
                        help="hf: responses per generate call, as the trainers' training.eval_batch_size (the "
                             "batch's padding can change float rounding); vllm: sequences the engine holds at once "
                             "(default: %(default)s)")
    from rlhflab.cliargs import number, seed
    from rlhflab.generate import add_backend_options

    parser.add_argument("--sample", action="store_true",
                        help="sample instead of greedy decoding (accuracy then estimates pass@1 at --temperature)")
    parser.add_argument("--temperature", type=number(0.0, lo_open=True), default=1.0,
                        help="sampling temperature, > 0 (with --sample; default: %(default)s)")
    parser.add_argument("--top-p", type=number(0.0, 1.0, lo_open=True), default=1.0,
                        help="nucleus sampling mass in (0, 1] (with --sample; default: %(default)s)")
    parser.add_argument("--seed", type=seed(), default=0,
                        help="sampling seed: each response's noise is keyed by (seed, its row), whatever the "
                             "batch size (default: %(default)s)")
    add_backend_options(parser)


def run(args: argparse.Namespace) -> int:
    from rlhflab.config.schema import DatasetConfig
    from rlhflab.data.prompts import load_prompts
    from rlhflab.generate import chat_template_setting, check_backend_options, engine_settings
    from rlhflab.models.load import resolve_device
    from rlhflab.rewards import RuleScorer, resolve_rule
    from rlhflab.rollout.sampler import Sampler, Sampling

    check_backend_options(args)
    use_chat = chat_template_setting(args.use_chat_template)
    # The plug-ins first (and once on the first row), so a typo fails before the model loads.
    ds = DatasetConfig(path=None, eval_path=args.data, prompt_field=args.prompt_field,
                       answer_field=args.answer_field, prompt_template=args.template,
                       use_chat_template=use_chat, max_prompt_length=args.max_prompt_length,
                       num_eval_samples=args.limit)
    examples = load_prompts(ds, None, split="eval")
    scorer = RuleScorer(resolve_rule(args.reward), args.reward)
    checks = EvalChecks(load_function(args.correct), args.correct) if args.correct else None
    first = examples[:1]
    probe = [str(e.row.get("answer", "")) for e in first]
    scorer.score([e.prompt for e in first], probe, [e.row for e in first])
    judge(checks, [e.prompt for e in first], probe, [e.row for e in first])

    device = str(resolve_device(args.device)) if args.backend == "hf" else "cpu"
    with Sampler.from_folder(args.model, backend=args.backend, template=args.template,
                             use_chat_template=use_chat, device=device,
                             max_prompt_length=args.max_prompt_length, engine=engine_settings(args)) as sampler:
        examples = load_prompts(ds, sampler.tokenizer, split="eval")  # rendered as the trainers render them
        sampling = Sampling(args.max_new_tokens, greedy=not args.sample, temperature=args.temperature,
                            top_p=args.top_p)
        res = evaluate_sampled(sampler, examples, scorer, sampling, batch_size=args.batch_size, checks=checks,
                               seed=args.seed)
        prompts_line = sampler.describe()
    rule = accuracy_rule(checks, [e.row for e in examples])
    if res.accuracy is not None:
        print(f"accuracy     {res.accuracy:.3f}   by {rule}")
    else:
        print("accuracy     n/a   (the answers are not numbers; give --correct module:function)")
    how = f"sampled at temperature {args.temperature:g}" if args.sample else "greedy"
    print(f"reward_mean  {res.reward_mean:.3f}   ({len(examples)} examples, reward {args.reward}, {how}, "
          f"backend {args.backend})")
    print(f"prompts: {prompts_line}")
    for s in res.samples[:3]:
        print(f"--- {s['prompt']!r}\n    {s['response']!r}  score={s['score']:.3g}")
    if args.samples:
        print(f"samples: {save_samples(res, args.samples)}")
    return 0
