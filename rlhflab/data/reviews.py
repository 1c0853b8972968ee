"""Movie-review-style text, generated locally: the offline version of the TRL sentiment example.

The TRL notebook prompts a GPT-2 with the first words of IMDB reviews and rewards the
continuation by a sentiment classifier's POSITIVE score. Here everything is generated
from small word lists, so a 2M-parameter model and a CPU are enough:

- review *openings* as prompts ("After seeing Night Harbor, I think"), with different
  film titles in the train and test splits;
- *continuations* of one or two clauses ("the acting was truly wonderful but the plot felt
  dull."), as the demonstrations that warm-start the policy: a grumpy critic, whose
  first clause is positive only 30% of the time, so the policy starts out negative and
  PPO has a direction to move it in;
- *labelled sentences* for the sentiment classifier (POSITIVE / NEGATIVE by the majority
  of their sentiment words; ties left out);
- a *lexicon check*, `lexicon_score` and `is_positive`: count the positive and negative
  words. It is the held-out check logged beside the classifier reward (``eval.correct``,
  ``eval.rewards``): a rule, not a network, so it cannot be fooled the way a learned
  reward can, and a policy that games the classifier shows up as the two diverging.

`rlhflab make-reviews --out outputs/reviews` writes the files (see `write_reviews`).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

POSITIVE = ("great", "wonderful", "brilliant", "moving", "funny", "beautiful", "superb", "charming",
            "delightful", "excellent", "gripping", "lovely")
NEGATIVE = ("boring", "awful", "dull", "terrible", "weak", "silly", "bad", "painful", "lazy", "messy",
            "tedious", "clumsy")
SUBJECTS = ("the film", "this movie", "the acting", "the plot", "the story", "the music", "the ending",
            "the cast", "the script", "the direction", "the dialogue", "the camera work")
VERBS = ("was", "felt", "seemed", "is")
INTENSIFIERS = ("", "", "really ", "very ", "truly ", "quite ", "so ")
CONNECTORS = ("and", "but", "while", "although")
TITLE_WORDS = ("Night", "Harbor", "Blue", "River", "Last", "Summer", "Iron", "Garden", "Silent", "City",
               "Winter", "Road", "Paper", "Moon", "Glass", "House", "Red", "Island", "Broken", "Sky",
               "Golden", "Storm", "Hidden", "Letter")
OPENINGS = ("I watched {title} last night and", "My review of {title}:", "After seeing {title}, I think",
            "{title} is a film where", "Honestly, {title}", "I went to see {title} and",
            "In {title},", "We rented {title} and", "The new film {title}", "So, {title}:")

LABELS = ("NEGATIVE", "POSITIVE")
_WORD = re.compile(r"[a-z]+")


# --------------------------------------------------------------------------------------
# The lexicon check
# --------------------------------------------------------------------------------------
def sentiment_counts(text: str) -> tuple[int, int]:
    """(positive words, negative words) in `text`, by the fixed word lists."""
    words = _WORD.findall(text.lower())
    return sum(w in POSITIVE for w in words), sum(w in NEGATIVE for w in words)


def lexicon_score(prompt: str, response: str, example: dict) -> float:
    """(positive − negative words) / (positive + negative words) of the response, in
    [−1, 1]; 0 when it has none. A reward plug-in: ``rlhflab.data.reviews:lexicon_score``."""
    pos, neg = sentiment_counts(response)
    return (pos - neg) / (pos + neg) if pos + neg else 0.0


def is_positive(prompt: str, response: str, example: dict) -> bool:
    """True when the response has more positive than negative words (the held-out
    positive-rate): ``eval.correct: rlhflab.data.reviews:is_positive``."""
    pos, neg = sentiment_counts(response)
    return pos > neg


# --------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------
def make_titles(rng: random.Random, n: int) -> list[str]:
    titles: list[str] = []
    while len(titles) < n:
        t = " ".join(rng.sample(TITLE_WORDS, 2))
        if t not in titles:
            titles.append(t)
    return titles


def opening(rng: random.Random, title: str) -> str:
    return rng.choice(OPENINGS).format(title=title)


def clause(rng: random.Random, positive: bool) -> str:
    adjective = rng.choice(POSITIVE if positive else NEGATIVE)
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(INTENSIFIERS)}{adjective}"


def continuation(rng: random.Random, positive: bool, two_clauses: bool | None = None) -> str:
    """One or two clauses; the first has the given sentiment, a second one either."""
    if two_clauses is None:
        two_clauses = rng.random() < 0.5
    text = clause(rng, positive)
    if two_clauses:
        text += f" {rng.choice(CONNECTORS)} {clause(rng, rng.random() < 0.5)}"
    return " " + text + "."


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_reviews(out_dir: str | Path, n_prompts: int = 2000, n_test: int = 200, n_labelled: int = 4000,
                  seed: int = 0, positive_share: float = 0.3) -> Path:
    """Write, under `out_dir`:

    - ``prompts_train.jsonl``, ``prompts_test.jsonl``: ``{"prompt": opening}`` (test titles unseen);
    - ``sft.jsonl``: ``{"prompt": opening, "completion": continuation}``, the first clause
      positive with probability `positive_share`;
    - ``labelled_train.jsonl``, ``labelled_test.jsonl``: ``{"text": continuation, "label": POSITIVE|NEGATIVE}``,
      balanced.
    """
    rng = random.Random(seed)
    out = Path(out_dir)
    titles = make_titles(rng, 120)
    test_titles, train_titles = titles[:20], titles[20:]
    train_prompts = [opening(rng, rng.choice(train_titles)) for _ in range(n_prompts)]
    test_prompts = [opening(rng, rng.choice(test_titles)) for _ in range(n_test)]
    write_jsonl([{"prompt": p} for p in train_prompts], out / "prompts_train.jsonl")
    write_jsonl([{"prompt": p} for p in test_prompts], out / "prompts_test.jsonl")
    write_jsonl([{"prompt": p, "completion": continuation(rng, rng.random() < positive_share).strip()}
                 for p in train_prompts], out / "sft.jsonl")
    labelled = []
    while len(labelled) < n_labelled:
        text = continuation(rng, rng.random() < 0.5).strip()
        pos, neg = sentiment_counts(text)
        if pos != neg:
            labelled.append({"text": text, "label": LABELS[pos > neg]})
    n_eval = n_labelled // 10
    write_jsonl(labelled[n_eval:], out / "labelled_train.jsonl")
    write_jsonl(labelled[:n_eval], out / "labelled_test.jsonl")
    return out


def add_parser(parser: argparse.ArgumentParser) -> None:
    from rlhflab.cliargs import count, number, seed

    parser.add_argument("--out", default="outputs/reviews", help="output folder")
    parser.add_argument("--prompts", type=count(), default=2000, help="training prompts (and demonstrations)")
    parser.add_argument("--labelled", type=count(2), default=4000, help="labelled sentences for the classifier")
    parser.add_argument("--positive-share", type=number(0.0, 1.0), default=0.3,
                        help="probability that a demonstration's first clause is positive")
    parser.add_argument("--seed", type=seed(), default=0)


def run(args: argparse.Namespace) -> int:
    out = write_reviews(args.out, n_prompts=args.prompts, n_labelled=args.labelled, seed=args.seed,
                        positive_share=args.positive_share)
    print(f"wrote review prompts, demonstrations and labelled sentences to {out}/")
    return 0
