"""The rollout/trainer mismatch: the logged gap and truncated importance-sampling weights.

With a separate sampler (vLLM) the tokens come from q, the sampler's distribution, while
PPO's `old_logprobs` come from the trainer's teacher-forced pass, π_old. Both are "the
same policy", but other kernels (and, with top-k/top-p, a truncated q) make them differ
a little. Per response token t, with Δ_t = old_logprobs_t − sample_logprobs_t:

    gap   = mean over response tokens of |Δ_t|         (logged as rollout/logprob_gap)
    w_t   = min(exp(Δ_t), cap) = min(π_old(a_t) / q(a_t), cap)

w_t is the importance weight that turns an expectation under q into one under π_old,
truncated at `cap` so a token the sampler drew at much lower probability than the
trainer assigns cannot dominate the batch (truncated importance sampling, TIS: Yao et
al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
the cap is Ionides' 2008 truncation). The weights are constants (no gradient): the
trainer multiplies each token's policy loss by w_t before aggregating it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rlhflab.ops.stats import masked_mean


class RolloutCorrection(NamedTuple):
    weights: Tensor         # (B, T) min(exp(Δ), cap), 0 on padding, no gradient
    gap: Tensor             # scalar: mean |Δ| over response tokens
    truncated_frac: Tensor  # scalar: fraction of response tokens whose ratio exceeded cap


def rollout_correction(old_logprobs: Tensor, sample_logprobs: Tensor, response_mask: Tensor,
                       cap: float = 2.0) -> RolloutCorrection:
    """TIS weights and the trainer/sampler log-prob gap; all inputs (B, T), cap > 0."""
    if not (old_logprobs.shape == sample_logprobs.shape == response_mask.shape):
        raise ValueError(
            f"rollout_correction expects equal (B, T) shapes; got old_logprobs "
            f"{tuple(old_logprobs.shape)}, sample_logprobs {tuple(sample_logprobs.shape)}, "
            f"response_mask {tuple(response_mask.shape)}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    with torch.no_grad():
        delta = old_logprobs.float() - sample_logprobs.float()                     # (B, T)
        # clamp: exp stays finite in float32, so a wild value on padding times 0 is 0, not NaN
        ratio = torch.exp(delta.clamp(max=80.0))
        mask = response_mask.to(delta.dtype)
        weights = ratio.clamp(max=cap) * mask                                     # (B, T)
        gap = masked_mean(delta.abs(), response_mask)
        truncated_frac = masked_mean((ratio > cap).float(), response_mask)
    return RolloutCorrection(weights, gap, truncated_frac)
