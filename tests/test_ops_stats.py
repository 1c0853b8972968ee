"""Masked statistics: hand-worked values, loop parity for whitening, empty masks, shapes."""

import math

import pytest
import torch

from rlhflab.ops import explained_variance, masked_mean, masked_sum, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
MASK = torch.tensor([[1, 0], [1, 1]])


def test_masked_mean_hand_worked():
    # kept: 1, 3, 4 -> (1 + 3 + 4) / 3 = 8/3
    assert masked_mean(X, MASK).item() == pytest.approx(8 / 3)
    # a bool mask means the same as a 0/1 mask
    assert masked_mean(X, MASK.bool()).item() == pytest.approx(8 / 3)
    assert masked_sum(X, MASK).item() == 8.0


def test_masked_mean_per_dim():
    # Partial mask [[1, 0], [1, 1]]:
    #   dim 0 (per column): col 0 -> (1 + 3) / 2 = 2; col 1 -> 4 / 1 = 4
    #   dim 1 (per row):    row 0 -> 1 / 1 = 1;       row 1 -> (3 + 4) / 2 = 3.5
    torch.testing.assert_close(masked_mean(X, MASK, dim=0), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(masked_mean(X, MASK, dim=1), torch.tensor([1.0, 3.5]))
    # Full mask: dim 0 -> [(1+3)/2, (2+4)/2] = [2, 3]; dim 1 -> [(1+2)/2, (3+4)/2] = [1.5, 3.5]
    full = torch.ones_like(MASK)
    torch.testing.assert_close(masked_mean(X, full, dim=0), torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(masked_mean(X, full, dim=1), torch.tensor([1.5, 3.5]))


def test_masked_var_hand_worked():
    # kept 1, 3, 4; mean 8/3; squared deviations (25 + 1 + 16) / 9 = 42/9
    # population: 42/9 / 3 = 14/9; unbiased: 42/9 / 2 = 7/3
    assert masked_var(X, MASK).item() == pytest.approx(14 / 9)
    assert masked_var(X, MASK, unbiased=True).item() == pytest.approx(7 / 3)


def test_masked_whiten_hand_worked():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # kept 1, 2, 4, 5, 6: mean 18/5 = 3.6
    # deviations -2.6, -1.6, 0.4, 1.4, 2.4; squares 6.76 + 2.56 + 0.16 + 1.96 + 5.76 = 17.2
    # population variance 17.2 / 5 = 3.44
    mean, var = 3.6, 3.44
    expected = torch.tensor([[(1 - mean), (2 - mean), 0.0], [(4 - mean), (5 - mean), (6 - mean)]])
    expected = expected / math.sqrt(var + 1e-8) * mask
    out = masked_whiten(x, mask)
    torch.testing.assert_close(out, expected)
    assert out[0, 2].item() == 0.0  # the masked-out 3 comes back as 0
    # the kept elements now have mean 0 and (population) variance 1
    assert masked_mean(out, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(out, mask).item() == pytest.approx(1.0, abs=1e-6)
    # shift_mean=False only scales: (x - 3.6)/std + 3.6 on kept elements, still 0 when masked
    kept = masked_whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(kept, (expected + mean) * mask)


def _whiten_loop(x, mask, eps=1e-8):
    kept = [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    mean = sum(kept) / len(kept)
    var = sum((v - mean) ** 2 for v in kept) / len(kept)
    out = [[(v - mean) / math.sqrt(var + eps) if m else 0.0 for v, m in zip(row, mrow)]
           for row, mrow in zip(x.tolist(), mask.tolist())]
    return torch.tensor(out, dtype=torch.float64)


def test_masked_whiten_matches_loop():
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randn(4, 7, generator=g, dtype=torch.float64) * 3 + 1
        lengths = torch.randint(1, 8, (4,), generator=g)
        mask = (torch.arange(7) < lengths[:, None]).long()                     # (B, T) right-padded
        torch.testing.assert_close(masked_whiten(x, mask), _whiten_loop(x, mask))


def test_masked_whiten_per_dim_whitens_each_row():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])
    out = masked_whiten(x, mask, dim=1)
    for i in range(3):
        torch.testing.assert_close(out[i:i + 1], _whiten_loop(x[i:i + 1], mask[i:i + 1]))


def test_padding_values_do_not_matter():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    garbage = torch.where(mask.bool(), x, torch.full_like(x, 1e4))
    for fn in (masked_mean, masked_var, masked_sum):
        torch.testing.assert_close(fn(garbage, mask), fn(x, mask))
    torch.testing.assert_close(masked_whiten(garbage, mask), masked_whiten(x, mask))


def test_all_false_mask_gives_zero_not_nan():
    x = torch.randn(2, 3)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for value in (masked_mean(x, empty), masked_var(x, empty), masked_var(x, empty, unbiased=True),
                  masked_sum(x, empty)):
        assert value.item() == 0.0
    assert torch.equal(masked_whiten(x, empty), torch.zeros(2, 3))
    # one row empty, per-row mean: that row is 0, the other is its mean
    mask = torch.tensor([[0, 0, 0], [1, 1, 0]])
    per_row = masked_mean(x, mask, dim=1)
    assert per_row[0].item() == 0.0
    assert per_row[1].item() == pytest.approx((x[1, 0] + x[1, 1]).item() / 2)


@pytest.mark.parametrize("fn", [masked_mean, masked_var, masked_sum, masked_whiten])
def test_shape_mismatch_raises(fn):
    with pytest.raises(ValueError, match="shape"):
        fn(torch.zeros(2, 3), torch.ones(2, 1))  # (B, 1) must not broadcast silently


# ------------------------------------------------------------------ explained_variance

def test_explained_variance_hand_worked():
    returns = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 9.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.5, 7.0], [0.0, 0.5, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # the 0s/9s in the last column are padding
    # kept returns 1, 1, 0, 0: mean 0.5, squared deviations 4 × 0.25, Var = 1/4
    # kept residuals returns − values: 0.5, 0.5, 0, −0.5: mean 1/8;
    #   deviations 3/8, 3/8, −1/8, −5/8; squares (9 + 9 + 1 + 25)/64 = 44/64; Var = 11/64
    # 1 − (11/64)/(1/4) = 1 − 11/16 = 5/16
    assert explained_variance(values, returns, mask).item() == pytest.approx(5 / 16, abs=1e-12)
    # a perfect critic explains everything; a constant offset changes nothing (the variance
    # of the error, not its mean square); a constant critic explains nothing
    assert explained_variance(returns, returns, mask).item() == 1.0
    assert explained_variance(returns + 3.0, returns, mask).item() == pytest.approx(1.0, abs=1e-12)
    assert explained_variance(torch.full_like(returns, 0.3), returns, mask).item() == pytest.approx(0.0, abs=1e-12)
    assert explained_variance(torch.zeros_like(returns), returns, mask).item() == 0.0  # the zero head: exactly 0
    # values that point the wrong way (−1, −1, 0, 0 where the returns are 1, 1, 0, 0):
    # residuals 2, 2, 0, 0, mean 1, Var = 1; 1 − 1/(1/4) = −3, worse than any constant
    wrong = torch.tensor([[-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert explained_variance(wrong, returns, mask).item() == pytest.approx(-3.0, abs=1e-12)


def test_explained_variance_matches_loop_and_ignores_padding():
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        returns = torch.randn(4, 6, generator=g, dtype=torch.float64)
        values = returns * 0.5 + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
        lengths = torch.randint(1, 7, (4,), generator=g)
        mask = (torch.arange(6) < lengths[:, None]).long()                     # (B, T) right-padded
        r = [x for x, m in zip(returns.flatten().tolist(), mask.flatten().tolist()) if m]
        e = [x - v for x, v, m in zip(returns.flatten().tolist(), values.flatten().tolist(),
                                      mask.flatten().tolist()) if m]
        var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)  # noqa: E731
        want = 1 - var(e) / var(r)
        assert explained_variance(values, returns, mask).item() == pytest.approx(want, abs=1e-12)
        garbage = torch.where(mask.bool(), values, torch.full_like(values, 1e4))
        assert explained_variance(garbage, returns, mask).item() == pytest.approx(want, abs=1e-12)


def test_explained_variance_undefined_and_given_variances():
    returns = torch.full((2, 3), 0.7)
    mask = torch.ones(2, 3)
    # returns that do not vary leave nothing to explain: NaN, as is an empty mask
    assert math.isnan(explained_variance(torch.randn(2, 3), returns, mask).item())
    assert math.isnan(explained_variance(torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3)).item())
    # the variances of every process's tokens, passed in: 1 − 0.25/2 = 0.875
    got = explained_variance(torch.zeros(2, 3), returns, mask, var_returns=2.0, var_residual=0.25)
    assert got.item() == 0.875
    with pytest.raises(ValueError, match="both"):
        explained_variance(torch.zeros(2, 3), returns, mask, var_returns=2.0)
    with pytest.raises(ValueError, match="shape"):
        explained_variance(torch.zeros(2, 1), returns, mask)  # (B, 1) must not broadcast silently
