"""The reference solution in the exercises' signatures: thin adapters, no second copy.

Each function below calls the library's own code (`rlhflab.ops` and the PPO trainer)
and only renames its inputs and outputs to the contract of an exercise. The grader
compares the learner's functions with these; `rlhflab learn solution N` prints the
library functions they call. There is deliberately no hand-written solution file.

`minibatch_loss` and `update_step` are the engine's `minibatch_loss` and
`update_group` (engine/update.py: the optimizer step over one accumulation group),
given the group's token count as normalizer; the exercises' minibatch dicts become the
engine's `MiniBatch`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rlhflab import ops
from rlhflab.engine.minibatch import MiniBatch
from rlhflab.engine.update import PPOMath, minibatch_loss as engine_minibatch_loss, update_group


class PolicyLoss(NamedTuple):
    loss: Tensor
    clip_frac: Tensor


class ValueLoss(NamedTuple):
    loss: Tensor
    clip_frac: Tensor


class EntropyLoss(NamedTuple):
    loss: Tensor
    entropy: Tensor


class MinibatchLoss(NamedTuple):
    total: Tensor
    policy: Tensor
    value: Tensor
    entropy: Tensor
    policy_clip_frac: Tensor
    value_clip_frac: Tensor


class UpdateStats(NamedTuple):
    loss: float
    grad_norm: float


# ---------------------------------------------------------------- exercises 1-4
def compute_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                        response_mask: Tensor, clip_eps: float = 0.2) -> PolicyLoss:
    out = ops.ppo_policy_loss(logprobs, old_logprobs, advantages, response_mask, clip_eps)
    return PolicyLoss(out.loss, out.clip_frac)


def compute_value_loss(values: Tensor, old_values: Tensor, returns: Tensor,
                       response_mask: Tensor, clip_range: float | None = 0.2) -> ValueLoss:
    out = ops.value_loss(values, old_values, returns, response_mask, clip_range)
    return ValueLoss(out.loss, out.clip_frac)


def compute_entropy_loss(logits: Tensor, response_mask: Tensor) -> EntropyLoss:
    out = ops.entropy_loss(ops.entropy_from_logits(logits), response_mask)
    return EntropyLoss(out.loss, out.entropy)


def compute_gae_advantages(rewards: Tensor, values: Tensor, response_mask: Tensor,
                           gamma: float = 1.0, lam: float = 0.95) -> ops.GAEOutput:
    return ops.gae(rewards, values, response_mask, gamma, lam)


def whiten_advantages(advantages: Tensor, response_mask: Tensor) -> Tensor:
    return ops.masked_whiten(advantages, response_mask)


# ---------------------------------------------------------------- exercise 5
class ResponseModel:
    """What exercise 5 receives as `model`: `logits, values = model(mb)`.

    Wraps anything with the actor-critic's `forward_response(input_ids, attention_mask,
    prompt_len, with_values)` and `trainable_parameters()`: the real `ActorCritic` in
    `learn run`, a toy one in the grader. Keeps the last logits so the trainer adapter
    can log the approximate KL without a second forward pass.
    """

    def __init__(self, actor_critic, temperature: float = 1.0):
        self.actor_critic = actor_critic
        self.temperature = temperature
        self.last_logits: Tensor | None = None

    def __call__(self, mb: dict) -> tuple[Tensor, Tensor]:
        out = self.actor_critic.forward_response(mb["input_ids"], mb["attention_mask"],
                                                 mb["prompt_len"], True)
        logits = out.logits if self.temperature == 1.0 else out.logits / self.temperature  # (B, T, V)
        self.last_logits = logits
        return logits, out.values

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.actor_critic.trainable_parameters())


def n_tokens(mb: dict) -> float:
    """Real response tokens of a minibatch (at least 1, as the library's normalizer)."""
    return float(mb["response_mask"].sum().clamp(min=1))


def minibatch_loss(model: ResponseModel, mb: dict, settings) -> MinibatchLoss:
    """The engine's `minibatch_loss`, normalised by this minibatch's own tokens."""
    total, st = engine_minibatch_loss(model.actor_critic, MiniBatch.from_mapping(mb), settings, model.temperature,
                                      PPOMath(), normalizer=n_tokens(mb))
    t = lambda x: torch.tensor(x)  # noqa: E731 - the trainer's stats are floats
    return MinibatchLoss(total, t(st.policy), t(st.value), t(st.entropy),
                         t(st.policy_clip_frac), t(st.value_clip_frac))


def update_step(model: ResponseModel, minibatches: list[dict], optimizer, settings) -> UpdateStats:
    """The engine's `update_group`: one optimizer step over a gradient-accumulation group."""
    # Every minibatch's loss is divided by the whole group's token count, so the
    # accumulated gradient is that of the group as one batch (docs/batching.md).
    group_tokens = sum(n_tokens(mb) for mb in minibatches)
    grad_norm, stats = update_group(model.actor_critic, [MiniBatch.from_mapping(mb) for mb in minibatches],
                                    optimizer, model.parameters(), settings, model.temperature, PPOMath(),
                                    normalizer=group_tokens)
    # Each minibatch's total is already its share of the group: their sum is the group's loss.
    return UpdateStats(sum(st.total for st in stats), grad_norm)


REFERENCE_FUNCTIONS = {
    "compute_policy_loss": compute_policy_loss,
    "compute_value_loss": compute_value_loss,
    "compute_entropy_loss": compute_entropy_loss,
    "compute_gae_advantages": compute_gae_advantages,
    "whiten_advantages": whiten_advantages,
    "minibatch_loss": minibatch_loss,
    "update_step": update_step,
}
