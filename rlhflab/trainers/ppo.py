"""PPO for language models: `rlhflab ppo --config configs/ppo_debug.yaml [key=value ...]`.

One step, in the order of the algorithm (the loop, `rlhflab.trainers.loop`, runs phase 1
through the rollout service and phase 6; this file owns 2-4, `ppo_prepare`, and 5,
`ppo_update`, the shared engine `rlhflab.engine.update`):

    1. rollout      sample responses to fresh prompts (KV cache, no gradients)
    2. score        the reward of each response (rule, reward model, classifier)
    3. forward      one teacher-forced pass: old logprobs, values, reference logprobs;
                    KL-shaped per-token rewards
    4. advantages   GAE in reverse, then whitening over response tokens
    5. update       `ppo.epochs` epochs of shuffled minibatches, gradient accumulation,
                    clipped policy and value losses, entropy bonus, grad-norm clipping
                    (+ PPO-ptx: a language-modelling loss on `ppo.ptx_data` rows)

The math lives in `rlhflab.ops`; this file only orders it. Where we depart from the
common recipe:
- Dropout is switched off in the policy, the critic and the reference, so that before
  the first update the ratio π/π_old is exactly 1 (PPO's clip assumes it).
- Logits are computed only for response positions.
- Token-mean losses under gradient accumulation are divided by the token count of the
  whole accumulated batch, so accumulation 1×8 equals 8×1 exactly.
- The reference forward is skipped when `ppo.kl_coeff` is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from rlhflab import ops
from rlhflab.config.schema import KLKind, PolicySection, f
from rlhflab.engine.scoring import score_rollout
from rlhflab.models import setup
from rlhflab.models.setup import PolicyModels
from rlhflab.engine.update import MinibatchStats, PPOMath, minibatch_loss, update_group
from rlhflab.trainers.common import Timer
from rlhflab.trainers.loop import (PolicyMethod, RLRun, one_step, policy_entry_points, policy_run_config,
                                   run_update, sample_rollout, score_responses, whiten, episode_rewards,
                                   outcome_scores)

# The names learner mode and older code use for the engine's pieces.
ppo_minibatch_loss = minibatch_loss
ppo_update_group = update_group


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
@dataclass
class PPOSection(PolicySection):
    """PPO settings (the update fields are the engine's, shared with every method)."""

    rollout_samples: int = f(64, "episodes collected per PPO step", gt=0)
    batch_size: int = f(16, "responses generated at once during the rollout", gt=0)
    mini_batch_size: int = f(8, "episodes per minibatch in the update", gt=0)
    epochs: int = f(4, "passes over the rollout buffer per PPO step", gt=0)
    learning_rate: float = f(1e-5, "peak learning rate", gt=0)
    gamma: float = f(1.0, "discount factor", ge=0, le=1)
    lam: float = f(0.95, "GAE lambda", ge=0, le=1)
    value_clip: Optional[float] = f(0.2, "value clip range around the rollout values; null disables", gt=0)
    vf_coeff: float = f(0.1, "weight of the value loss in the total loss", ge=0)
    critic_learning_rate: Optional[float] = f(
        None, "peak learning rate of the value head or separate critic (same warmup and schedule); null: "
              "learning_rate. A fresh value head on a pretrained policy learns little at a policy's learning rate",
        gt=0)
    kl_coeff: float = f(0.05, "weight of the KL penalty to the reference", ge=0)
    kl_estimator: KLKind = f("k1", "KL estimator: k1, k2, k3, abs or mse")
    kl_in: Literal["reward", "loss"] = f("reward", "put the KL penalty in the per-token reward or in the loss")
    whiten_advantages: bool = f(True, "normalise advantages to mean 0, std 1 over response tokens")
    whiten_rewards: bool = f(False, "normalise per-token rewards before GAE (scale only)")

    @property
    def rollout_size(self) -> int:
        return self.rollout_samples

    @property
    def kl_loss_coeff(self) -> float:
        return self.kl_coeff if self.kl_in == "loss" else 0.0


PPORunConfig = policy_run_config(
    "PPORunConfig", "ppo", PPOSection, command="ppo", title="a PPO", kl_weight="kl_coeff", module=__name__)


# --------------------------------------------------------------------------------------
# Phases 1-5 of one step
# --------------------------------------------------------------------------------------
def ppo_prepare(run: RLRun, roll, step: int, timer: Timer) -> dict[str, float]:
    """Phases 2-4 of one PPO step on its rollout: scores, the old/value/reference passes,
    KL-shaped rewards, GAE; sets the rollout's advantages and returns. Under several
    processes the rollout is this rank's share and whitening is global."""
    cfg, sec, models = run.cfg, run.sec, run.models
    temp = cfg.generation.temperature
    # 2. score: one float per response, batched.
    with timer("score"):
        roll.scores = score_responses(run.scorer, roll, cfg.reward, models.device)      # (B,)
    # 3. forward: old logprobs and values (one pass), reference logprobs (one pass), a
    # minibatch of rows at a time from the shortest to the longest: every row has its own
    # prompt here, and one pass over them all would pad each to the longest of the rollout.
    with timer("forward"):
        score_rollout(models.actor, models.reference, roll, temperature=temp,
                      micro_batch=sec.mini_batch_size, with_values=True, old_logprobs=cfg.generation.old_logprobs,
                      layout=sec.layout, mini_batch_tokens=sec.mini_batch_tokens, dist=run.dist)
        ref_lp = roll.ref_logprobs if roll.ref_logprobs is not None else roll.logprobs
        coeff = sec.kl_coeff if sec.kl_in == "reward" else 0.0
        roll.rewards, roll.kl = ops.kl_shaped_rewards(
            roll.scores, roll.logprobs, ref_lp, roll.response_mask, coeff, sec.kl_estimator)  # (B, T) each
        turns = episode_rewards(roll, models.device)  # multi-turn: the environment's (B, N) turn rewards
        if turns is not None:  # each on its turn's end-of-turn token (dense rewards, docs/environments.md)
            batch = roll.episodes
            roll.rewards = roll.rewards + ops.place_turn_rewards(
                turns, batch.turn_ends.to(models.device), batch.turn_mask.to(models.device),
                roll.response_mask.shape[1]).to(roll.rewards.dtype)
            roll.scores = outcome_scores(roll, roll.scores)  # the episode's return, for the logs
        rewards = roll.rewards
        if sec.whiten_rewards:
            rewards = whiten(rewards, roll.response_mask, run.dist, shift_mean=False)
        # 4. advantages: GAE (reverse recursion), then whitening over real tokens only
        # (of every rank).
        if turns is None:
            adv, ret = run.math.advantages(rewards, roll.values, roll.response_mask, sec.gamma, sec.lam)
        else:  # GAE over the action tokens only: context tokens are no time steps (ops.multiturn)
            adv, ret = ops.gae_over_actions(rewards, roll.values, roll.response_mask, sec.gamma, sec.lam)
        if sec.whiten_advantages:
            adv = whiten(adv, roll.response_mask, run.dist)
        roll.advantages, roll.returns = adv, ret
    return {}


def ppo_update(run: RLRun, roll, step: int) -> dict[str, float]:
    """5. update epochs over minibatches (the shared engine): clipped policy and value losses."""
    return run_update(run, roll, step)


def collect_rollout(run: RLRun, examples, timer: Timer, step: int = 0):
    """Phases 1-4 for one PPO step on `examples` (tests and benches; the loop runs phase 1
    itself); returns a rollout with advantages and returns set."""
    roll = sample_rollout(run, examples, step, timer)
    ppo_prepare(run, roll, step, timer)
    return roll


def ppo_step(run: RLRun, examples, step: int, timer: Timer) -> dict[str, float]:
    """Phases 1-5 of one PPO step, in one call (tests and benches); returns its metrics."""
    return one_step(run, examples, step, timer, ppo_prepare, ppo_update)


def optimizer_groups(actor, critic_lr: float | None) -> list:
    """What PPO's optimizer trains: every trainable parameter, the critic's (value head or
    separate critic) in a group of its own at `critic_lr` when one is given."""
    params = actor.trainable_parameters()
    if critic_lr is None:
        return params
    critic = actor.critic if actor.critic is not None else actor.value_head
    ids = {id(p) for p in critic.parameters()}
    return [{"params": [p for p in params if id(p) not in ids]},
            {"params": [p for p in params if id(p) in ids], "lr": critic_lr}]


def method(cfg: PPORunConfig) -> PolicyMethod:
    critic_lr = cfg.ppo.critic_learning_rate
    return PolicyMethod("ppo", ppo_prepare, ppo_update, critic=cfg.model.critic,
                        need_reference=lambda c: c.ppo.kl_coeff > 0 and c.model.reference != "none",
                        optimizer_params=None if critic_lr is None else lambda actor: optimizer_groups(actor, critic_lr))


def build_models(cfg: PPORunConfig, resume_dir: Path | None = None) -> PolicyModels:
    """PPO's models as a run builds them: the policy, its critic and (with a KL) the reference."""
    m = method(cfg)
    return setup.build_models(cfg.model, cfg.lora, cfg.training.device, need_reference=m.need_reference(cfg),
                              critic=m.critic, resume_dir=resume_dir, mixed_precision=cfg.training.mixed_precision)


train, add_parser, run = policy_entry_points(
    method, PPORunConfig, command="ppo", example="ppo.kl_coeff=0.1")
__all__ = ["PPOSection", "PPORunConfig", "PPOMath", "MinibatchStats", "collect_rollout", "ppo_prepare", "ppo_update", "ppo_step", "train",
           "ppo_minibatch_loss", "ppo_update_group"]
