"""The pieces of a natural-gradient (TRPO) step: the exact KL between two categorical
distributions, and conjugate gradient for F·x = g without forming F.

TRPO (Schulman et al., 2015) maximises the surrogate L(θ) = E[π_θ/π_old · A] subject to
mean KL(π_old‖π_θ) ≤ δ. To second order the KL is ½ Δθᵀ F Δθ, with F the Fisher matrix
(the Hessian of the KL at θ_old), and the best step is along F⁻¹g. F has one row per
parameter, so it is never built: conjugate gradient needs only products F·v, which are
a second backward pass through ∇KL·v ("Fisher-vector products").
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor


def categorical_kl(old_logprobs: Tensor, new_logprobs: Tensor) -> Tensor:
    """KL(old‖new) = Σ_v p_old(v)·(log p_old(v) − log p_new(v)) per position, from full
    log-distributions (…, V) -> (…). Exact over the vocabulary, not a sampled estimate."""
    if old_logprobs.shape != new_logprobs.shape:
        raise ValueError(f"old {tuple(old_logprobs.shape)} != new {tuple(new_logprobs.shape)}")
    dtype = torch.promote_types(torch.promote_types(old_logprobs.dtype, new_logprobs.dtype), torch.float32)
    old = old_logprobs.to(dtype)
    return (old.exp() * (old - new_logprobs.to(dtype))).sum(-1)


class CGResult(NamedTuple):
    x: Tensor              # the approximate solution of A·x = b
    iterations: int
    residual_norm: float   # ‖b − A·x‖ at the end


def conjugate_gradient(matvec: Callable[[Tensor], Tensor], b: Tensor, iterations: int = 10,
                       residual_tol: float = 1e-10) -> CGResult:
    """Solve A·x = b for a symmetric positive-definite A known only through `matvec`.

    Starts at x = 0; in exact arithmetic it is exact after n iterations for an n×n A.
    Worked example: A = [[4, 1], [1, 3]], b = [1, 2] -> x = [1/11, 7/11] in 2 iterations.
    """
    x = torch.zeros_like(b)
    r = b.clone()                 # residual b − A·x
    p = r.clone()                 # search direction
    rr = torch.dot(r, r)
    done = 0
    for i in range(iterations):
        if float(rr) <= residual_tol:
            break
        ap = matvec(p)
        alpha = rr / torch.dot(p, ap)
        x = x + alpha * p
        r = r - alpha * ap
        rr_new = torch.dot(r, r)
        p = r + (rr_new / rr) * p
        rr = rr_new
        done = i + 1
    return CGResult(x, done, float(rr.sqrt()))
