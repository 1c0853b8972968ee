"""Exercise 4: GAE advantages, returns, and whitening.

Contract
--------
compute_gae_advantages(rewards, values, response_mask, gamma=1.0, lam=0.95)

    rewards        (B, T) float  the per-token reward r_t (KL penalty on every token,
                                 the score added on the last real one)
    values         (B, T) float  the critic's V(s_t) from the rollout
    response_mask  (B, T) 0/1    1 on a real response token, 0 on padding; the
                                 padding is on the right (1 ... 1 0 ... 0)
    gamma, lam     float         the discount and the GAE lambda

Returns GAE(advantages, returns), both (B, T):

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}
    returns = A + V                (the value targets)

The episode ends at the last real token: past it, V and A are 0 (do not bootstrap
from a padding position). Padding positions of `rewards` and `values` may hold any
number; advantages and returns must be 0 there. Do not whiten here.

whiten_advantages(advantages, response_mask)

    advantages     (B, T) float
    response_mask  (B, T) 0/1

Returns (B, T): (A - mean) / sqrt(var + 1e-8), where the mean and the (population,
divide-by-n) variance are taken over the real response tokens of the whole batch;
0 on padding.

Why
---
The advantage says how much better than expected a token turned out. GAE blends the
one-step TD error (low variance, biased by the critic) with the Monte Carlo return
(unbiased, noisy) through lam. Written forwards each A_t is a sum over all later
tokens; the recursion above, run from the last token back to the first, costs one
multiply-add per token. Whitening puts every batch's advantages on the same scale, so
one learning rate works whatever the reward's size; counting padding in the mean and
the spread would shift every real advantage. See docs/advantages.md.

Check your work:   rlhflab learn check 4 --dir <this folder>
Stuck?             rlhflab learn solution 4
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class GAE(NamedTuple):
    advantages: Tensor  # (B, T), 0 on padding
    returns: Tensor     # (B, T) = advantages + values, 0 on padding


def compute_gae_advantages(rewards: Tensor, values: Tensor, response_mask: Tensor,
                           gamma: float = 1.0, lam: float = 0.95) -> GAE:
    # ==== YOUR CODE (exercise 4, part 1) ==== replace the line below; about 12 lines
    raise NotImplementedError("exercise 4: compute_gae_advantages is not written yet")
    # ==== END OF YOUR CODE ====


def whiten_advantages(advantages: Tensor, response_mask: Tensor) -> Tensor:
    # ==== YOUR CODE (exercise 4, part 2) ==== replace the line below; about 5 lines
    raise NotImplementedError("exercise 4: whiten_advantages is not written yet")
    # ==== END OF YOUR CODE ====
