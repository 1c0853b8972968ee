"""Importance weights for a sampler that is not the trainer.

When another engine samples the responses (vLLM), its log-probs differ slightly from
the trainer's own for the same weights (other kernels, other rounding). PPO's "old"
policy is the trainer's teacher-forced log-probs, so the ratio is exactly 1 at the first
minibatch; the samples, though, came from the sampler's distribution μ, not from π_old.
Truncated importance sampling (TIS; Ionides, 2008; used for this mismatch by Yao et
al., 2025) weighs each token's loss by

    w_t = min(π_old(y_t) / μ(y_t), C) = min(exp(old_logprobs_t − sample_logprobs_t), C)

which corrects the expectation up to the cap C and bounds the variance.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlhflab.ops.stats import masked_mean, work_dtype


def truncated_is_weights(old_logprobs: Tensor, sample_logprobs: Tensor, response_mask: Tensor,
                         cap: float) -> Tensor:
    """w = min(exp(old − sample), cap) on real tokens, 0 on padding; (B, T), no gradient,
    float64 for float64 inputs. The log-ratio is capped at log(cap) before the exp, so a
    wild one gives the cap, not exp's overflow."""
    if not (old_logprobs.shape == sample_logprobs.shape == response_mask.shape):
        raise ValueError(f"truncated_is_weights expects equal (B, T) shapes; got {tuple(old_logprobs.shape)}, "
                         f"{tuple(sample_logprobs.shape)}, {tuple(response_mask.shape)}")
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    with torch.no_grad():
        dtype = work_dtype(old_logprobs, sample_logprobs)
        log_w = (old_logprobs.to(dtype) - sample_logprobs.to(dtype)).clamp(max=math.log(cap))
        w = torch.exp(log_w).clamp(max=cap)   # exp(log cap) can round one ulp above cap
        return w * response_mask.to(dtype)


def logprob_gap(logprobs: Tensor, sample_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """mean |logprobs − sample_logprobs| over real response tokens: how far the sampler's
    log-probs are from the trainer's (`rollout/logprob_gap`)."""
    dtype = work_dtype(logprobs, sample_logprobs)
    return masked_mean((logprobs.to(dtype) - sample_logprobs.to(dtype)).abs(), response_mask)
