"""GRPO for language models: `rlhflab grpo --config configs/grpo_debug.yaml [key=value ...]`.

Group Relative Policy Optimization (Shao et al., 2024, DeepSeekMath): no critic; each
prompt is answered `grpo.group_size` times and a response's advantage is its reward
relative to the others of its group. One step (the loop, `rlhflab.trainers.loop`, runs
phase 1 through the rollout service and phase 6; this file owns 2-4, `grpo_prepare`, and
5, `grpo_update`, the shared engine):

    1. rollout      group_size sampled responses per prompt (KV cache, no gradients)
    2. score        the reward of each response (rule, reward model, classifier)
    3. forward      reference log-probs (only when kl_coeff > 0); old log-probs (only when a
                    step makes more than one optimizer step, see below)
    4. advantages   `ops.group_advantages`: reward − group mean, divided by the group's
                    std, the batch's std, or nothing; the same value on every token
    5. update       clipped surrogate against the sampling policy + kl_coeff · KL(k3) to the
                    reference, in epochs of minibatches with gradient accumulation
    6. log, evaluate, save

Where we depart from the paper or from common practice:
- The ratio of the clipped surrogate is π/π_old with π_old the policy that sampled the
  responses. (Some tutorials take it against the reference, which makes the clip a
  second KL penalty and not a trust region.) When a step makes exactly one optimizer
  step, π_old is the current policy, so its log-probs are the detached log-probs of the
  update's own forward pass and no extra pass is made; the ratio is then exactly 1.
- `kl_coeff` = 0 (the paper's β; `beta` is still read as it) loads no reference model at
  all (DAPO, Dr. GRPO drop the KL term).
- Under LoRA the reference is the adapter-disabled policy, never a second copy.
- `advantage_scale: batch` divides by the batch's std instead of the group's, which
  does not up-weight prompts whose group rewards barely differ (Liu et al., 2025).
- `loss_aggregation: token_mean` divides by the tokens of the whole accumulated batch
  (DAPO); the paper's per-sequence mean is `seq_mean`.
- `mask_truncated` leaves responses that hit the length limit without EOS out of the
  loss (DAPO's overlong filtering); they still count in their group's mean and std.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhflab import ops
from rlhflab.config.schema import GroupSection, KLKind, f
from rlhflab.engine.scoring import score_rollout
from rlhflab.trainers.common import Timer
from rlhflab.trainers.loop import (PolicyMethod, RLRun, broadcast_advantages, group_advantages, one_step,
                                   policy_entry_points, policy_run_config, run_update, sample_rollout,
                                   score_responses, outcome_scores)


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
@dataclass
class GRPOSection(GroupSection):
    """GRPO settings (the rollout, optimizer and update fields are the engine's)."""

    group_size: int = f(4, "responses sampled per prompt; advantages are relative to this group", gt=1)
    advantage_scale: Literal["group", "batch", "none"] = f(
        "group", "divide the centred reward by the group's std, the batch's std, or nothing")
    kl_coeff: float = f(0.04, "weight of the KL(policy||reference) term in the loss; 0 loads no reference", ge=0)
    kl_estimator: KLKind = f("k3", "per-token KL estimator in the loss: k3 (GRPO's), k1, k2, abs or mse")

    @property
    def samples_per_prompt(self) -> int:
        return self.group_size

    @property
    def kl_loss_coeff(self) -> float:
        return self.kl_coeff


GRPORunConfig = policy_run_config(
    "GRPORunConfig", "grpo", GRPOSection, command="grpo", title="a GRPO", kl_weight="kl_coeff", module=__name__)


# --------------------------------------------------------------------------------------
# Phases 2-4 (prepare) and 5 (update) of one step; phase 1 is the loop's
# --------------------------------------------------------------------------------------
def score_and_forward(run: RLRun, roll, timer: Timer, *, kl_in_reward: bool = False) -> None:
    """Phases 2-3 shared by the group methods, on a rollout of `samples_per_prompt`
    responses per prompt (each group contiguous): the scores, and the log-probs the step
    needs: the reference's when a KL is used, the sampling policy's when the update makes
    more than one optimizer step or the KL is folded into the reward."""
    sec, cfg, models = run.sec, run.cfg, run.models
    temp = cfg.generation.temperature
    # 2. score: one float per response.
    with timer("score"):
        # (B,); multi-turn: the final answer's score plus the environment's turn rewards
        roll.scores = outcome_scores(roll, score_responses(run.scorer, roll, cfg.reward, models.device))
    # 3. forward: reference log-probs for the KL; old log-probs only when needed.
    with timer("forward"):
        need_old = sec.optimizer_steps_per_rollout() > 1 or kl_in_reward
        score_rollout(models.actor, models.reference, roll, temperature=temp,
                      micro_batch=max(sec.mini_batch_size, sec.batch_size), with_policy=need_old,
                      old_logprobs=cfg.generation.old_logprobs, layout=sec.layout,
                      mini_batch_tokens=sec.mini_batch_tokens, dist=run.dist)
        if roll.ref_logprobs is not None and roll.logprobs is not None:
            roll.kl = ops.kl_estimate(roll.logprobs, roll.ref_logprobs, sec.kl_estimator) * roll.response_mask


def sample_and_score(run: RLRun, examples, timer: Timer, step: int = 0, *, kl_in_reward: bool = False):
    """Phases 1-3 of a group method on `examples` (tests and benches; the loop runs phase 1)."""
    roll = sample_rollout(run, examples, step, timer)
    score_and_forward(run, roll, timer, kl_in_reward=kl_in_reward)
    return roll


def grpo_prepare(run: RLRun, roll, step: int, timer: Timer) -> dict[str, float]:
    """Phases 2-4 of one GRPO step on its rollout: scores, the passes it needs, advantages."""
    sec = run.sec
    score_and_forward(run, roll, timer)
    # 4. advantages: relative to the group, the same value on every token (a group never
    # straddles processes; the batch std of advantage_scale: batch is over every rank).
    seq_adv = group_advantages(roll.scores, sec.group_size, sec.advantage_scale, run.dist)  # (B,)
    roll.advantages = broadcast_advantages(seq_adv, roll.response_mask)             # (B, T)
    return {}


def grpo_update(run: RLRun, roll, step: int) -> dict[str, float]:
    """5. update: the shared engine's clipped surrogate (+ kl_coeff KL to the reference)."""
    return run_update(run, roll, step)


def grpo_step(run: RLRun, examples, step: int, timer: Timer) -> dict[str, float]:
    """Phases 1-5 of one GRPO step, in one call (tests and benches); returns its metrics."""
    return one_step(run, examples, step, timer, grpo_prepare, grpo_update)


def method(cfg: GRPORunConfig) -> PolicyMethod:
    return PolicyMethod("grpo", grpo_prepare, grpo_update, need_reference=lambda c: c.grpo.kl_coeff > 0)


train, add_parser, run = policy_entry_points(
    method, GRPORunConfig, command="grpo", example="grpo.group_size=8")
