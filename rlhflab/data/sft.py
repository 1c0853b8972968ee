"""Rows for supervised fine-tuning: recognise the layout, format, tokenize, mask the prompt.

Layouts recognised (the first that fits a row wins):

    messages            {"messages": [{"role": "user", "content": ...}, ..., {"role": "assistant", ...}]}
                        (TRL's conversational language-modelling form)
    instruction         {"instruction", "response"} (Dolly; optional "context")
                        or {"instruction", "output"} (Alpaca; optional "input" as the context)
    prompt_completion   {"prompt", "completion"}, plain text or TRL's conversational form
                        (the prompt a list of messages, the completion the assistant's
                        message(s), or a string)
    input_output        {"input", "output"}
    question_answer     {"question", "answer"} (GSM8K and the arithmetic task)

A row that fits none is reported with its index and the fields it has and skipped; a
file where more than `max_bad_fraction` of the rows are bad stops with a `UserError`. A
layout's fields present with a value of the wrong type (an object where text belongs, a
message whose content is not text) stop at once, naming the file, the row and the field.

Formatting: with `use_chat_template` (resolved by `rlhflab.data.chat`: auto uses the
tokenizer's template when it has one) the conversation is rendered by the template: the
prompt part with the generation prompt, the response part is the rest up to and
including the template's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``), which the
model learns to emit and generation stops at. Otherwise ``prompt_template`` (default
``"User: {prompt}\\n\\nAssistant:"``) and ``response_template`` (default ``" {response}"``)
are used and EOS is appended, giving ``User: {prompt}\\n\\nAssistant: {response}<eos>``.

Prompt and response are tokenized separately and concatenated, exactly as a prompt is
tokenized at generation time and the response is then produced token by token; so the
model learns to answer right after the prompt's last token. Labels are -100 on the
prompt (and later on padding): the loss covers response tokens only. With
``train_on_prompt`` (`sft.train_on_prompt`) the prompt's labels are its token ids, as in
the notebook seed's ``labels = input_ids``: the model also learns to write the prompts
(padding stays -100; the first token is never a target, nothing precedes it).

Truncation to `max_seq_length` cuts from the right, keeping the prompt's start; a row
whose prompt alone fills the budget has no response left and is dropped. Both are
counted and reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlhflab.data.chat import end_of_turn_id, has_chat_template
from rlhflab.data.tokens import leading_ids
from rlhflab.errors import UserError

IGNORE_INDEX = -100
LAYOUTS = ("messages", "instruction", "prompt_completion", "input_output", "question_answer")


@dataclass
class SFTExample:
    """One demonstration: a conversation whose last assistant turn is the target."""

    messages: list[dict]  # [{"role", "content"}, ...], the last one from the assistant
    index: int            # row number in the source file (0-based)

    @property
    def prompt(self) -> str:
        """The last user turn (what a plain template shows as {prompt})."""
        users = [m["content"] for m in self.messages[:-1] if m["role"] == "user"]
        return users[-1] if users else ""

    @property
    def response(self) -> str:
        return self.messages[-1]["content"]


def _text(v: Any) -> bool:
    """A string, or a number (csv/parquet readers turn a response such as "12" into 12)."""
    return isinstance(v, str) or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _messages(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(
        isinstance(m, dict) and _text(m.get("role")) and _text(m.get("content")) for m in v)


_LAYOUT_FIELDS = (("messages",), ("instruction", "response"), ("instruction", "output"), ("prompt", "completion"),
                  ("input", "output"), ("question", "answer"))


def type_problem(row: dict) -> tuple[str, Any] | None:
    """(field, value) of the first layout field present with a value of the wrong type
    (every field of that layout present), else None."""
    for fields in _LAYOUT_FIELDS:
        if not all(f in row for f in fields):
            continue
        for f in fields:
            v = row[f]
            ok = _messages(v) if f == "messages" else (
                _text(v) or (f in ("prompt", "completion") and _messages(v)))
            if not ok:
                return f, v
    return None


def detect_layout(row: dict) -> str | None:
    """The name of the layout `row` fits, or None."""
    msgs = row.get("messages")
    if isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and _text(m.get("role")) and _text(m.get("content")) for m in msgs):
        return "messages"
    if _text(row.get("instruction")) and (_text(row.get("response")) or _text(row.get("output"))):
        return "instruction"
    if _text(row.get("prompt")) and _text(row.get("completion")):
        return "prompt_completion"
    if _messages(row.get("prompt")) and (_messages(row.get("completion")) or _text(row.get("completion"))):
        return "prompt_completion"
    if _text(row.get("input")) and _text(row.get("output")):
        return "input_output"
    if _text(row.get("question")) and _text(row.get("answer")):
        return "question_answer"
    return None


def row_to_example(row: dict, index: int, layout: str | None = None) -> SFTExample | None:
    """The row as an SFTExample, or None when it fits no layout (or has no assistant turn)."""
    layout = layout or detect_layout(row)
    if layout == "messages":
        msgs = [{"role": m["role"], "content": str(m["content"])} for m in row["messages"]]
        # The target is the last assistant turn; anything after it is dropped.
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
        if last is None or last == 0:
            return None
        return SFTExample(msgs[: last + 1], index)
    if layout == "instruction":
        context = row.get("context") or row.get("input") or ""  # csv readers give None for empty cells
        context = str(context) if _text(context) else ""
        prompt = str(row["instruction"]) + (f"\n\n{context}" if context.strip() else "")
        response = row["response"] if _text(row.get("response")) else row["output"]
    elif layout == "prompt_completion":
        prompt, response = row["prompt"], row["completion"]
        if isinstance(prompt, list):  # TRL's conversational prompt-completion
            done = row["completion"] if isinstance(row["completion"], list) else [
                {"role": "assistant", "content": row["completion"]}]
            msgs = [{"role": m["role"], "content": str(m["content"])} for m in [*prompt, *done]]
            last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
            if last is None or last < len(prompt):
                return None
            return SFTExample(msgs[: last + 1], index)
    elif layout == "input_output":
        prompt, response = row["input"], row["output"]
    elif layout == "question_answer":
        prompt, response = row["question"], row["answer"]
    else:
        return None
    return SFTExample([{"role": "user", "content": str(prompt)}, {"role": "assistant", "content": str(response)}],
                      index)


def parse_rows(rows: Sequence[dict], source: str, max_bad_fraction: float = 0.5,
               warn=print) -> list[SFTExample]:
    """Rows -> examples; bad rows are reported (index and fields) and skipped."""
    if not rows:
        raise UserError(f"{source}: no rows; check the file or split")
    examples, bad = [], []
    for i, row in enumerate(rows):
        ex = row_to_example(row, i) if isinstance(row, dict) else None
        problem = type_problem(row) if ex is None and isinstance(row, dict) else None
        if problem is not None:
            from rlhflab.data.prompts import check_text_field

            field, value = problem
            check_text_field(value, source, i, field, messages=field in ("messages", "prompt", "completion"))
            raise UserError(f"{source}: row {i} field {field!r} is {type(value).__name__} {value!r:.60}, which "
                            "fits no SFT layout; fix the row")
        if ex is None:
            bad.append(i)
            if len(bad) <= 5:
                fields = sorted(row) if isinstance(row, dict) else type(row).__name__
                warn(f"warning: {source}: row {i} fits no SFT layout (it has {fields}); skipped")
        else:
            examples.append(ex)
    if bad:
        if len(bad) > 5:
            warn(f"warning: {source}: {len(bad)} rows in all fit no SFT layout and were skipped")
        if len(bad) / len(rows) > max_bad_fraction or not examples:
            first = rows[bad[0]]
            fields = sorted(first) if isinstance(first, dict) else type(first).__name__
            raise UserError(
                f"{source}: {len(bad)} of {len(rows)} rows fit no SFT layout (row {bad[0]} has {fields}); "
                "give rows with messages, instruction/response, prompt/completion, input/output or "
                "question/answer fields")
    return examples


# --------------------------------------------------------------------------------------
# Formatting and tokenization
# --------------------------------------------------------------------------------------
@dataclass
class Template:
    """How an example becomes text; see the module docstring."""

    prompt_template: str = "User: {prompt}\n\nAssistant:"
    response_template: str = " {response}"
    use_chat_template: bool = True  # already resolved (`rlhflab.data.chat.resolve_use_chat_template`)


def _plain_history(messages: list[dict], tpl: Template) -> str:
    """Earlier turns of a multi-turn conversation without a chat template."""
    parts = []
    for m in messages:
        if m["role"] == "assistant":
            parts.append(tpl.response_template.replace("{response}", m["content"]) + "\n\n")
        elif m["role"] == "user":
            parts.append(tpl.prompt_template.replace("{prompt}", m["content"]))
        else:  # system and other roles: plain text, first
            parts.append(m["content"] + "\n\n")
    return "".join(parts)


def format_example(ex: SFTExample, tokenizer, tpl: Template) -> tuple[str, str, bool]:
    """(prompt text, response text, append_eos) for one example."""
    if tpl.use_chat_template and has_chat_template(tokenizer):
        prompt = tokenizer.apply_chat_template(ex.messages[:-1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(ex.messages, tokenize=False)
        if full.startswith(prompt):
            # The template's own end-of-turn token closes the response, as it closes a
            # generated one (generation stops there): what a template writes after it
            # (ChatML's "\n") is left out, and EOS is added only when the template has
            # neither.
            response = full[len(prompt):]
            eot = end_of_turn_id(tokenizer)
            eot_text = tokenizer.convert_ids_to_tokens(eot) if eot is not None else None
            if eot_text and eot_text in response:
                response = response[: response.rindex(eot_text) + len(eot_text)]
                return prompt, response, False
            return prompt, response, not full.rstrip().endswith(tokenizer.eos_token or "\0")
        # A template that renders the history differently with the generation prompt:
        # fall back to plain formatting for this row rather than mis-mask it.
    history = _plain_history(ex.messages[:-2], tpl) if len(ex.messages) > 2 else ""
    if ex.messages[-2]["role"] == "user":
        prompt = history + tpl.prompt_template.replace("{prompt}", ex.messages[-2]["content"])
    else:
        prompt = history + _plain_history([ex.messages[-2]], tpl)
    response = tpl.response_template.replace("{response}", ex.response)
    return prompt, response, True


@dataclass
class TokenizedExample:
    input_ids: list[int]
    labels: list[int]      # IGNORE_INDEX on the prompt (its ids under train_on_prompt)
    prompt_len: int
    truncated: bool


@dataclass
class TokenizeReport:
    examples: list[TokenizedExample]
    truncated: int         # rows cut to max_seq_length (response shortened)
    dropped: int           # rows whose prompt alone filled max_seq_length

    def message(self, source: str, max_seq_length: int) -> str | None:
        if not self.truncated and not self.dropped:
            return None
        msg = f"{source}: {self.truncated} rows truncated to max_seq_length={max_seq_length} (prompt start kept)"
        if self.dropped:
            msg += f"; {self.dropped} rows dropped because the prompt alone fills it"
        return msg + "; raise data.max_seq_length to keep them whole"


def tokenize_example(prompt: str, response: str, append_eos: bool, tokenizer,
                     max_seq_length: int, train_on_prompt: bool = False) -> TokenizedExample | None:
    """Token ids and labels (prompt masked unless `train_on_prompt`); None when no
    response token fits."""
    prompt_ids = leading_ids(tokenizer, [prompt])[0]  # as the rollouts see it (BOS rule)
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    if append_eos and tokenizer.eos_token_id is not None and (
            not response_ids or response_ids[-1] != tokenizer.eos_token_id):
        response_ids = response_ids + [tokenizer.eos_token_id]
    ids = prompt_ids + response_ids
    truncated = len(ids) > max_seq_length
    ids = ids[:max_seq_length]  # keep the start
    n_prompt = min(len(prompt_ids), len(ids))
    if n_prompt >= len(ids):
        return None
    labels = list(ids) if train_on_prompt else [IGNORE_INDEX] * n_prompt + ids[n_prompt:]
    return TokenizedExample(ids, labels, n_prompt, truncated)


def tokenize_examples(examples: Sequence[SFTExample], tokenizer, tpl: Template,
                      max_seq_length: int, train_on_prompt: bool = False) -> TokenizeReport:
    out, truncated, dropped = [], 0, 0
    for ex in examples:
        prompt, response, eos = format_example(ex, tokenizer, tpl)
        tok = tokenize_example(prompt, response, eos, tokenizer, max_seq_length, train_on_prompt)
        if tok is None:
            dropped += 1
            continue
        truncated += tok.truncated
        out.append(tok)
    return TokenizeReport(out, truncated, dropped)


def collate(batch: Sequence[TokenizedExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels (-100 on padding, and on the
    prompt unless it was tokenized with train_on_prompt). (B, L)."""
    width = max(len(b.input_ids) for b in batch)
    ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)    # (B, L)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)  # (B, L)
    mask = torch.zeros((len(batch), width), dtype=torch.long)                 # (B, L)
    for i, b in enumerate(batch):
        n = len(b.input_ids)
        ids[i, :n] = torch.tensor(b.input_ids)
        labels[i, :n] = torch.tensor(b.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
