"""Per-token KL estimators and KL-shaped rewards.

The tokens were sampled from the policy π, so with d = logπ(x) − logπ_ref(x):

- k1  = d                      unbiased for KL(π‖π_ref), can be negative, high variance
- k2  = d² / 2  (alias mse)    biased, never negative, low variance
- k3  = (r − 1) − log r,  r = π_ref/π = exp(−d)
                               unbiased and never negative (Schulman, "Approximating KL
                               divergence", 2020). r is the reference over the policy;
                               the inverted ratio (π/π_ref) is a known bug in the wild.
- abs = |d|
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhflab.ops.stats import work_dtype

KL_KINDS = ("k1", "k2", "k3", "abs", "mse")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k1",
                clamp: float | None = None) -> Tensor:
    """Per-token KL(π‖π_ref) estimate. logprobs, ref_logprobs: (B, T) -> (B, T), float64
    for float64 inputs, else float32.

    k3's log r is clamped to ±20 so that exp stays finite when the two models disagree
    wildly (e^20 ≈ 4.9e8; a token there is an outlier either way). `clamp`, when given,
    bounds the estimate itself to [−clamp, clamp], as verl and OpenRLHF do with 10
    (docs/conventions.md); rlhflab's default leaves it unbounded.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} != ref_logprobs {tuple(ref_logprobs.shape)}")
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be > 0 or None, got {clamp}")
    dtype = work_dtype(logprobs, ref_logprobs)
    d = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if kind == "k1":
        out = d
    elif kind in ("k2", "mse"):
        out = 0.5 * d.square()
    elif kind == "abs":
        out = d.abs()
    elif kind == "k3":
        # log r = -d; clamp keeps exp finite when the two models disagree wildly.
        log_r = (-d).clamp(min=-20.0, max=20.0)
        out = torch.expm1(log_r) - log_r
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_KINDS)}")
    return out if clamp is None else out.clamp(-clamp, clamp)


def last_token_index(response_mask: Tensor) -> Tensor:
    """Index of the last real response token of each row: (B, T) -> (B,) long.

    Rows with no response token give 0 (the caller masks them out).
    """
    t = response_mask.shape[-1]
    pos = torch.arange(t, device=response_mask.device).expand_as(response_mask)
    return torch.where(response_mask.bool(), pos, torch.zeros_like(pos)).amax(dim=-1)


def kl_shaped_rewards(scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor,
                      response_mask: Tensor, kl_coeff: float, kind: str = "k1",
                      score_clip: float | None = None, kl_clamp: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-token rewards: −kl_coeff·KL on every response token, plus the sequence score
    at the last real response token.

    scores: (B,); logprobs, ref_logprobs, response_mask: (B, T).
    Returns (rewards, kl), both (B, T) and 0 on padding; `kl` is the per-token estimate
    (bounded to ±`kl_clamp` when given, see `kl_estimate`). float64 for float64 inputs.
    """
    if scores.dim() != 1 or scores.shape[0] != logprobs.shape[0]:
        raise ValueError(f"scores must be (B,) = ({logprobs.shape[0]},), got {tuple(scores.shape)}")
    if response_mask.shape != logprobs.shape:  # a (B, 1) or (T,) mask would broadcast silently
        raise ValueError(f"response_mask {tuple(response_mask.shape)} != logprobs {tuple(logprobs.shape)}")
    dtype = work_dtype(scores, logprobs, ref_logprobs)
    mask = response_mask.to(dtype)
    kl = kl_estimate(logprobs, ref_logprobs, kind, clamp=kl_clamp).to(dtype) * mask  # (B, T)
    rewards = -kl_coeff * kl
    scores = scores.to(dtype)
    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    last = last_token_index(response_mask)  # (B,)
    has_tokens = mask.sum(-1) > 0
    bonus = torch.zeros_like(rewards)
    bonus.scatter_(1, last.unsqueeze(1), (scores * has_tokens).unsqueeze(1))
    return rewards + bonus, kl
