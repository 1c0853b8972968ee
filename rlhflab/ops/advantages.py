"""Advantages: GAE for PPO, group-relative for GRPO and Dr. GRPO, leave-one-out for RLOO,
discounted returns for REINFORCE++.

Whitening is not done here: the trainer calls `masked_whiten` itself, so GAE alone
can be tested (a fault of some libraries whose GAE always whitens).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from rlhflab.ops.stats import work_dtype


class GAEOutput(NamedTuple):
    advantages: Tensor  # (B, T), 0 on padding
    returns: Tensor     # (B, T) = advantages + values, 0 on padding; the value targets


def gae(rewards: Tensor, values: Tensor, response_mask: Tensor,
        gamma: float = 1.0, lam: float = 0.95) -> GAEOutput:
    """Generalised Advantage Estimation (Schulman et al., 2016), computed in reverse.

    rewards, values, response_mask: (B, T), the mask right-padded (1…1 0…0).

        δ_t = r_t + γ·V_{t+1} − V_t         (V past the last real token is 0: the episode ends)
        A_t = δ_t + γλ·A_{t+1}

    Worked example (γ=0.9, λ=0.95, r=[1,0,2], V=[2,2.5,3]): δ = [1.25, 0.2, −1.0],
    A = [0.690, −0.655, −1.0]. Padding gives 0, and extra right padding changes nothing.
    """
    if not (rewards.shape == values.shape == response_mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"gae expects rewards, values, response_mask all (B, T); got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(response_mask.shape)}")
    mask = response_mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    b, t = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_adv = torch.zeros(b, dtype=rewards.dtype, device=rewards.device)    # A_{t+1}, (B,)
    next_value = torch.zeros(b, dtype=values.dtype, device=values.device)    # V_{t+1}, (B,)
    for i in reversed(range(t)):
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        next_adv = (delta + gamma * lam * next_adv) * mask[:, i]
        advantages[:, i] = next_adv
        next_value = values[:, i]
    returns = (advantages + values) * mask
    return GAEOutput(advantages, returns)


def group_advantages(scores: Tensor, group_size: int,
                     scale: Literal["group", "batch", "none"] = "group",
                     eps: float = 1e-4, batch_std: Tensor | float | None = None) -> Tensor:
    """GRPO advantages: each score minus its group's mean, scaled.

    scores: (B,) with B = n_groups · group_size, each group contiguous -> (B,), float64
    for float64 scores, else float32.
    scale="group" divides by the group's std (Shao et al., 2024), "batch" by the
    std of the whole batch (less biased towards easy/hard prompts, Liu et al. 2025),
    "none" leaves the centred score. A group's std is the unbiased (n − 1) estimate,
    as every tool computes it; the batch's std is the population one (divided by n),
    the convention of every whole-batch statistic (`batch_std_of`, rlhflab.engine.dist).
    `eps` is added to the std (1e-4, as TRL; verl 1e-6, OpenRLHF 1e-9:
    docs/conventions.md). `batch_std` replaces the batch's std (e.g. the std over every
    process's scores).

    A group whose scores are all equal gets advantage exactly 0, at any size and
    magnitude: each group is first shifted by its own first score, so equal scores are
    exactly 0 before any mean is taken. (The plain s − mean(s) is an ulp off for most
    equal groups, since the float32 sum of eight 0.7s is not 8 × 0.7, and that ulp over
    std + eps ≈ 1e-4 gave every response of the group the same advantage, +6e-4 for
    0.7 and −0.037 for 42.1.) The shift changes no mean, std or advantage otherwise.
    The batch std is computed in float64 around its own mean (two passes), as
    `engine.dist.group_advantages` computes it over several processes.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be (B,), got {tuple(scores.shape)}")
    if group_size < 1 or scores.shape[0] % group_size:
        raise ValueError(f"batch of {scores.shape[0]} is not a whole number of groups of {group_size}")
    s = scores.to(work_dtype(scores)).view(-1, group_size)       # (G, K)
    d = s - s[:, :1]                                              # (G, K), shifted by a member: exact 0 if all equal
    centred = d - d.mean(dim=1, keepdim=True)
    if scale == "group":
        std = d.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(s[:, :1])
        out = centred / (std + eps)
    elif scale == "batch":
        if batch_std is not None:
            std = torch.as_tensor(batch_std, dtype=s.dtype, device=s.device)
        else:
            std = batch_std_of(s.reshape(-1)).to(s.dtype)
        out = centred / (std + eps)
    elif scale == "none":
        out = centred
    else:
        raise ValueError(f"unknown scale {scale!r}; choose group, batch or none")
    return out.reshape(-1)


def batch_std_of(scores: Tensor) -> Tensor:
    """Std of every score of the batch, the population one (Σ(s − mean)² / n, the
    convention of every whole-batch statistic), in float64: shifted by the largest score
    first (a constant batch is exactly 0), then two passes (the mean, then the squares
    around it); 0 for no score. The one-process form of `engine.dist.batch_moments`."""
    x = scores.reshape(-1).double()
    n = x.numel()
    if n < 1:
        return x.new_zeros(())
    d = x - x.max()
    mean = d.sum() / n
    return ((d - mean).square().sum() / n).sqrt()


def discounted_returns(rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + γ·G_{t+1} over each response, computed in reverse; 0 on padding. (B, T) -> (B, T).

    REINFORCE++ (Hu, 2025) uses these returns of the KL-shaped per-token rewards as
    advantages (after whitening over the batch). It is GAE with no critic and λ = 1.
    Worked example (γ = 0.5, r = [1, 0, 2]): G = [1 + 0.5·(0 + 0.5·2), 0 + 0.5·2, 2] = [1.5, 1, 2].
    """
    if rewards.shape != response_mask.shape or rewards.dim() != 2:
        raise ValueError(f"discounted_returns expects rewards and response_mask both (B, T); got "
                         f"{tuple(rewards.shape)} and {tuple(response_mask.shape)}")
    mask = response_mask.to(rewards.dtype)
    rewards = rewards * mask
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)  # G_{t+1}, (B,)
    for i in reversed(range(rewards.shape[1])):
        running = (rewards[:, i] + gamma * running) * mask[:, i]
        out[:, i] = running
    return out


def rloo_advantages(scores: Tensor, k: int) -> Tensor:
    """RLOO: each score minus the mean of the other k − 1 scores of its prompt.

    scores: (B,) with B = n_prompts · k, each prompt's samples contiguous -> (B,),
    float64 for float64 scores, else float32.
    baseline_i = (Σ_j s_j − s_i) / (k − 1)   (Kool et al., 2019; Ahmadian et al., 2024)
    Each prompt's scores are first shifted by its first score (the baseline moves with
    them), so a prompt whose k scores are equal gets exactly 0, not an ulp over k − 1.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be (B,), got {tuple(scores.shape)}")
    if k < 2 or scores.shape[0] % k:
        raise ValueError(f"RLOO needs k >= 2 samples per prompt and B divisible by k; got B={scores.shape[0]}, k={k}")
    s = scores.to(work_dtype(scores)).view(-1, k)                  # (P, k)
    d = s - s[:, :1]                                                # (P, k), exact 0 if all equal
    baseline = (d.sum(dim=1, keepdim=True) - d) / (k - 1)
    return (d - baseline).reshape(-1)
