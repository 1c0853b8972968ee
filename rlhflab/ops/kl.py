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

KL_KINDS = ("k1", "k2", "k3", "abs", "mse")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k1") -> Tensor:
    """Per-token KL(π‖π_ref) estimate. logprobs, ref_logprobs: (B, T) -> (B, T)."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} != ref_logprobs {tuple(ref_logprobs.shape)}")
    d = logprobs.float() - ref_logprobs.float()
    if kind == "k1":
        return d
    if kind in ("k2", "mse"):
        return 0.5 * d.square()
    if kind == "abs":
        return d.abs()
    if kind == "k3":
        # log r = -d; clamp keeps exp finite when the two models disagree wildly.
        log_r = (-d).clamp(min=-20.0, max=20.0)
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_KINDS)}")


def last_token_index(response_mask: Tensor) -> Tensor:
    """Index of the last real response token of each row: (B, T) -> (B,) long.

    Rows with no response token give 0 (the caller masks them out).
    """
    t = response_mask.shape[-1]
    pos = torch.arange(t, device=response_mask.device).expand_as(response_mask)
    return torch.where(response_mask.bool(), pos, torch.zeros_like(pos)).amax(dim=-1)


def kl_shaped_rewards(scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor,
                      response_mask: Tensor, kl_coeff: float, kind: str = "k1",
                      score_clip: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-token rewards: −kl_coeff·KL on every response token, plus the sequence score
    at the last real response token.

    scores: (B,); logprobs, ref_logprobs, response_mask: (B, T).
    Returns (rewards, kl), both (B, T) and 0 on padding; `kl` is the per-token estimate.
    """
    if scores.dim() != 1 or scores.shape[0] != logprobs.shape[0]:
        raise ValueError(f"scores must be (B,) = ({logprobs.shape[0]},), got {tuple(scores.shape)}")
    if response_mask.shape != logprobs.shape:  # a (B, 1) or (T,) mask would broadcast silently
        raise ValueError(f"response_mask {tuple(response_mask.shape)} != logprobs {tuple(logprobs.shape)}")
    mask = response_mask.float()
    kl = kl_estimate(logprobs, ref_logprobs, kind) * mask  # (B, T)
    rewards = -kl_coeff * kl
    scores = scores.float()
    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    last = last_token_index(response_mask)  # (B,)
    has_tokens = mask.sum(-1) > 0
    bonus = torch.zeros_like(rewards)
    bonus.scatter_(1, last.unsqueeze(1), (scores * has_tokens).unsqueeze(1))
    return rewards + bonus, kl
