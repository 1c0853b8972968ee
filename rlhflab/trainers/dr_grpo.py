"""Dr. GRPO: `rlhflab dr-grpo --config configs/dr_grpo_debug.yaml [key=value ...]`.

"GRPO Done Right" (Liu et al., 2025, "Understanding R1-Zero-Like Training") removes two
normalisations of GRPO that bias it:

- the per-group std: dividing by it up-weights prompts whose rewards barely differ
  (too easy or too hard), so the advantage is the centred reward alone
  (`advantage_scale: none`);
- the per-response length: a token mean inside each response makes a long wrong answer
  cost less per token than a short one, so the loss sums tokens and divides by a
  constant, responses × max_new_tokens (`loss_aggregation: token_sum`).

It is GRPO's step with these defaults (and no KL term, `kl_coeff: 0`, as in the paper); the
engine does the rest. Every GRPO key still applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhflab.config.schema import Aggregation, f
from rlhflab.trainers.grpo import GRPOSection, grpo_prepare, grpo_update
from rlhflab.trainers.loop import PolicyMethod, policy_entry_points, policy_run_config


@dataclass
class DrGRPOSection(GRPOSection):
    """Dr. GRPO settings: GRPO's, with the two normalisations removed by default."""

    advantage_scale: Literal["group", "batch", "none"] = f(
        "none", "none: the centred reward (Dr. GRPO); group or batch bring GRPO's std back")
    loss_aggregation: Aggregation = f(
        "token_sum", "token_sum: token sum over responses x max_new_tokens (Dr. GRPO's constant)")
    kl_coeff: float = f(0.0, "weight of the KL(policy||reference) term in the loss; 0 loads no reference", ge=0)


DrGRPORunConfig = policy_run_config(
    "DrGRPORunConfig", "dr_grpo", DrGRPOSection, command="dr-grpo", title="a Dr. GRPO", kl_weight="kl_coeff",
    module=__name__)


def method(cfg: DrGRPORunConfig) -> PolicyMethod:
    return PolicyMethod("dr_grpo", grpo_prepare, grpo_update, need_reference=lambda c: c.dr_grpo.kl_coeff > 0)


train, add_parser, run = policy_entry_points(
    method, DrGRPORunConfig, command="dr-grpo", example="dr_grpo.group_size=8")
