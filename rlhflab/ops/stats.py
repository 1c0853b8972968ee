"""Masked statistics over response tokens.

`mask` is 1 (True) where a value counts. An all-false mask gives 0, never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check(x: Tensor, mask: Tensor) -> Tensor:
    if x.shape != mask.shape:
        raise ValueError(f"values shape {tuple(x.shape)} != mask shape {tuple(mask.shape)}")
    return mask.to(x.dtype)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` where `mask` is 1, over all elements or along `dim`."""
    m = _check(x, mask)
    return (x * m).sum() if dim is None else (x * m).sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` where `mask` is 1; 0 where nothing is kept.

    Example: x = [[1, 2], [3, 4]], mask = [[1, 0], [1, 1]] -> (1 + 3 + 4) / 3 = 8/3.
    """
    m = _check(x, mask)
    total = (x * m).sum() if dim is None else (x * m).sum(dim=dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = False, dim: int | None = None) -> Tensor:
    """Variance of `x` where `mask` is 1 (population by default; `unbiased` uses n - 1)."""
    m = _check(x, mask)
    mean = masked_mean(x, mask, dim)
    if dim is not None:
        mean = mean.unsqueeze(dim)
    sq = (x - mean) ** 2 * m
    total = sq.sum() if dim is None else sq.sum(dim=dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    denom = (count - 1) if unbiased else count
    return total / denom.clamp(min=1.0)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, dim: int | None = None,
                  eps: float = 1e-8, mean: Tensor | float | None = None,
                  var: Tensor | float | None = None) -> Tensor:
    """(x - mean) / std over masked elements; masked-out positions come back as 0.

    With `shift_mean=False` only the scale changes (the mean is added back), which is
    how per-token rewards are normalised without moving their sign. `mean` and `var`,
    when given, replace the statistics of `x` (e.g. those of every process's tokens).
    """
    if (mean is None) != (var is None):
        raise ValueError("give both mean and var, or neither")
    if mean is None:
        mean = masked_mean(x, mask, dim)
        var = masked_var(x, mask, dim=dim)
        if dim is not None:
            mean, var = mean.unsqueeze(dim), var.unsqueeze(dim)
    mean, var = torch.as_tensor(mean, dtype=x.dtype), torch.as_tensor(var, dtype=x.dtype)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * _check(x, mask)
