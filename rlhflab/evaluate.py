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
--data test.jsonl [--correct my_rewards:exact]` runs it from the command line, greedy by
default or sampled (``--sample --temperature T``), with either generation backend:
``--backend hf`` (Hugging Face ``generate``) or ``--backend vllm`` (a vLLM engine on the
model folder; docs/rollout_backends.md). Both hand their responses to the same
`score_rollout`, so the metrics are computed the same way whoever generated.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from rlhflab.data.prompts import PromptExample
from rlhflab.rewards.gsm8k import ground_truth, is_correct, parse_number
from rlhflab.rewards.plugins import call_plugin, load_function
from rlhflab.rollout import Rollout, generate


@dataclass
class EvalChecks:
    """What an evaluation measures beside the optimised reward (built from `eval:`)."""

    correct: Callable | None = None   # fn(prompt, response, example) -> bool, or batched
    correct_name: str = ""            # its spec, for messages and the samples file
    rewards: dict = field(default_factory=dict)  # metric name -> scorer, logged as eval/<name>


def build_eval_checks(eval_cfg, device: torch.device | str = "cpu") -> EvalChecks:
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


def judge(checks: EvalChecks | None, prompts: Sequence[str], responses: Sequence[str],
          examples: Sequence[dict]) -> list[bool] | None:
    """One bool per response by `accuracy_rule`'s rule; None when no rule applies."""
    if checks is not None and checks.correct is not None:
        values = call_plugin(checks.correct, checks.correct_name, prompts, responses, examples, what="check")
        return [v == 1.0 for v in values]
    if has_numeric_answers(examples):
        return [is_correct(r, str(e["answer"])) for r, e in zip(responses, examples)]
    return None


@torch.no_grad()
def evaluate_policy(model, tokenizer, examples: list[PromptExample], scorer, *,
                    max_new_tokens: int, max_prompt_length: int | None = None,
                    batch_size: int = 64, checks: EvalChecks | None = None) -> EvalResult:
    """Greedy responses to every example, scored by the reward and by `checks`; keeps
    every response (with its score, correctness and eval-only rewards) for inspection."""
    roll = generate(model, tokenizer, [e.prompt for e in examples], max_new_tokens=max_new_tokens,
                    greedy=True, max_prompt_length=max_prompt_length, batch_size=batch_size,
                    examples=[e.row for e in examples])
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
    acc = sum(correct) / len(correct) if correct else None
    extra = {name: float(v.mean()) if len(v) else 0.0 for name, v in extra_scores.items()}
    return EvalResult(acc, float(scores.mean()) if len(scores) else 0.0, samples, extra)


def save_samples(result: EvalResult, path: str | Path, limit: int | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for s in result.samples[:limit]:
            fh.write(json.dumps(s) + "\n")
    return path


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model folder or hub name")
    parser.add_argument("--data", required=True, help="jsonl/json/parquet/csv of held-out rows")
    parser.add_argument("--prompt-field", default="question")
    parser.add_argument("--answer-field", default="answer", help="copied into example['answer'] for the checks")
    from rlhflab.data.arith import PROMPT_TEMPLATE

    parser.add_argument("--template", default=PROMPT_TEMPLATE,
                        help="how a question is shown to the model; {prompt} is replaced (default: the "
                             "arithmetic task's, %(default)r)")
    from rlhflab.cliargs import count

    parser.add_argument("--max-new-tokens", type=count(), default=32, help="longest answer (default: %(default)s)")
    parser.add_argument("--limit", type=count(), default=None, help="first N rows only (default: all)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--reward", default="gsm8k",
                        help="reward: a registered rule (gsm8k), module:function or path/to/file.py:function")
    parser.add_argument("--correct", default=None,
                        help="accuracy: module:function or file.py:function returning True when a response is "
                             "right; default: the GSM8K checker when every answer is a number, else none")
    parser.add_argument("--samples", default=None, help="write every response (jsonl) here")
    parser.add_argument("--batch-size", type=count(), default=64,
                        help="hf: responses per generate call; vllm: sequences the engine holds at once "
                             "(default: %(default)s)")
    from rlhflab.cliargs import number, seed
    from rlhflab.generate import add_backend_options

    parser.add_argument("--sample", action="store_true",
                        help="sample instead of greedy decoding (accuracy then estimates pass@1 at --temperature)")
    parser.add_argument("--temperature", type=number(0.0, lo_open=True), default=1.0,
                        help="sampling temperature, > 0 (with --sample; default: %(default)s)")
    parser.add_argument("--top-p", type=number(0.0, 1.0, lo_open=True), default=1.0,
                        help="nucleus sampling mass in (0, 1] (with --sample; default: %(default)s)")
    parser.add_argument("--seed", type=seed(), default=0, help="sampling seed (default: %(default)s)")
    add_backend_options(parser)


def run(args: argparse.Namespace) -> int:
    from rlhflab.config.schema import DatasetConfig
    from rlhflab.data.prompts import load_prompts
    from rlhflab.generate import check_backend_options
    from rlhflab.models.load import load_model
    from rlhflab.rewards import RuleScorer, resolve_rule

    check_backend_options(args)
    # The plug-ins first (and once on the first row), so a typo fails before the model loads.
    ds = DatasetConfig(path=None, eval_path=args.data, prompt_field=args.prompt_field,
                       answer_field=args.answer_field, prompt_template=args.template,
                       num_eval_samples=args.limit)
    examples = load_prompts(ds, None, split="eval")
    scorer = RuleScorer(resolve_rule(args.reward), args.reward)
    checks = EvalChecks(load_function(args.correct), args.correct) if args.correct else None
    first = examples[:1]
    probe = [str(e.row.get("answer", "")) for e in first]
    scorer.score([e.prompt for e in first], probe, [e.row for e in first])
    judge(checks, [e.prompt for e in first], probe, [e.row for e in first])

    sampling = dict(max_new_tokens=args.max_new_tokens, greedy=not args.sample, temperature=args.temperature,
                    top_p=args.top_p)
    if args.backend == "vllm":  # only the tokenizer here: the engine loads the weights itself
        from rlhflab.generate import CLI_OPTIONS
        from rlhflab.models.load import load_tokenizer
        from rlhflab.rollout.vllm import engine_for_folder

        tok = load_tokenizer(args.model, kind="model")
        examples = load_prompts(ds, tok, split="eval")
        prompts = [e.prompt for e in examples]
        engine = engine_for_folder(args.model, tok, prompts, max_new_tokens=args.max_new_tokens,
                                   max_num_seqs=min(args.batch_size, len(prompts)), seed=args.seed,
                                   kv_cache_gb=args.kv_cache_gb, gpu_memory_utilization=args.gpu_memory_utilization,
                                   enforce_eager=args.enforce_eager, options=CLI_OPTIONS)
        roll = engine.generate(prompts, examples=[e.row for e in examples], seed=args.seed,
                               sample_logprobs=False, **sampling)
    else:
        model, tok = load_model(args.model, device=args.device)
        examples = load_prompts(ds, tok, split="eval")
        torch.manual_seed(args.seed)
        roll = generate(model, tok, [e.prompt for e in examples], batch_size=args.batch_size,
                        examples=[e.row for e in examples], **sampling)
    res = score_rollout(roll, scorer, checks)
    rule = accuracy_rule(checks, [e.row for e in examples])
    if res.accuracy is not None:
        print(f"accuracy     {res.accuracy:.3f}   by {rule}")
    else:
        print("accuracy     n/a   (the answers are not numbers; give --correct module:function)")
    how = f"sampled at temperature {args.temperature:g}" if args.sample else "greedy"
    print(f"reward_mean  {res.reward_mean:.3f}   ({len(examples)} examples, reward {args.reward}, {how}, "
          f"backend {args.backend})")
    for s in res.samples[:3]:
        print(f"--- {s['prompt']!r}\n    {s['response']!r}  score={s['score']:.3g}")
    if args.samples:
        print(f"samples: {save_samples(res, args.samples)}")
    return 0
