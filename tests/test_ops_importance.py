"""Sampler/trainer mismatch (ops/importance.py): TIS weights and the log-prob gap, worked by hand."""

import math

import pytest
import torch

from rlhflab.ops import logprob_gap, truncated_is_weights

# Two responses, T = 3; row 1 has one padding position.
OLD = torch.tensor([[-1.0, -2.0, -0.5],
                    [-0.2, -3.0, -9.0]])
SAMPLE = torch.tensor([[-1.0, -2.5, -2.0],
                       [-0.1, -1.0, 0.0]])
MASK = torch.tensor([[1, 1, 1],
                     [1, 1, 0]])


def test_hand_worked_weights_and_gap():
    weights = truncated_is_weights(OLD, SAMPLE, MASK, cap=2.0)
    # Δ = old - sample = [[0, 0.5, 1.5], [-0.1, -2.0, (pad)]]
    # exp(Δ)            = [[1, 1.648721, 4.481689], [0.904837, 0.135335, -]]
    # min(·, cap = 2)   = [[1, 1.648721, 2],        [0.904837, 0.135335, 0]]  (0 on padding)
    want = torch.tensor([[1.0, math.exp(0.5), 2.0], [math.exp(-0.1), math.exp(-2.0), 0.0]])
    torch.testing.assert_close(weights, want)
    # gap = mean |Δ| over the 5 response tokens = (0 + 0.5 + 1.5 + 0.1 + 2.0) / 5 = 0.82
    assert logprob_gap(OLD, SAMPLE, MASK).item() == pytest.approx(0.82, abs=1e-6)


def test_loop_reference_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    old, sample = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.3).long()
    weights, deltas = torch.zeros(6, 9), []
    for b in range(6):
        for t in range(9):
            if mask[b, t]:
                d = (old[b, t] - sample[b, t]).item()
                weights[b, t] = min(math.exp(d), 1.5)
                deltas.append(abs(d))
    torch.testing.assert_close(truncated_is_weights(old, sample, mask, cap=1.5), weights)
    assert logprob_gap(old, sample, mask).item() == pytest.approx(sum(deltas) / len(deltas), abs=1e-6)


def test_identical_logprobs_give_weight_one_and_no_gap():
    lp = torch.randn(4, 7)
    mask = torch.ones(4, 7, dtype=torch.long)
    assert torch.equal(truncated_is_weights(lp, lp.clone(), mask, cap=2.0), torch.ones(4, 7))
    assert logprob_gap(lp, lp.clone(), mask).item() == 0.0


def test_padding_changes_nothing_even_with_wild_values():
    weights = truncated_is_weights(OLD, SAMPLE, MASK, cap=2.0)
    old = torch.cat([OLD, torch.full((2, 2), 500.0)], 1)       # exp(1000) is inf in float32
    sample = torch.cat([SAMPLE, torch.full((2, 2), -500.0)], 1)
    mask = torch.cat([MASK, torch.zeros(2, 2, dtype=torch.long)], 1)
    padded = truncated_is_weights(old, sample, mask, cap=2.0)
    torch.testing.assert_close(padded[:, :3], weights)
    assert torch.equal(padded[:, 3:], torch.zeros(2, 2))   # 0, not NaN
    assert logprob_gap(old, sample, mask).item() == pytest.approx(logprob_gap(OLD, SAMPLE, MASK).item())


def test_weights_carry_no_gradient_and_bad_shapes_are_refused():
    old = OLD.clone().requires_grad_(True)
    assert not truncated_is_weights(old, SAMPLE, MASK, cap=2.0).requires_grad
    with pytest.raises(ValueError, match="equal \\(B, T\\) shapes"):
        truncated_is_weights(OLD, SAMPLE[:, :2], MASK, cap=2.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(OLD, SAMPLE, MASK, cap=0.0)


def test_the_worked_example_in_the_docs():
    """docs/rollout_backends.md quotes the hand-worked case above; its numbers are these."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "rollout_backends.md").read_text(encoding="utf-8")
    w = truncated_is_weights(OLD, SAMPLE, MASK, cap=2.0)
    assert f"| row 0: w = min(e^Δ, 2) | {w[0, 0]:.0f} | {w[0, 1]:.3f} | {w[0, 2]:.0f} (e^1.5 = {math.exp(1.5):.3f}, truncated) |" in page
    assert f"| row 1: w | {w[1, 0]:.3f} | {w[1, 1]:.3f} | {w[1, 2]:.0f} |" in page
    assert f"gap = (0 + 0.5 + 1.5 + 0.1 + 2.0) / 5 = {logprob_gap(OLD, SAMPLE, MASK).item():.2f}" in page
