"""Importance weights for a sampler that is not the trainer.

When another engine samples the responses (vLLM), its log-probs differ slightly from
the trainer's own for the same weights (other kernels, other rounding). PPO's "old"
policy is the trainer's teacher-forced log-probs, so the ratio is exactly 1 at the first
minibatch; the samples, though, came from the sampler's distribution μ, not from π_old.
Truncated importance sampling (TIS; Ionides, 2008; used for this mismatch by Yao et
al., 2025) weighs each token's loss by

    w_t = min(π_old(y_t) / μ(y_t), C) = min(exp(old_logprobs_t − sample_logprobs_t), C)

which corrects the expectation up to the cap C and bounds the variance.

Sequence-level masked importance sampling (TRL's default for vLLM samples, its
`vllm_importance_sampling_mode: sequence_mask` with C = 3) takes one ratio per response,
the product of its token ratios, and drops the whole response when that ratio is too
large:

    ρ_i = Π_t π_old(y_t) / μ(y_t) = exp(Σ_t (old_logprobs_t − sample_logprobs_t))
    w_t = ρ_i on every real token of response i if ρ_i ≤ C, else 0

A kept response is importance-weighted by ρ_i itself (not by 1); a masked one gives the
policy loss nothing, while its tokens still count in the loss's denominator.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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


class SequenceMaskWeights(NamedTuple):
    weights: Tensor  # (B, T) ρ_i on the real tokens of a kept response; 0 on a masked one and on padding
    ratio: Tensor    # (B,) ρ_i = exp(Σ_t (old − sample)) over real tokens (inf where the sum overflows)
    masked: Tensor   # (B,) bool: a response with a real token whose ρ_i left [floor, cap]


def sequence_mask_weights(old_logprobs: Tensor, sample_logprobs: Tensor, response_mask: Tensor,
                          cap: float, floor: float | None = None) -> SequenceMaskWeights:
    """Sequence-level masked importance weights (module docstring): ρ_i = exp(Σ_t (old −
    sample)) over response i's real tokens; w = ρ_i on those tokens when floor ≤ ρ_i ≤ cap,
    else 0 (padding 0). No gradient; float64 for float64 inputs. Padding never enters
    (its values are ignored, an inf included), and a response with no real token is never
    masked. `floor` None: no lower bound (TRL's default)."""
    if not (old_logprobs.shape == sample_logprobs.shape == response_mask.shape) or old_logprobs.dim() != 2:
        raise ValueError(f"sequence_mask_weights expects equal (B, T) shapes; got {tuple(old_logprobs.shape)}, "
                         f"{tuple(sample_logprobs.shape)}, {tuple(response_mask.shape)}")
    if cap <= 0 or (floor is not None and not 0 <= floor <= cap):
        raise ValueError(f"cap must be > 0 and floor in [0, cap]; got cap={cap}, floor={floor}")
    with torch.no_grad():
        dtype = work_dtype(old_logprobs, sample_logprobs)
        real = response_mask.bool()
        diff = old_logprobs.to(dtype) - sample_logprobs.to(dtype)                     # (B, T)
        log_ratio = torch.where(real, diff, torch.zeros_like(diff)).sum(-1)            # (B,)
        ratio = torch.exp(log_ratio)                                                   # (B,) ρ_i
        out = ratio > cap
        if floor is not None:
            out = out | (ratio < floor)
        masked = out & real.any(-1)
        kept = torch.where(masked, torch.zeros_like(ratio), ratio)                     # (B,) no inf survives
        weights = kept.unsqueeze(1) * real.to(dtype)                                   # (B, T)
        return SequenceMaskWeights(weights, ratio, masked)
