"""Write the word-reversal task: `python make_data.py [--out data]`.

Each row is {"word": "cat", "reversed": "tac"}: the prompt field and the answer field have
names of our own (the configs say which is which). Three files:

- train.jsonl / test.jsonl: 2,000 and 200 distinct random lowercase words of 3 to 5
  letters (no word in both);
- sft.jsonl: demonstrations for the supervised warm start as {"prompt", "completion"}
  rows, from a *sloppy* teacher: 60% of its answers have their first two letters swapped
  ("cat" -> "atc"). The slip is systematic, so the warm-started model's likeliest answer
  is usually the wrong one, and a reward for the exact reversal has something to teach.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path


def random_words(n: int, rng: random.Random, exclude: set[str] = frozenset()) -> list[str]:
    words: list[str] = []
    seen = set(exclude)
    while len(words) < n:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 5)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def sloppy(answer: str) -> str:
    """The teacher's slip: the first two letters swapped (the same letters, wrong order)."""
    return answer[1] + answer[0] + answer[2:]


def write(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wrong-rate", type=float, default=0.6)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    test = random_words(200, rng)
    train = random_words(2000, rng, exclude=set(test))
    write([{"word": w, "reversed": w[::-1]} for w in train], out / "train.jsonl")
    write([{"word": w, "reversed": w[::-1]} for w in test], out / "test.jsonl")
    demos = [{"prompt": w, "completion": sloppy(w[::-1]) if rng.random() < args.wrong_rate else w[::-1]}
             for w in train]
    write(demos, out / "sft.jsonl")
    wrong = sum(d["completion"] != d["prompt"][::-1] for d in demos)
    print(f"wrote {len(train)} train, {len(test)} test, {len(demos)} demonstrations "
          f"({wrong / len(demos):.0%} of them wrong) to {out}/")


if __name__ == "__main__":
    main()
