"""Masked statistics over response tokens.

`mask` is 1 (True) where a value counts. An all-false mask gives 0, never NaN (one
exception: `explained_variance` is NaN where the returns do not vary, as a ratio of
nothing to nothing has no value).

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


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor, var_returns: Tensor | float | None = None,
                       var_residual: Tensor | float | None = None) -> Tensor:
    """How much of the returns' variance the critic's values explain, over the tokens where
    `mask` is 1: 1 − Var(returns − values) / Var(returns), a 0-dim tensor.

    values, returns, mask: (B, T). Scale-free, so it can be compared across rewards and
    across a run whose reward variance changes (a 0/1 reward with success rate p has
    variance p(1 − p), so even a good critic's squared error moves with p):
    1 is a perfect critic; 0 a critic no better than a constant (the zero head at the
    start, or one that tracks only the batch's mean return); below 0 values that add
    noise. A constant offset does not count (the variance of the error, not its mean
    square), so a critic that is right but late by the same amount everywhere still scores
    high; its value loss shows the offset. Population variances (n), as `masked_var`.

    `var_returns` and `var_residual`, when given together, replace the two variances (those
    of every process's tokens, `rlhflab.engine.dist.explained_variance`). NaN when the
    returns do not vary (Var(returns) = 0, or no token kept): there is nothing to explain;
    a caller that logs it skips it then.
    """
    if values.shape != returns.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != returns shape {tuple(returns.shape)}")
    if (var_returns is None) != (var_residual is None):
        raise ValueError("give both var_returns and var_residual, or neither")
    dtype = work_dtype(values, returns)
    if var_returns is None:
        v, r = values.to(dtype), returns.to(dtype)
        var_returns = masked_var(r, mask)
        var_residual = masked_var(r - v, mask)
    var_returns = torch.as_tensor(var_returns, dtype=dtype)
    var_residual = torch.as_tensor(var_residual, dtype=dtype)
    undefined = var_returns <= 0
    ratio = var_residual / torch.where(undefined, torch.ones_like(var_returns), var_returns)
    return torch.where(undefined, torch.full_like(ratio, float("nan")), 1.0 - ratio)
