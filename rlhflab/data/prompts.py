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

    def render(self, text: str | list[dict], tokenizer) -> str:
        return format_prompt(text, self.template, tokenizer, self.use_chat)

    def describe(self, source: str = "the tokenizer") -> str:
        """One line for a command's output, e.g. `chat template of m (auto) around "Q: {prompt}"`."""
        setting = {True: "true", False: "false"}.get(self.setting, self.setting)  # type: ignore[call-overload]
        inner = json.dumps(self.template)
        if self.use_chat:
            return f"chat template of {source} ({setting}) around {inner}"
        why = "the tokenizer has no chat template" if setting == "auto" else "no chat template"
        return f"raw template {inner} ({setting}: {why})"


def format_prompt(text: str | list[dict], template: str, tokenizer=None,
                  use_chat_template: bool | str = False) -> str:
    """`template` with {prompt} replaced, then wrapped by the tokenizer's chat template
    (with the generation prompt) when asked for (true or "auto") and the tokenizer has one.

    `text` may also be a conversation, a list of {role, content} messages (TRL's
    conversational prompt): `template` goes around the last user turn and the chat template
    renders the whole list. Without a chat template (no tokenizer: the preflight) the last
    user turn stands alone.

    Per-row and forgiving; a config's setting is checked once, before the rows, with
    `rlhflab.data.chat.resolve_use_chat_template` (true without a template is an error).
    """
    if isinstance(text, list):
        messages = _templated_messages(text, template)
        if use_chat_template and tokenizer is not None and has_chat_template(tokenizer):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        users = [m["content"] for m in messages if m["role"] == "user"]
        return users[-1] if users else messages[-1]["content"]
    body = template.replace("{prompt}", text)
    if use_chat_template and tokenizer is not None and has_chat_template(tokenizer):
        return tokenizer.apply_chat_template([{"role": "user", "content": body}],
                                             tokenize=False, add_generation_prompt=True)
    return body


def _templated_messages(messages: list[dict], template: str) -> list[dict]:
    """The messages with `template` around the last user turn's content."""
    out = [{"role": m["role"], "content": m["content"]} for m in messages]
    last = max((i for i, m in enumerate(out) if m["role"] == "user"), default=None)
    if last is not None:
        out[last]["content"] = template.replace("{prompt}", out[last]["content"])
    return out


def is_messages(value) -> bool:
    """A non-empty list of {role, content} messages with string values (TRL's conversational form)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)


def check_text_field(value, source: str, row: int | None, field: str, messages: bool = False):
    """`value` when it is a string (or, with `messages`, a list of {role, content}
    messages); else a one-line `UserError` naming the file, the row and the field
    (`row` None: `source` names the row already, e.g. "f.jsonl line 3")."""
    if isinstance(value, str) or (messages and is_messages(value)):
        return value
    want = "a string or a list of {role, content} messages" if messages else "a string"
    if isinstance(value, list) and messages:
        bad = next((j for j, m in enumerate(value) if not (
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str))), None)
        what = "an empty list" if not value else f"a list whose item {bad} is not a {{role, content}} message " \
                                                 f"with string values ({value[bad]!r:.60})"
    else:
        what = f"a {type(value).__name__} ({value!r:.60})"
    where = source if row is None else f"{source}: row {row}"
    raise UserError(f"{where} field {field!r} is {what}, not {want}; fix the row (numbers as text: \"12\")")


# --------------------------------------------------------------------------------------
# One rule for templated prompts: files hold raw prompts, the run applies the template.
# --------------------------------------------------------------------------------------
_PROBE = "rlhflab-prompt-probe"


def template_heads(template: str, tokenizer=None, use_chat: bool = False) -> list[tuple[str, str]]:
    """What the run writes in front of a raw prompt: [(what, text)], the plain template's
    text before {prompt} (when it has any) and, under a chat template, the template's own
    opening (its first special token, e.g. ``<|im_start|>``: a pre-rendered prompt starts
    with it whatever system text the template adds)."""
    heads = []
    head = template.split("{prompt}")[0]
    if head.strip():
        heads.append(("the prompt template's opening", head))
    if use_chat and tokenizer is not None and has_chat_template(tokenizer):
        try:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False,
                                                     add_generation_prompt=True)
        except Exception:  # a template that cannot render a lone user turn: nothing to compare
            rendered = ""
        chat_head = rendered.split(_PROBE)[0] if isinstance(rendered, str) else ""
        specials = sorted((t for t in (getattr(tokenizer, "all_special_tokens", None) or []) if t
                           and chat_head.startswith(t)), key=len, reverse=True)
        opening = specials[0] if specials else chat_head
        if opening.strip():
            heads.append(("the chat template's opening", opening))
    return heads


def refuse_templated(text: str, heads: list[tuple[str, str]], source: str, row: int, field: str,
                     key: str = "dataset.prompt_template") -> None:
    """A `UserError` when `text` already begins with what the run adds in front of it
    (`template_heads`): the template would be applied twice."""
    for what, head in heads:
        if text.startswith(head):
            fix = (f"set {key.rsplit('.', 1)[0]}.use_chat_template=false" if "chat" in what
                   else f"set {key}=\"{{prompt}}\"")
            raise UserError(f"{source}: row {row} field {field!r} already begins with {what} ({head!r:.50}), which "
                            f"the run adds again; write raw prompts in the file (docs/reference/data_formats.md, "
                            f"'Raw prompts, one template') or {fix}")


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
    heads = template_heads(fmt.template, tokenizer, fmt.use_chat)
    out = []
    for i, row in enumerate(rows):
        row = dict(row)
        if d.answer_field in row:  # the configured field wins over a row's own "answer"
            row["answer"] = row[d.answer_field]
        text = check_text_field(row[d.prompt_field], str(source), i, d.prompt_field, messages=True)
        if isinstance(text, list):
            if d.use_chat_template is False or d.use_chat_template == "false":
                raise UserError(f"{source}: row {i} field {d.prompt_field!r} is a list of messages, which only a "
                                "chat template can render, but dataset.use_chat_template is false; set it to "
                                "auto (or true), or give the prompt as a string")
            if tokenizer is not None and not fmt.use_chat:
                name = getattr(tokenizer, "name_or_path", "") or "the model's"
                raise UserError(f"{source}: row {i} field {d.prompt_field!r} is a list of messages, but the "
                                f"tokenizer {name!r} has no chat template to render it; use a model with one "
                                "(e.g. `rlhflab make-tiny --chat-template chatml`) or give the prompt as a string")
        else:
            refuse_templated(text, heads, str(source), i, d.prompt_field)
        out.append(PromptExample(fmt.render(text, tokenizer), row))
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
