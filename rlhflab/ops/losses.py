"""Losses: PPO clipped surrogate (and GSPO's sequence-level one), clipped value loss, entropy bonus, DPO, reward model.

Aggregation over tokens (`aggregation`):
- "token_mean": Σ loss·mask / Σ mask — every response token weighs the same.
- "seq_mean":   mean over sequences of each sequence's token mean — every response
                weighs the same, however long.
- "token_sum":  Σ loss·mask / (B·T) — a constant denominator that does not depend on
                how long the responses are (Dr. GRPO, Liu et al., 2025: the trainer
                passes sequences × max_new_tokens as the normalizer).
`normalizer`, when given, replaces the denominator (the token count for token_mean,
the sequence count for seq_mean, the constant for token_sum). A trainer that
accumulates gradients over several micro-batches passes the count of the whole
accumulated batch, so the sum of the micro-batch losses equals the loss of the whole
batch exactly (the usual `loss / accumulation_steps` is only right when every
micro-batch holds as many tokens).

The log-ratio is clamped to ±LOG_RATIO_CLAMP = 20 before the exp (as verl does). Without
it, a token whose log-ratio passes float32's exp limit (about 88.7: an old log-prob of −91
from a sampler that disagrees wildly) makes the ratio inf; the clipped branch is taken
and the token's loss is a finite constant, yet the backward pass multiplies the zero
gradient of the unused branch by exp's inf and returns NaN, and the engine stops on a
non-finite gradient norm. At ±20 the ratio (e^20 ≈ 4.9e8, or 2e-9) is far outside any
clip range, so the clamp changes neither the loss nor the gradient of any token whose
ratio is ordinary, and a clamped token's gradient is exactly 0. The one place it differs
from the unclamped maths is a token with A < 0, no dual clip and a log-ratio above 20:
its loss stays −A·e^20 instead of growing, and it pushes no gradient (an outlier that
the unclamped form would turn into a gradient of ~5e8·|A|). A where-select of the two
branches was the alternative; the clamp was chosen because it also keeps the loss value
finite for that A < 0 token, and it matches the peers (docs/conventions.md).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhflab.ops.stats import masked_mean

Aggregation = Literal["token_mean", "seq_mean", "token_sum"]

LOG_RATIO_CLAMP = 20.0  # |log π − log π_old| bound before the exp; see the module docstring


def aggregate(x: Tensor, response_mask: Tensor, aggregation: Aggregation = "token_mean",
              normalizer: float | Tensor | None = None) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar; see the module docstring."""
    if x.shape != response_mask.shape:
        raise ValueError(f"loss {tuple(x.shape)} != response_mask {tuple(response_mask.shape)}")
    mask = response_mask.to(x.dtype)
    if aggregation == "token_mean":
        total = (x * mask).sum()
        denom = mask.sum().clamp(min=1.0) if normalizer is None else normalizer
        return total / denom
    if aggregation == "seq_mean":
        per_seq = (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)   # (B,)
        if normalizer is None:
            normalizer = (mask.sum(-1) > 0).sum().clamp(min=1).to(x.dtype)
        return per_seq.sum() / normalizer
    if aggregation == "token_sum":
        denom = float(mask.numel()) if normalizer is None else normalizer
        return (x * mask).sum() / denom
    raise ValueError(f"unknown aggregation {aggregation!r}; choose token_mean, seq_mean or token_sum")


class PolicyLossOutput(NamedTuple):
    loss: Tensor       # scalar, to minimise
    clip_frac: Tensor  # fraction of response tokens where the clipped branch was taken
    approx_kl: Tensor  # mean of ½(log π − log π_old)², how far the update moved the policy
    clip_frac_low: Tensor | None = None   # ... of them with A < 0 and ratio < 1 − ε_low
    clip_frac_high: Tensor | None = None  # ... of them with A > 0 and ratio > 1 + ε_high


def ppo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                    response_mask: Tensor, clip_eps: float = 0.2,
                    clip_eps_high: float | None = None, dual_clip: float | None = None,
                    aggregation: Aggregation = "token_mean",
                    normalizer: float | Tensor | None = None,
                    token_weights: Tensor | None = None) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al., 2017), as a loss.

    All inputs (B, T). ratio = exp(clamp(logprobs − old_logprobs, ±20)) (module docstring);
    loss_t = max(−A·ratio, −A·clip(ratio, 1 − ε_low, 1 + ε_high)).
    The max of the two negatives is the min of the two surrogates: the gradient stops
    once the ratio has moved past the clip in the direction the advantage pushes it.
    `clip_eps_high` (default: `clip_eps`) allows asymmetric clipping (DAPO's clip-higher).
    `dual_clip` c > 1 bounds the loss at −c·A when A < 0 (Ye et al., 2020).
    `token_weights` (B, T), detached, multiply each token's loss: the truncated
    importance weights that correct for a sampler other than the trainer (vLLM).
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape == response_mask.shape):
        raise ValueError(
            f"ppo_policy_loss expects equal (B, T) shapes; got logprobs {tuple(logprobs.shape)}, "
            f"old_logprobs {tuple(old_logprobs.shape)}, advantages {tuple(advantages.shape)}, "
            f"response_mask {tuple(response_mask.shape)}")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = logprobs - old_logprobs
    # clamped before the exp: an inf ratio gives a NaN gradient even where it is clipped
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
    if token_weights is not None:
        if token_weights.shape != per_token.shape:
            raise ValueError(f"token_weights {tuple(token_weights.shape)} != (B, T) {tuple(per_token.shape)}")
        per_token = per_token * token_weights.detach()
    loss = aggregate(per_token, response_mask, aggregation, normalizer)
    with torch.no_grad():
        dt = per_token.dtype
        clip_frac = masked_mean((clipped > unclipped).to(dt), response_mask)
        approx_kl = masked_mean(0.5 * log_ratio.square(), response_mask)
        # The clipped branch is taken below (A < 0) or above (A > 0): the two parts of clip_frac.
        low = masked_mean(((ratio < 1.0 - clip_eps) & (advantages < 0)).to(dt), response_mask)
        high = masked_mean(((ratio > 1.0 + eps_high) & (advantages > 0)).to(dt), response_mask)
    return PolicyLossOutput(loss, clip_frac, approx_kl, low, high)


def gspo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                     response_mask: Tensor, clip_eps: float = 3e-4,
                     clip_eps_high: float | None = 4e-4, dual_clip: float | None = None,
                     aggregation: Aggregation = "seq_mean",
                     normalizer: float | Tensor | None = None,
                     token_weights: Tensor | None = None) -> PolicyLossOutput:
    """GSPO's clipped surrogate (Zheng et al., 2025, "Group Sequence Policy Optimization"):
    one importance ratio per response, clipped at the sequence level.

    All inputs (B, T); a response's advantage is the same on its tokens (GRPO's group
    advantage), read as their mean. With n_i real tokens,

        s_i = exp( (1/n_i) Σ_t (log π − log π_old) )         the geometric mean of the
                                                              token ratios, (B,)
        ℓ_i = max(−A_i·s_i, −A_i·clip(s_i, 1 − ε_low, 1 + ε_high))

    and ℓ_i stands on each of row i's real tokens before `aggregate`: "seq_mean" (the
    default, the paper's 1/G Σ_i) is the mean of ℓ_i over responses; "token_mean" weighs
    each response by its length. The clip ranges are small (the paper's 3e-4 and 4e-4)
    because s_i averages the log-ratios: a sequence ratio moves far less than a token's.
    Worked example: log-ratios (0.2, −0.1) give s = exp(0.05) = 1.0513.

    `dual_clip` and `token_weights` are token-level and have no sequence-level meaning
    here: either raises ValueError (GSPO's section refuses them in its `check`).
    Returned fractions are over responses; approx_kl is the token mean of ½(log ratio)².
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape == response_mask.shape):
        raise ValueError(
            f"gspo_policy_loss expects equal (B, T) shapes; got logprobs {tuple(logprobs.shape)}, "
            f"old_logprobs {tuple(old_logprobs.shape)}, advantages {tuple(advantages.shape)}, "
            f"response_mask {tuple(response_mask.shape)}")
    if dual_clip is not None or token_weights is not None:
        raise ValueError("gspo_policy_loss: dual_clip and token_weights are token-level; leave them unset")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = response_mask.to(logprobs.dtype)
    n = mask.sum(-1).clamp(min=1.0)                                               # (B,)
    log_ratio = logprobs - old_logprobs                                           # (B, T)
    seq_log_ratio = (log_ratio * mask).sum(-1) / n                                # (B,)
    ratio = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))     # (B,) s_i
    seq_adv = (advantages * mask).sum(-1) / n                                     # (B,) A_i
    unclipped = -seq_adv * ratio
    clipped = -seq_adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    per_seq = torch.maximum(unclipped, clipped)                                   # (B,) ℓ_i
    per_token = per_seq.unsqueeze(1).expand_as(logprobs)                          # (B, T)
    loss = aggregate(per_token, response_mask, aggregation, normalizer)
    with torch.no_grad():
        real = (mask.sum(-1) > 0).to(logprobs.dtype)                              # (B,) rows with a token
        rows = real.sum().clamp(min=1.0)
        clip_frac = ((clipped > unclipped).to(real.dtype) * real).sum() / rows
        approx_kl = masked_mean(0.5 * log_ratio.square(), response_mask)
        low = (((ratio < 1.0 - clip_eps) & (seq_adv < 0)).to(real.dtype) * real).sum() / rows
        high = (((ratio > 1.0 + eps_high) & (seq_adv > 0)).to(real.dtype) * real).sum() / rows
    return PolicyLossOutput(loss, clip_frac, approx_kl, low, high)


class ValueLossOutput(NamedTuple):
    loss: Tensor       # scalar
    clip_frac: Tensor  # fraction of tokens where the clipped error was the larger


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor,
               clip_range: float | None = 0.2, aggregation: Aggregation = "token_mean",
               normalizer: float | Tensor | None = None) -> ValueLossOutput:
    """Clipped value loss: ½ · mean(max((V − R)², (V_clip − R)²)).

    All inputs (B, T). V_clip = V_old + clip(V − V_old, −c, c) keeps the critic from
    moving far from the rollout's values in one update. `clip_range=None` gives the
    plain ½ · mean((V − R)²).
    """
    if not (values.shape == old_values.shape == returns.shape == response_mask.shape):
        raise ValueError(
            f"value_loss expects equal (B, T) shapes; got values {tuple(values.shape)}, "
            f"old_values {tuple(old_values.shape)}, returns {tuple(returns.shape)}, "
            f"response_mask {tuple(response_mask.shape)}")
    unclipped = (values - returns).square()
    if clip_range is None:
        per_token = unclipped
        clip_frac = values.new_zeros(())
    else:
        v_clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        clipped = (v_clipped - returns).square()
        per_token = torch.maximum(unclipped, clipped)
        with torch.no_grad():
            clip_frac = masked_mean((clipped > unclipped).to(per_token.dtype), response_mask)
    return ValueLossOutput(0.5 * aggregate(per_token, response_mask, aggregation, normalizer), clip_frac)


class EntropyLossOutput(NamedTuple):
    loss: Tensor     # −mean entropy (minimising it raises entropy)
    entropy: Tensor  # mean entropy, for logging (detached)


def entropy_loss(entropy: Tensor, response_mask: Tensor, aggregation: Aggregation = "token_mean",
                 normalizer: float | Tensor | None = None) -> EntropyLossOutput:
    """The entropy bonus as a loss: −mean H over response tokens.

    entropy: (B, T) from `entropy_from_logits`. The trainer adds
    `entropy_coeff · loss`, i.e. subtracts `entropy_coeff · H`.
    """
    mean_h = aggregate(entropy, response_mask, aggregation, normalizer)
    return EntropyLossOutput(-mean_h, mean_h.detach())


class DPOLossOutput(NamedTuple):
    loss: Tensor              # scalar
    chosen_rewards: Tensor    # (B,) β·(log π − log π_ref) of the chosen response, detached
    rejected_rewards: Tensor  # (B,) the same for the rejected response, detached


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor,
             ref_rejected: Tensor, beta: float = 0.1,
             kind: Literal["sigmoid", "ipo", "hinge"] = "sigmoid",
             label_smoothing: float = 0.0) -> DPOLossOutput:
    """Direct Preference Optimisation on sequence log-probs, all (B,).

    h = (log π(y_w) − log π(y_l)) − (log π_ref(y_w) − log π_ref(y_l))
    - sigmoid (Rafailov et al., 2023): −(1−ε)·log σ(βh) − ε·log σ(−βh), ε = label_smoothing
    - ipo (Azar et al., 2023): (h − 1/(2β))²
    - hinge (SLiC, Zhao et al., 2023): max(0, 1 − βh)
    """
    for name, t in (("policy_rejected", policy_rejected), ("ref_chosen", ref_chosen),
                    ("ref_rejected", ref_rejected)):
        if t.shape != policy_chosen.shape:
            raise ValueError(f"dpo_loss: {name} {tuple(t.shape)} != policy_chosen {tuple(policy_chosen.shape)}")
    if policy_chosen.dim() != 1:
        raise ValueError(f"dpo_loss expects sequence log-probs of shape (B,), got {tuple(policy_chosen.shape)}")
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if kind == "sigmoid":
        losses = (-(1 - label_smoothing) * F.logsigmoid(beta * h)
                  - label_smoothing * F.logsigmoid(-beta * h))
    elif kind == "ipo":
        losses = (h - 1.0 / (2.0 * beta)).square()
    elif kind == "hinge":
        losses = torch.relu(1.0 - beta * h)
    else:
        raise ValueError(f"unknown DPO loss kind {kind!r}; choose sigmoid, ipo or hinge")
    chosen_rewards = (beta * (policy_chosen - ref_chosen)).detach()
    rejected_rewards = (beta * (policy_rejected - ref_rejected)).detach()
    return DPOLossOutput(losses.mean(), chosen_rewards, rejected_rewards)


class RewardModelLossOutput(NamedTuple):
    loss: Tensor      # scalar
    accuracy: Tensor  # fraction of pairs with chosen score > rejected score


def reward_model_loss(chosen_scores: Tensor, rejected_scores: Tensor,
                      margin: Tensor | float | None = None,
                      center_coeff: float = 0.0) -> RewardModelLossOutput:
    """Bradley-Terry pairwise loss: −log σ(r_chosen − r_rejected − margin).

    chosen_scores, rejected_scores: (B,). `margin` (B,) or scalar asks for a larger gap
    on strongly preferred pairs (Llama 2). `center_coeff` adds coeff·mean((r_c + r_r)²),
    which keeps scores near zero (Eisenstein et al., 2023).
    """
    if chosen_scores.shape != rejected_scores.shape or chosen_scores.dim() != 1:
        raise ValueError(f"reward_model_loss expects two (B,) tensors; got {tuple(chosen_scores.shape)} "
                         f"and {tuple(rejected_scores.shape)}")
    if isinstance(margin, Tensor) and margin.dim() > 0 and margin.shape != chosen_scores.shape:
        # a (B, 1) margin against (B,) scores would broadcast to (B, B) silently
        raise ValueError(f"margin {tuple(margin.shape)} must be a scalar or (B,) = {tuple(chosen_scores.shape)}")
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff).mean()
    if center_coeff:
        loss = loss + center_coeff * (chosen_scores + rejected_scores).square().mean()
    accuracy = (chosen_scores > rejected_scores).to(loss.dtype).mean().detach()
    return RewardModelLossOutput(loss, accuracy)
