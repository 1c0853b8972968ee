"""Exercise 1: the PPO clipped policy loss.

Contract
--------
compute_policy_loss(logprobs, old_logprobs, advantages, response_mask, clip_eps=0.2)

    logprobs       (B, T) float  log pi(a_t | s_t) under the policy being trained; it
                                 carries the gradient
    old_logprobs   (B, T) float  the same tokens under the policy that sampled them
                                 (fixed for the whole update, no gradient)
    advantages     (B, T) float  A_t, already whitened (no gradient)
    response_mask  (B, T) 0/1    1 on a real response token, 0 on padding
    clip_eps       float         epsilon, the clip range of the ratio

B is the batch (episodes), T the response length. Padding sits on the right of each
row, and padding positions of the other inputs may hold any number at all: they must
not change the result.

Returns PolicyLoss(loss, clip_frac):

    loss       0-dim tensor to *minimise*, with a gradient with respect to `logprobs`:
               minus the mean, over real response tokens, of PPO's clipped objective

                   r_t         = pi(a_t|s_t) / pi_old(a_t|s_t)
                   objective_t = min( r_t * A_t ,  clip(r_t, 1 - eps, 1 + eps) * A_t )

               "mean over real response tokens" = sum_t x_t * mask_t / sum_t mask_t
               over the whole batch (every real token weighs the same).
    clip_frac  0-dim tensor (or float): the fraction of real response tokens where the
               clipped term is the one taken, i.e. where clip(r)*A is strictly smaller
               than r*A (those tokens get no gradient).

Why
---
A policy-gradient step that is too large can ruin a policy in one update, and PPO
reuses each batch for several epochs, so the ratio drifts away from 1 as it trains.
The clip removes the incentive to move a token's probability further than 1 +- eps in
the direction its advantage pushes, while the min keeps the pessimistic term, so a
step in the wrong direction is always pulled back. See
docs/trpo_to_ppo.md (section 3, the four cases) and docs/ppo_step.md (the losses).

Check your work:   rlhflab learn check 1 --dir <this folder>
Stuck?             rlhflab learn solution 1
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class PolicyLoss(NamedTuple):
    loss: Tensor       # scalar, to minimise
    clip_frac: Tensor  # fraction of real tokens on the clipped branch


def compute_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                        response_mask: Tensor, clip_eps: float = 0.2) -> PolicyLoss:
    # ==== YOUR CODE (exercise 1) ==== replace the line below; about 8 lines
    raise NotImplementedError("exercise 1: compute_policy_loss is not written yet")
    # ==== END OF YOUR CODE ====
