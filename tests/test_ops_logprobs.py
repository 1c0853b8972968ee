"""Log-probs and entropy from logits: reference parity, dtypes, hand-worked, masked vocab."""

import math

import pytest
import torch

from rlhflab.ops import entropy_from_logits, logprobs_from_logits


def _reference_logprobs(logits, tokens):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def test_logprobs_hand_worked():
    # logits [0, ln 3] -> softmax [1/4, 3/4]; log p = [ln 1/4, ln 3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    tokens = torch.tensor([[0, 1]])
    out = logprobs_from_logits(logits, tokens)
    torch.testing.assert_close(out, torch.tensor([[math.log(0.25), math.log(0.75)]]))


@pytest.mark.parametrize("chunk_size", [0, 1, 2, 16])
def test_logprobs_match_log_softmax_gather(chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 11, generator=g) * 4                           # (B, T, V)
    tokens = torch.randint(0, 11, (5, 7), generator=g)                        # (B, T)
    out = logprobs_from_logits(logits, tokens, chunk_size=chunk_size)
    assert out.dtype == torch.float32 and out.shape == (5, 7)
    torch.testing.assert_close(out, _reference_logprobs(logits, tokens))


def test_logprobs_bfloat16_logits_give_float32():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 4, 50, generator=g) * 5).to(torch.bfloat16)
    tokens = torch.randint(0, 50, (3, 4), generator=g)
    out = logprobs_from_logits(logits, tokens)
    assert out.dtype == torch.float32
    # computed from the bf16 values upcast, not in bf16 (which would be ~1e-2 off)
    torch.testing.assert_close(out, _reference_logprobs(logits, tokens), rtol=0, atol=1e-5)


def test_logprobs_gradient_matches_reference():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 6, generator=g, requires_grad=True)
    tokens = torch.randint(0, 6, (2, 3), generator=g)
    (grad,) = torch.autograd.grad(logprobs_from_logits(logits, tokens).sum(), logits)
    (ref,) = torch.autograd.grad(_reference_logprobs(logits, tokens).sum(), logits)
    torch.testing.assert_close(grad, ref)


def test_logprobs_shape_mismatch_raises():
    with pytest.raises(ValueError, match="do not match"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_entropy_hand_worked():
    # uniform over 4 -> ln 4; a point mass (one huge logit) -> 0
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    out = entropy_from_logits(logits)
    torch.testing.assert_close(out, torch.tensor([[math.log(4.0), 0.0]]))
    # p = [1/4, 3/4]: H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351
    two = torch.tensor([[[0.0, math.log(3.0)]]])
    assert entropy_from_logits(two).item() == pytest.approx(0.5623351446, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_equals_minus_sum_p_log_p(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 5, 13, generator=g) * 3).to(dtype)
    out = entropy_from_logits(logits)
    assert out.dtype == torch.float32 and out.shape == (4, 5)
    logp = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(out, -(logp.exp() * logp).sum(-1), rtol=0, atol=1e-5)


def test_entropy_with_masked_out_tokens_is_finite():
    # A -inf logit is a token with p = 0, which adds 0 to the entropy (not 0 * -inf = NaN).
    # [0, ln 3, -inf] has the entropy of [1/4, 3/4].
    logits = torch.tensor([[[0.0, math.log(3.0), float("-inf")]]], requires_grad=True)
    h = entropy_from_logits(logits)
    assert h.item() == pytest.approx(0.5623351446, abs=1e-6)
    (grad,) = torch.autograd.grad(h.sum(), logits)
    assert torch.isfinite(grad).all() and grad[0, 0, 2].item() == 0.0
