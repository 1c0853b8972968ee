"""TRPO's surrogate ratio: clamped like ops.ppo_policy_loss, so an extreme log-ratio
gives a finite objective and gradient."""

from __future__ import annotations

import math

import torch

from rlhflab.ops.losses import LOG_RATIO_CLAMP
from rlhflab.trainers.trpo import surrogate_objective


def test_log_ratio_of_91_gives_a_finite_objective_and_gradient():
    # Token 0: log π − log π_old = −0.5 − (−91.5) = 91, past float32's exp limit (~88.7).
    # Token 1: an ordinary token, log-ratio 0, ratio 1.
    logprobs = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    old = torch.tensor([[-91.5, -1.0]])
    adv = torch.tensor([[1.0, 2.0]])
    mask = torch.tensor([[1, 1]])
    # Without the clamp the ratio is inf and so is the objective (what the code did before).
    assert math.isinf(float(((logprobs.detach() - old).exp() * adv).sum()))
    obj = surrogate_objective(logprobs, old, adv, mask)
    # (e^20·1 + 1·2) / 2 tokens = (485165195.4 + 2) / 2 = 242582598.7
    assert math.isfinite(float(obj))
    torch.testing.assert_close(obj, torch.tensor((math.exp(LOG_RATIO_CLAMP) + 2.0) / 2.0))
    obj.backward()
    # d/d logprob: the clamped token 0, no gradient; token 1: ratio·A/n = 1·2/2 = 1.
    assert torch.isfinite(logprobs.grad).all()
    assert torch.equal(logprobs.grad, torch.tensor([[0.0, 1.0]]))


def test_negative_extreme_and_padding():
    # log-ratio −91 clamps to −20: ratio e^-20 ≈ 2.06e-9; the padded token (mask 0) with a
    # log-ratio of +200 adds nothing and stays finite.
    logprobs = torch.tensor([[-91.0, 0.0, 100.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, -100.0]])
    adv = torch.tensor([[3.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    obj = surrogate_objective(logprobs, old, adv, mask)
    # (e^-20·3 + 1·(−1)) / 2 = (6.18e-9 − 1) / 2
    torch.testing.assert_close(obj, torch.tensor((3 * math.exp(-20.0) - 1.0) / 2.0))
    obj.backward()
    assert torch.equal(logprobs.grad, torch.tensor([[0.0, -0.5, 0.0]]))


def test_ordinary_ratios_equal_the_unclamped_formula():
    # Parity with the plain expression wherever |log-ratio| < 20, the gradient included.
    torch.manual_seed(0)
    lp = (torch.randn(4, 6) * 0.3).requires_grad_()
    old = torch.randn(4, 6) * 0.3
    adv = torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).long()
    mask[:, 0] = 1
    ours = surrogate_objective(lp, old, adv, mask)
    (g_ours,) = torch.autograd.grad(ours, lp)
    plain = ((lp - old).exp() * adv * mask).sum() / mask.sum()
    (g_plain,) = torch.autograd.grad(plain, lp)
    torch.testing.assert_close(ours, plain)
    torch.testing.assert_close(g_ours, g_plain)
