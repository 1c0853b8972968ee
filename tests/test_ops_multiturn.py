"""GAE and discounted returns over multi-turn trajectories (action mask with holes), and
rewards placed per turn: hand-worked values, parity with `ops.gae` on a contiguous mask
and with a compaction reference, padding invariance."""

from __future__ import annotations

import pytest
import torch

from rlhflab import ops
from rlhflab.ops.multiturn import (
    discounted_returns_over_actions,
    episode_returns,
    gae_over_actions,
    place_turn_rewards,
)


def test_two_turn_gae_by_hand():
    # Response part: a a | c c | a a | pad; turn 1 ends at 1 (reward 0.5), turn 2 at 5 (reward 1).
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]])
    rewards = place_turn_rewards(torch.tensor([[0.5, 1.0]], dtype=torch.float64), torch.tensor([[1, 5]]),
                                 torch.tensor([[1, 1]]), 7)
    assert rewards.tolist() == [[0, 0.5, 0, 0, 0, 1.0, 0]]
    # Values on context and padding (9) must not matter.
    values = torch.tensor([[1.0, 0.5, 9, 9, 0.8, 0.4, 9]], dtype=torch.float64)
    out = gae_over_actions(rewards, values, mask, gamma=0.9, lam=0.8)   # γλ = 0.72
    # Action steps in order: pos 0, 1, 4, 5.
    # pos 5: δ = 1.0 + 0.9·0 − 0.4 = 0.6;                A = 0.6
    # pos 4: δ = 0 + 0.9·0.4 − 0.8 = −0.44;              A = −0.44 + 0.72·0.6 = −0.008
    # pos 1: δ = 0.5 + 0.9·0.8 − 0.5 = 0.72 (V of pos 4 bootstraps turn 1's end-of-turn token)
    #                                                    A = 0.72 + 0.72·(−0.008) = 0.71424
    # pos 0: δ = 0 + 0.9·0.5 − 1.0 = −0.55;              A = −0.55 + 0.72·0.71424 = −0.0357472
    expected = [-0.0357472, 0.71424, 0, 0, -0.008, 0.6, 0]
    assert torch.allclose(out.advantages, torch.tensor([expected], dtype=torch.float64), atol=1e-12)
    # returns = A + V on actions: [0.9642528, 1.21424, ., ., 0.792, 1.0, .]
    assert torch.allclose(out.returns, torch.tensor([[0.9642528, 1.21424, 0, 0, 0.792, 1.0, 0]],
                                                    dtype=torch.float64), atol=1e-12)
    # ops.gae on the same mask would restart at the hole: pos 1 would see no future (A = 0.5 − 0.5 = 0).
    plain = ops.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert plain.advantages[0, 1].item() == pytest.approx(0.0)


def test_dense_reward_gae_by_hand():
    # Per-token rewards −0.1 on every action token (a KL penalty, say), 5 on a context token
    # (must be ignored), plus turn rewards 1 (turn 1, ends at pos 1) and 2 (turn 2, ends at pos 3).
    mask = torch.tensor([[1, 1, 0, 1]])
    token = torch.tensor([[-0.1, -0.1, 5.0, -0.1]], dtype=torch.float64)
    rewards = place_turn_rewards(torch.tensor([[1.0, 2.0]], dtype=torch.float64), torch.tensor([[1, 3]]),
                                 torch.tensor([[1, 1]]), 4, token_rewards=token)
    assert torch.allclose(rewards, torch.tensor([[-0.1, 0.9, 5.0, 1.9]], dtype=torch.float64))
    values = torch.tensor([[0.5, 0.5, 7.0, 1.0]], dtype=torch.float64)
    out = gae_over_actions(rewards, values, mask, gamma=0.5, lam=1.0)
    # λ = 1: A_t = G_t − V_t, G over action steps with γ = 0.5:
    # G(pos 3) = 1.9;  G(pos 1) = 0.9 + 0.5·1.9 = 1.85;  G(pos 0) = −0.1 + 0.5·1.85 = 0.825
    # A = [0.825 − 0.5, 1.85 − 0.5, 0, 1.9 − 1.0] = [0.325, 1.35, 0, 0.9]
    assert torch.allclose(out.advantages, torch.tensor([[0.325, 1.35, 0, 0.9]], dtype=torch.float64), atol=1e-12)
    g = discounted_returns_over_actions(rewards, mask, gamma=0.5)
    assert torch.allclose(g, torch.tensor([[0.825, 1.85, 0, 1.9]], dtype=torch.float64), atol=1e-12)
    # Outcome methods: the plain sum of turn rewards, 1 + 2 = 3 (a padded turn counts nothing).
    assert episode_returns(torch.tensor([[1.0, 2.0, 4.0]]), torch.tensor([[1, 1, 0]])).tolist() == [3.0]


def _contiguous(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).long()         # (B, T)
    return torch.randn(b, t, generator=g), torch.randn(b, t, generator=g), mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0)])
def test_contiguous_mask_equals_gae_exactly(gamma, lam):
    rewards, values, mask = _contiguous(6, 9, seed=3)
    ref = ops.gae(rewards, values, mask, gamma, lam)
    out = gae_over_actions(rewards, values, mask, gamma, lam)
    assert torch.equal(out.advantages, ref.advantages) and torch.equal(out.returns, ref.returns)
    assert torch.equal(discounted_returns_over_actions(rewards, mask, gamma),
                       ops.discounted_returns(rewards, mask, gamma))


def _compacted_reference(rewards, values, mask, gamma, lam):
    """Each row's action tokens taken out, `ops.gae` run on them alone, put back."""
    adv, ret = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for row in range(rewards.shape[0]):
        idx = mask[row].nonzero().flatten()
        if len(idx) == 0:
            continue
        o = ops.gae(rewards[row, idx][None], values[row, idx][None], torch.ones(1, len(idx)), gamma, lam)
        adv[row, idx], ret[row, idx] = o.advantages[0], o.returns[0]
    return adv, ret


def test_holes_match_the_compacted_reference():
    g = torch.Generator().manual_seed(7)
    rewards, values = torch.randn(5, 12, generator=g, dtype=torch.float64), torch.randn(5, 12, generator=g,
                                                                                      dtype=torch.float64)
    mask = (torch.rand(5, 12, generator=g) < 0.6).long()
    mask[2] = 0  # a row with no action at all
    out = gae_over_actions(rewards, values, mask, 0.95, 0.9)
    adv, ret = _compacted_reference(rewards, values, mask, 0.95, 0.9)
    assert torch.allclose(out.advantages, adv, atol=1e-12) and torch.allclose(out.returns, ret, atol=1e-12)
    assert out.advantages[2].abs().sum() == 0


def test_padding_and_context_length_invariance():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]])
    rewards = torch.tensor([[0.1, 0.5, 0, 0, -0.2, 1.0]])
    values = torch.tensor([[0.3, 0.2, 0, 0, 0.6, 0.1]])
    base = gae_over_actions(rewards, values, mask, 0.9, 0.95)
    # Extra right padding changes nothing.
    pad = gae_over_actions(torch.nn.functional.pad(rewards, (0, 3)), torch.nn.functional.pad(values, (0, 3)),
                           torch.nn.functional.pad(mask, (0, 3)), 0.9, 0.95)
    assert torch.equal(pad.advantages[:, :6], base.advantages) and pad.advantages[:, 6:].abs().sum() == 0
    # A longer environment answer (more context tokens) changes no action's advantage.
    ins = lambda x: torch.cat([x[:, :2], torch.zeros(1, 5), x[:, 2:]], 1)  # noqa: E731
    longer = gae_over_actions(ins(rewards), ins(values), ins(mask.float()).long(), 0.9, 0.95)
    keep = ins(mask.float()).bool()
    assert torch.equal(longer.advantages[keep], base.advantages[mask.bool()])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="one shape"):
        gae_over_actions(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        place_turn_rewards(torch.ones(1, 1), torch.tensor([[4]]), torch.ones(1, 1), 4)
