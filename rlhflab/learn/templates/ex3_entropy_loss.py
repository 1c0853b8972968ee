"""Exercise 3: the entropy bonus.

Contract
--------
compute_entropy_loss(logits, response_mask)

    logits         (B, T, V) float  the policy's logits for each response position
                                    (V is the vocabulary); they carry the gradient
    response_mask  (B, T) 0/1       1 on a real response token, 0 on padding

Padding positions of `logits` may hold anything: they must not change the result.
Logits can be large (a confident model gives gaps of hundreds between logits), so the
result must stay finite there: take log-probabilities with log_softmax, never
log(softmax(...)).

Returns EntropyLoss(loss, entropy):

    entropy  0-dim tensor: the mean over real response tokens of the entropy of the
             next-token distribution p = softmax(logits_t), in nats:

                 H_t = - sum_v p_v * log p_v

             "mean over real tokens" = sum_t H_t * mask_t / sum_t mask_t.
             It is for logging: detach it.
    loss     0-dim tensor with a gradient with respect to `logits`: -entropy
             (minimising the loss raises the entropy).

Why
---
The entropy of the next-token distribution measures how spread out the policy's
choices are: log V when every token is equally likely, 0 when one token has all the
mass. The trainer adds entropy_coeff * loss to the total loss, so a positive
coefficient pays the policy for keeping alternatives open (exploration) instead of
collapsing onto its first good answer. See docs/knobs.md (entropy_coeff).

Check your work:   rlhflab learn check 3 --dir <this folder>
Stuck?             rlhflab learn solution 3
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class EntropyLoss(NamedTuple):
    loss: Tensor     # -mean entropy, to minimise
    entropy: Tensor  # mean entropy in nats, detached, for logging


def compute_entropy_loss(logits: Tensor, response_mask: Tensor) -> EntropyLoss:
    # ==== YOUR CODE (exercise 3) ==== replace the line below; about 5 lines
    raise NotImplementedError("exercise 3: compute_entropy_loss is not written yet")
    # ==== END OF YOUR CODE ====
