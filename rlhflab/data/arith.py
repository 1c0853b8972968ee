"""A GSM8K-format arithmetic task, generated locally.

Each row has the fields of GSM8K: ``question`` (a short word problem) and ``answer``
(a worked line ending in ``#### N``). The problems are one-digit additions and
subtractions wrapped in a few sentence templates, so a tiny model can learn them on a
CPU in a minute or two.

``noisy_demonstrations`` makes the "sloppy demonstrator" used for the supervised warm
start: with probability ``wrong_rate`` the worked answer is off by one (always +1, a
systematic slip). A model imitating it learns the format and arithmetic but prefers
the wrong answer; a reward for correctness can then take it beyond its teacher, which
is the point the RLHF seeds make about reward learning versus demonstrations.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gia", "Hugo", "Ivy", "Jon",
         "Kai", "Lea", "Max", "Nia", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tess"]
ITEMS = ["apples", "books", "coins", "cards", "pens", "shells", "stamps", "marbles",
         "cookies", "stickers"]

ADD_TEMPLATES = [
    "{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
    "{name} found {a} {item} on Monday and {b} {item} on Tuesday. How many {item} in all?",
    "There are {a} {item} in a box and {name} adds {b}. How many {item} are in the box?",
]
SUB_TEMPLATES = [
    "{name} has {a} {item} and gives away {b}. How many {item} are left?",
    "{name} had {a} {item} and lost {b} of them. How many {item} does {name} have now?",
    "There are {a} {item} in a jar and {name} takes {b}. How many {item} stay in the jar?",
]


# How the task's questions are shown to the model: `rlhflab eval` and `rlhflab generate` default to
# it, and the quickstart and the debug configs use it.
PROMPT_TEMPLATE = "Question: {prompt}\nAnswer:"

# Distinct problems: (100 additions + 55 subtractions) x 3 sentences x 20 names x 10 items, about
# 93,000; drawing more than about half of them by rejection gets slow, so a request is capped.
MAX_PROBLEMS = 50_000


def make_problem(rng: random.Random) -> dict:
    """One problem: {"question", "answer", "a", "b", "op", "result"}."""
    op = rng.choice("+-")
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if op == "-" and b > a:
        a, b = b, a
    result = a + b if op == "+" else a - b
    template = rng.choice(ADD_TEMPLATES if op == "+" else SUB_TEMPLATES)
    question = template.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
    answer = f"{a} {op} {b} = {result}\n#### {result}"
    return {"question": question, "answer": answer, "a": a, "b": b, "op": op, "result": result}


def draw_distinct(make, n: int, seed: int, exclude: set[str] | None = None) -> list[dict]:
    """`n` distinct rows of `make(rng)` (by question text), none of them in `exclude`."""
    rng = random.Random(seed)
    rows, seen = [], set(exclude or ())
    for _ in range(n * 50):
        row = make(rng)
        if row["question"] in seen:
            continue
        seen.add(row["question"])
        rows.append(row)
        if len(rows) == n:
            return rows
    raise RuntimeError(f"could not draw {n} distinct problems; ask for fewer")


def make_split(n: int, seed: int, exclude: set[str] | None = None) -> list[dict]:
    """`n` distinct problems (by question text), none of them in `exclude`."""
    return draw_distinct(make_problem, n, seed, exclude)


def noisy_demonstrations(rows: list[dict], wrong_rate: float, seed: int) -> list[dict]:
    """SFT rows (prompt/completion) from `rows`, a `wrong_rate` fraction off by one."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        result = row["result"] + (1 if rng.random() < wrong_rate else 0)
        out.append({"prompt": row["question"],
                    "completion": f"{row['a']} {row['op']} {row['b']} = {result}\n#### {result}"})
    return out


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    """Write rows as jsonl atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path


def write_task(out_dir: str | Path, n_train: int = 2000, n_test: int = 200, seed: int = 0,
               wrong_rate: float = 0.6) -> dict[str, Path]:
    """Write train.jsonl, test.jsonl and sft.jsonl (noisy demonstrations) to `out_dir`."""
    return write_splits(out_dir, make_problem, lambda train: noisy_demonstrations(train, wrong_rate, seed + 2),
                        n_train, n_test, seed)


def write_splits(out_dir: str | Path, make, demonstrate, n_train: int, n_test: int, seed: int) -> dict[str, Path]:
    """A task's three files: `n_test` distinct rows of `make(rng)` (seed + 1), `n_train`
    others (seed) that share no question with them, and `demonstrate(train)` as SFT rows."""
    out = Path(out_dir)
    test = draw_distinct(make, n_test, seed + 1)
    train = draw_distinct(make, n_train, seed, exclude={r["question"] for r in test})
    return {
        "train": write_jsonl(train, out / "train.jsonl"),
        "test": write_jsonl(test, out / "test.jsonl"),
        "sft": write_jsonl(demonstrate(train), out / "sft.jsonl"),
    }


def add_parser(parser: argparse.ArgumentParser) -> None:
    from rlhflab.cliargs import count, number, seed

    parser.add_argument("--task", choices=["arith", "word-problems"], default="arith",
                        help="arith: one-digit sums for a tiny model; word-problems: two-digit, one- and "
                             "two-step problems for a small pretrained chat model (rlhflab/data/wordproblems.py) "
                             "(default: %(default)s)")
    parser.add_argument("--out", default=None,
                        help="output folder for train.jsonl, test.jsonl and sft.jsonl (default: outputs/arith, "
                             "or outputs/wordproblems with --task word-problems)")
    parser.add_argument("--n-train", type=count(1, MAX_PROBLEMS), default=2000,
                        help="training problems, also the SFT demonstrations (default: %(default)s)")
    parser.add_argument("--n-test", type=count(1, MAX_PROBLEMS), default=200,
                        help="held-out problems, none also in training (default: %(default)s)")
    parser.add_argument("--seed", type=seed(), default=0, help="seed of the problems (default: %(default)s)")
    parser.add_argument("--wrong-rate", type=number(0.0, 1.0), default=0.6,
                        help="fraction of SFT demonstrations whose answer is off by one (default: %(default)s)")
    from rlhflab.data.wordproblems import LEVELS

    parser.add_argument("--level", choices=list(LEVELS), default="standard",
                        help="word-problems only: easy keeps every number small (sums to 24, times tables to "
                             "6 x 6), standard has two-digit numbers (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from rlhflab.errors import UserError
    if args.level != "standard" and args.task != "word-problems":
        raise UserError(f"--level {args.level}: levels belong to --task word-problems; drop --level for --task {args.task}")
    if args.task == "word-problems":
        from rlhflab.data.wordproblems import write_task as write_word_problems
        paths = write_word_problems(args.out or "outputs/wordproblems", args.n_train, args.n_test, args.seed,
                                    args.level)
        for name, path in paths.items():
            print(f"{name:>5}: {path}")
        return 0
    if args.n_train + args.n_test > MAX_PROBLEMS:
        raise UserError(f"--n-train {args.n_train} + --n-test {args.n_test}: the task has about 93,000 distinct "
                        f"problems and draws at most {MAX_PROBLEMS:,} in all; ask for fewer")
    paths = write_task(args.out or "outputs/arith", args.n_train, args.n_test, args.seed, args.wrong_rate)
    for name, path in paths.items():
        print(f"{name:>5}: {path}")
    return 0
