"""Exercise 5: the PPO minibatch update.

Two functions: `minibatch_loss` (forward pass and losses of one minibatch) and
`update_step` (one optimizer step over a group of minibatches, with gradient
accumulation and gradient-norm clipping). They use your exercises 1-3, imported below.

Contract
--------
minibatch_loss(model, mb, settings)

    model     call it as  `logits, values = model(mb)`:
                  logits  (B, T, V)  the policy's logits at the response positions
                                     (temperature already applied), with gradient
                  values  (B, T)     the critic's values there, with gradient
              `model.parameters()` lists the trainable parameters.
    mb        a dict of tensors for one minibatch:
                  response_ids   (B, T) long   the sampled tokens
                  response_mask  (B, T) 0/1    1 on a real response token
                  old_logprobs, old_values, advantages, returns   (B, T), from the rollout
              (plus input_ids, attention_mask, prompt_len, which the model reads).
    settings  an object with the fields clip_eps, value_clip, vf_coeff, entropy_coeff,
              max_grad_norm (the `ppo:` section of the config).

    Returns MinibatchLoss(total, policy, value, entropy, policy_clip_frac, value_clip_frac):

        total = policy + vf_coeff * value + entropy_coeff * (entropy loss)

    where policy, value and the entropy loss are your exercises 1-3 on this minibatch
    (each a mean over its real tokens). `total` is a 0-dim tensor with gradient; the
    others are for logging: `entropy` is the mean entropy itself (not the loss), the
    clip fractions are those of exercises 1 and 2.

update_step(model, minibatches, optimizer, settings)

    minibatches  a list of mb dicts: one gradient-accumulation group
    optimizer    a torch optimizer over model.parameters()

    Takes ONE optimizer step whose gradient is that of the whole group taken as one
    batch (a token mean over all its real tokens):
      1. for each minibatch, its `total` weighted by (its real tokens) / (the group's
         real tokens), then backward (the gradients add up across minibatches);
      2. clip the global gradient norm of model.parameters() to settings.max_grad_norm
         (None: no clipping);
      3. step the optimizer, and leave no gradient behind for the next call.

    Returns UpdateStats(loss, grad_norm), both floats: the group's loss (the sum of
    the weighted minibatch totals) and the global gradient norm *before* clipping.

Why
---
This is phase 5 of the PPO loop: a fresh forward pass with gradients on data that was
collected without them, the three losses combined into one, and one optimizer step per
group of minibatches. Responses have different lengths, so dividing each minibatch's
mean loss by the number of minibatches would weigh a short minibatch's tokens more than
a long one's; weighting by token counts makes accumulating 8 minibatches of 1 exactly
equal to one minibatch of 8. See docs/ppo_step.md and docs/batching.md (exact gradient
accumulation).

Check your work:   rlhflab learn check 5 --dir <this folder>
(graded with the library's versions of exercises 1-3 in place of yours, so that a
mistake there does not show up here; `rlhflab learn run` uses yours)
Stuck?             rlhflab learn solution 5
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rlhflab.ops import logprobs_from_logits  # given: log pi of `tokens` from `logits`, (B, T)

from ex1_policy_loss import compute_policy_loss
from ex2_value_loss import compute_value_loss
from ex3_entropy_loss import compute_entropy_loss


class MinibatchLoss(NamedTuple):
    total: Tensor             # scalar with gradient: policy + vf_coeff*value + entropy_coeff*(-entropy)
    policy: Tensor            # the three parts, for logging
    value: Tensor
    entropy: Tensor           # mean entropy (not the loss)
    policy_clip_frac: Tensor
    value_clip_frac: Tensor


class UpdateStats(NamedTuple):
    loss: float       # the group's loss: sum of the token-weighted minibatch totals
    grad_norm: float  # global gradient norm before clipping


def minibatch_loss(model, mb: dict, settings) -> MinibatchLoss:
    # ==== YOUR CODE (exercise 5, part 1) ==== replace the line below; about 10 lines
    raise NotImplementedError("exercise 5: minibatch_loss is not written yet")
    # ==== END OF YOUR CODE ====


def update_step(model, minibatches: list[dict], optimizer, settings) -> UpdateStats:
    # ==== YOUR CODE (exercise 5, part 2) ==== replace the line below; about 12 lines
    raise NotImplementedError("exercise 5: update_step is not written yet")
    # ==== END OF YOUR CODE ====
