"""Test-time preference optimisation: `rlhflab tpo --config configs/tpo_quickstart.yaml`.

TPO (Li et al., 2025, "Test-Time Preference Optimization: On-the-Fly Alignment via
Iterative Textual Feedback") improves one answer at inference, with no weight update:

    0. sample N candidates for the prompt and score each with a reward; keep them all
    for round t = 1..T:
       a. take the best and the worst candidate so far (the "chosen" and "rejected")
       b. critique: the model writes what makes the best better than the worst
          (the paper's "textual loss" and "textual gradient"; optional here)
       c. refine: sample N new candidates from a prompt that shows the best, the worst and
          the critique; score them and add them to the pool
    the answer is the best candidate in the pool

Each round is reported beside best-of-N at equal samples: the best of N·(t+1) candidates
sampled from the plain prompt, which is what the extra compute buys without feedback.

The templates are Python format strings with the fields {prompt}, {best}, {worst},
{best_score}, {worst_score} and (in the refine template) {critique}; write ``{{``
for a literal brace. ``critique_template: null`` skips step b.

Where we depart from the paper: it relies on an instruction-following model that can
read and write critiques (its chat models have billions of parameters); a model that
cannot follow the templates gets nothing from the feedback, and TPO is then a
best-of-N whose later samples come from a longer, stranger prompt. rlhflab measures
that honestly (docs/tpo.md) rather than assuming the feedback helps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import string
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

from rlhflab.config import load_config
from rlhflab.config.schema import CpuConfig, DatasetConfig, EvalConfig, GenerationConfig, ModelConfig, RewardConfig, f

TEMPLATE_FIELDS = ("prompt", "best", "worst", "best_score", "worst_score", "critique")


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
def _template_errors(key: str, template: Optional[str], allowed: Sequence[str]) -> list[str]:
    if template is None:
        return []
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        return [f"{key}: not a valid format string ({exc}); write {{{{ for a literal brace"]
    bad = [n for n in names if n not in allowed]
    if bad:
        return [f"{key}: unknown field {{{bad[0]}}}; use {', '.join('{' + a + '}' for a in allowed)} "
                f"(write {{{{ for a literal brace)"]
    if "prompt" not in names:
        return [f"{key}: must contain {{prompt}}, the question being answered"]
    return []


@dataclass
class TPOSection:
    """TPO settings: samples per round, rounds, and the feedback templates."""

    num_candidates: int = f(4, "N: candidates sampled per prompt in every round", gt=0)
    rounds: int = f(3, "T: rounds of feedback after the first sampling (0: plain best-of-N)", ge=0)
    critique_template: Optional[str] = f(
        None, "prompt asking the model to compare the best and worst answers ({prompt} {best} {worst} "
              "{best_score} {worst_score}); null skips the critique")
    refine_template: str = f(
        "{prompt} {worst}\nScore: {worst_score:.1f}\n{prompt} {best}\nScore: {best_score:.1f}\n{prompt}",
        "prompt the new candidates are sampled from ({prompt} {best} {worst} {best_score} {worst_score} {critique})")
    max_critique_tokens: int = f(32, "longest critique in tokens", gt=0)
    batch_size: int = f(64, "sequences generated at once", gt=0)

    def check(self) -> list[str]:
        return (_template_errors("critique_template", self.critique_template, TEMPLATE_FIELDS[:5])
                + _template_errors("refine_template", self.refine_template, TEMPLATE_FIELDS))


@dataclass
class TPORunSection:
    """Where the results go, the device and the seed."""

    output_dir: str = f("outputs/tpo", "folder for effective_config.yaml, tpo_rounds.jsonl, samples.jsonl")
    device: str = f("auto", "cpu, cuda, or auto")
    seed: int = f(0, "seed for the sampling")
    num_threads: Optional[int] = f(None, "torch CPU threads; null leaves torch's default", gt=0)


@dataclass
class TPORunConfig:
    """`rlhflab tpo`: the model, the prompts, the reward, what accuracy means, TPO's settings."""

    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tpo: TPOSection = field(default_factory=TPOSection)
    run: TPORunSection = field(default_factory=TPORunSection)
    cpu: CpuConfig = field(default_factory=CpuConfig)


# --------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------
Sampler = Callable[[Sequence[str], int, int], list[list[str]]]
"""sampler(prompts, n, max_new_tokens) -> n sampled responses per prompt."""


@dataclass
class Pool:
    """Every candidate for one prompt so far and its reward."""

    responses: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def add(self, responses: Sequence[str], scores: Sequence[float]) -> None:
        self.responses += list(responses)
        self.scores += [float(s) for s in scores]

    @property
    def best(self) -> int:
        """Index of the highest reward (the earliest on a tie)."""
        return max(range(len(self.scores)), key=lambda i: (self.scores[i], -i))

    @property
    def worst(self) -> int:
        return min(range(len(self.scores)), key=lambda i: (self.scores[i], i))


def fill(template: str, prompt: str, pool: Pool, critique: str = "") -> str:
    b, w = pool.best, pool.worst
    return template.format(prompt=prompt, best=pool.responses[b].strip(), worst=pool.responses[w].strip(),
                           best_score=pool.scores[b], worst_score=pool.scores[w], critique=critique.strip())


class RoundStats(NamedTuple):
    round: int
    samples_per_prompt: int   # N·(round+1)
    round_reward: float       # mean reward of this round's new candidates
    best_reward: float        # mean over prompts of the best reward so far
    best_accuracy: float | None  # accuracy of the best candidate so far (None: no checker)
    bon_reward: float         # best-of-N·(round+1) plain samples: mean best reward
    bon_accuracy: float | None
    copied_best: float | None = None   # share of this round's candidates equal to the best shown (rounds ≥ 1)
    copied_worst: float | None = None  # ... equal to the worst shown: is the model copying, not improving?


@dataclass
class TPOResult:
    rounds: list[RoundStats]
    pools: list[Pool]             # TPO's candidates per prompt
    refine_prompts: list[list[str]]  # per round ≥ 1, the prompt each prompt's candidates came from
    critiques: list[list[str]]


def _score(scorer, prompts: Sequence[str], responses: Sequence[str], rows: Sequence[dict]) -> list[float]:
    return [float(s) for s in scorer.score(list(prompts), list(responses), list(rows))]


def _best_accuracy(pools: Sequence[Pool], prompts, rows, correct_fn) -> float | None:
    if correct_fn is None:
        return None
    picks = [p.responses[p.best] for p in pools]
    judged = correct_fn(prompts, picks, rows)
    return None if judged is None else sum(judged) / len(judged)


def tpo_search(sampler: Sampler, prompts: Sequence[str], rows: Sequence[dict], scorer, sec: TPOSection,
               max_new_tokens: int, correct_fn=None) -> TPOResult:
    """TPO for every prompt at once, with best-of-N at equal samples beside each round.

    `correct_fn(prompts, responses, rows) -> list[bool] | None` gives the accuracy of the
    picked answers (`rlhflab.evaluate.judge` with the run's checks). Rewards are always
    computed against the original prompt, whatever prompt a candidate was sampled from.
    """
    n, T = sec.num_candidates, sec.rounds
    pools = [Pool() for _ in prompts]
    # The baseline: N·(T+1) plain samples per prompt, its first N·(t+1) judged at round t.
    plain = sampler(prompts, n * (T + 1), max_new_tokens)
    plain_scores = [_score(scorer, [p] * len(c), c, [r] * len(c)) for p, r, c in zip(prompts, rows, plain)]
    stats, refine_prompts, critiques = [], [], []
    for t in range(T + 1):
        copied_best = copied_worst = None
        if t == 0:
            new = [c[:n] for c in plain]  # round 0 is N plain samples: the baseline's first N
        else:
            crit = [""] * len(prompts)
            if sec.critique_template is not None:
                asks = [fill(sec.critique_template, p, pool) for p, pool in zip(prompts, pools)]
                crit = [c[0] for c in sampler(asks, 1, sec.max_critique_tokens)]
            refine = [fill(sec.refine_template, p, pool, c) for p, pool, c in zip(prompts, pools, crit)]
            new = sampler(refine, n, max_new_tokens)
            refine_prompts.append(refine)
            critiques.append(crit)
            shown = [(pool.responses[pool.best].strip(), pool.responses[pool.worst].strip()) for pool in pools]
            copied_best = sum(x.strip() == b for (b, _), c in zip(shown, new) for x in c) / (n * len(prompts))
            copied_worst = sum(x.strip() == w for (_, w), c in zip(shown, new) for x in c) / (n * len(prompts))
        new_scores = [_score(scorer, [p] * len(c), c, [r] * len(c)) for p, r, c in zip(prompts, rows, new)]
        for pool, c, s in zip(pools, new, new_scores):
            pool.add(c, s)
        k = n * (t + 1)
        bon = [Pool(c[:k], s[:k]) for c, s in zip(plain, plain_scores)]
        stats.append(RoundStats(
            t, k, sum(map(sum, new_scores)) / (n * len(prompts)),
            sum(p.scores[p.best] for p in pools) / len(pools), _best_accuracy(pools, prompts, rows, correct_fn),
            sum(p.scores[p.best] for p in bon) / len(bon), _best_accuracy(bon, prompts, rows, correct_fn),
            copied_best, copied_worst))
    return TPOResult(stats, pools, refine_prompts, critiques)


def hf_sampler(model, tokenizer, gen: GenerationConfig, max_prompt_length: int, batch_size: int) -> Sampler:
    """A `Sampler` on a causal LM: `rlhflab.rollout.generate` with the run's sampling settings."""
    from rlhflab.rollout import generate

    def sample(prompts: Sequence[str], n: int, max_new_tokens: int) -> list[list[str]]:
        flat = [p for p in prompts for _ in range(n)]
        roll = generate(model, tokenizer, flat, max_new_tokens=max_new_tokens, temperature=gen.temperature,
                        top_k=gen.top_k, top_p=gen.top_p, max_prompt_length=max_prompt_length,
                        batch_size=batch_size)
        return [roll.responses[i * n : (i + 1) * n] for i in range(len(prompts))]

    return sample


def engine_sampler(folder, gen: GenerationConfig, max_prompt_length: int, batch_size: int, seed: int,
                   dtype: str = "float32"):
    """A `Sampler` on a model folder through `rlhflab.rollout.sampler.Sampler` with the
    configured backend (`generation.backend`: vllm starts its engine on the folder). The
    engine is sized for prompts of max_prompt_length tokens, as long as a refine prompt
    may be. Returns (sample, the rollout Sampler, to close)."""
    from rlhflab.rollout.sampler import EngineSettings, Sampler as FolderSampler, Sampling

    engine = EngineSettings(kv_cache_gb=gen.vllm.kv_cache_gb, gpu_memory_utilization=gen.vllm.gpu_memory_utilization,
                            enforce_eager=gen.vllm.enforce_eager)
    folder_sampler = FolderSampler.from_folder(folder, backend=gen.backend, max_prompt_length=max_prompt_length,
                                               engine=engine, dtype=dtype)
    longest = " ".join(["0"] * (4 * max_prompt_length))  # cut to max_prompt_length tokens when the engine sizes
    sampling = Sampling.from_config(gen)
    calls = [0]

    def sample(prompts: Sequence[str], n: int, max_new_tokens: int) -> list[list[str]]:
        folder_sampler.start([longest], max_new_tokens=max_new_tokens, max_num_seqs=batch_size, seed=seed)
        calls[0] += 1  # each round draws other noise: the seed moves on with the call
        roll = folder_sampler.sample(list(prompts), replace(sampling, max_new_tokens=max_new_tokens), n=n,
                                     batch_size=batch_size, seed=seed + 1_000_003 * calls[0])
        return [roll.responses[i * n : (i + 1) * n] for i in range(len(prompts))]

    return sample, folder_sampler


def format_rounds(rounds: Sequence[RoundStats]) -> str:
    def pct(v):
        return "   n/a" if v is None else f"{100 * v:5.1f}%"

    lines = ["round  samples  new-sample reward  TPO best reward  TPO accuracy  best-of-N reward  best-of-N accuracy"
             "  copies of best / worst"]
    for r in rounds:
        lines.append(f"{r.round:>5}  {r.samples_per_prompt:>7}  {r.round_reward:>17.3f}  {r.best_reward:>15.3f}  "
                     f"{pct(r.best_accuracy):>12}  {r.bon_reward:>16.3f}  {pct(r.bon_accuracy):>18}  "
                     f"{pct(r.copied_best):>10} / {pct(r.copied_worst)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/tpo_quickstart.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. tpo.rounds=2 tpo.num_candidates=8")
    parser.epilog = ("Prints, per round, the mean reward of the new samples, the best reward and accuracy so far, "
                     "and best-of-N at the same number of samples; writes tpo_rounds.jsonl and samples.jsonl.")


def run(args: argparse.Namespace) -> int:
    import torch

    from rlhflab.config import save_effective_config
    from rlhflab.data.prompts import PromptFormat, load_prompts
    from rlhflab.evaluate import accuracy_rule, build_eval_checks, judge
    from rlhflab.models.load import load_model
    from rlhflab.rewards import build_reward
    from rlhflab.rewards.preflight import preflight
    from rlhflab import cpu
    from rlhflab.models.load import resolve_device
    from rlhflab.trainers.common import seed_everything, set_threads

    from rlhflab.models.quant import refuse_quantization

    cfg, effective = load_config(args.config, TPORunConfig, args.overrides)
    refuse_quantization(cfg.model, "rlhflab tpo")
    set_threads(cfg.run.num_threads)
    cpu.setup_process(resolve_device(cfg.run.device), cfg.cpu)
    preflight(_as_eval_run(cfg))  # the plug-ins, on the held-out rows, before the model loads
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_effective_config(effective, out)
    seed_everything(cfg.run.seed)
    closing = None
    if cfg.generation.backend == "hf":
        model, tok = load_model(cfg.model.name_or_path, cfg.model.torch_dtype, cfg.run.device,
                                cfg.model.trust_remote_code, cfg.model.tokenizer)
        device = next(model.parameters()).device
        cpu.apply(model, cfg.model, device, trained=False)  # oneDNN linears where chosen, on a CPU
    else:  # the engine reads the folder itself
        sampler, closing = engine_sampler(cfg.model.name_or_path, cfg.generation, cfg.dataset.max_prompt_length,
                                          cfg.tpo.batch_size, cfg.run.seed, dtype=cfg.model.torch_dtype)
        tok, device = closing.tokenizer, resolve_device(cfg.run.device)
    examples = load_prompts(cfg.dataset, tok, "eval")  # with the tokenizer: its chat template, if used
    shown = PromptFormat.resolve(cfg.dataset.prompt_template, cfg.dataset.use_chat_template, tok)
    scorer = build_reward(cfg.reward, device, shown, tok)  # reference rows shown as the prompts are
    checks = build_eval_checks(cfg.eval, device, shown, tok)
    rows = [e.row for e in examples]
    correct_fn = (lambda p, r, e: judge(checks, p, r, e)) if accuracy_rule(checks, rows) else None
    if closing is None:
        sampler = hf_sampler(model, tok, cfg.generation, cfg.dataset.max_prompt_length, cfg.tpo.batch_size)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            res = tpo_search(sampler, [e.prompt for e in examples], rows, scorer, cfg.tpo,
                             cfg.generation.max_new_tokens, correct_fn)
    finally:
        if closing is not None:
            closing.close()
    seconds = time.perf_counter() - start
    (out / "tpo_rounds.jsonl").write_text("".join(json.dumps(r._asdict()) + "\n" for r in res.rounds))
    with (out / "samples.jsonl").open("w") as fh:
        for i, (e, pool) in enumerate(zip(examples, res.pools)):
            fh.write(json.dumps({"prompt": e.prompt, "best": pool.responses[pool.best],
                                 "candidates": pool.responses, "scores": pool.scores,
                                 "last_refine_prompt": res.refine_prompts[-1][i] if res.refine_prompts else None,
                                 "last_critique": res.critiques[-1][i] if res.critiques else None}) + "\n")
    rule = accuracy_rule(checks, rows)
    print(f"tpo: {len(examples)} prompts, N={cfg.tpo.num_candidates}, T={cfg.tpo.rounds}, {seconds:.0f}s; "
          f"accuracy by {rule or 'nothing (set eval.correct)'}")
    print(format_rounds(res.rounds))
    print(f"written: {out / 'tpo_rounds.jsonl'}, {out / 'samples.jsonl'}")
    return 0


def _as_eval_run(cfg: TPORunConfig):
    """The run as the preflight reads it: the reward is checked on held-out rows, since TPO
    only ever sees those."""
    return dataclasses.replace(cfg, dataset=dataclasses.replace(cfg.dataset, path=cfg.dataset.eval_path))
