"""Exercise 2: the clipped value loss.

Contract
--------
compute_value_loss(values, old_values, returns, response_mask, clip_range=0.2)

    values         (B, T) float  V(s_t) from the critic now; it carries the gradient
    old_values     (B, T) float  V(s_t) when the batch was collected (no gradient)
    returns        (B, T) float  the targets R_t from GAE (no gradient)
    response_mask  (B, T) 0/1    1 on a real response token, 0 on padding
    clip_range     float | None  c; None means no clipping at all

Padding positions of the inputs may hold any number: they must not change the result.

Returns ValueLoss(loss, clip_frac):

    loss       0-dim tensor with a gradient with respect to `values`:

                   V_clip_t = old_values_t + clip(values_t - old_values_t, -c, c)
                   loss     = 1/2 * mean over real tokens of
                              max( (values_t - R_t)^2 , (V_clip_t - R_t)^2 )

               (with clip_range=None: 1/2 * mean of (values_t - R_t)^2).
               "mean over real tokens" = sum_t x_t * mask_t / sum_t mask_t.
    clip_frac  0-dim tensor (or float): the fraction of real tokens where the clipped
               error is strictly the larger one; 0 when clip_range is None.

Why
---
The critic is a regression onto the returns, but the returns of one batch are noisy.
Like the policy's ratio clip, the value clip stops one batch from moving a value
estimate further than c from where it was when the batch was collected: once the
value has moved past the clip towards the target, the max picks the clipped error,
whose gradient is 0. Note that c is in reward units. See docs/knobs.md (value_clip)
and docs/actor_critic.md.

Check your work:   rlhflab learn check 2 --dir <this folder>
Stuck?             rlhflab learn solution 2
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class ValueLoss(NamedTuple):
    loss: Tensor       # scalar, to minimise
    clip_frac: Tensor  # fraction of real tokens where the clipped error was the larger


def compute_value_loss(values: Tensor, old_values: Tensor, returns: Tensor,
                       response_mask: Tensor, clip_range: float | None = 0.2) -> ValueLoss:
    # ==== YOUR CODE (exercise 2) ==== replace the line below; about 8 lines
    raise NotImplementedError("exercise 2: compute_value_loss is not written yet")
    # ==== END OF YOUR CODE ====
