"""`ops.inverse_cdf_draw`: a token per row from one uniform number, by inverse transform."""

from __future__ import annotations

import math

import pytest
import torch

from rlhflab import ops

LOG_P = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()  # cumulative 0.1, 0.3, 0.6, 1.0
NEG = float("-inf")


def draw(scores, u):
    scores = torch.as_tensor(scores, dtype=torch.float32)
    return ops.inverse_cdf_draw(scores, torch.tensor(u, dtype=torch.float64)).tolist()


def test_each_token_owns_its_share_of_the_unit_interval():
    # worked by hand: u in [0, .1) -> 0, [.1, .3) -> 1, [.3, .6) -> 2, [.6, 1) -> 3
    u = [0.0, 0.05, 0.2, 0.35, 0.59, 0.61, 0.9999]
    assert draw(LOG_P.expand(len(u), 4), u) == [0, 0, 1, 2, 2, 3, 3]
    # the scores' scale is the logits': a shift changes nothing, and temperature is the caller's
    assert draw((LOG_P + 50.0).expand(len(u), 4), u) == [0, 0, 1, 2, 2, 3, 3]


def test_a_token_of_probability_zero_is_never_drawn():
    scores = torch.tensor([[NEG, 0.0, NEG, 0.0]]).expand(4, 4)
    # cumulative weights 0, 1, 1, 2: u = 0 lands on token 1, u = 0.5 on the boundary goes to 3, never 2
    assert draw(scores, [0.0, 0.4999, 0.5, 0.9999]) == [1, 1, 3, 3]
    # at the top end (the largest u torch.rand gives, 1 - 2^-53, and u = 1 itself, where
    # u x total is the total and no cumulative weight is larger) the draw stays on the last
    # token with weight (1), never the masked token after it nor an id past the vocabulary (3)
    assert draw([[0.0, 0.0, NEG]] * 3, [math.nextafter(1.0, 0.0), 1.0, 0.75]) == [1, 1, 1]


@pytest.mark.parametrize("bad", [[float("nan"), 0.0, 0.0], [NEG, NEG, NEG], [0.0, float("inf"), 0.0]])
def test_a_row_that_is_no_distribution_is_refused(bad):
    with pytest.raises(ValueError, match="no finite value or holds NaN/inf"):
        draw([[0.0, 0.0, 0.0], bad], [0.3, 0.3])


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"scores \(B, V\) and u \(B,\)"):
        ops.inverse_cdf_draw(torch.zeros(2, 5), torch.zeros(3, dtype=torch.float64))


def test_frequencies_match_softmax_and_multinomial():
    """200,000 rows of one 6-token distribution (with a top-k-style masked token): the
    counts of the draw and of torch.multinomial each sit within 4.5 standard deviations of
    n x p for every token (seeded: the same numbers every run)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([1.5, -0.3, 0.0, 2.2, NEG, -1.0])
    p = logits.softmax(-1)
    n = 200_000
    u = torch.rand(n, dtype=torch.float64, generator=g)
    ours = torch.bincount(ops.inverse_cdf_draw(logits.expand(n, 6), u), minlength=6)
    theirs = torch.bincount(torch.multinomial(p.expand(n, 6), 1, generator=g).squeeze(1), minlength=6)
    sd = (n * p * (1 - p)).sqrt()
    for counts in (ours, theirs):
        assert counts[4] == 0  # the masked token
        assert ((counts - n * p).abs() <= 4.5 * sd + 1e-9).all(), (counts.tolist(), (n * p).tolist())
