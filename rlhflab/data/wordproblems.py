"""Plain-English arithmetic word problems for a real chat model, generated locally.

The arithmetic task (`rlhflab.data.arith`) is sized for a 2.46M-parameter model trained
from scratch: one-digit sums that a pretrained chat model answers almost always. This
task is sized for a small pretrained chat model (SmolLM2-135M-Instruct answers about a
third of it greedily), so reinforcement learning has room to show: two-digit numbers,
and problems of one or two steps (add, take away, groups of, share equally, buy then
give away).

Each row has the GSM8K fields, ``question`` and ``answer`` (a worked line ending in
``#### N``), plus ``result`` (the integer answer) and ``kind``. The answer is always a
non-negative integer.

The checker reads a chat model's natural answer, not a fixed format: an explicit answer
("The answer is 12", "#### 12", "**12**", "\\boxed{12}") wins; else the number after the
last "=" ("7 + 5 = 12 apples"); else the last number in the response. `reward` scores
1.0 for the right integer, 0.0 otherwise; `correct` is the same test as a bool (for
``eval.correct``).
"""

from __future__ import annotations

import random
import re

from rlhflab.data.arith import draw_distinct

NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gia", "Hugo", "Ivy", "Jon",
         "Kai", "Lea", "Max", "Nia", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tess"]
ITEMS = ["apples", "books", "coins", "cards", "pens", "shells", "stamps", "marbles",
         "cookies", "stickers", "pencils", "eggs"]

# How a question is shown to the model (inside the chat template when the tokenizer has one).
PROMPT_TEMPLATE = "{prompt}"

KINDS = ("add", "sub", "mul", "div", "two_step")

# The number ranges of each level. "easy" keeps every operand small (sums to 24, take-aways
# from 20, times tables to 6 x 6): SmolLM2-135M-Instruct answers about a third of it
# greedily and gets 6-19% of its samples right at temperature 0.7 (the recipes' first
# rollouts), so a group of 8 samples often holds a right and a wrong answer, the contrast
# GRPO and PPO learn from.
# "standard" has two-digit operands: the same model answers about a quarter greedily, but
# mostly the multiplications, and almost never the subtractions and two-step problems
# (it cannot do the arithmetic), which leaves reinforcement learning little to work with.
LEVELS = {
    "easy": {"add": ((2, 15), (2, 9)), "sub": ((6, 20), (2, 2)), "mul": ((2, 6), (2, 6)),
             "div": ((2, 5), (2, 6)), "two_step": ((3, 12), (2, 9), 2)},
    "standard": {"add": ((11, 59), (11, 39)), "sub": ((30, 90), (11, 5)), "mul": ((3, 9), (3, 12)),
                 "div": ((2, 9), (3, 12)), "two_step": ((10, 40), (5, 30), 3)},
}


def _add(rng: random.Random, size) -> tuple[str, str, int]:
    (lo_a, hi_a), (lo_b, hi_b) = size
    a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
    q = rng.choice([
        "{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
        "{name} collected {a} {item} on Monday and {b} {item} on Tuesday. How many {item} did {name} collect in all?",
        "A box holds {a} {item}. {name} puts {b} more {item} in it. How many {item} are in the box now?",
    ])
    return q.format(a=a, b=b, name="{name}", item="{item}"), f"{a} + {b} = {a + b}", a + b


def _sub(rng: random.Random, size) -> tuple[str, str, int]:
    (lo_a, hi_a), (lo_b, gap) = size   # b from lo_b up to a - gap: at least `gap` are left
    a = rng.randint(lo_a, hi_a)
    b = rng.randint(lo_b, a - gap)
    q = rng.choice([
        "{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?",
        "There were {a} {item} on a shelf. {name} took {b} of them. How many {item} are still on the shelf?",
        "{name} had {a} {item} and lost {b}. How many {item} does {name} have now?",
    ])
    return q.format(a=a, b=b, name="{name}", item="{item}"), f"{a} - {b} = {a - b}", a - b


def _mul(rng: random.Random, size) -> tuple[str, str, int]:
    (lo_a, hi_a), (lo_b, hi_b) = size
    a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
    q = rng.choice([
        "{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?",
        "There are {a} boxes and each box has {b} {item}. How many {item} are there in total?",
        "{name} gets {b} {item} every day for {a} days. How many {item} does {name} get?",
    ])
    return q.format(a=a, b=b, name="{name}", item="{item}"), f"{a} x {b} = {a * b}", a * b


def _div(rng: random.Random, size) -> tuple[str, str, int]:
    (lo_b, hi_b), (lo_k, hi_k) = size
    b, k = rng.randint(lo_b, hi_b), rng.randint(lo_k, hi_k)
    a = b * k
    q = rng.choice([
        "{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
        "{name} puts {a} {item} into {b} equal piles. How many {item} are in each pile?",
    ])
    return q.format(a=a, b=b, name="{name}", item="{item}"), f"{a} / {b} = {k}", k


def _two_step(rng: random.Random, size) -> tuple[str, str, int]:
    (lo_a, hi_a), (lo_b, hi_b), margin = size   # c takes at least `margin` and leaves at least `margin`
    a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
    c = rng.randint(margin, a + b - margin)
    q = rng.choice([
        "{name} has {a} {item}, buys {b} more, and then gives {c} to a friend. How many {item} does {name} have now?",
        "A jar has {a} {item}. {name} adds {b} {item} and later takes out {c}. How many {item} are in the jar?",
    ])
    r = a + b - c
    return q.format(a=a, b=b, c=c, name="{name}", item="{item}"), f"{a} + {b} - {c} = {r}", r


_MAKERS = {"add": _add, "sub": _sub, "mul": _mul, "div": _div, "two_step": _two_step}


def make_problem(rng: random.Random, level: str = "standard") -> dict:
    """One problem of `level` ("easy" or "standard"): {"question", "answer", "result", "kind"}."""
    kind = rng.choice(KINDS)
    template, worked, result = _MAKERS[kind](rng, LEVELS[level][kind])
    question = template.format(name=rng.choice(NAMES), item=rng.choice(ITEMS))
    return {"question": question, "answer": f"{worked}\n#### {result}", "result": result, "kind": kind}


def make_split(n: int, seed: int, exclude: set[str] | None = None, level: str = "standard") -> list[dict]:
    """`n` distinct problems (by question text) of `level`, none of them in `exclude`."""
    return draw_distinct(lambda rng: make_problem(rng, level), n, seed, exclude)


def demonstrations(rows: list[dict]) -> list[dict]:
    """SFT rows (prompt/completion): the worked line and a plain final sentence."""
    return [{"prompt": r["question"],
             "completion": f"{r['answer'].split(chr(10))[0]}. The answer is {r['result']}."} for r in rows]


def write_task(out_dir, n_train: int = 2000, n_test: int = 200, seed: int = 0, level: str = "standard") -> dict:
    """Write train.jsonl, test.jsonl and sft.jsonl (correct demonstrations) of `level` to `out_dir`."""
    from rlhflab.data.arith import write_splits

    if level not in LEVELS:
        raise ValueError(f"level {level!r}: choose one of {', '.join(LEVELS)}")
    return write_splits(out_dir, lambda rng: make_problem(rng, level), demonstrations, n_train, n_test, seed)


# --- the checker -------------------------------------------------------------------------

_INT = r"-?\d[\d,]*(?:\.\d+)?"
# Explicit answers, strongest first; the last match of the first pattern that matches wins.
_EXPLICIT = [
    re.compile(r"####\s*\$?(" + _INT + r")"),
    re.compile(r"\\boxed\{\s*\$?(" + _INT + r")"),
    re.compile(r"answer\s*(?:is|:|=)?\s*:?\s*\**\s*\$?(" + _INT + r")", re.IGNORECASE),
    re.compile(r"\*\*\s*\$?(" + _INT + r")\s*[a-zA-Z ]{0,20}\*\*"),
]
_AFTER_EQUALS = re.compile(r"=\s*\$?(" + _INT + r")")
_ANY = re.compile(_INT)


def _to_int(text: str) -> int | None:
    text = text.replace(",", "")
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value == int(value) else None


def extract_answer(response: str) -> int | None:
    """The integer a response gives as its answer, or None (see the module docstring)."""
    for pattern in _EXPLICIT:
        found = pattern.findall(response)
        if found:
            return _to_int(found[-1].rstrip(","))
    found = _AFTER_EQUALS.findall(response)
    if found:
        return _to_int(found[-1].rstrip(","))
    found = _ANY.findall(response)
    if found:
        return _to_int(found[-1].rstrip(","))
    return None


def _want(example: dict) -> int:
    if "result" in example:
        return int(example["result"])
    return int(str(example["answer"]).split("####")[-1].strip())


def correct(prompt: str, response: str, example: dict) -> bool:
    """True when the response's answer is the problem's integer answer."""
    return extract_answer(response) == _want(example)


def reward(prompt: str, response: str, example: dict) -> float:
    """1.0 for the right integer answer, else 0.0."""
    return 1.0 if correct(prompt, response, example) else 0.0
