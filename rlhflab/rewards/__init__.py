"""Reward sources for RL: rule functions, reward models, classifiers, and weighted sums.

A rule is a Python function named in the config: a registered name (``gsm8k``,
``gsm8k_lenient``), ``module:function`` or ``path/to/file.py:function`` (see
`rlhflab.rewards.plugins` and docs/rewards.md). It is called per example as
``fn(prompt, response, example) -> float``, or, marked with `batched`, once per batch as
``fn(prompts, responses, examples) -> list[float]``. Models and classifiers are batched
scorers with ``score(prompts, responses, examples) -> Tensor (B,)``.
`build_reward(cfg.reward, ...)` turns a config's ``reward.sources`` into one scorer.
"""

from __future__ import annotations

import importlib
from typing import Callable, Protocol, Sequence

import torch

from rlhflab.errors import UserError
from rlhflab.rewards.gsm8k import gsm8k_reward
from rlhflab.rewards.plugins import batched, call_plugin, is_plugin_spec, load_function  # noqa: F401 (batched: re-exported)

RewardFn = Callable[[str, str, dict], float]

REGISTRY: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make a rule reward available as ``reward.sources[i].name: <name>``."""
    def wrap(fn: RewardFn) -> RewardFn:
        REGISTRY[name] = fn
        return fn
    return wrap


def _answer(example: dict) -> str:
    if "answer" not in example:
        raise UserError(f"the gsm8k reward needs a reference answer, but a row has only {sorted(example)}; "
                        "set dataset.answer_field to the field that holds it")
    return str(example["answer"])


@register("gsm8k")
def _gsm8k(prompt: str, response: str, example: dict) -> float:
    return gsm8k_reward(response, _answer(example))


@register("gsm8k_lenient")
def _gsm8k_lenient(prompt: str, response: str, example: dict) -> float:
    return gsm8k_reward(response, _answer(example), fallback_last_number=True)


class Scorer(Protocol):
    def score(self, prompts: Sequence[str], responses: Sequence[str],
              examples: Sequence[dict]) -> torch.Tensor: ...


def resolve_rule(name: str, plugin_dir: str | None = None) -> RewardFn:
    """A registered rule, or the function a ``module:function`` / ``file.py:function`` names
    (looked for in the current directory, then `plugin_dir`; see `rlhflab.rewards.plugins`)."""
    if name in REGISTRY:
        return REGISTRY[name]
    if is_plugin_spec(name):
        return load_function(name, plugin_dir)
    import difflib
    near = difflib.get_close_matches(name, list(REGISTRY), n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise UserError(f"reward rule {name!r} is not registered; {hint}known: "
                    f"{', '.join(sorted(REGISTRY))}, or give module:function or path/to/file.py:function")


class RuleScorer:
    """A Python function applied per (prompt, response, example), or once per batch when
    it is marked `batched`; its errors and bad return values are one-line `UserError`s."""

    def __init__(self, fn: RewardFn, name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "rule")

    def score(self, prompts, responses, examples) -> torch.Tensor:
        values = call_plugin(self.fn, self.name, prompts, responses, examples, what="reward")
        return torch.tensor(values, dtype=torch.float32)


class WeightedSum:
    """Σ weight_i · scorer_i."""

    def __init__(self, parts: list[tuple[float, Scorer]]):
        self.parts = parts

    def score(self, prompts, responses, examples) -> torch.Tensor:
        total = torch.zeros(len(responses), dtype=torch.float32)
        for weight, scorer in self.parts:
            total += weight * scorer.score(prompts, responses, examples).float().cpu()
        return total


def build_source(source, device: torch.device | str = "cpu", plugin_dir: str | None = None,
                 fmt=None, tokenizer=None) -> Scorer:
    """One `RewardSource` config -> a scorer (`plugin_dir`: where rule files are looked for
    after the current directory; the config file's folder). `fmt`, `tokenizer`: the run's
    prompt format (`data.prompts.PromptFormat`) and the policy's tokenizer, which show a
    `reference_path` file's raw prompts as the run shows its own (None: as they are)."""
    if source.type == "rule":
        return RuleScorer(resolve_rule(source.name, plugin_dir), source.name)
    if source.type == "model":
        from rlhflab.rewards.model import RewardModelScorer
        return RewardModelScorer.from_config(source, device, fmt, tokenizer)
    if source.type == "classifier":
        from rlhflab.rewards.classifier import ClassifierScorer
        return ClassifierScorer.from_config(source, device, fmt, tokenizer)
    raise UserError(f"reward type {source.type!r}: choose rule, model or classifier")


def build_reward(reward_cfg, device: torch.device | str = "cpu", fmt=None, tokenizer=None) -> Scorer:
    """The config's reward sources as one scorer (a weighted sum when there are several);
    `fmt`, `tokenizer` as in `build_source`."""
    if not reward_cfg.sources:
        raise UserError("reward.sources is empty; add at least one source (e.g. type: rule, name: gsm8k)")
    parts = [(s.weight, build_source(s, device, reward_cfg.plugin_dir, fmt, tokenizer)) for s in reward_cfg.sources]
    if len(parts) == 1 and parts[0][0] == 1.0:
        return parts[0][1]
    return WeightedSum(parts)
