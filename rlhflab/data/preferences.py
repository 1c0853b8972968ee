"""Preference pairs for reward models (and DPO): read the labelling app's export as it is.

Row forms accepted:

    standard        {"prompt": str, "chosen": str, "rejected": str, ...}
    conversational  {"chosen": [messages], "rejected": [messages]}: the prompt is the
                    shared leading messages, the completion the rest; an explicit
                    "prompt" (a list of messages, or a string read as one user turn)
                    may be given instead, with chosen/rejected holding completions only.

Optional fields: "margin" (or "strength"): how strongly chosen is preferred (the app
writes 1.0 "much better", 0.5 "slightly better"); "tie": true (or margin 0) for a tie;
"pair_id", "n_labels" (kept for reference). Any other field is ignored.

The text a reward model reads is ``prompt + response``: the app stores prompts exactly
as the policy saw them (templated), and PPO passes its prompts the same way, so no
template is applied here. Conversational rows are rendered with the tokenizer's chat
template when it has one, else as ``User: ...\\n\\nAssistant: ...``
(`rlhflab.data.sft.format_example`).

A row that fits no form is reported with its index and fields and skipped; a file
where more than `max_bad_fraction` of rows are bad stops with a `UserError`. Rows whose
chosen and rejected responses are identical carry no preference and are skipped.
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


def _why_bad(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"is a {type(row).__name__}, not an object"
    if "chosen" not in row or "rejected" not in row:
        return "lacks chosen/rejected"
    c, r = row["chosen"], row["rejected"]
    if isinstance(c, str) and isinstance(r, str):
        if not isinstance(row.get("prompt"), str):
            return "has string chosen/rejected but no string prompt"
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
                        "exported by `rlhflab label export`, or conversational chosen/rejected messages")
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
    """The prompt and the chosen and rejected response texts as the model reads them."""
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
ARITH_TEMPLATE = "Question: {prompt}\nAnswer:"


def arith_pairs(rows: Sequence[dict], seed: int = 0, template: str = ARITH_TEMPLATE) -> list[dict]:
    """Preference rows in the labelling app's export format from arithmetic problems.

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
            "prompt": template.replace("{prompt}", row["question"]),
            "chosen": f" {a} {op} {b} = {res}\n#### {res}",
            "rejected": rejected,
            "margin": 1.0, "pair_id": i, "n_labels": 1,
        })
    return out


def write_arith_pairs(out_dir, n_train: int = 2000, n_test: int = 200, seed: int = 0,
                      template: str = ARITH_TEMPLATE) -> dict:
    """Write train.jsonl and test.jsonl preference files (held-out questions differ).

    With the same seed as `rlhflab make-data`, the questions match its train/test split.
    """
    from pathlib import Path

    from rlhflab.data import arith

    out = Path(out_dir)
    test = arith.make_split(n_test, seed + 1)
    train = arith.make_split(n_train, seed, exclude={r["question"] for r in test})
    return {"train": arith.write_jsonl(arith_pairs(train, seed + 3, template), out / "train.jsonl"),
            "test": arith.write_jsonl(arith_pairs(test, seed + 4, template), out / "test.jsonl")}


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
