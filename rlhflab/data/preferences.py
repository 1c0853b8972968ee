"""Preference pairs for reward models (and DPO), in TRL's four preference layouts.

Row forms accepted (TRL's names in brackets):

    standard        {"prompt": str, "chosen": str, "rejected": str, ...}  [explicit prompt]
                    {"chosen": str, "rejected": str}: the prompt is the leading text both
                    share, cut at its last space (the space goes with the completions)
                    [implicit prompt]
    conversational  {"chosen": [messages], "rejected": [messages]}: the prompt is the
                    shared leading messages, the completion the rest; an explicit
                    "prompt" (a list of messages, or a string read as one user turn)
                    may be given instead, with chosen/rejected holding completions only.

Optional fields: "margin" (or "strength"): how strongly chosen is preferred (the app
writes 1.0 "much better", 0.5 "slightly better"); "tie": true (or margin 0) for a tie;
"pair_id", "n_labels" (kept for reference). Any other field is ignored.

Prompts are raw (docs/reference/data_formats.md, "Raw prompts, one template"): the
labelling app exports them as the file gave them, and the run that reads the pairs
(`rlhflab rm`: ``data.prompt_template``; `rlhflab dpo`: ``dataset.prompt_template``)
applies its template and, by the one rule, the tokenizer's chat template, as the
policy's run does; `rlhflab.data.prompts.refuse_templated` stops a prompt that already
holds what the run adds. Conversational rows are rendered with the tokenizer's chat
template when it has one, else as ``User: ...\n\nAssistant: ...``
(`rlhflab.data.sft.format_example`).

A row that lacks a field is reported with its index and fields and skipped; a file
where more than `max_bad_fraction` of rows are bad stops with a `UserError`. A field of
the wrong type (a number or an object where a string or messages belong) stops at once
with the file, the row and the field. Rows whose chosen and rejected responses are
identical carry no preference and are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from rlhflab.errors import UserError


@dataclass
class PreferencePair:
    """One row of a preference file as read: the fields as they are, before any
    template (see `PairText` for the texts a model reads)."""

    prompt: Any          # str, or a list of messages (conversational)
    chosen: Any          # str, or a list of messages (the completion only)
    rejected: Any
    margin: float | None
    tie: bool
    index: int           # row number in the source (0-based)
    pair_id: Any = None

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)


def _is_messages(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in v)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    return None


def shared_text_prefix(a: str, b: str) -> int:
    """Where the implicit prompt of two texts ends: their common leading text, cut at its
    last whitespace (which goes with the completions), so no word is split; 0 when they
    share no whole word."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if n == len(a) == len(b):
        return n
    cut = max(a.rfind(" ", 0, n + 1), a.rfind("\n", 0, n + 1))
    return max(cut, 0)


def check_types(row: Any, source: str, index: int) -> None:
    """A field of the wrong type is a one-line `UserError` naming the file, row and field
    (a missing field is `_why_bad`'s, and only skips the row)."""
    from rlhflab.data.prompts import check_text_field

    if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
        return
    c = check_text_field(row["chosen"], source, index, "chosen", messages=True)
    r = check_text_field(row["rejected"], source, index, "rejected", messages=True)
    if isinstance(c, str) != isinstance(r, str):
        raise UserError(f"{source}: row {index} has 'chosen' as {'text' if isinstance(c, str) else 'messages'} and "
                        f"'rejected' as {'text' if isinstance(r, str) else 'messages'}; give both as strings or "
                        "both as lists of {role, content} messages")
    if row.get("prompt") is not None:
        check_text_field(row["prompt"], source, index, "prompt", messages=isinstance(c, list))


def _why_bad(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"is a {type(row).__name__}, not an object"
    if "chosen" not in row or "rejected" not in row:
        return "lacks chosen/rejected"
    c, r = row["chosen"], row["rejected"]
    if isinstance(c, str) and isinstance(r, str):
        if not isinstance(row.get("prompt"), str) and shared_text_prefix(c, r) == 0:
            return "has string chosen/rejected, no prompt, and no shared leading text to take as one"
    elif not (_is_messages(c) and _is_messages(r)):
        return "has chosen/rejected that are neither strings nor lists of {role, content} messages"
    for key in ("margin", "strength"):
        if key in row and row[key] is not None and _number(row[key]) is None:
            return f"has a non-numeric {key} {row[key]!r}"
    return None


def row_to_pair(row: dict, index: int) -> PreferencePair:
    """One valid row (see `_why_bad`) as a PreferencePair."""
    margin = _number(row.get("margin"))
    if margin is None:
        margin = _number(row.get("strength"))
    tie = bool(row.get("tie")) or margin == 0.0
    c, r = row["chosen"], row["rejected"]
    prompt: Any = row.get("prompt")
    if isinstance(c, list):
        if _is_messages(prompt):
            pass
        elif isinstance(prompt, str) and prompt:
            prompt = [{"role": "user", "content": prompt}]
        else:
            # The implicit prompt: the leading messages both sides share.
            n = 0
            while n < min(len(c), len(r)) - 1 and c[n] == r[n]:
                n += 1
            prompt, c, r = c[:n], c[n:], r[n:]
    elif not isinstance(prompt, str):
        n = shared_text_prefix(c, r)  # TRL's implicit prompt, in text
        prompt, c, r = c[:n], c[n:], r[n:]
    return PreferencePair(prompt, c, r, margin, tie, index, row.get("pair_id"))


@dataclass
class PairReport:
    pairs: list[PreferencePair]
    bad: int
    identical: int
    ties: int


def parse_pairs(rows: Sequence[Any], source: str, max_bad_fraction: float = 0.5, warn=print) -> PairReport:
    """Rows -> pairs; bad rows reported (index and fields) and skipped."""
    if not rows:
        raise UserError(f"{source}: no rows; check the file or split")
    pairs, bad, identical = [], [], 0
    for i, row in enumerate(rows):
        check_types(row, source, i)
        why = _why_bad(row)
        if why is not None:
            bad.append(i)
            if len(bad) <= 5:
                fields = sorted(row) if isinstance(row, dict) else type(row).__name__
                warn(f"warning: {source}: row {i} {why} (it has {fields}); skipped")
            continue
        pair = row_to_pair(row, i)
        if pair.chosen == pair.rejected and not pair.tie:
            identical += 1
            continue
        pairs.append(pair)
    if bad and len(bad) > 5:
        warn(f"warning: {source}: {len(bad)} rows in all were not preference pairs and were skipped")
    if identical:
        warn(f"warning: {source}: {identical} rows have identical chosen and rejected responses; skipped")
    if bad and (len(bad) / len(rows) > max_bad_fraction or not pairs):
        first = rows[bad[0]]
        fields = sorted(first) if isinstance(first, dict) else type(first).__name__
        raise UserError(f"{source}: {len(bad)} of {len(rows)} rows are not preference pairs (row {bad[0]} "
                        f"{_why_bad(first)}; it has {fields}); give prompt/chosen/rejected rows as "
                        "exported by `rlhflab label export`, chosen/rejected texts sharing the prompt, or "
                        "conversational chosen/rejected messages")
    if not pairs:
        raise UserError(f"{source}: no usable preference pairs; check the file")
    return PairReport(pairs, len(bad), identical, sum(p.tie for p in pairs))


def _completion_text(messages: list[dict]) -> str:
    return "\n\n".join(m["content"] for m in messages)


class PairText(NamedTuple):
    """A pair as a model reads it: the prompt text (templated) and the two response texts."""

    prompt: str
    chosen: str
    rejected: str


def pair_texts(pair: PreferencePair, tokenizer=None, use_chat_template: bool = True) -> PairText:
    """The prompt and the chosen and rejected response texts as the model reads them
    (a plain pair's prompt as it is: `render_pairs` applies the run's template)."""
    if not pair.conversational:
        return PairText(pair.prompt, pair.chosen, pair.rejected)
    from rlhflab.data import sft as sftdata

    tpl = sftdata.Template(use_chat_template=use_chat_template)
    out = []
    for side in (pair.chosen, pair.rejected):
        msgs = list(pair.prompt) + [{"role": "assistant", "content": _completion_text(side)}]
        if not any(m["role"] == "user" for m in pair.prompt):
            msgs = [{"role": "user", "content": ""}] + msgs
        prompt, response, _ = sftdata.format_example(sftdata.SFTExample(msgs, pair.index), tokenizer, tpl)
        out.append((prompt, response))
    return PairText(out[0][0], out[0][1], out[1][1])


def render_pairs(pairs: Sequence[PreferencePair], tokenizer, template: str, use_chat: bool, source: str,
                 key: str) -> list[PairText]:
    """Each pair as the model reads it: a plain prompt through `template` ({prompt}
    replaced) and, when `use_chat`, the tokenizer's chat template, as the policy's run
    renders its prompts; a conversational pair through the chat template (`pair_texts`).
    A plain prompt that already begins with what the run adds is a `UserError`
    (`key` names the template's config key)."""
    from rlhflab.data.prompts import format_prompt, refuse_templated, template_heads

    heads = template_heads(template, tokenizer, use_chat)
    out = []
    for p in pairs:
        text = pair_texts(p, tokenizer, use_chat)
        if not p.conversational:
            refuse_templated(p.prompt, heads, source, p.index, "prompt", key)
            text = text._replace(prompt=format_prompt(p.prompt, template, tokenizer, use_chat))
        out.append(text)
    return out


FEW_PAIRS = 8  # fewer training pairs than this teach a model next to nothing: a warning says so


def check_sources(path: str | None, eval_path: str | None, n_train: int, keys: tuple[str, str], warn) -> None:
    """Warnings for a run that would report a misleading number: a held-out file from
    another folder than the training file (a config's `eval_path` left behind when
    `path` was overridden on the command line measures another file's pairs), and fewer
    than `FEW_PAIRS` training pairs. `keys` names the two config keys."""
    from pathlib import Path

    if path and eval_path and Path(path).suffix and Path(eval_path).suffix:
        here, there = Path(path).expanduser().resolve().parent, Path(eval_path).expanduser().resolve().parent
        if here != there:
            warn(f"warning: {keys[1]} {eval_path} is not beside {keys[0]} {path}: the held-out numbers measure "
                 f"another file's pairs; give {keys[1]} a held-out file of the same source, or {keys[1]}=null to "
                 "hold out a share of the training pairs")
    if n_train < FEW_PAIRS:
        warn(f"warning: {keys[0]} {path}: only {n_train} training pair(s); a model learns next to nothing from "
             f"fewer than {FEW_PAIRS}, so expect held-out accuracy near chance")


class ImportRow(NamedTuple):
    """A row of a file for `rlhflab label import`, as the labelling database stores it."""

    prompt: str            # raw, as a pair file holds it
    responses: list[str]   # a pair (response_a/b, or chosen/rejected) or 2+ candidates
    is_pair: bool          # False: every two distinct responses make a pair
    ext_id: Any            # the row's id / pair_id, kept as the export's pair_id; None without one
    source: str


def _one_turn(value: Any, where: str, field: str, role: str) -> str:
    """The text of a one-message conversation part (TRL conversational rows)."""
    if not (isinstance(value, list) and len(value) == 1 and value[0]["role"] == role):
        raise UserError(f"{where}: field {field!r} is a conversation of {len(value)} messages; the labelling app "
                        f"shows one {role} turn here, so give it a one-message list or plain text")
    return value[0]["content"]


def import_row(row: Any, where: str) -> ImportRow:
    """A labelling-import row in any form the app or the trainers read: the app's own
    ({prompt, response_a, response_b}, optional id and source; {prompt, responses: [...]})
    or a preference row (TRL's standard or conversational chosen/rejected, with explicit
    or implicit prompt; chosen becomes response A). `where` names the file and line in
    the one-line `UserError` for a row that fits none."""
    from rlhflab.data.prompts import check_text_field

    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
    source = row.get("source", "import")
    if not isinstance(source, str):
        raise UserError(f"{where}: 'source' must be a string")
    ext_id = row.get("id", row.get("pair_id"))
    if ext_id is not None and (not isinstance(ext_id, (str, int)) or isinstance(ext_id, bool)):
        raise UserError(f"{where}: 'id' must be a string or an integer")
    if "chosen" in row or "rejected" in row:
        if "chosen" not in row or "rejected" not in row:
            raise UserError(f"{where}: a preference row needs both 'chosen' and 'rejected'")
        for f in ("chosen", "rejected", "prompt"):
            if row.get(f) is not None:
                check_text_field(row[f], where, None, f, messages=True)
        why = _why_bad(row)
        if why is not None:
            raise UserError(f"{where}: the row {why}; give prompt/chosen/rejected, or chosen/rejected sharing "
                            "the prompt")
        pair = row_to_pair(row, 0)
        if pair.conversational:
            if not pair.prompt:
                raise UserError(f"{where}: chosen and rejected share no leading message to take as the prompt; "
                                "give an explicit 'prompt'")
            prompt = _one_turn(pair.prompt, where, "prompt", "user")
            responses = [_one_turn(pair.chosen, where, "chosen", "assistant"),
                         _one_turn(pair.rejected, where, "rejected", "assistant")]
        else:
            prompt, responses = pair.prompt, [pair.chosen, pair.rejected]
        if not prompt.strip():
            raise UserError(f"{where}: needs a non-empty prompt (an explicit 'prompt', or chosen/rejected "
                            "sharing one)")
        return ImportRow(prompt, responses, True, ext_id, source)
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        check_text_field(prompt, where, 0, "prompt", messages=True)
        prompt = _one_turn(prompt, where, "prompt", "user")
    if not isinstance(prompt, str) or not prompt.strip():
        raise UserError(f"{where}: needs a non-empty string 'prompt'")
    if "responses" in row:
        responses = row["responses"]
        if (not isinstance(responses, list) or len(responses) < 2
                or not all(isinstance(r, str) for r in responses)):
            raise UserError(f"{where}: 'responses' must be a list of at least 2 strings")
        return ImportRow(prompt, list(responses), False, None, source)
    a, b = row.get("response_a"), row.get("response_b")
    if not isinstance(a, str) or not isinstance(b, str):
        raise UserError(f"{where}: needs string fields 'response_a' and 'response_b' "
                        "(or a list 'responses', or 'chosen' and 'rejected')")
    return ImportRow(prompt, [a, b], True, ext_id, source)


def pairs_from_samples(prompt: str, responses: Sequence[str], scores: Sequence[float],
                       max_pairs: int = 1, pair_id: Any = None) -> list[dict]:
    """Preference rows for one prompt from its labelled samples (a rule's scores, e.g. 1
    right / 0 wrong), in the labelling app's export format.

    Each distinct response counts once (its first score). Sorted by score, high to low
    (ties keep the sampling order), the i-th best is paired with the i-th worst while it
    scores higher, up to `max_pairs` pairs; no response is in two pairs. So a prompt whose
    samples all score the same (all right, or all wrong) gives no pair, and with 0/1
    labels a prompt gives min(#right, #wrong, max_pairs) pairs. `pair_id` (default: the
    prompt) is written as "<pair_id>/<i>".
    """
    if len(responses) != len(scores):
        raise ValueError(f"pairs_from_samples: {len(responses)} responses but {len(scores)} scores")
    first = {}
    for response, score in zip(responses, scores):
        first.setdefault(response, float(score))
    ranked = sorted(first.items(), key=lambda rs: -rs[1])  # stable: sampling order among equals
    out = []
    for i in range(min(max_pairs, len(ranked) // 2)):
        (chosen, hi), (rejected, lo) = ranked[i], ranked[-1 - i]
        if hi <= lo:
            break
        out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": 1.0,
                    "pair_id": f"{prompt if pair_id is None else pair_id}/{i}", "n_labels": 1})
    return out


# --------------------------------------------------------------------------------------
# A learnable preference task for the offline pipeline (no humans on a CPU runner)
# --------------------------------------------------------------------------------------
ARITH_TEMPLATE = "Question: {prompt}\nAnswer:"  # what the arithmetic configs' runs put around a question


def arith_pairs(rows: Sequence[dict], seed: int = 0) -> list[dict]:
    """Preference rows in the labelling app's export format from arithmetic problems,
    the prompt the bare question (raw: the run applies its template).

    chosen is the correct worked answer; rejected is wrong in one of three ways:
    - 60%: the result is off by 1-3, up or down with equal odds (both in the equation
      and after ####), so "smaller (or larger) is better" is no shortcut;
    - 20%: the equation is right but the number after #### is off by 1-2;
    - 20%: a self-consistent equation on one wrong operand (``a' op b = a' op b``),
      so checking the arithmetic alone is not enough: the operands must match the question.
    Every rejected final answer is wrong. A reward model has to read the question and
    check the sum to tell them apart;
    a model that learns a shortcut is exploited by PPO (answers drift to the shortcut).
    `rows` are `rlhflab.data.arith` problems (question, a, b, op, result).
    """
    import random as _random

    rng = _random.Random(seed)
    out = []
    for i, row in enumerate(rows):
        a, b, op, res = row["a"], row["b"], row["op"], row["result"]
        kind = rng.random()
        if kind < 0.6:
            wrong = res + rng.choice([-3, -2, -1, 1, 2, 3])
            rejected = f" {a} {op} {b} = {wrong}\n#### {wrong}"
        elif kind < 0.8:
            rejected = f" {a} {op} {b} = {res}\n#### {res + rng.choice([-2, -1, 1, 2])}"
        else:
            # One operand changed, the result right for the changed equation (never negative).
            options = [(x, b) for x in range(10) if x != a and (op == "+" or x >= b)]
            options += [(a, y) for y in range(10) if y != b and (op == "+" or y <= a)]
            options = [(x, y) for x, y in options if (x + y if op == "+" else x - y) != res]
            a2, b2 = rng.choice(options)
            res2 = a2 + b2 if op == "+" else a2 - b2
            rejected = f" {a2} {op} {b2} = {res2}\n#### {res2}"
        out.append({
            "prompt": row["question"],
            "chosen": f" {a} {op} {b} = {res}\n#### {res}",
            "rejected": rejected,
            "margin": 1.0, "pair_id": i, "n_labels": 1,
        })
    return out


def write_arith_pairs(out_dir, n_train: int = 2000, n_test: int = 200, seed: int = 0) -> dict:
    """Write train.jsonl and test.jsonl preference files (held-out questions differ).

    With the same seed as `rlhflab make-data`, the questions match its train/test split.
    """
    from pathlib import Path

    from rlhflab.data import arith

    out = Path(out_dir)
    test = arith.make_split(n_test, seed + 1)
    train = arith.make_split(n_train, seed, exclude={r["question"] for r in test})
    return {"train": arith.write_jsonl(arith_pairs(train, seed + 3), out / "train.jsonl"),
            "test": arith.write_jsonl(arith_pairs(test, seed + 4), out / "test.jsonl")}


def off_by_one_pairs(rows: Sequence[dict], seed: int = 0) -> list[dict]:
    """Export-format rows from arithmetic-task rows, for DPO's demo: chosen is the right
    worked answer, rejected the same line with the result off by one, up or down at
    random (down only when the result is above 0). Prompts are the bare questions; DPO's
    `dataset.prompt_template` formats them.

    Both directions, because a rejected answer that is always one too high teaches the
    shortcut "smaller digits are better", which the implicit reward learns as readily
    as "right is better" and which shifts every digit the policy writes, operands too.
    (`arith_pairs` makes harder pairs, three kinds of wrong, for the reward model.)
    """
    import random as _random

    rng = _random.Random(seed)
    out = []
    for i, row in enumerate(rows):
        a, op, b, result = row["a"], row["op"], row["b"], row["result"]
        wrong = result + (1 if result == 0 or rng.random() < 0.5 else -1)
        out.append({"prompt": row["question"],
                    "chosen": f" {a} {op} {b} = {result}\n#### {result}",
                    "rejected": f" {a} {op} {b} = {wrong}\n#### {wrong}",
                    "margin": 1.0, "pair_id": i, "n_labels": 1})
    return out


def write_off_by_one_pairs(task_dir) -> dict:
    """pairs_train.jsonl and pairs_test.jsonl (`off_by_one_pairs`) beside an existing
    task's train.jsonl and test.jsonl (`rlhflab make-data`); `rlhflab dpo --make-arith-pairs`."""
    from pathlib import Path

    from rlhflab.data import arith
    from rlhflab.data.loading import read_rows

    task_dir = Path(task_dir)
    out = {}
    for split in ("train", "test"):
        src = task_dir / f"{split}.jsonl"
        if not src.is_file():
            raise UserError(f"{src} not found; make the task first with `rlhflab make-data --out {task_dir}`")
        rows = off_by_one_pairs(read_rows(str(src)), seed=0 if split == "train" else 1)
        out[split] = arith.write_jsonl(rows, task_dir / f"pairs_{split}.jsonl")
    return out
