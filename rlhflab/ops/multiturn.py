"""Advantages over multi-turn trajectories: rewards placed on action tokens, and GAE /
discounted returns over an action mask with holes.

A multi-turn episode is trained as one sequence. After the first prompt, its "response"
part interleaves the model's own tokens (actions, `action_mask` 1) with the tokens of the
environment's and the tools' answers (context, `action_mask` 0):

    response part   a a a E | c c c c | a a E | c c | a E  pad pad
    action_mask     1 1 1 1   0 0 0 0   1 1 1   0 0   1 1  0   0
                                (E: the end-of-turn token, an action)

How a turn boundary is treated (the choice made here, and why). The MDP's time steps are
the action tokens only. Context tokens are not decisions of the policy, so they are not
time steps: they get no advantage, no value target, and no discount. The last action
token of a turn (its end-of-turn token) is followed, as a time step, by the first action
token of the next turn, so

    δ_t = r_t + γ·V_{t'} − V_t,     A_t = δ_t + γλ·A_{t'}

where t' is the next action token of the same row (V_{t'} = 0, A_{t'} = 0 after the last
one: the episode ends). The value at the first token of the next turn has seen the
environment's answer, so it bootstraps the previous turn with what the environment said,
which is what a value should do; γ and λ apply once per action step whatever the length
of the environment's answer (a long tool output does not discount the future more than
a short one). The alternative, restarting GAE at every turn (`ops.gae` on a mask with
holes does that: a 0 in the mask ends the recursion), would treat each turn as its own
episode and make a reward at the end invisible to every turn but the last.

With a contiguous mask (1…1 0…0, the single-turn case) `gae_over_actions` is exactly
`ops.gae`, bit for bit, and `discounted_returns_over_actions` exactly
`ops.discounted_returns`.

Rewards. An environment gives one reward per turn; `place_turn_rewards` puts each on the
last action token of its turn (the turn's end-of-turn token), as `kl_shaped_rewards`
puts a single-turn score on the last response token. Per-token rewards (a (B, T) tensor
that is already per token) are added as given, on action tokens only. The outcome-based
methods (GRPO, RLOO, Dr. GRPO) use `episode_returns`: the plain (undiscounted) sum of an
episode's turn rewards.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhflab.ops.advantages import GAEOutput


def _check_same(name: str, *tensors: Tensor) -> None:
    shapes = [tuple(t.shape) for t in tensors]
    if len(set(shapes)) != 1 or tensors[0].dim() != 2:
        raise ValueError(f"{name} expects (B, T) tensors of one shape; got {', '.join(map(str, shapes))}")


def place_turn_rewards(turn_rewards: Tensor, turn_ends: Tensor, turn_mask: Tensor, length: int,
                       token_rewards: Tensor | None = None) -> Tensor:
    """Per-token rewards of a batch of trajectories: each turn's reward on the last action
    token of that turn, plus `token_rewards` as given.

    turn_rewards: (B, N) float, turn_ends: (B, N) long, the index in the response part of
    each turn's last action token; turn_mask: (B, N), 1 for a real turn (rows with fewer
    turns are right-padded). token_rewards: (B, T) or None. Returns (B, T) with
    T = `length`, float64 for float64 inputs, else float32.

    Worked example (T = 8, turns ending at 3 and 6 with rewards 0.5 and 2):
    [0, 0, 0, 0.5, 0, 0, 2, 0].
    """
    if not (turn_rewards.shape == turn_ends.shape == turn_mask.shape) or turn_rewards.dim() != 2:
        raise ValueError(f"turn_rewards, turn_ends, turn_mask must all be (B, N); got {tuple(turn_rewards.shape)}, "
                         f"{tuple(turn_ends.shape)}, {tuple(turn_mask.shape)}")
    dtype = torch.float64 if turn_rewards.dtype == torch.float64 else torch.float32
    b = turn_rewards.shape[0]
    keep = turn_mask.bool()
    if keep.any() and (turn_ends[keep].min() < 0 or turn_ends[keep].max() >= length):
        raise ValueError(f"turn_ends must lie in [0, {length}); got {turn_ends[keep].min()}..{turn_ends[keep].max()}")
    out = torch.zeros(b, length, dtype=dtype, device=turn_rewards.device)       # (B, T)
    ends = torch.where(keep, turn_ends, torch.zeros_like(turn_ends)).long()
    out.scatter_add_(1, ends, torch.where(keep, turn_rewards.to(dtype), torch.zeros((), dtype=dtype)))
    if token_rewards is not None:
        if token_rewards.shape != (b, length):
            raise ValueError(f"token_rewards must be (B, T) = ({b}, {length}); got {tuple(token_rewards.shape)}")
        out = out + token_rewards.to(dtype)
    return out


def gae_over_actions(rewards: Tensor, values: Tensor, action_mask: Tensor,
                     gamma: float = 1.0, lam: float = 0.95) -> GAEOutput:
    """GAE over the action tokens of trajectories whose mask has holes (context tokens).

    rewards, values, action_mask: (B, T). Each action token's successor is the next
    action token of its row (see the module docstring); rewards and values on context
    tokens and padding are ignored. Returns advantages and returns, (B, T), 0 on context
    and padding. With a contiguous mask the result equals `ops.gae` exactly.

    Worked example in tests/test_ops_multiturn.py (two turns, γ = 0.9, λ = 0.8).
    """
    _check_same("gae_over_actions", rewards, values, action_mask)
    mask = action_mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    b, t = rewards.shape
    is_action = action_mask.bool()
    advantages = torch.zeros_like(rewards)
    next_adv = torch.zeros(b, dtype=rewards.dtype, device=rewards.device)    # A_{t'}, (B,)
    next_value = torch.zeros(b, dtype=values.dtype, device=values.device)    # V_{t'}, (B,)
    for i in reversed(range(t)):
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        adv = (delta + gamma * lam * next_adv) * mask[:, i]
        advantages[:, i] = adv
        # A context token or padding is no time step: the carry passes over it unchanged.
        next_adv = torch.where(is_action[:, i], adv, next_adv)
        next_value = torch.where(is_action[:, i], values[:, i], next_value)
    returns = (advantages + values) * mask
    return GAEOutput(advantages, returns)


def discounted_returns_over_actions(rewards: Tensor, action_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + γ·G_{t'} over the action tokens (t' the next action token), 0 on context
    and padding. (B, T) -> (B, T). REINFORCE++'s advantages on a multi-turn trajectory;
    equal to `ops.discounted_returns` for a contiguous mask."""
    _check_same("discounted_returns_over_actions", rewards, action_mask)
    mask = action_mask.to(rewards.dtype)
    rewards = rewards * mask
    is_action = action_mask.bool()
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)  # G_{t'}, (B,)
    for i in reversed(range(rewards.shape[1])):
        g = (rewards[:, i] + gamma * running) * mask[:, i]
        out[:, i] = g
        running = torch.where(is_action[:, i], g, running)
    return out


def episode_returns(turn_rewards: Tensor, turn_mask: Tensor) -> Tensor:
    """The return of each episode for the outcome-based methods: the sum of its turn
    rewards, undiscounted. (B, N), (B, N) -> (B,)."""
    if turn_rewards.shape != turn_mask.shape or turn_rewards.dim() != 2:
        raise ValueError(f"turn_rewards and turn_mask must both be (B, N); got {tuple(turn_rewards.shape)}, "
                         f"{tuple(turn_mask.shape)}")
    return (turn_rewards * turn_mask.to(turn_rewards.dtype)).sum(-1)
