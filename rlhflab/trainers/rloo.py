"""RLOO for language models: `rlhflab rloo --config configs/rloo_debug.yaml [key=value ...]`.

REINFORCE Leave-One-Out (Kool et al., 2019; Ahmadian et al., 2024, "Back to Basics"):
no critic; each prompt is answered `rloo.k` times and each response's baseline is the
mean reward of the other k − 1. The KL to the reference is folded into the sequence
reward, as in the usual formulation:

    R_i = score_i − kl_coeff · Σ_t KL_t(π‖π_ref)       A_i = R_i − mean_{j≠i} R_j

One visible step (the loop around it, phase 6, is shared with GRPO):

    1. rollout      k sampled responses per prompt
    2. score        the reward of each response
    3. forward      the sampling policy's log-probs and the reference's (when kl_coeff > 0);
                    the sequence-level KL folded into the reward
    4. advantages   `ops.rloo_advantages`, the same value on every token
    5. update       the clipped surrogate of `policy_update` (with one optimizer step per
                    rollout the ratio is 1 and this is plain REINFORCE with the baseline)

Departures: the KL is k1 summed over the response by default (an unbiased sequence
KL); `normalize_advantages` whitens over the batch (TRL's option), off by default.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from rlhflab import ops
from rlhflab.config import load_config
from rlhflab.config.schema import (DatasetConfig, EvalConfig, GenerationConfig, KLKind, LoggingConfig, LoRAConfig,
                                   ModelConfig, RewardConfig, TrainingConfig, f)
from rlhflab.rewards.preflight import preflight
from rlhflab.trainers.common import Timer
from rlhflab.trainers.policy_gradient import (PolicyGradientSection, PolicyModels, TrainResult,
                                              broadcast_advantages, check_reference, old_logprobs,
                                              policy_update, reference_logprobs, report, rollout_metrics,
                                              run_training, sample_groups, score_responses)


@dataclass
class RLOOSection(PolicyGradientSection):
    """RLOO settings (the rollout, optimizer and update fields are shared with GRPO)."""

    KL_KNOB = "rloo.kl_coeff"  # named in the doctor's advice

    k: int = f(4, "responses sampled per prompt; each one's baseline is the mean of the other k-1", gt=1)
    kl_coeff: float = f(0.05, "weight of the sequence KL(policy||reference) subtracted from the reward; 0 loads no reference", ge=0)
    kl_estimator: KLKind = f("k1", "per-token KL estimator, summed over the response")
    normalize_advantages: bool = f(False, "whiten the advantages over the batch (mean 0, std 1)")

    @property
    def samples_per_prompt(self) -> int:
        return self.k


@dataclass
class RLOORunConfig:
    """`rlhflab rloo`: every section of an RLOO run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rloo: RLOOSection = field(default_factory=RLOOSection)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def check(self) -> list[str]:
        return check_reference(self.model, self.lora, self.rloo.kl_coeff, "rloo.kl_coeff")


def rloo_step(models: PolicyModels, examples, cfg: RLOORunConfig, scorer, optimizer, scheduler,
              step: int, timer: Timer) -> dict[str, float]:
    """Phases 1-5 of one RLOO step; returns its metrics."""
    r, temp = cfg.rloo, cfg.generation.temperature
    # 1. rollout: k responses per prompt, each prompt's responses contiguous.
    with timer("generate"):
        roll = sample_groups(models, examples, r.k, cfg.generation, cfg.dataset.max_prompt_length, r.batch_size,
                             r.share_prompt)
    # 2. score.
    with timer("score"):
        scores = score_responses(scorer, roll, cfg.reward, models.device)                # (B,)
        roll.scores = scores
    # 3. forward: sampling-policy and reference log-probs; the sequence KL joins the reward.
    with timer("forward"):
        micro = max(r.mini_batch_size, r.batch_size)
        k = r.k if r.share_prompt else 1
        mask = roll.response_mask.float()
        rewards = scores
        if r.kl_coeff > 0 or r.optimizer_steps_per_rollout() > 1:
            old_logprobs(models, roll, temp, micro, k)                                       # (B, T)
        if r.kl_coeff > 0:
            roll.ref_logprobs = reference_logprobs(models.reference, roll, temp, micro, k)  # (B, T)
            kl_seq = (ops.kl_estimate(roll.logprobs, roll.ref_logprobs, r.kl_estimator) * mask).sum(-1)  # (B,)
            rewards = scores - r.kl_coeff * kl_seq
    # 4. advantages: leave-one-out baseline, the same value on every token.
    seq_adv = ops.rloo_advantages(rewards, r.k)                                          # (B,)
    if r.normalize_advantages and len(seq_adv) > 1:
        seq_adv = (seq_adv - seq_adv.mean()) / (seq_adv.std() + 1e-8)
    roll.advantages = broadcast_advantages(seq_adv, roll.response_mask)                  # (B, T)
    # 5. update: the KL is already in the reward, so none in the loss.
    with timer("update"):
        upd = policy_update(models, optimizer, scheduler, roll, r, temperature=temp, step=step,
                            seed=cfg.training.seed, kl_coeff=0.0)
    metrics = {**rollout_metrics(roll, scores, r.k), **upd,
               "rollout/shaped_reward_mean": float(rewards.mean()),
               "rollout/advantage_abs_mean": float(seq_adv.abs().mean())}
    if r.kl_coeff > 0:
        metrics["params/kl_to_ref"] = float(kl_seq.mean())
    return metrics


def train(cfg: RLOORunConfig, resume: str | Path | None = None, effective=None,
          quiet: bool = False) -> TrainResult:
    """Run RLOO as configured (the loop around `rloo_step` is `run_training`)."""
    preflight(cfg, quiet)  # every reward/check plug-in imported and called once, before any model loads
    return run_training(cfg, cfg.rloo, rloo_step, "rloo", need_reference=cfg.rloo.kl_coeff > 0,
                        resume=resume, effective=effective, quiet=quiet)


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/rloo_debug.yaml")
    parser.add_argument("--resume", default=None, help="continue from a step_N/ checkpoint folder")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rloo.k=8")


def run(args: argparse.Namespace) -> int:
    cfg, effective = load_config(args.config, RLOORunConfig, args.overrides)
    report(train(cfg, resume=args.resume, effective=effective))
    return 0
