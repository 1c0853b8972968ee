"""TRPO for language models, a teaching implementation: `rlhflab trpo --config configs/trpo_debug.yaml`.

Trust Region Policy Optimization (Schulman et al., 2015) is what PPO approximates: it
maximises the surrogate L(θ) = E[π_θ(y)/π_old(y) · A] subject to the mean
KL(π_old‖π_θ) ≤ `trpo.max_kl`, and enforces the constraint instead of clipping a ratio.
One step (phases 1 and 6 are `rlhflab.trainers.loop`'s; 2-4 `trpo_prepare`, 5 `trpo_update`):

    1. rollout      one response per prompt
    2. score        the reward of each response
    3. forward      old log-probs and values; KL-shaped rewards (kl_coeff > 0 only)
    4. advantages   GAE, whitened
    5. update       a. the natural-gradient step: g = ∇L at θ_old; conjugate gradient solves
                       F·x = g with Fisher-vector products (F = the Hessian of the mean KL,
                       a second backward pass; F is never formed); the step
                       √(2δ / xᵀFx)·x has a KL of δ to second order; a backtracking line
                       search halves it until the exact KL ≤ δ and L has improved (or
                       leaves the policy as it was)
                    b. the value function, fitted separately by AdamW on the returns; its
                       gradients never reach the policy (a value head reads the policy's
                       hidden states detached; `model.critic: separate` is its own model)

Departures, as a teaching implementation: the whole rollout is one batch for the
natural-gradient step and the exact KL over the vocabulary is computed from full
(B, T, V) log-distributions, so it suits small models (or LoRA) and modest rollouts; it
runs in one process. For large models use PPO, which gets most of TRPO's stability from
the clip at first-order cost (docs/trpo_to_ppo.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from rlhflab import ops
from rlhflab.config.schema import KLKind, OptimizerFields, f
from rlhflab.engine.scoring import score_rollout
from rlhflab.models.actor_critic import response_hidden
from rlhflab.ops.losses import LOG_RATIO_CLAMP
from rlhflab.rollout import Rollout
from rlhflab.trainers.common import Timer
from rlhflab.trainers.loop import (PolicyMethod, RLRun, one_step, policy_entry_points, policy_run_config,
                                   score_responses, whiten, episode_rewards, outcome_scores)


@dataclass
class TRPOSection(OptimizerFields):
    """TRPO settings; the optimizer fields are the value function's (the policy takes the
    natural-gradient step)."""

    KL_KNOB = "max_kl"
    ASYNCHRONOUS = False  # the line search needs the rollout's own policy (generation.max_staleness: 0)
    SAMPLER_OLD_LOGPROBS = False  # the update recomputes the old policy's whole distribution (generation.old_logprobs)

    rollout_samples: int = f(32, "episodes collected per step (one batch for the natural-gradient step)", gt=0)
    batch_size: int = f(32, "responses generated at once during the rollout", gt=0)
    max_kl: float = f(0.01, "trust region: the mean KL(old||new) over response tokens a step may reach", gt=0)
    cg_iterations: int = f(10, "conjugate-gradient iterations for F x = g", gt=0)
    cg_damping: float = f(0.1, "added to F (F + damping I) so that the solve is well conditioned", ge=0)
    line_search_steps: int = f(10, "backtracking steps: the step is multiplied by backtrack until it is accepted", gt=0)
    backtrack: float = f(0.5, "factor of each backtracking step", gt=0, lt=1)
    gamma: float = f(1.0, "discount factor", ge=0, le=1)
    lam: float = f(0.95, "GAE lambda", ge=0, le=1)
    whiten_advantages: bool = f(True, "normalise advantages to mean 0, std 1 over response tokens")
    kl_coeff: float = f(0.0, "weight of a KL penalty to the reference in the reward (the trust region is to the "
                             "previous policy); 0 loads no reference", ge=0)
    kl_estimator: KLKind = f("k1", "estimator of the KL penalty in the reward")
    learning_rate: float = f(1e-3, "the value function's learning rate", gt=0)
    value_epochs: int = f(4, "passes over the rollout fitting the value function", gt=0)
    value_mini_batch_size: int = f(16, "episodes per value-function minibatch", gt=0)
    value_clip: Optional[float] = f(None, "value clip range around the rollout values; null: plain regression", gt=0)
    layout: Literal["padded", "packed"] = f("padded", "decoder passes of the scoring, the natural-gradient step (its "
                                                      "line search too) and the value fit: padded rows, or packed "
                                                      "(the same numbers to rounding; SDPA, eager or FlashAttention)")

    # What the loop reads of every method's section.
    samples_per_prompt = 1
    ptx_coeff = 0.0

    @property
    def rollout_size(self) -> int:
        return self.rollout_samples

    @property
    def mini_batch_size(self) -> int:
        return self.value_mini_batch_size

    def optimizer_steps_per_rollout(self) -> int:
        return self.value_epochs * math.ceil(self.rollout_samples / self.value_mini_batch_size)

    def check(self) -> list[str]:
        errs = super().check()
        if self.value_mini_batch_size > self.rollout_samples:
            errs.append(f"value_mini_batch_size: {self.value_mini_batch_size} is larger than the rollout "
                        f"({self.rollout_samples}); lower it")
        return errs


TRPORunConfig = policy_run_config(
    "TRPORunConfig", "trpo", TRPOSection, command="trpo", title="a TRPO", kl_weight="kl_coeff", module=__name__)


# --------------------------------------------------------------------------------------
# 5a. the natural-gradient step
# --------------------------------------------------------------------------------------
class StepStats(dict):
    """trpo/* metrics of one natural-gradient step."""


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def surrogate_objective(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor) -> torch.Tensor:
    """L = mean over real tokens of ratio · A, ratio = π/π_old; all inputs (B, T).

    The log-ratio is clamped to ±`ops.losses.LOG_RATIO_CLAMP` before the exp, as in
    `ops.ppo_policy_loss`: a log-ratio past float32's exp limit (~88.7; a line-search step
    far outside the trust region can reach it) would make the ratio inf and the gradient
    NaN. A clamped token contributes e^±20·A and no gradient; any ordinary ratio is
    untouched.
    """
    mask = response_mask.float()
    ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # (B, T)
    return (ratio * advantages * mask).sum() / mask.sum().clamp(min=1.0)


def natural_gradient_step(actor, roll: Rollout, sec: TRPOSection, temperature: float = 1.0) -> StepStats:
    """Move the policy along F⁻¹g within the trust region (see the module docstring).

    roll.advantages and roll.response_mask (B, T) must be set. Returns the step's
    statistics: the KL and the surrogate improvement of the accepted step (0 when the
    line search rejected every step and the policy is unchanged). Every forward (the
    line search's too) runs in `sec.layout`; it attends to `roll.attention_mask()` (a
    multi-turn episode's context included) while the surrogate and the KL read the action
    tokens (`roll.response_mask`) alone.
    """
    params = [p for p in actor.policy.parameters() if p.requires_grad]
    ids, am, p_len = roll.input_ids(), roll.attention_mask(), roll.prompt_len
    layout_kw = {} if sec.layout == "padded" else {"layout": sec.layout}
    mask = roll.response_mask.float()
    n = mask.sum().clamp(min=1.0)
    tokens = roll.response_ids.unsqueeze(-1)

    def log_dist() -> torch.Tensor:  # (B, T, V) log π(·|s_t) at the sampling temperature
        # The math attention kernel: the fused ones have no second derivative, which the
        # Fisher-vector products need.
        with sdpa_kernel(SDPBackend.MATH):
            logits = actor.forward_response(ids, am, p_len, with_values=False, **layout_kw).logits
        return (logits.float() / temperature).log_softmax(-1)

    def surrogate(dist: torch.Tensor) -> torch.Tensor:  # L = mean_t ratio_t · A_t over real tokens
        return surrogate_objective(dist.gather(-1, tokens).squeeze(-1), old_lp, roll.advantages, mask)

    def mean_kl(dist: torch.Tensor) -> torch.Tensor:
        return (ops.categorical_kl(old_dist, dist) * mask).sum() / n

    with torch.no_grad():
        old_dist = log_dist()                                                          # (B, T, V)
        old_lp = old_dist.gather(-1, tokens).squeeze(-1)                               # (B, T)
    dist = log_dist()
    loss_old = surrogate(dist)
    g = _flat(torch.autograd.grad(loss_old, params, retain_graph=True))
    # ∇KL at θ_old is 0, but its graph gives F·v as the gradient of (∇KL · v).
    grad_kl = _flat(torch.autograd.grad(mean_kl(dist), params, create_graph=True))

    def fisher_vector(v: torch.Tensor) -> torch.Tensor:
        fv = _flat(torch.autograd.grad(torch.dot(grad_kl, v), params, retain_graph=True))
        return fv + sec.cg_damping * v

    cg = ops.conjugate_gradient(fisher_vector, g.detach(), sec.cg_iterations)
    xfx = float(torch.dot(cg.x, fisher_vector(cg.x)))
    stats = StepStats({"trpo/grad_norm": float(g.norm()), "trpo/cg_residual": cg.residual_norm,
                       "trpo/step_fraction": 0.0, "trpo/kl": 0.0, "trpo/surrogate_improvement": 0.0})
    if not (xfx > 0 and math.isfinite(xfx)):
        return stats
    full_step = math.sqrt(2.0 * sec.max_kl / xfx) * cg.x                                # KL = max_kl to 2nd order
    stats["trpo/expected_improvement"] = float(torch.dot(g, full_step))
    theta = parameters_to_vector(params).detach().clone()
    base = float(loss_old.detach())
    with torch.no_grad():
        for i in range(sec.line_search_steps):
            frac = sec.backtrack ** i
            vector_to_parameters(theta + frac * full_step, params)
            new = log_dist()
            kl, improvement = float(mean_kl(new)), float(surrogate(new)) - base
            if kl <= sec.max_kl and improvement > 0:
                stats.update({"trpo/step_fraction": frac, "trpo/kl": kl, "trpo/surrogate_improvement": improvement,
                              "trpo/line_search_steps": i + 1})
                return stats
        vector_to_parameters(theta, params)  # no step satisfied both: keep the old policy
    stats["trpo/line_search_steps"] = sec.line_search_steps
    return stats


# --------------------------------------------------------------------------------------
# 5b. the value function, fitted on its own
# --------------------------------------------------------------------------------------
def value_parameters(actor) -> list[torch.nn.Parameter]:
    """What the value optimizer trains: the value head or the separate critic, never the policy."""
    module = actor.critic if actor.critic is not None else actor.value_head
    return [p for p in module.parameters() if p.requires_grad]


def fit_values(actor, optimizer, roll: Rollout, sec: TRPOSection, step: int, seed: int) -> dict[str, float]:
    """`value_epochs` passes of minibatches regressing the values on the returns. The
    forward attends to `roll.attend_mask` (a multi-turn episode's context too) in
    `sec.layout`; the loss reads the action tokens (`roll.response_mask`)."""
    g = torch.Generator().manual_seed(seed * 7_919 + step)
    losses = []
    mask, attend = roll.response_mask, roll.attend_mask
    for _ in range(sec.value_epochs):
        order = torch.randperm(len(roll), generator=g)
        for s in range(0, len(roll), sec.value_mini_batch_size):
            rows = order[s : s + sec.value_mini_batch_size]
            args = (roll.prompt_ids[rows], roll.prompt_mask[rows], roll.response_ids[rows], attend[rows])
            if actor.critic is not None:
                values = actor.critic(*args, mixed_precision=actor.mixed_precision, layout=sec.layout)
            else:  # the policy's features, detached: the value loss does not move the policy
                with torch.no_grad(), actor.autocast(mask.device):
                    hidden = response_hidden(actor.policy, *args, layout=sec.layout)
                values = actor.value_head(hidden)
            vl = ops.value_loss(values, roll.values[rows], roll.returns[rows], mask[rows], sec.value_clip)
            vl.loss.backward()
            if sec.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(value_parameters(actor), sec.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(vl.loss.detach()))
    return {"loss/value": sum(losses) / len(losses)}


# --------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------
def trpo_prepare(run: RLRun, roll, step: int, timer: Timer) -> dict[str, float]:
    """Phases 2-4 of one TRPO step on its rollout (one response per prompt)."""
    cfg, sec, models = run.cfg, run.sec, run.models
    temp = cfg.generation.temperature
    # 2. score.
    with timer("score"):
        roll.scores = score_responses(run.scorer, roll, cfg.reward, models.device)       # (B,)
    # 3. forward: old log-probs and values; the KL-shaped rewards.
    with timer("forward"):
        score_rollout(models.actor, models.reference, roll, temperature=temp, micro_batch=sec.batch_size,
                      with_values=True, layout=sec.layout)
        ref_lp = roll.ref_logprobs if roll.ref_logprobs is not None else roll.logprobs
        roll.rewards, roll.kl = ops.kl_shaped_rewards(roll.scores, roll.logprobs, ref_lp, roll.response_mask,
                                                      sec.kl_coeff, sec.kl_estimator)
        turns = episode_rewards(roll, models.device)  # multi-turn: as PPO (docs/environments.md)
        if turns is not None:
            roll.rewards = roll.rewards + ops.place_turn_rewards(
                turns, roll.episodes.turn_ends.to(models.device), roll.episodes.turn_mask.to(models.device),
                roll.response_mask.shape[1]).to(roll.rewards.dtype)
            roll.scores = outcome_scores(roll, roll.scores)
        # 4. advantages: GAE (over the action tokens of a multi-turn episode), whitened.
        gae = ops.gae if turns is None else ops.gae_over_actions
        adv, roll.returns = gae(roll.rewards, roll.values, roll.response_mask, sec.gamma, sec.lam)
        roll.advantages = whiten(adv, roll.response_mask, run.dist) if sec.whiten_advantages else adv
    return {}


def trpo_update(run: RLRun, roll, step: int) -> dict[str, float]:
    """5a. the natural-gradient step of the policy (with its line search); 5b. the value function."""
    cfg, sec, models = run.cfg, run.sec, run.models
    stats = natural_gradient_step(models.actor, roll, sec, cfg.generation.temperature)
    values = fit_values(models.actor, run.optimizer, roll, sec, step, cfg.training.seed)
    run.scheduler.step()
    return {**stats, **values, "lr": run.optimizer.param_groups[0]["lr"]}


def trpo_step(run: RLRun, examples, step: int, timer: Timer) -> dict[str, float]:
    """Phases 1-5 of one TRPO step, in one call (tests and benches); returns its metrics."""
    return one_step(run, examples, step, timer, trpo_prepare, trpo_update)


def method(cfg: TRPORunConfig) -> PolicyMethod:
    return PolicyMethod("trpo", trpo_prepare, trpo_update, critic=cfg.model.critic,
                        need_reference=lambda c: c.trpo.kl_coeff > 0 and c.model.reference != "none",
                        optimizer_params=value_parameters, step_knob="max_kl",
                        plot_groups={"reward": ["rollout/reward_mean", "eval/reward_mean", "eval/accuracy"],
                                     "trust_region": ["trpo/kl", "trpo/surrogate_improvement"],
                                     "line_search": ["trpo/step_fraction"], "value": ["loss/value"]})


train, add_parser, run = policy_entry_points(
    method, TRPORunConfig, command="trpo", example="trpo.max_kl=0.02")
