"""Aggregation of labels into preferences, and agreement statistics, worked by hand."""

import itertools
import random

import pytest

from rlhflab.label import agreement as ag


def test_score_and_direction_table():
    # a_level 1..5 -> +2 +1 0 -1 -2 (half-margin units, positive = A better)
    assert [ag.score(lv) for lv in range(1, 6)] == [2, 1, 0, -1, -2]
    assert [ag.direction(lv) for lv in range(1, 6)] == ["A", "A", "=", "B", "B"]
    with pytest.raises(ValueError):
        ag.score(6)


@pytest.mark.parametrize("levels, winner, margin", [
    ([1], "A", 1.0),            # one "A much better": |+2| / (2*1) = 1.0
    ([2], "A", 0.5),            # one "A slightly better": 1 / 2 = 0.5
    ([5], "B", 1.0),
    ([4], "B", 0.5),
    ([3], None, 0.0),           # about the same
    ([1, 4], "A", 0.25),        # +2 - 1 = +1 -> A, 1 / (2*2) = 0.25
    ([1, 5], None, 0.0),        # +2 - 2 = 0 -> tie (contested)
    ([2, 2, 5], None, 0.0),     # +1 +1 -2 = 0 -> tie
    ([4, 5, 3], "B", 0.5),      # -1 -2 + 0 = -3 -> B, 3 / 6 = 0.5
    ([1, 1, 2], "A", 5 / 6),    # 2 + 2 + 1 = 5, 5 / 6
])
def test_aggregate_by_hand(levels, winner, margin):
    pref = ag.aggregate(levels)
    assert pref.winner == winner
    assert pref.margin == pytest.approx(margin)
    assert pref.n_labels == len(levels)


def test_aggregate_is_order_free_and_symmetric():
    rng = random.Random(0)
    for _ in range(200):
        levels = [rng.randint(1, 5) for _ in range(rng.randint(1, 6))]
        shuffled = rng.sample(levels, len(levels))
        assert ag.aggregate(levels) == ag.aggregate(shuffled)
        # swapping A and B (level -> 6 - level) swaps the winner and keeps the margin
        mirrored = ag.aggregate([6 - lv for lv in levels])
        flip = {"A": "B", "B": "A", None: None}
        assert mirrored.winner == flip[ag.aggregate(levels).winner]
        assert mirrored.margin == ag.aggregate(levels).margin


def test_cohen_kappa_by_hand():
    x = ["A", "A", "B", "B"]
    y = ["A", "B", "B", "B"]
    # p_o = 3/4; p_e = P(A)P(A) + P(B)P(B) = .5*.25 + .5*.75 = .5; kappa = (.75-.5)/(1-.5) = .5
    assert ag.cohen_kappa(x, y) == pytest.approx(0.5)
    assert ag.cohen_kappa(x, x) == pytest.approx(1.0)
    # perfect disagreement on a balanced split: p_o = 0, p_e = .5 -> kappa = -1
    assert ag.cohen_kappa(["A", "B"], ["B", "A"]) == pytest.approx(-1.0)
    # one category only: chance agreement is 1, kappa undefined
    assert ag.cohen_kappa(["A", "A"], ["A", "A"]) is None


def test_fleiss_kappa_by_hand():
    items = [["A", "A", "A"], ["A", "A", "B"]]
    # P_1 = (9 - 3) / (3*2) = 1; P_2 = (4 + 1 - 3) / 6 = 1/3; P_bar = 2/3
    # p_A = 5/6, p_B = 1/6; P_e = 25/36 + 1/36 = 13/18
    # kappa = (2/3 - 13/18) / (1 - 13/18) = (-1/18) / (5/18) = -0.2
    assert ag.observed_agreement(items) == pytest.approx(2 / 3)
    assert ag.fleiss_kappa(items) == pytest.approx(-0.2)
    # items with a single rating are ignored; all-same is undefined
    assert ag.fleiss_kappa([["A"], ["A", "A"]]) is None
    assert ag.fleiss_kappa([["A"]]) is None
    assert ag.observed_agreement([["A"]]) is None


def test_observed_agreement_matches_a_plain_loop_over_rater_pairs():
    rng = random.Random(1)
    items = [[rng.choice("ABC") for _ in range(rng.randint(2, 5))] for _ in range(50)]
    shares = []
    for ratings in items:
        pairs = list(itertools.permutations(range(len(ratings)), 2))
        shares.append(sum(ratings[i] == ratings[j] for i, j in pairs) / len(pairs))
    assert ag.observed_agreement(items) == pytest.approx(sum(shares) / len(shares))


def test_fleiss_kappa_equal_raters_matches_textbook_formula():
    # With the same n for every item the varying-n form is Fleiss (1971):
    # kappa = (P_bar - P_e) / (1 - P_e) with P_i = (sum_j n_ij^2 - n) / (n (n - 1)).
    rng = random.Random(2)
    n, cats = 4, "ABC"
    items = [[rng.choice(cats) for _ in range(n)] for _ in range(30)]
    counts = [[r.count(c) for c in cats] for r in items]
    p_i = [(sum(v * v for v in row) - n) / (n * (n - 1)) for row in counts]
    p_j = [sum(row[j] for row in counts) / (n * len(items)) for j in range(len(cats))]
    p_bar, p_e = sum(p_i) / len(p_i), sum(p * p for p in p_j)
    assert ag.fleiss_kappa(items) == pytest.approx((p_bar - p_e) / (1 - p_e))


def test_pairwise_cohen_uses_only_shared_items():
    ratings = {
        1: {"ann": "A", "bob": "A", "cy": "B"},
        2: {"ann": "B", "bob": "A"},
        3: {"ann": "A", "cy": "A"},
    }
    by = {(p.annotator_1, p.annotator_2): p for p in ag.pairwise_cohen(ratings)}
    assert set(by) == {("ann", "bob"), ("ann", "cy"), ("bob", "cy")}
    assert by[("ann", "bob")].shared == 2 and by[("ann", "bob")].agreement == 0.5
    # ann/bob: x = [A, B], y = [A, A]; p_o = .5; p_e = .5*1 + .5*0 = .5 -> kappa 0
    assert by[("ann", "bob")].kappa == pytest.approx(0.0)
    assert by[("bob", "cy")].shared == 1 and by[("bob", "cy")].agreement == 0.0
