"""REINFORCE++: `rlhflab reinforce-pp --config configs/reinforce_pp_debug.yaml [key=value ...]`.

REINFORCE++ (Hu, 2025) keeps PPO's token-level KL penalty in the reward and its
clipped update, and drops the critic: the advantage of a token is the return of the
KL-shaped rewards from that token on, whitened over the whole batch (every token of
every response, on every process), not relative to a group.

    r_t = −kl_coeff · KL_t(π‖π_ref)  (+ the score on the last token)
    A_t = whiten_batch( Σ_{s ≥ t} γ^{s−t} r_s )

One step (phases 1 and 6 are `rlhflab.trainers.loop`'s, phase 5 the shared engine):

    1. rollout      `n_samples` responses per prompt (1: plain REINFORCE++)
    2. score        the reward of each response
    3. forward      the sampling policy's and the reference's log-probs; KL-shaped rewards
    4. advantages   discounted returns, whitened over the batch; with
                    `baseline: group_mean` (REINFORCE++-baseline) each score first has its
                    group's mean subtracted
    5. update       the clipped surrogate of the engine; no value loss

Departure: the KL is k2 by default (½(log π − log π_ref)²: non-negative, so the shaped
reward never pays the policy for moving away).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhflab import ops
from rlhflab.config.schema import GroupSection, KLKind, f
from rlhflab.trainers.common import Timer
from rlhflab.trainers.grpo import score_and_forward
from rlhflab.trainers.loop import (PolicyMethod, RLRun, one_step, policy_entry_points, policy_run_config,
                                   run_update, whiten)


@dataclass
class ReinforcePPSection(GroupSection):
    """REINFORCE++ settings (the rollout, optimizer and update fields are the engine's)."""

    n_samples: int = f(1, "responses sampled per prompt (more than 1 for the group_mean baseline)", gt=0)
    kl_coeff: float = f(0.01, "weight of the per-token KL penalty in the reward; 0 loads no reference", ge=0)
    kl_estimator: KLKind = f("k2", "per-token KL estimator in the reward")
    gamma: float = f(1.0, "discount of the returns", ge=0, le=1)
    baseline: Literal["none", "group_mean"] = f(
        "none", "group_mean subtracts each prompt's mean score first (REINFORCE++-baseline; needs n_samples > 1)")

    @property
    def samples_per_prompt(self) -> int:
        return self.n_samples

    def check(self) -> list[str]:
        errs = super().check()
        if self.baseline == "group_mean" and self.n_samples < 2:
            errs.append("baseline: group_mean needs n_samples >= 2 responses per prompt; raise n_samples or use none")
        return errs


ReinforcePPRunConfig = policy_run_config(
    "ReinforcePPRunConfig", "reinforce_pp", ReinforcePPSection, command="reinforce-pp", title="a REINFORCE++",
    kl_weight="kl_coeff", module=__name__)


def reinforce_pp_advantages(scores, logprobs, ref_logprobs, response_mask, sec, dist) -> tuple:
    """Phase 4: (advantages (B, T), kl (B, T)) from scores (B,) and the two log-probs."""
    if sec.baseline == "group_mean":
        groups = scores.float().view(-1, sec.n_samples)                                # (P, k)
        scores = (groups - groups.mean(1, keepdim=True)).reshape(-1)
    ref = ref_logprobs if ref_logprobs is not None else logprobs
    rewards, kl = ops.kl_shaped_rewards(scores, logprobs, ref, response_mask, sec.kl_coeff,
                                        sec.kl_estimator)                               # (B, T) each
    # Over the action tokens (context tokens of a multi-turn episode are no time steps);
    # for a single response's contiguous mask this is ops.discounted_returns exactly.
    returns = ops.discounted_returns_over_actions(rewards, response_mask, sec.gamma)    # (B, T)
    return whiten(returns, response_mask, dist), kl


def reinforce_pp_prepare(run: RLRun, roll, step: int, timer: Timer) -> dict[str, float]:
    """Phases 2-4 of one REINFORCE++ step on its rollout."""
    sec = run.sec
    # 2-3. score, the sampling policy's and the reference's log-probs.
    score_and_forward(run, roll, timer, kl_in_reward=True)
    # 4. advantages: returns of the KL-shaped rewards, whitened over the whole batch.
    roll.advantages, roll.kl = reinforce_pp_advantages(roll.scores, roll.logprobs, roll.ref_logprobs,
                                                       roll.response_mask, sec, run.dist)
    return {}


def reinforce_pp_update(run: RLRun, roll, step: int) -> dict[str, float]:
    """5. update: the KL is in the reward, so none in the loss."""
    return run_update(run, roll, step)


def reinforce_pp_step(run: RLRun, examples, step: int, timer: Timer) -> dict[str, float]:
    """Phases 1-5 of one REINFORCE++ step, in one call (tests and benches); returns its metrics."""
    return one_step(run, examples, step, timer, reinforce_pp_prepare, reinforce_pp_update)


def method(cfg: ReinforcePPRunConfig) -> PolicyMethod:
    return PolicyMethod("reinforce_pp", reinforce_pp_prepare, reinforce_pp_update,
                        need_reference=lambda c: c.reinforce_pp.kl_coeff > 0 and c.model.reference != "none")


train, add_parser, run = policy_entry_points(
    method, ReinforcePPRunConfig, command="reinforce-pp", example="reinforce_pp.kl_coeff=0.02")
