"""GRPO for language models: `rlhflab grpo --config configs/grpo_debug.yaml [key=value ...]`.

Group Relative Policy Optimization (Shao et al., 2024, DeepSeekMath): no critic; each
prompt is answered `grpo.group_size` times and a response's advantage is its reward
relative to the others of its group. One visible loop:

    1. rollout      group_size sampled responses per prompt (KV cache, no gradients)
    2. score        the reward of each response (rule, reward model, classifier)
    3. forward      reference log-probs (only when beta > 0); old log-probs (only when a
                    step makes more than one optimizer step, see below)
    4. advantages   `ops.group_advantages`: reward − group mean, divided by the group's
                    std, the batch's std, or nothing; the same value on every token
    5. update       clipped surrogate against the sampling policy + beta · KL(k3) to the
                    reference, in epochs of minibatches with gradient accumulation
    6. log, evaluate, save

Where we depart from the paper or from common practice:
- The ratio of the clipped surrogate is π/π_old with π_old the policy that sampled the
  responses. (Some tutorials take it against the reference, which makes the clip a
  second KL penalty and not a trust region.) When a step makes exactly one optimizer
  step, π_old is the current policy, so its log-probs are the detached log-probs of the
  update's own forward pass and no extra pass is made; the ratio is then exactly 1.
- `beta` = 0 loads no reference model at all (DAPO, Dr. GRPO drop the KL term).
- Under LoRA the reference is the adapter-disabled policy, never a second copy.
- `advantage_scale: batch` divides by the batch's std instead of the group's, which
  does not up-weight prompts whose group rewards barely differ (Liu et al., 2025).
- `loss_aggregation: token_mean` divides by the tokens of the whole accumulated batch
  (DAPO); the paper's per-sequence mean is `seq_mean`.
- `mask_truncated` leaves responses that hit the length limit without EOS out of the
  loss (DAPO's overlong filtering); they still count in their group's mean and std.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

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


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
@dataclass
class GRPOSection(PolicyGradientSection):
    """GRPO settings (the rollout, optimizer and update fields are shared with RLOO)."""

    KL_KNOB = "grpo.beta"  # named in the doctor's advice

    group_size: int = f(4, "responses sampled per prompt; advantages are relative to this group", gt=1)
    advantage_scale: Literal["group", "batch", "none"] = f(
        "group", "divide the centred reward by the group's std, the batch's std, or nothing")
    beta: float = f(0.04, "weight of the KL(policy||reference) term in the loss; 0 loads no reference", ge=0)
    kl_estimator: KLKind = f("k3", "per-token KL estimator in the loss: k3 (GRPO's), k1, k2, abs or mse")

    @property
    def samples_per_prompt(self) -> int:
        return self.group_size


@dataclass
class GRPORunConfig:
    """`rlhflab grpo`: every section of a GRPO run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def check(self) -> list[str]:
        return check_reference(self.model, self.lora, self.grpo.beta, "grpo.beta")


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------
def grpo_step(models: PolicyModels, examples, cfg: GRPORunConfig, scorer, optimizer, scheduler,
              step: int, timer: Timer) -> dict[str, float]:
    """Phases 1-5 of one GRPO step; returns its metrics."""
    g, temp = cfg.grpo, cfg.generation.temperature
    # 1. rollout: group_size responses per prompt, each group contiguous.
    with timer("generate"):
        roll = sample_groups(models, examples, g.group_size, cfg.generation,
                             cfg.dataset.max_prompt_length, g.batch_size, g.share_prompt)
    # 2. score: one float per response.
    with timer("score"):
        scores = score_responses(scorer, roll, cfg.reward, models.device)            # (B,)
        roll.scores = scores
    # 3. forward: reference log-probs for the KL term; old log-probs only when needed.
    with timer("forward"):
        micro = max(g.mini_batch_size, g.batch_size)
        k = g.group_size if g.share_prompt else 1
        if g.optimizer_steps_per_rollout() > 1:
            old_logprobs(models, roll, temp, micro, k)                                   # (B, T)
        if g.beta > 0:
            roll.ref_logprobs = reference_logprobs(models.reference, roll, temp, micro, k)  # (B, T)
    # 4. advantages: relative to the group, the same value on every token.
    seq_adv = ops.group_advantages(scores, g.group_size, g.advantage_scale)           # (B,)
    roll.advantages = broadcast_advantages(seq_adv, roll.response_mask)               # (B, T)
    # 5. update.
    with timer("update"):
        upd = policy_update(models, optimizer, scheduler, roll, g, temperature=temp, step=step,
                            seed=cfg.training.seed, kl_coeff=g.beta, kl_estimator=g.kl_estimator)
    metrics = {**rollout_metrics(roll, scores, g.group_size), **upd,
               "rollout/advantage_abs_mean": float(seq_adv.abs().mean())}
    return metrics


def train(cfg: GRPORunConfig, resume: str | Path | None = None, effective=None,
          quiet: bool = False) -> TrainResult:
    """Run GRPO as configured (step 6, the loop around `grpo_step`, is `run_training`)."""
    preflight(cfg, quiet)  # every reward/check plug-in imported and called once, before any model loads
    return run_training(cfg, cfg.grpo, grpo_step, "grpo", need_reference=cfg.grpo.beta > 0,
                        resume=resume, effective=effective, quiet=quiet)


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/grpo_debug.yaml")
    parser.add_argument("--resume", default=None, help="continue from a step_N/ checkpoint folder")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.group_size=8")


def run(args: argparse.Namespace) -> int:
    cfg, effective = load_config(args.config, GRPORunConfig, args.overrides)
    report(train(cfg, resume=args.resume, effective=effective))
    return 0
    return 0
