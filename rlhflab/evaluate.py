"""Held-out evaluation: mean reward, accuracy, and checks you choose.

What each metric means:

- ``eval/reward_mean``: the optimised reward (``reward.sources``) on the held-out prompts.
- ``eval/accuracy``: the fraction of responses your ``eval.correct`` function calls right.
  Without one, a numeric rule, but only when every held-out row has an ``answer`` whose
  final part (after ``####``, or the whole of a plain number) is a number: the GSM8K
  checker for ``#### N`` answers, the response's ``#### N`` or else its last number for
  plain ones; otherwise no accuracy is logged at all, never a misleading 0
  (`accuracy_rule` says which rule applies; each sample keeps the number read, ``parsed``).
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
`rlhflab eval --run RUN_DIR` takes those settings, the reward and the checks from the run's
effective_config.yaml and the model from RUN_DIR/final; a flag given still wins.
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
                                    has_numeric_answers, judge, read_number)
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

    @property
    def unparsed(self) -> int | None:
        """Responses in which the numeric rule found no number; None when it did not judge."""
        if not self.samples or "parsed" not in self.samples[0]:
            return None
        return sum(s["parsed"] is None for s in self.samples)

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
    numeric = correct is not None and (checks is None or checks.correct is None)
    samples = []
    for i, (p, r, s) in enumerate(zip(roll.prompts, roll.responses, scores.tolist())):
        sample = {"prompt": p, "response": r, "score": float(s)}
        example = roll.examples[i] if i < len(roll.examples) else {}
        if "answer" in example:
            ans = example["answer"]  # the reference, beside the response it judges
            sample["answer"] = ans if isinstance(ans, (str, int, float)) else str(ans)
        if correct is not None:
            sample["correct"] = correct[i]
        if numeric:
            sample["parsed"] = read_number(r, example["answer"])  # the number the rule read; None: none found
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


# What `--run RUN_DIR` takes from the run's effective_config.yaml when the flag is not given:
# option -> (section, key); the dataset rows and the limit only when --data comes from the run too.
RUN_SETTINGS = {
    "prompt_field": ("dataset", "prompt_field"), "answer_field": ("dataset", "answer_field"),
    "template": ("dataset", "prompt_template"), "use_chat_template": ("dataset", "use_chat_template"),
    "max_prompt_length": ("dataset", "max_prompt_length"), "max_new_tokens": ("generation", "max_new_tokens"),
    "batch_size": ("training", "eval_batch_size"),
}


def add_parser(parser: argparse.ArgumentParser) -> None:
    from rlhflab.config.schema import DatasetConfig, TrainingConfig

    parser.add_argument("--run", default=None, metavar="RUN_DIR",
                        help="a training run's folder: its effective_config.yaml gives the defaults (held-out file, "
                             "fields, template, chat-template use, reward, eval.correct and eval.rewards, lengths, "
                             "batch size) and RUN_DIR/final the model; any flag given still wins")
    parser.add_argument("--model", default=None, help="model folder or hub name (default with --run: RUN_DIR/final)")
    parser.add_argument("--data", default=None,
                        help="jsonl/json/parquet/csv of held-out rows (default with --run: the run's "
                             "dataset.eval_path, its first dataset.num_eval_samples rows)")
    parser.add_argument("--prompt-field", default=None, help="default: question (with --run: the run's)")
    parser.add_argument("--answer-field", default=None,
                        help="copied into example['answer'] for the checks; default: answer (with --run: the run's)")
    from rlhflab.data.arith import PROMPT_TEMPLATE

    parser.add_argument("--template", default=None,
                        help=f"how a question is shown to the model; {{prompt}} is replaced (default: the "
                             f"arithmetic task's, {PROMPT_TEMPLATE!r}; with --run: the run's)".replace("%", "%%"))
    from rlhflab.cliargs import count
    from rlhflab.generate import add_chat_template_option

    add_chat_template_option(parser)
    parser.set_defaults(use_chat_template=None)
    parser.add_argument("--max-new-tokens", type=count(), default=None,
                        help="longest answer (default: 32; with --run: the run's generation.max_new_tokens)")
    parser.add_argument("--max-prompt-length", type=count(), default=None,
                        help="prompts longer than this (in tokens) are cut from the left, as the trainers' "
                             f"dataset.max_prompt_length (default: {DatasetConfig.max_prompt_length}; with --run: "
                             "the run's)")
    parser.add_argument("--limit", type=count(), default=None, help="first N rows only (default: all)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--reward", default=None,
                        help="reward: a registered rule (gsm8k), module:function or path/to/file.py:function "
                             "(default: gsm8k; with --run: the run's reward.sources)")
    parser.add_argument("--correct", default=None,
                        help="accuracy: module:function or file.py:function returning True when a response is "
                             "right (with --run: the run's eval.correct); without one, a numeric answer is judged "
                             "by the GSM8K checker ('#### N' answers) or the plain-number checker, else none")
    parser.add_argument("--samples", default=None,
                        help="write every response (jsonl) here, with its reference answer and verdict")
    parser.add_argument("--batch-size", type=count(), default=None,
                        help="hf: responses per generate call, as the trainers' training.eval_batch_size (the "
                             "batch's padding can change float rounding); vllm: sequences the engine holds at once "
                             f"(default: {TrainingConfig.eval_batch_size}; with --run: the run's)")
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


def load_run_settings(run_dir: str | Path):
    """The dataset, reward, eval, generation and training sections of a run folder's
    effective_config.yaml, typed and checked as the trainers check them."""
    import dataclasses

    import yaml

    from rlhflab.config import load_config
    from rlhflab.config.schema import DatasetConfig, EvalConfig, GenerationConfig, RewardConfig, TrainingConfig
    from rlhflab.errors import UserError

    path = Path(run_dir) / "effective_config.yaml"
    if not Path(run_dir).is_dir():
        raise UserError(f"--run {run_dir}: no such folder; give a training run's output_dir")
    if not path.is_file():
        raise UserError(f"--run {run_dir}: no effective_config.yaml there, so it is not a training run's folder; "
                        "give the run's output_dir, or use --model and --data without --run")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: cannot be read as YAML ({str(exc).splitlines()[0]})") from None
    view = dataclasses.make_dataclass("RunView", [
        ("dataset", DatasetConfig, dataclasses.field(default_factory=DatasetConfig)),
        ("reward", RewardConfig, dataclasses.field(default_factory=RewardConfig)),
        ("eval", EvalConfig, dataclasses.field(default_factory=EvalConfig)),
        ("generation", GenerationConfig, dataclasses.field(default_factory=GenerationConfig)),
        ("training", TrainingConfig, dataclasses.field(default_factory=TrainingConfig))])
    base = {k: raw[k] for k in ("dataset", "reward", "eval", "generation", "training") if isinstance(raw.get(k), dict)}
    try:
        return load_config(None, view, base=base)[0]
    except UserError as exc:
        raise UserError(f"{path}: {str(exc).splitlines()[0]}") from None


def resolve_run_args(args: argparse.Namespace):
    """Fill the options left unset from `--run` (the run's effective config) or the defaults;
    returns the run's settings (None without --run). A flag given always wins."""
    from rlhflab.config.schema import DatasetConfig, TrainingConfig
    from rlhflab.data.arith import PROMPT_TEMPLATE
    from rlhflab.errors import UserError

    run = load_run_settings(args.run) if args.run else None
    if args.model is None:
        if run is None:
            raise UserError("give --model PATH (a model folder), or --run RUN_DIR to evaluate a run's final/ model")
        final = Path(args.run) / "final"
        if not final.is_dir():
            raise UserError(f"--run {args.run}: no final/ model there (the run did not finish?); "
                            f"give --model {args.run}/step_N")
        args.model = str(final)
    if args.data is None:
        if run is None or not run.dataset.eval_path:
            raise UserError("give --data FILE (held-out rows)" if run is None else
                            f"--run {args.run}: the run has no dataset.eval_path; give --data FILE")
        args.data = run.dataset.eval_path
        if args.limit is None:
            args.limit = run.dataset.num_eval_samples
    defaults = {"prompt_field": "question", "answer_field": "answer", "template": PROMPT_TEMPLATE,
                "use_chat_template": "auto", "max_prompt_length": DatasetConfig.max_prompt_length,
                "max_new_tokens": 32, "batch_size": TrainingConfig.eval_batch_size}
    for name, (section, key) in RUN_SETTINGS.items():
        if getattr(args, name) is None:
            value = getattr(getattr(run, section), key) if run is not None else defaults[name]
            setattr(args, name, str(value).lower() if name == "use_chat_template" else value)
    return run


def _shown_prompts(args: argparse.Namespace, use_chat) -> tuple:
    """(prompt format, tokenizer) of the prompts this evaluation shows the model, for a
    run's reward sources that read raw `reference_path` prompts (the tokenizer only: cheap)."""
    from rlhflab.data.prompts import PromptFormat
    from rlhflab.models.load import load_tokenizer

    tok = load_tokenizer(args.model, kind="model")
    return PromptFormat.resolve(args.template, use_chat, tok, "--use-chat-template"), tok


def run(args: argparse.Namespace) -> int:
    from rlhflab.config.schema import DatasetConfig
    from rlhflab.data.prompts import load_prompts
    from rlhflab.generate import chat_template_setting, check_backend_options, engine_settings
    from rlhflab.models.load import resolve_device
    from rlhflab.rewards import RuleScorer, build_reward, resolve_rule
    from rlhflab.rollout.sampler import Sampler, Sampling

    check_backend_options(args)
    settings = resolve_run_args(args)
    use_chat = chat_template_setting(args.use_chat_template)
    # The plug-ins first (and once on the first row), so a typo fails before the model loads.
    ds = DatasetConfig(path=None, eval_path=args.data, prompt_field=args.prompt_field,
                       answer_field=args.answer_field, prompt_template=args.template,
                       use_chat_template=use_chat, max_prompt_length=args.max_prompt_length,
                       num_eval_samples=args.limit)
    examples = load_prompts(ds, None, split="eval")
    device = str(resolve_device(args.device)) if args.backend == "hf" else "cpu"
    shown = _shown_prompts(args, use_chat) if settings is not None else (None, None)
    if args.reward is not None or settings is None:
        reward_name = args.reward or "gsm8k"
        scorer = RuleScorer(resolve_rule(reward_name), reward_name)
    else:
        reward_name = "the run's reward.sources (" + ", ".join(
            s.name if s.type == "rule" else f"{s.type} {s.path}" for s in settings.reward.sources) + ")"
        scorer = build_reward(settings.reward, device, *shown)
    if args.correct:
        checks = EvalChecks(load_function(args.correct), args.correct)
    elif settings is not None:
        checks = build_eval_checks(settings.eval, device, *shown)
    else:
        checks = None
    first = examples[:1]
    probe = [str(e.row.get("answer", "")) for e in first]
    scorer.score([e.prompt for e in first], probe, [e.row for e in first])
    judge(checks, [e.prompt for e in first], probe, [e.row for e in first])

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
        unparsed = res.unparsed
        tail = "" if unparsed is None else f"; {unparsed} of {len(res.samples)} responses had no number it could read"
        print(f"accuracy     {res.accuracy:.3f}   by {rule}{tail}")
    else:
        print("accuracy     n/a   (the answers are not numbers; give --correct module:function)")
    how = f"sampled at temperature {args.temperature:g}" if args.sample else "greedy"
    print(f"reward_mean  {res.reward_mean:.3f}   ({len(examples)} examples, reward {reward_name}, {how}, "
          f"backend {args.backend})")
    for name, value in res.extra.items():
        print(f"eval/{name}  {value:.3f}")
    if settings is not None:
        print(f"run: {args.run} (model {args.model}, data {args.data})")
    print(f"prompts: {prompts_line}")
    for s in res.samples[:3]:
        ref = f"  answer={s['answer']!r}" if "answer" in s else ""
        print(f"--- {s['prompt']!r}\n    {s['response']!r}  score={s['score']:.3g}{ref}")
    if args.samples:
        print(f"samples: {save_samples(res, args.samples)}")
    return 0
