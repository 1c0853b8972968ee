"""RLOO for language models: `rlhflab rloo --config configs/rloo_debug.yaml [key=value ...]`.

REINFORCE Leave-One-Out (Kool et al., 2019; Ahmadian et al., 2024, "Back to Basics"):
no critic; each prompt is answered `rloo.k` times and each response's baseline is the
mean reward of the other k − 1. The KL to the reference is folded into the sequence
reward, as in the usual formulation:

    R_i = score_i − kl_coeff · Σ_t KL_t(π‖π_ref)       A_i = R_i − mean_{j≠i} R_j

One step (phases 2-3 and 5 are GRPO's; the loop, `rlhflab.trainers.loop`, runs 1 and 6):

    1. rollout      k sampled responses per prompt
    2. score        the reward of each response
    3. forward      the sampling policy's log-probs and the reference's (when kl_coeff > 0);
                    the sequence-level KL folded into the reward
    4. advantages   `ops.rloo_advantages`, the same value on every token
    5. update       the shared engine's clipped surrogate (with one optimizer step per
                    rollout the ratio is 1 and this is plain REINFORCE with the baseline)

Departures: the KL is k1 summed over the response by default (an unbiased sequence
KL); `normalize_advantages` whitens over the batch (TRL's option, with the population
variance of every batch statistic, `engine.dist`), off by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhflab import ops
from rlhflab.config.schema import GroupSection, KLKind, f
from rlhflab.trainers.common import Timer
from rlhflab.trainers.grpo import score_and_forward
from rlhflab.trainers.loop import (PolicyMethod, RLRun, broadcast_advantages, one_step, policy_entry_points,
                                   policy_run_config, run_update, whiten)


@dataclass
class RLOOSection(GroupSection):
    """RLOO settings (the rollout, optimizer and update fields are the engine's)."""

    k: int = f(4, "responses sampled per prompt; each one's baseline is the mean of the other k-1", gt=1)
    kl_coeff: float = f(0.05, "weight of the sequence KL(policy||reference) subtracted from the reward; 0 loads no reference", ge=0)
    kl_estimator: KLKind = f("k1", "per-token KL estimator, summed over the response")
    normalize_advantages: bool = f(False, "whiten the advantages over the batch (mean 0, std 1)")

    @property
    def samples_per_prompt(self) -> int:
        return self.k


RLOORunConfig = policy_run_config(
    "RLOORunConfig", "rloo", RLOOSection, command="rloo", title="an RLOO", kl_weight="kl_coeff", module=__name__)


def rloo_prepare(run: RLRun, roll, step: int, timer: Timer) -> dict[str, float]:
    """Phases 2-4 of one RLOO step on its rollout; returns the shaped reward's mean."""
    sec = run.sec
    score_and_forward(run, roll, timer, kl_in_reward=sec.kl_coeff > 0)
    # 3. (cont.) the sequence KL joins the reward.
    rewards = roll.scores
    if roll.kl is not None:
        rewards = roll.scores - sec.kl_coeff * roll.kl.sum(-1)                           # (B,)
    # 4. advantages: leave-one-out baseline, the same value on every token.
    seq_adv = ops.rloo_advantages(rewards, sec.k)                                      # (B,)
    if sec.normalize_advantages:  # over the whole batch, every rank's (engine.dist: one variance convention)
        seq_adv = whiten(seq_adv, torch.ones_like(seq_adv), run.dist)
    roll.advantages = broadcast_advantages(seq_adv, roll.response_mask)              # (B, T)
    return {"rollout/shaped_reward_mean": run.dist.mean(float(rewards.mean()))}


def rloo_update(run: RLRun, roll, step: int) -> dict[str, float]:
    """5. update: the KL is already in the reward, so none in the loss."""
    return run_update(run, roll, step)


def rloo_step(run: RLRun, examples, step: int, timer: Timer) -> dict[str, float]:
    """Phases 1-5 of one RLOO step, in one call (tests and benches); returns its metrics."""
    return one_step(run, examples, step, timer, rloo_prepare, rloo_update)


def method(cfg: RLOORunConfig) -> PolicyMethod:
    return PolicyMethod("rloo", rloo_prepare, rloo_update, need_reference=lambda c: c.rloo.kl_coeff > 0)


train, add_parser, run = policy_entry_points(
    method, RLOORunConfig, command="rloo", example="rloo.k=8")
