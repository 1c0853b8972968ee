"""Turning labels into preferences, and agreement between annotators. Pure functions.

A label's canonical level `a_level` (1 = A much better ... 5 = B much better) maps to a
signed score in half-margin units, positive when A is better:

    a_level   1    2    3    4    5
    score    +2   +1    0   -1   -2       margin of one label = |score| / 2 -> 1.0, 0.5, 0

Aggregation rule (several labels of one pair): sum the scores. A positive sum makes A
chosen, a negative sum B, zero is a tie. The margin is |sum| / (2 n): the mean signed
margin of the n labels, so one label gives 1.0 or 0.5 as in the export format, and
disagreement lowers it ("A much" + "B slightly" -> A chosen, margin (2 - 1) / 4 = 0.25).

Agreement is measured on two scales: the five levels as given, and the direction alone
(A better / about the same / B better). Fleiss' kappa uses the form for a varying number
of raters per item (each item's observed agreement P_i over its own n_i raters); with
the same n for every item it is Fleiss (1971) exactly.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Sequence


def score(a_level: int) -> int:
    """Signed score in half-margin units: +2 A much better ... -2 B much better."""
    if a_level not in (1, 2, 3, 4, 5):
        raise ValueError(f"level must be 1..5, got {a_level!r}")
    return 3 - a_level


def direction(a_level: int) -> str:
    """'A', '=' or 'B': which response was judged better, ignoring strength."""
    s = score(a_level)
    return "A" if s > 0 else "B" if s < 0 else "="


@dataclass(frozen=True)
class Preference:
    """The aggregate of a pair's labels. `winner` is 'A', 'B' or None for a tie."""

    winner: str | None
    margin: float
    n_labels: int


def aggregate(a_levels: Sequence[int]) -> Preference:
    """Sum the signed scores; the sign picks the winner, |sum| / (2 n) is the margin."""
    if not a_levels:
        raise ValueError("aggregate needs at least one label")
    total = sum(score(lv) for lv in a_levels)  # integer, so a tie is exactly 0
    winner = "A" if total > 0 else "B" if total < 0 else None
    return Preference(winner, abs(total) / (2 * len(a_levels)), len(a_levels))


def observed_agreement(items: Sequence[Sequence[Hashable]]) -> float | None:
    """Mean over items (with >= 2 ratings) of the share of rater pairs that agree."""
    shares = []
    for ratings in items:
        n = len(ratings)
        if n < 2:
            continue
        agree = sum(c * (c - 1) for c in Counter(ratings).values())
        shares.append(agree / (n * (n - 1)))
    return sum(shares) / len(shares) if shares else None


def fleiss_kappa(items: Sequence[Sequence[Hashable]]) -> float | None:
    """Fleiss' kappa over items with >= 2 ratings; None when undefined (no such item, or
    every rating in one category so chance agreement is 1)."""
    items = [list(r) for r in items if len(r) >= 2]
    if not items:
        return None
    p_bar = observed_agreement(items)
    totals: Counter = Counter()
    for ratings in items:
        totals.update(ratings)
    n_all = sum(totals.values())
    p_e = sum((c / n_all) ** 2 for c in totals.values())
    if p_e >= 1.0:
        return None
    return (p_bar - p_e) / (1.0 - p_e)


def cohen_kappa(x: Sequence[Hashable], y: Sequence[Hashable]) -> float | None:
    """Cohen's kappa of two raters on the same items; None when chance agreement is 1."""
    if len(x) != len(y):
        raise ValueError(f"cohen_kappa needs equal lengths, got {len(x)} and {len(y)}")
    n = len(x)
    if n == 0:
        return None
    p_o = sum(a == b for a, b in zip(x, y, strict=True)) / n
    cx, cy = Counter(x), Counter(y)
    p_e = sum(cx[k] * cy[k] for k in cx) / (n * n)
    if p_e >= 1.0:
        return None
    return (p_o - p_e) / (1.0 - p_e)


@dataclass(frozen=True)
class PairwiseKappa:
    """Cohen's kappa of two annotators over the pairs both labelled."""

    annotator_1: str
    annotator_2: str
    shared: int
    kappa: float | None
    agreement: float


def pairwise_cohen(ratings: dict[Hashable, dict[str, Hashable]]) -> list[PairwiseKappa]:
    """Cohen's kappa for every two annotators sharing at least one item.

    `ratings` maps item -> {annotator: category}.
    """
    annotators = sorted({a for by in ratings.values() for a in by})
    out = []
    for a1, a2 in itertools.combinations(annotators, 2):
        common = [by for by in ratings.values() if a1 in by and a2 in by]
        if not common:
            continue
        x = [by[a1] for by in common]
        y = [by[a2] for by in common]
        agreement = sum(u == v for u, v in zip(x, y, strict=True)) / len(common)
        out.append(PairwiseKappa(a1, a2, len(common), cohen_kappa(x, y), agreement))
    return out
