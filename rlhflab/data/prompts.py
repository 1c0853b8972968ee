"""Prompts for RL: load a split, format each prompt, draw a fresh shuffle every step."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from rlhflab.data.chat import has_chat_template, resolve_use_chat_template
from rlhflab.data.loading import read_rows, require_fields
from rlhflab.errors import UserError


@dataclass
class PromptExample:
    prompt: str  # the formatted text the model sees
    row: dict    # the raw dataset row (the reward reads e.g. row["answer"])


@dataclass(frozen=True)
class PromptFormat:
    """How a prompt's text becomes what the model sees: `template` with {prompt} replaced,
    wrapped by the tokenizer's chat template when `use_chat` (the `use_chat_template`
    setting already resolved for this tokenizer). `setting` is that setting as given."""

    template: str = "{prompt}"
    use_chat: bool = False
    setting: bool | str = False

    @classmethod
    def resolve(cls, template: str, setting: bool | str, tokenizer,
                key: str = "dataset.use_chat_template") -> "PromptFormat":
        """The trainers' rule (`resolve_use_chat_template`): auto uses the template when the
        tokenizer has one; true without one is a `UserError` naming `key`."""
        use = resolve_use_chat_template(setting, tokenizer, key) if tokenizer is not None else False
        return cls(template, use, setting)

    def render(self, text: str, tokenizer) -> str:
        return format_prompt(text, self.template, tokenizer, self.use_chat)

    def describe(self, source: str = "the tokenizer") -> str:
        """One line for a command's output, e.g. `chat template of m (auto) around "Q: {prompt}"`."""
        setting = {True: "true", False: "false"}.get(self.setting, self.setting)  # type: ignore[call-overload]
        inner = json.dumps(self.template)
        if self.use_chat:
            return f"chat template of {source} ({setting}) around {inner}"
        why = "the tokenizer has no chat template" if setting == "auto" else "no chat template"
        return f"raw template {inner} ({setting}: {why})"


def format_prompt(text: str, template: str, tokenizer=None, use_chat_template: bool | str = False) -> str:
    """`template` with {prompt} replaced, then wrapped by the tokenizer's chat template
    (with the generation prompt) when asked for (true or "auto") and the tokenizer has one.

    Per-row and forgiving; a config's setting is checked once, before the rows, with
    `rlhflab.data.chat.resolve_use_chat_template` (true without a template is an error).
    """
    body = template.replace("{prompt}", text)
    if use_chat_template and tokenizer is not None and has_chat_template(tokenizer):
        return tokenizer.apply_chat_template([{"role": "user", "content": body}],
                                             tokenize=False, add_generation_prompt=True)
    return body


def load_prompts(dataset_cfg, tokenizer=None, split: str = "train") -> list[PromptExample]:
    """The train or eval split as formatted prompts, with `answer` normalised into the row.

    `dataset.use_chat_template` is resolved once here (auto: the tokenizer's template when
    it has one); true on a tokenizer without a template stops before any row is read.
    """
    d = dataset_cfg
    if split == "train":
        source, hub_split, limit = (d.path or d.name), d.split, d.num_samples
    else:
        source, hub_split, limit = (d.eval_path or d.name), d.eval_split, d.num_eval_samples
    if source is None:
        raise UserError(f"dataset: no {'path' if split == 'train' else 'eval_path'} and no name; set one")
    fmt = PromptFormat.resolve(d.prompt_template, d.use_chat_template, tokenizer)
    rows = read_rows(source, hub_split, d.subset)
    require_fields(rows, [d.prompt_field], str(source))
    if limit is not None:
        rows = rows[:limit]
    out = []
    for row in rows:
        row = dict(row)
        if d.answer_field in row:  # the configured field wins over a row's own "answer"
            row["answer"] = row[d.answer_field]
        out.append(PromptExample(fmt.render(str(row[d.prompt_field]), tokenizer), row))
    return out


def step_prompts(examples: list[PromptExample], n: int, seed: int, step: int) -> list[PromptExample]:
    """`n` prompts for PPO step `step`: a fresh permutation per step, seeded by (seed, step).

    Depends only on (seed, step), so a resumed run draws what the uninterrupted run would.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    picked: list[PromptExample] = []
    while len(picked) < n:
        order = torch.randperm(len(examples), generator=g).tolist()
        picked.extend(examples[i] for i in order[: n - len(picked)])
    return picked
