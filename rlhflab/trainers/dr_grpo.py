"""Dr. GRPO: `rlhflab dr-grpo --config configs/dr_grpo_debug.yaml [key=value ...]`.

"GRPO Done Right" (Liu et al., 2025, "Understanding R1-Zero-Like Training") removes two
normalisations of GRPO that bias it:

- the per-group std: dividing by it up-weights prompts whose rewards barely differ
  (too easy or too hard), so the advantage is the centred reward alone
  (`advantage_scale: none`);
- the per-response length: a token mean inside each response makes a long wrong answer
  cost less per token than a short one, so the loss sums tokens and divides by a
  constant, responses × max_new_tokens (`loss_aggregation: token_sum`).

It is GRPO's step with these defaults (and no KL term, `beta: 0`, as in the paper); the
engine does the rest. Every GRPO key still applies.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlhflab.config.schema import (Aggregation, DatasetConfig, GenerationConfig, LoggingConfig, LoRAConfig,
                                   ModelConfig, RewardConfig, TrainingConfig, check_reference, f)
from rlhflab.trainers.common import TrainResult
from rlhflab.trainers.grpo import GRPOSection, grpo_step
from rlhflab.trainers.loop import PolicyMethod, add_policy_parser, run_policy_command, run_policy_training


@dataclass
class DrGRPOSection(GRPOSection):
    """Dr. GRPO settings: GRPO's, with the two normalisations removed by default."""

    advantage_scale: Literal["group", "batch", "none"] = f(
        "none", "none: the centred reward (Dr. GRPO); group or batch bring GRPO's std back")
    loss_aggregation: Aggregation = f(
        "token_sum", "token_sum: token sum over responses x max_new_tokens (Dr. GRPO's constant)")
    beta: float = f(0.0, "weight of the KL(policy||reference) term in the loss; 0 loads no reference", ge=0)


@dataclass
class DrGRPORunConfig:
    """`rlhflab dr-grpo`: every section of a Dr. GRPO run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    dr_grpo: DrGRPOSection = field(default_factory=DrGRPOSection)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def check(self) -> list[str]:
        return check_reference(self.model, self.lora, self.dr_grpo.beta, "dr_grpo.beta")


def method(cfg: DrGRPORunConfig) -> PolicyMethod:
    return PolicyMethod("dr_grpo", grpo_step, need_reference=lambda c: c.dr_grpo.beta > 0)


def train(cfg: DrGRPORunConfig, resume: str | Path | None = None, effective=None,
          quiet: bool = False) -> TrainResult:
    """Run Dr. GRPO as configured."""
    return run_policy_training(cfg, method(cfg), resume=resume, effective=effective, quiet=quiet)


def add_parser(parser: argparse.ArgumentParser) -> None:
    add_policy_parser(parser, "dr-grpo", "dr_grpo.group_size=8")


def run(args: argparse.Namespace) -> int:
    return run_policy_command(args, DrGRPORunConfig, train)
