"""Masked statistics over response tokens.

`mask` is 1 (True) where a value counts. An all-false mask gives 0, never NaN.

Variance and whitening centre the values on a pivot first: the largest kept value
(`masked_pivot`), one of the values themselves. The statistics of x − pivot are the
statistics of x (shift invariance), and a constant tensor becomes exactly 0 before any
sum is taken, so its variance is exactly 0 and its whitened values are exactly 0. The
plain form, mean = Σx / n, is off by an ulp or so for most constant tensors (the float32
sum of eight 0.7s is not 8 × 0.7), and dividing that ulp by sqrt(0 + eps) turned it
into a whitened value of about 6e-4 with one sign for every token. The same pivot is a
max over every process's tokens under several processes (`engine.dist.batch_moments`),
so one and several processes compute the same statistic.
"""

from __future__ import annotations

import torch
from torch import Tensor


def work_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the ops compute and return in: float64 when an input is float64, else
    float32 (half precision, integers and bools are promoted)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


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


def masked_pivot(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """The largest kept value (over all elements or along `dim`), detached; 0 where
    nothing is kept. The shift the variance and whitening subtract first."""
    keep = _check(x, mask).bool()
    with torch.no_grad():
        low = torch.finfo(x.dtype).min if x.dtype.is_floating_point else torch.iinfo(x.dtype).min
        filled = torch.where(keep, x, torch.full_like(x, low))
        top = filled.amax() if dim is None else filled.amax(dim=dim)
        anything = keep.any() if dim is None else keep.any(dim=dim)
        return torch.where(anything, top, torch.zeros_like(top))


def _centred(x: Tensor, mask: Tensor, dim: int | None) -> tuple[Tensor, Tensor]:
    """(x − pivot, pivot), the pivot broadcastable against x."""
    pivot = masked_pivot(x, mask, dim)
    if dim is not None:
        pivot = pivot.unsqueeze(dim)
    return x - pivot, pivot


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = False, dim: int | None = None) -> Tensor:
    """Variance of `x` where `mask` is 1 (population by default; `unbiased` uses n - 1).

    Exactly 0 for a constant tensor (see the module docstring)."""
    m = _check(x, mask)
    d, _ = _centred(x, mask, dim)
    mean = masked_mean(d, mask, dim)
    if dim is not None:
        mean = mean.unsqueeze(dim)
    sq = (d - mean) ** 2 * m
    total = sq.sum() if dim is None else sq.sum(dim=dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    denom = (count - 1) if unbiased else count
    return total / denom.clamp(min=1.0)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, dim: int | None = None,
                  eps: float = 1e-8, mean: Tensor | float | None = None,
                  var: Tensor | float | None = None, unbiased: bool = False) -> Tensor:
    """(x - mean) / sqrt(var + eps) over masked elements; masked-out positions come back as 0.

    With `shift_mean=False` only the scale changes (the mean is added back), which is
    how per-token rewards are normalised without moving their sign. `mean` and `var`,
    when given, replace the statistics of `x` (e.g. those of every process's tokens).
    `unbiased=True` divides the variance by n − 1 instead of n (verl's and TRL's
    whitening; docs/conventions.md). A constant tensor whitens to exactly 0.
    """
    if (mean is None) != (var is None):
        raise ValueError("give both mean and var, or neither")
    m = _check(x, mask)
    if mean is None:
        d, pivot = _centred(x, mask, dim)
        mean_d = masked_mean(d, mask, dim)
        var = masked_var(d, mask, unbiased=unbiased, dim=dim)
        if dim is not None:
            mean_d, var = mean_d.unsqueeze(dim), var.unsqueeze(dim)
        centred = d - mean_d                       # exactly 0 for a constant x
        mean = pivot + mean_d
    else:
        mean, var = torch.as_tensor(mean, dtype=x.dtype), torch.as_tensor(var, dtype=x.dtype)
        centred = x - mean
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m
