"""The math of RLHF as pure functions on tensors (torch only; no models, I/O or config).

Shapes: B batch, T response length, V vocabulary. `response_mask` is 1 for a real
response token. See each module's docstring for where it departs from common practice.
"""

from rlhflab.ops.advantages import GAEOutput, batch_std_of, discounted_returns, gae, group_advantages, rloo_advantages
from rlhflab.ops.chunked import LogitTransform, TokenLogprobs, chunked_cross_entropy, chunked_logprobs, transform_logits
from rlhflab.ops.importance import SequenceMaskWeights, logprob_gap, sequence_mask_weights, truncated_is_weights
from rlhflab.ops.kl import KL_KINDS, kl_estimate, kl_shaped_rewards, last_token_index
from rlhflab.ops.logprobs import entropy_from_logits, logprobs_from_logits
from rlhflab.ops.multiturn import (
    discounted_returns_over_actions,
    episode_returns,
    gae_over_actions,
    place_turn_rewards,
)
from rlhflab.ops.losses import (
    DPOLossOutput,
    EntropyLossOutput,
    PolicyLossOutput,
    RewardModelLossOutput,
    ValueLossOutput,
    aggregate,
    dpo_loss,
    entropy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
    reward_model_loss,
    value_loss,
)
from rlhflab.ops.natural_gradient import CGResult, categorical_kl, conjugate_gradient
from rlhflab.ops.sampling import counter_uniform, inverse_cdf_draw, row_keys
from rlhflab.ops.stats import explained_variance, masked_mean, masked_pivot, masked_sum, masked_var, masked_whiten

__all__ = [
    "masked_sum", "masked_mean", "masked_var", "masked_whiten", "masked_pivot", "explained_variance",
    "logprobs_from_logits", "entropy_from_logits",
    "chunked_logprobs", "chunked_cross_entropy", "TokenLogprobs", "LogitTransform", "transform_logits",
    "KL_KINDS", "kl_estimate", "kl_shaped_rewards", "last_token_index",
    "GAEOutput", "gae", "group_advantages", "batch_std_of", "rloo_advantages", "discounted_returns",
    "gae_over_actions", "discounted_returns_over_actions", "place_turn_rewards", "episode_returns",
    "aggregate", "ppo_policy_loss", "gspo_policy_loss", "PolicyLossOutput", "value_loss", "ValueLossOutput",
    "entropy_loss", "EntropyLossOutput", "dpo_loss", "DPOLossOutput",
    "reward_model_loss", "RewardModelLossOutput",
    "truncated_is_weights", "sequence_mask_weights", "SequenceMaskWeights", "logprob_gap", "categorical_kl", "conjugate_gradient", "CGResult", "row_keys", "counter_uniform", "inverse_cdf_draw",
]
