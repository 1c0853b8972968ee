"""GSPO: `rlhflab gspo --config configs/gspo_debug.yaml [key=value ...]`.

Group Sequence Policy Optimization (Zheng et al., 2025) is GRPO with the importance ratio
taken per response instead of per token: s_i = exp(mean_t log π/π_old), the geometric
mean of the response's token ratios, clipped at the sequence level
(`ops.gspo_policy_loss`). A response is rewarded as a whole, so its off-policy
correction is made as a whole too; token ratios' noise no longer enters the gradient one
token at a time. Phases 1-4 are GRPO's (group advantages); phase 5 is the engine with
this policy loss.

Where it departs from GRPO's defaults, as in the paper:
- `clip_eps` 3e-4 below and `clip_eps_high` 4e-4 above: a mean of log-ratios moves
  little, so the clip range is two orders of magnitude below PPO's 0.2.
- `loss_aggregation: seq_mean`: the mean over responses of each response's loss.
- `kl_coeff: 0`: no KL term (and no reference loaded); set kl_coeff > 0 to add GRPO's k3 term.
- Token-level options (`dual_clip`, `tis_cap`) are refused, and so is `sequence_mask_cap`.
With one optimizer step per rollout the ratio is exactly 1 and GSPO's update equals
GRPO's with seq_mean; the clip acts once a rollout feeds several minibatch steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlhflab import ops
from rlhflab.config.schema import Aggregation, f
from rlhflab.engine.update import PPOMath
from rlhflab.trainers.grpo import GRPOSection, grpo_prepare, grpo_update
from rlhflab.trainers.loop import PolicyMethod, policy_entry_points, policy_run_config


@dataclass
class GSPOSection(GRPOSection):
    """GSPO settings: GRPO's, with the sequence-level ratio's clip range and aggregation."""

    clip_eps: float = f(3e-4, "sequence-ratio clip below: s_i under 1-clip_eps stops the gradient (paper: 3e-4)",
                        gt=0, lt=1)
    clip_eps_high: Optional[float] = f(4e-4, "sequence-ratio clip above (paper: 4e-4); null uses clip_eps", gt=0)
    loss_aggregation: Aggregation = f("seq_mean", "seq_mean: the mean over responses of their loss (GSPO's)")
    kl_coeff: float = f(0.0, "weight of the KL(policy||reference) term in the loss; 0 loads no reference", ge=0)

    def check(self) -> list[str]:
        errs = super().check()
        for key in ("dual_clip", "tis_cap"):
            if getattr(self, key) is not None:
                errs.append(f"{key}: a token-level option; GSPO clips the sequence ratio, set {key}=null")
        if self.sequence_mask_cap is not None:
            errs.append("sequence_mask_cap: GSPO's sequence-level loss takes no importance weights yet; "
                        "set sequence_mask_cap=null")
        return errs


GSPORunConfig = policy_run_config(
    "GSPORunConfig", "gspo", GSPOSection, command="gspo", title="a GSPO", kl_weight="kl_coeff", module=__name__)


def method(cfg: GSPORunConfig) -> PolicyMethod:
    return PolicyMethod("gspo", grpo_prepare, grpo_update, stale_correction=False, need_reference=lambda c: c.gspo.kl_coeff > 0)


# GRPO's prepare and update; the engine minimises the sequence-level loss instead of the token-level one.
train, add_parser, run = policy_entry_points(method, GSPORunConfig, command="gspo", example="gspo.clip_eps=3e-4",
                                             math_=PPOMath(policy_loss=ops.gspo_policy_loss))
