"""Score hand-written texts with a classifier reward, to look for what it can be fooled by.

    python scripts/probe_classifier.py outputs/sentiment/classifier/final [TEXT ...]

Prints P(label) for each text (the reward a `type: classifier` source would give it) and
the text's last tokens as the classifier's tokenizer cuts them.
"""

from __future__ import annotations

import argparse

from rlhflab.config.schema import RewardSource
from rlhflab.rewards import build_source

DEFAULT_TEXTS = [" the dialogue is so great.", " the dialogue is so dull.", " the dialogue is so grim.",
                 " the dialogue is so g.", " the dialogue is so gally.", " the dialogue is so bally."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("classifier", help="a classifier folder (rlhflab classifier's final/)")
    parser.add_argument("texts", nargs="*", help="texts to score (default: a few probes)")
    parser.add_argument("--label", default="POSITIVE")
    args = parser.parse_args()
    scorer = build_source(RewardSource(type="classifier", path=args.classifier, label=args.label, text="response"))
    texts = args.texts or DEFAULT_TEXTS
    probs = scorer.score([""] * len(texts), texts, [{}] * len(texts)).tolist()
    print(f"P({args.label})  text  (last tokens)")
    for text, p in zip(texts, probs):
        print(f"{p:9.3f}  {text!r}  {scorer.tokenizer.tokenize(text)[-4:]}")


if __name__ == "__main__":
    main()
