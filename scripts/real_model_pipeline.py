#!/usr/bin/env python
"""The whole RLHF chain on SmolLM2-135M-Instruct, offline on a CPU, with the task's checker
as the ground truth that the learned reward is compared against.

    .venv/bin/python scripts/real_model_pipeline.py [--data DIR] [--out DIR] [sizes ...]
    .venv/bin/python scripts/real_model_pipeline.py --quick --out /tmp/pipe   (one step each)

Stages, each one existing `rlhflab` command (run in this process) with a config of
configs/*_smollm2_pipeline.yaml and the sizes of the flags as dotted overrides:

0. base: the untrained model's held-out greedy accuracy (`rlhflab eval`).
1. sft: a LoRA adapter on `--sft-rows` demonstrations of the task's sft.jsonl, one epoch
   (`rlhflab sft`); final/ is the merged model every later stage starts from.
2. pairs: `--samples` responses to each of `--pair-prompts` training questions (ones the SFT
   rows did not show) sampled from the SFT model at `--temperature`, each labelled by the
   task's checker; a right answer paired with a wrong one to the same prompt
   (`rlhflab.data.preferences.pairs_from_samples`); prompts whose samples were all right or
   all wrong give no pair. Written in the labelling app's export format (the raw question:
   the rm and dpo stages apply `--template` and the chat template, as the sampler did), split
   by prompt into pairs/train.jsonl and a held-out pairs/test.jsonl.
3. rm: a Bradley-Terry reward model from the SFT model on those pairs (`rlhflab rm`); its
   held-out pair accuracy before and after.
4. ppo: PPO from the SFT model rewarded by that reward model only (`rlhflab ppo`); at every
   step the reward model's score and the checker's accuracy on `--ppo-eval-rows` held-out
   prompts are logged side by side (`eval.correct`: eval/reward_mean beside eval/accuracy).
5. dpo: DPO from the SFT model on the same training pairs (`rlhflab dpo`).

After the base model and each policy stage, `rlhflab eval` measures held-out greedy accuracy
on the same first `--eval-rows` rows of the task's test.jsonl with the same settings. The
script prints one table (stage, what it measures, value, minutes) and appends a JSON line
with every number to `<out>/results.jsonl`. Minutes are wall time of the stage (its
training, sampling or evaluation), under whatever else the machine runs.

The task is the easy word problems of `rlhflab make-data --task word-problems --level easy`
(written to `--data` when it is missing), as in the SmolLM2 recipes; any folder with train.jsonl/test.jsonl/sft.jsonl in that
layout works, with `--correct` and `--reward` naming its checker.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlhflab.openmp import apply_default_wait  # noqa: E402  (before torch loads, as the CLI does)

apply_default_wait()

CONFIGS = ROOT / "configs"
MODEL = "outputs/models/smollm2-135m-instruct"
CHECKER = "rlhflab.data.wordproblems"
HEADER = "| stage | measures | value | minutes |\n| --- | --- | --- | --- |"
# The SmolLM2 recipes' prompt (configs/grpo_smollm2.yaml): short answers with the arithmetic
# shown, the form of the task's demonstrations ("23 + 15 = 38. The answer is 38.").
TEMPLATE = "{prompt}\nGive the calculation and the answer in one short sentence."


# --------------------------------------------------------------------------------------
# Stage 2's pure part: labelled samples -> preference pairs, and the held-out split
# --------------------------------------------------------------------------------------
class PairSet(NamedTuple):
    pairs: list[dict]      # preference rows, in the prompts' order
    prompts: int           # prompts sampled
    all_right: int         # prompts whose distinct samples were all right: no pair
    all_wrong: int         # prompts whose distinct samples were all wrong: no pair
    samples_right: float   # share of all samples that were right


def build_pairs(prompts: Sequence[str], samples: Sequence[Sequence[str]], labels: Sequence[Sequence[bool]],
                max_pairs: int = 1) -> PairSet:
    """Pairs of a right and a wrong answer to the same prompt: `samples[i]` answer
    `prompts[i]`, `labels[i][j]` is the checker's verdict on `samples[i][j]`. Up to
    `max_pairs` pairs a prompt, no response used twice; identical texts count once."""
    from rlhflab.data.preferences import pairs_from_samples

    if not len(prompts) == len(samples) == len(labels):
        raise ValueError(f"build_pairs: {len(prompts)} prompts, {len(samples)} sample lists, {len(labels)} label lists")
    pairs, all_right, all_wrong, right, total = [], 0, 0, 0, 0
    for i, (prompt, responses, verdicts) in enumerate(zip(prompts, samples, labels)):
        if len(responses) != len(verdicts):
            raise ValueError(f"build_pairs: prompt {i} has {len(responses)} samples and {len(verdicts)} labels")
        right += sum(map(bool, verdicts))
        total += len(verdicts)
        made = pairs_from_samples(prompt, list(responses), [float(bool(v)) for v in verdicts], max_pairs, pair_id=i)
        if not made and verdicts:
            all_right += all(verdicts)
            all_wrong += not any(verdicts)
        pairs += made
    return PairSet(pairs, len(prompts), all_right, all_wrong, right / total if total else 0.0)


def split_by_prompt(pairs: Sequence[dict], test_fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, test): whole prompts held out, about `test_fraction` of them, at least one on
    each side when there are two prompts or more (so no held-out pair shares a prompt with
    a training pair)."""
    prompts = list(dict.fromkeys(p["prompt"] for p in pairs))
    random.Random(seed).shuffle(prompts)
    n_test = round(len(prompts) * test_fraction)
    if len(prompts) >= 2:
        n_test = min(max(n_test, 1), len(prompts) - 1)
    held = set(prompts[:n_test])
    return [p for p in pairs if p["prompt"] not in held], [p for p in pairs if p["prompt"] in held]


# --------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------
@dataclass
class Sizes:
    sft_rows: int = 300
    pair_prompts: int = 300
    samples: int = 4
    pairs_per_prompt: int = 2
    pair_test_fraction: float = 0.2
    temperature: float = 0.7
    max_new_tokens: int = 48
    eval_rows: int = 100
    ppo_steps: int = 4
    ppo_episodes: int = 32
    ppo_eval_rows: int = 50
    dpo_epochs: float = 1.0


SIZE_HELP = {
    "sft_rows": "demonstrations for SFT (the first rows of sft.jsonl), one epoch",
    "pair_prompts": "training questions sampled for pairs (the ones after the SFT rows)",
    "samples": "responses sampled per question for pairs",
    "pairs_per_prompt": "at most this many right/wrong pairs per question",
    "pair_test_fraction": "share of the questions with pairs held out for the reward model's accuracy",
    "temperature": "sampling temperature for the pairs",
    "max_new_tokens": "longest response, everywhere (sampling, PPO, evaluation)",
    "eval_rows": "held-out rows rlhflab eval reads after each policy stage (the first N of test.jsonl)",
    "ppo_steps": "PPO steps",
    "ppo_episodes": "PPO episodes (prompts, one response each) per step",
    "ppo_eval_rows": "held-out prompts of PPO's per-step check (reward-model score and true accuracy)",
    "dpo_epochs": "DPO passes over the training pairs",
}
QUICK = Sizes(sft_rows=4, pair_prompts=8, samples=4, pairs_per_prompt=1, max_new_tokens=24, eval_rows=2,
              ppo_steps=1, ppo_episodes=4, ppo_eval_rows=1)


# --------------------------------------------------------------------------------------
# Running the commands
# --------------------------------------------------------------------------------------
class Row(NamedTuple):
    stage: str
    measures: str
    value: str
    minutes: float | None


def rlhflab(*argv: str) -> None:
    """One `rlhflab` command in this process; a non-zero exit stops the pipeline."""
    from rlhflab import cli

    print(f"\n$ rlhflab {' '.join(argv)}", flush=True)
    code = cli.main(list(argv))
    if code:
        raise SystemExit(f"error: `rlhflab {argv[0]}` exited with {code}; the pipeline stops here")


def timed(fn: Callable, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - t0) / 60


def ensure_data(data: Path) -> None:
    if all((data / f).is_file() for f in ("train.jsonl", "test.jsonl", "sft.jsonl")):
        return
    if any((data / f).exists() for f in ("train.jsonl", "test.jsonl", "sft.jsonl")):
        raise SystemExit(f"error: {data} lacks train.jsonl, test.jsonl or sft.jsonl; write all three with "
                         f"`rlhflab make-data --task word-problems --level easy --out {data}`")
    from rlhflab.data.wordproblems import write_task
    print(f"writing the word-problem task (easy level) to {data} ...", flush=True)
    write_task(data, level="easy")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(rows: Sequence[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# The PPO and DPO stages' final/ is read as a model (evaluated, never resumed): their
# checkpoints skip the optimizer state (training.save_only_model), which under AdamW holds
# two numbers per trained weight, so a fully fine-tuned final/ takes a third of the room.
MODEL_ONLY = ["training.save_only_model=true"]


class Pipeline:
    def __init__(self, a: argparse.Namespace, sizes: Sizes):
        self.a, self.s, self.out = a, sizes, a.out
        self.common = [f"training.num_threads={a.threads}", f"training.seed={a.seed}", "training.overwrite=true",
                       "logging.progress_bar=false", "logging.plots=false"]
        self.rows: list[Row] = []
        self.numbers: dict = {}

    def evaluate(self, stage: str, model: Path | str) -> None:
        """Held-out greedy accuracy of `model` by `rlhflab eval` (the same rows and settings each time)."""
        a, s = self.a, self.s
        samples = self.out / "eval" / f"{stage}.jsonl"

        def run() -> float:
            rlhflab("eval", "--model", str(model), "--data", str(a.data / "test.jsonl"), "--template", a.template,
                    "--use-chat-template", "auto", "--max-new-tokens", str(s.max_new_tokens),
                    "--limit", str(s.eval_rows), "--reward", a.reward, "--correct", a.correct,
                    "--batch-size", "50", "--samples", str(samples))
            rows = read_jsonl(samples)
            return sum(bool(r["correct"]) for r in rows) / len(rows)

        accuracy, minutes = timed(run)
        self.numbers[stage] = {**self.numbers.get(stage, {}), "accuracy": accuracy, "eval_minutes": minutes}
        self.rows.append(Row(stage, f"held-out greedy accuracy, first {s.eval_rows} test rows (rlhflab eval)",
                             f"{100 * accuracy:.1f}%", minutes))

    def sft(self) -> Path:
        a, s = self.a, self.s
        demos = read_jsonl(a.data / "sft.jsonl")[: s.sft_rows]
        for r in demos:  # the prompts in the pipeline's template, as every later stage shows them
            r["prompt"] = a.template.replace("{prompt}", r["prompt"])
        rows = write_jsonl(demos, self.out / "sft_rows.jsonl")
        folder = self.out / "sft"
        _, minutes = timed(rlhflab, "sft", "--config", str(CONFIGS / "sft_smollm2_pipeline.yaml"),
                           f"model.name_or_path={a.model}", f"data.path={rows}", f"data.num_samples={len(demos)}",
                           f"training.output_dir={folder}", *self.common, *a.sft)
        result = json.loads((folder / "train_result.json").read_text())
        loss = (result.get("eval_after") or {}).get("eval/loss")
        self.numbers["sft"] = {"rows": len(demos), "steps": result.get("steps"), "eval_loss": loss,
                               "train_minutes": minutes}
        self.rows.append(Row("sft", f"LoRA SFT, {len(demos)} demonstrations, {result.get('steps')} steps: "
                                    f"held-out response loss",
                             f"{loss:.3f}" if loss is not None else "n/a", minutes))
        return folder / "final"

    def pairs(self, policy: Path) -> tuple[Path, Path]:
        a, s = self.a, self.s
        (pair_set, train, test), minutes = timed(self._sample_pairs, policy)
        folder = self.out / "pairs"
        write_jsonl(train, folder / "train.jsonl")
        write_jsonl(test, folder / "test.jsonl")
        self.numbers["pairs"] = {"prompts": pair_set.prompts, "samples_per_prompt": s.samples, "train": len(train),
                                 "test": len(test), "all_right": pair_set.all_right, "all_wrong": pair_set.all_wrong,
                                 "samples_right": pair_set.samples_right, "minutes": minutes}
        self.rows.append(Row("pairs", f"pairs train/held-out from {pair_set.prompts} prompts x {s.samples} samples "
                                      f"(T={s.temperature}); no pair: {pair_set.all_right} all right, "
                                      f"{pair_set.all_wrong} all wrong",
                             f"{len(train)}/{len(test)} ({100 * pair_set.samples_right:.0f}% of samples right)",
                             minutes))
        if not train or not test:
            raise SystemExit(f"error: {len(train)} training and {len(test)} held-out pairs: too few prompts got both a "
                             f"right and a wrong sample; raise --pair-prompts or --samples")
        return folder / "train.jsonl", folder / "test.jsonl"

    def _sample_pairs(self, policy: Path):
        import torch

        from rlhflab.rewards.plugins import load_function
        from rlhflab.rollout.sampler import Sampler, Sampling

        a, s = self.a, self.s
        correct = load_function(a.correct)
        # Questions after the SFT rows' (sft.jsonl holds train.jsonl's rows in order): new to the model.
        rows = read_jsonl(a.data / "train.jsonl")[s.sft_rows: s.sft_rows + s.pair_prompts]
        if len(rows) < s.pair_prompts:
            raise SystemExit(f"error: {a.data / 'train.jsonl'} has {len(rows)} rows after the first {s.sft_rows}; "
                             f"lower --pair-prompts or --sft-rows")
        torch.set_num_threads(a.threads)
        with Sampler.from_folder(str(policy), template=a.template, use_chat_template="auto") as sampler:
            prompts = sampler.render([r["question"] for r in rows])
            roll = sampler.sample(prompts, Sampling(s.max_new_tokens, greedy=False, temperature=s.temperature),
                                  n=s.samples, batch_size=64, seed=a.seed)
        k = s.samples
        samples = [roll.responses[i * k: (i + 1) * k] for i in range(len(rows))]
        labels = [[bool(correct(p, r, row)) for r in group] for p, group, row in zip(prompts, samples, rows)]
        # Raw prompts in the pair file (docs/reference/data_formats.md): rm and dpo render them again.
        pair_set = build_pairs([r["question"] for r in rows], samples, labels, s.pairs_per_prompt)
        train, test = split_by_prompt(pair_set.pairs, s.pair_test_fraction, a.seed)
        return pair_set, train, test

    def rm(self, policy: Path, train: Path, test: Path) -> Path:
        a = self.a
        folder = self.out / "rm"
        _, minutes = timed(rlhflab, "rm", "--config", str(CONFIGS / "rm_smollm2_pipeline.yaml"),
                           f"model.name_or_path={policy}", f"data.path={train}", f"data.eval_path={test}",
                           f"data.prompt_template={json.dumps(a.template)}",
                           f"training.output_dir={folder}", *self.common, *a.rm)
        result = json.loads((folder / "train_result.json").read_text())
        before = (result.get("eval_before") or {}).get("eval/accuracy")
        after = (result.get("eval_after") or {}).get("eval/accuracy")
        self.numbers["rm"] = {"accuracy_before": before, "accuracy_after": after, "steps": result.get("steps"),
                              "train_minutes": minutes}
        self.rows.append(Row("rm", f"held-out pair accuracy ({sum(1 for _ in open(test))} pairs), before -> after",
                             f"{_pct(before)} -> {_pct(after)}", minutes))
        return folder / "final"

    def ppo(self, policy: Path, reward_model: Path) -> Path:
        a, s = self.a, self.s
        folder = self.out / "ppo"
        mini = min(8, s.ppo_episodes)
        _, minutes = timed(
            rlhflab, "ppo", "--config", str(CONFIGS / "ppo_smollm2_pipeline.yaml"),
            f"model.name_or_path={policy}", f"dataset.path={a.data / 'train.jsonl'}",
            f"dataset.eval_path={a.data / 'test.jsonl'}", f"dataset.prompt_template={json.dumps(a.template)}",
            f"dataset.num_eval_samples={s.ppo_eval_rows}", f"dataset.max_gen_length={s.max_new_tokens}",
            f"generation.max_new_tokens={s.max_new_tokens}",
            f"reward.sources=[{{type: model, path: {reward_model}, normalize: true, batch_size: 32}}]",
            f"eval.correct={a.correct}", f"ppo.rollout_samples={s.ppo_episodes}", f"ppo.batch_size={s.ppo_episodes}",
            f"ppo.mini_batch_size={mini}", f"training.total_steps={s.ppo_steps}", "training.eval_interval=1",
            f"training.output_dir={folder}", *self.common, *MODEL_ONLY, *a.ppo)
        from rlhflab.metrics import read_metrics

        steps = [r for r in read_metrics(folder / "metrics.jsonl") if "eval/accuracy" in r]
        per_step = [{"step": r.get("step"), "rm_score": r.get("eval/reward_mean"), "accuracy": r["eval/accuracy"],
                     "rollout_rm_score": r.get("rollout/reward_mean"), "kl": r.get("params/kl_to_ref")}
                    for r in steps]
        self.numbers["ppo"] = {"steps": s.ppo_steps, "episodes_per_step": s.ppo_episodes, "per_step": per_step,
                               "train_minutes": minutes}
        first, last = per_step[0], per_step[-1]
        self.rows.append(Row("ppo", f"{s.ppo_steps} steps x {s.ppo_episodes} episodes; on {s.ppo_eval_rows} held-out "
                                    f"prompts every step: reward-model score and true accuracy, step {first['step']} "
                                    f"-> {last['step']}",
                             f"RM {first['rm_score']:+.2f}, true {_pct(first['accuracy'])} -> "
                             f"RM {last['rm_score']:+.2f}, true {_pct(last['accuracy'])}", minutes))
        return folder / "final"

    def dpo(self, policy: Path, train: Path, test: Path) -> Path:
        a, s = self.a, self.s
        folder = self.out / "dpo"
        _, minutes = timed(rlhflab, "dpo", "--config", str(CONFIGS / "dpo_smollm2_pipeline.yaml"),
                           f"model.name_or_path={policy}", f"dataset.path={train}", f"dataset.eval_path={test}",
                           f"dataset.prompt_template={json.dumps(a.template)}", f"dpo.epochs={s.dpo_epochs}",
                           f"training.output_dir={folder}", *self.common, *MODEL_ONLY, *a.dpo)
        result = json.loads((folder / "train_result.json").read_text())
        from rlhflab.metrics import read_metrics

        steps = max((r["step"] for r in read_metrics(folder / "metrics.jsonl")), default=0)
        after = (result.get("eval_after") or {}).get("eval/rewards/accuracies")
        self.numbers["dpo"] = {"steps": steps, "pair_accuracy_after": after,
                               "eval_loss_after": (result.get("eval_after") or {}).get("eval/loss"),
                               "train_minutes": minutes}
        self.rows.append(Row("dpo", f"{steps} steps; held-out pairs ranked right by the implicit "
                                    f"reward (0 before training: every reward is 0)", _pct(after), minutes))
        return folder / "final"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def format_table(rows: Sequence[Row]) -> str:
    lines = [HEADER]
    for r in rows:
        lines.append(f"| {r.stage} | {r.measures} | {r.value} | {'' if r.minutes is None else f'{r.minutes:.1f}'} |")
    return "\n".join(lines)


def parse_args(argv=None) -> tuple[argparse.Namespace, Sizes]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("outputs/wordproblems-easy"),
                    help="task folder with train.jsonl, test.jsonl, sft.jsonl (written when missing; default: %(default)s)")
    ap.add_argument("--model", default=MODEL, help="the model to start from (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("outputs/real_model_pipeline"),
                    help="stage folders and results.jsonl (default: %(default)s)")
    ap.add_argument("--template", default=TEMPLATE,
                    help="how a question is shown, inside the chat template, at every stage (default: %(default)r)")
    ap.add_argument("--correct", default=f"{CHECKER}:correct", help="the checker (default: %(default)s)")
    ap.add_argument("--reward", default=f"{CHECKER}:reward", help="the eval reward (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: one step of each stage on a few rows (sizes below are ignored)")
    d = Sizes()
    for name, value in vars(d).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value,
                        help=f"{SIZE_HELP[name]} (default: {value})")
    for stage in ("sft", "rm", "ppo", "dpo"):
        ap.add_argument(f"--{stage}", nargs="*", default=[], metavar="KEY=VALUE",
                        help=f"extra dotted overrides for `rlhflab {stage}`")
    a = ap.parse_args(argv)
    sizes = QUICK if a.quick else Sizes(**{k: getattr(a, k) for k in vars(d)})
    if a.quick:  # one optimizer step each
        a.sft = ["sft.max_steps=1", "sft.batch_size=2", "data.eval_fraction=0.25", *a.sft]
        a.rm = ["rm.max_steps=1", "rm.batch_size=2", "rm.gradient_accumulation_steps=1", *a.rm]
        a.dpo = ["dpo.max_steps=1", "dpo.batch_size=2", "dpo.mini_batch_size=2", *a.dpo]
    return a, sizes


def main(argv=None) -> int:
    a, s = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    ensure_data(a.data)
    p = Pipeline(a, s)
    started = time.time()
    p.evaluate("base", a.model)
    sft = p.sft()
    p.evaluate("sft", sft)
    train, test = p.pairs(sft)
    reward_model = p.rm(sft, train, test)
    ppo = p.ppo(sft, reward_model)
    p.evaluate("ppo", ppo)
    dpo = p.dpo(sft, train, test)
    p.evaluate("dpo", dpo)
    table = format_table(p.rows)
    print("\n" + table)
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "quick": a.quick,
              "model": str(a.model), "data": str(a.data), "template": a.template, "threads": a.threads,
              "seed": a.seed, "sizes": vars(s), "overrides": {k: getattr(a, k) for k in ("sft", "rm", "ppo", "dpo")},
              "stages": p.numbers, "rows": [r._asdict() for r in p.rows],
              "total_minutes": (time.time() - started) / 60}
    with (a.out / "results.jsonl").open("a") as fh:
        fh.write(json.dumps(record) + "\n")
    print(f"appended to {a.out / 'results.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
