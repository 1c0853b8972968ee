"""Chunked log-probs/entropy from hidden states: hand-worked values, parity with the
unchunked ops (values and gradients, float32 and float64, chunk sizes that do and do not
divide N, temperature), gradcheck, padding invariance, bfloat16 inputs, and what the
autograd graph keeps (saved-tensor hooks: no (N, V) tensor is saved)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rlhflab import ops
from rlhflab.ops import chunked_cross_entropy, chunked_logprobs, entropy_from_logits, logprobs_from_logits


def _inputs(b=2, t=6, h=5, v=11, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(b, t, h, generator=g, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    bb = torch.randn(v, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, (b, t), generator=g)
    return hidden, weight, bb, targets


def _reference(hidden, weight, bias, targets, temperature=1.0):
    """The unchunked path: full (B, T, V) logits, then the existing ops (which compute in
    float32), or for float64 inputs the same formulas in float64."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logits = logits / temperature
    if logits.dtype != torch.float64:
        return logprobs_from_logits(logits, targets), entropy_from_logits(logits)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


# --------------------------------------------------------------------------------------
# By hand
# --------------------------------------------------------------------------------------
def test_hand_worked_logprob_and_entropy():
    # h = [1, 0]; W rows [0, 0] and [ln 3, 0] -> logits [0, ln 3] -> p = [1/4, 3/4].
    # log p(token 1) = ln 3/4 = -0.2876821; H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351.
    hidden = torch.tensor([[[1.0, 0.0]]])
    weight = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    out = chunked_logprobs(hidden, weight, None, torch.tensor([[1]]), with_entropy=True)
    assert out.logprobs.item() == pytest.approx(math.log(0.75), abs=1e-7)
    assert out.entropy.item() == pytest.approx(0.5623351446, abs=1e-7)
    # Temperature 2 halves the logits: [0, ln sqrt(3)] -> p = [1, sqrt 3] / (1 + sqrt 3)
    # = [0.3660254, 0.6339746]; log p(token 0) = -ln(1 + sqrt 3) = -1.0050525.
    hot = chunked_logprobs(hidden, weight, None, torch.tensor([[0]]), temperature=2.0, with_entropy=True)
    assert hot.logprobs.item() == pytest.approx(-math.log(1 + math.sqrt(3)), abs=1e-7)
    p = torch.tensor([1.0, math.sqrt(3)]) / (1 + math.sqrt(3))
    assert hot.entropy.item() == pytest.approx(float(-(p * p.log()).sum()), abs=1e-7)


def test_hand_worked_gradient_wrt_the_logits():
    # d log p(y) / d z = onehot(y) - p. With logits z = h W^T, h = [1, 0], W = [[0, 0], [ln 3, 0]]:
    # dz/dW[v, 0] = h[0] = 1, so grad_W[:, 0] = onehot(1) - p = [-1/4, 1 - 3/4] = [-0.25, 0.25].
    hidden = torch.tensor([[[1.0, 0.0]]], requires_grad=True)
    weight = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], requires_grad=True)
    chunked_logprobs(hidden, weight, None, torch.tensor([[1]])).logprobs.sum().backward()
    torch.testing.assert_close(weight.grad, torch.tensor([[-0.25, 0.0], [0.25, 0.0]]))
    # grad_h = (onehot - p) W = -0.25 * [0, 0] + 0.25 * [ln 3, 0] = [0.2746531, 0]
    torch.testing.assert_close(hidden.grad, torch.tensor([[[0.25 * math.log(3.0), 0.0]]]))


# --------------------------------------------------------------------------------------
# Parity with the unchunked ops
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [1, 5, 12, 1000])  # N = 12 rows: 5 does not divide it
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_unchunked_path(dtype, chunk_size, temperature):
    hidden, weight, bias, targets = _inputs(dtype=dtype)
    g = torch.Generator().manual_seed(1)
    # Random weights on both outputs so each gradient path (log-prob and entropy) is checked.
    a = torch.randn(targets.shape, generator=g, dtype=torch.float64).to(dtype)
    c = torch.randn(targets.shape, generator=g, dtype=torch.float64).to(dtype)

    out = chunked_logprobs(hidden, weight, bias, targets, temperature, chunk_size, with_entropy=True)
    ref_lp, ref_h = _reference(hidden, weight, bias, targets, temperature)
    assert out.logprobs.dtype == dtype and out.logprobs.shape == targets.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out.logprobs, ref_lp, rtol=tol, atol=tol)
    torch.testing.assert_close(out.entropy, ref_h, rtol=tol, atol=tol)

    got = _grads((a * out.logprobs).sum() + (c * out.entropy).sum(), (hidden, weight, bias))
    want = _grads((a * ref_lp).sum() + (c * ref_h).sum(), (hidden, weight, bias))
    # Weight and bias gradients are sums over the N rows, added in another order than
    # autograd's: in float32 they agree to 1e-6 absolute plus 1e-5 relative (a 1.2-sized
    # entry was seen 2.3e-6 off, about 20 float32 ulps); in float64 to 1e-12.
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=10 * tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [1, 5, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])  # True: computed for logging, not in the loss
def test_a_loss_on_the_logprobs_alone_has_the_unchunked_gradients(dtype, chunk_size, temperature, with_entropy):
    # The backward without an entropy gradient: softmax in place, the row weights -g / T on
    # the (c, H) side of each product. Checked against autograd through the full logits.
    hidden, weight, bias, targets = _inputs(dtype=dtype, seed=3)
    a = torch.randn(targets.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(dtype)
    out = chunked_logprobs(hidden, weight, bias, targets, temperature, chunk_size, with_entropy=with_entropy)
    ref_lp, ref_h = _reference(hidden, weight, bias, targets, temperature)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out.logprobs, ref_lp, rtol=tol, atol=tol)
    if with_entropy:
        torch.testing.assert_close(out.entropy, ref_h, rtol=tol, atol=tol)
    got = _grads((a * out.logprobs).sum(), (hidden, weight, bias))
    want = _grads((a * ref_lp).sum(), (hidden, weight, bias))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=10 * tol, atol=tol)


def test_gradcheck_float64_logprobs_alone():
    hidden, weight, bias, targets = _inputs(b=2, t=3, h=4, v=7, dtype=torch.float64)

    def fn(h, w, b):
        return chunked_logprobs(h, w, b, targets, temperature=0.8, chunk_size=4).logprobs

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def test_gradcheck_float64_logprobs_and_entropy():
    hidden, weight, bias, targets = _inputs(b=2, t=3, h=4, v=7, dtype=torch.float64)

    def fn(h, w, b):
        out = chunked_logprobs(h, w, b, targets, temperature=0.8, chunk_size=4, with_entropy=True)
        return out.logprobs, out.entropy

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


# --------------------------------------------------------------------------------------
# The model's logit transform (scale, soft cap)
# --------------------------------------------------------------------------------------
def test_hand_worked_soft_cap_and_scale():
    # h = [1, 0], W rows [0, 0] and [2, 0]: a = [0, 2].
    # Soft cap c = 2: f(a) = 2 tanh(a / 2) = [0, 2 tanh 1] = [0, 1.5231883];
    # log p(token 1) = -ln(1 + e^-1.5231883) = -ln(1.2180157) = -0.1972230.
    hidden = torch.tensor([[[1.0, 0.0]]])
    weight = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    capped = chunked_logprobs(hidden, weight, None, torch.tensor([[1]]), transform=ops.LogitTransform(softcap=2.0))
    assert capped.logprobs.item() == pytest.approx(-0.1972230392, abs=1e-7)
    # Scale 1/2 (Granite's logits_scaling 2): f(a) = [0, 1]; log p(1) = -ln(1 + e^-1) = -0.3132617.
    scaled = chunked_logprobs(hidden, weight, None, torch.tensor([[1]]), transform=ops.LogitTransform(scale=0.5))
    assert scaled.logprobs.item() == pytest.approx(-0.3132616875, abs=1e-7)


TRANSFORMS = [ops.LogitTransform(scale=0.0625), ops.LogitTransform(softcap=3.0),
              ops.LogitTransform(scale=1.7, softcap=2.5)]  # the last: scale then cap, as MuseGlimmer's


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("with_entropy_grad", [False, True])  # the two backward paths
def test_transformed_logits_equal_the_unchunked_path(transform, with_entropy_grad):
    # The full-logits reference: transform_logits(h W^T + b) / T, then the plain ops. Logits
    # here are of size ~5, so a cap of 2.5-3 bends them well into tanh's curve.
    hidden, weight, bias, targets = _inputs(seed=5)
    g = torch.Generator().manual_seed(6)
    a = torch.randn(targets.shape, generator=g)
    c = torch.randn(targets.shape, generator=g)
    out = chunked_logprobs(hidden, weight, bias, targets, 0.7, 5, with_entropy=True, transform=transform)
    logits = ops.transform_logits(hidden @ weight.t() + bias, transform) / 0.7
    ref_lp, ref_h = logprobs_from_logits(logits, targets), entropy_from_logits(logits)
    # float32, one rounding apart in the transform (s/c as one product): 1e-6 as the parity test above
    torch.testing.assert_close(out.logprobs, ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.entropy, ref_h, rtol=1e-6, atol=1e-6)
    loss_of = (lambda lp, h: (a * lp).sum() + (c * h).sum()) if with_entropy_grad else (lambda lp, h: (a * lp).sum())
    got = _grads(loss_of(out.logprobs, out.entropy), (hidden, weight, bias))
    want = _grads(loss_of(ref_lp, ref_h), (hidden, weight, bias))
    for x, y in zip(got, want):  # sums over rows in another order: as the parity test above
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_gradcheck_float64_under_a_soft_cap():
    hidden, weight, bias, targets = _inputs(b=2, t=3, h=4, v=7, dtype=torch.float64)
    tf = ops.LogitTransform(scale=0.8, softcap=2.0)

    def both(h, w, b):
        out = chunked_logprobs(h, w, b, targets, temperature=0.8, chunk_size=4, with_entropy=True, transform=tf)
        return out.logprobs, out.entropy

    def alone(h, w, b):
        return chunked_logprobs(h, w, b, targets, temperature=0.8, chunk_size=4, transform=tf).logprobs

    assert torch.autograd.gradcheck(both, (hidden, weight, bias))
    assert torch.autograd.gradcheck(alone, (hidden, weight, bias))


@pytest.mark.parametrize("bad", [ops.LogitTransform(scale=0.0), ops.LogitTransform(scale=float("inf")),
                                 ops.LogitTransform(softcap=0.0), ops.LogitTransform(softcap=-1.0)])
def test_a_transform_that_is_no_function_is_refused(bad):
    hidden, weight, bias, targets = _inputs()
    with pytest.raises(ValueError, match="logit transform"):
        chunked_logprobs(hidden, weight, bias, targets, transform=bad)


def test_entropy_alone_and_logprobs_alone_backpropagate():
    hidden, weight, bias, targets = _inputs()
    for name in ("entropy", "logprobs"):  # the other output takes no part in the loss
        out = chunked_logprobs(hidden, weight, bias, targets, chunk_size=4, with_entropy=True)
        ref_lp, ref_h = _reference(hidden, weight, bias, targets)
        ref = ref_h if name == "entropy" else ref_lp
        got = _grads(getattr(out, name).sum(), (hidden, weight, bias))
        want = _grads(ref.sum(), (hidden, weight, bias))
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_without_entropy_returns_none_and_matches():
    hidden, weight, _, targets = _inputs(bias=False)
    out = chunked_logprobs(hidden, weight, None, targets, chunk_size=3)
    assert out.entropy is None
    torch.testing.assert_close(out.logprobs, _reference(hidden, weight, None, targets)[0], rtol=1e-6, atol=1e-6)


def test_padding_rows_change_nothing_for_the_real_rows():
    # The same 2x4 real tokens, then 3 extra pad columns whose targets are the pad id 0:
    # the real rows' values and the gradients of their masked sum are unchanged.
    hidden, weight, bias, targets = _inputs(b=2, t=7)
    mask = torch.zeros(2, 7)
    mask[:, :4] = 1
    padded_targets = torch.where(mask.bool(), targets, torch.zeros_like(targets))
    out = chunked_logprobs(hidden, weight, bias, padded_targets, chunk_size=3, with_entropy=True)
    short = chunked_logprobs(hidden[:, :4], weight, bias, targets[:, :4], chunk_size=3, with_entropy=True)
    torch.testing.assert_close(out.logprobs[:, :4], short.logprobs, rtol=0, atol=1e-6)
    g_pad = _grads(ops.masked_sum(out.logprobs + out.entropy, mask), (weight, bias))
    g_short = _grads((short.logprobs + short.entropy).sum(), (weight, bias))
    for x, y in zip(g_pad, g_short):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_bfloat16_inputs_compute_in_float32():
    hidden, weight, bias, targets = _inputs(dtype=torch.bfloat16)
    out = chunked_logprobs(hidden, weight, bias, targets, chunk_size=5, with_entropy=True)
    assert out.logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    # Float32 accuracy on the same (bf16-representable) values: within 1e-5 of a float64
    # computation, where bfloat16 logits (8 bits of mantissa) would be ~1e-2 off.
    ref_lp, ref_h = _reference(hidden.double(), weight.double(), bias.double(), targets)
    torch.testing.assert_close(out.logprobs, ref_lp.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy, ref_h.float(), rtol=0, atol=1e-5)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert hidden.grad.dtype == weight.grad.dtype == bias.grad.dtype == torch.bfloat16


def test_tied_weight_gets_both_gradients():
    # A tied LM head is the embedding matrix: the gradient is the sum of both uses.
    torch.manual_seed(0)
    emb = torch.randn(9, 4, requires_grad=True)
    ids = torch.randint(0, 9, (2, 3))
    targets = torch.randint(0, 9, (2, 3))
    hidden = emb[ids] * 1.5                                                   # (B, T, H) from the embedding
    chunked_logprobs(hidden, emb, None, targets, chunk_size=2).logprobs.sum().backward()
    got = emb.grad.clone()
    emb.grad = None
    logprobs_from_logits((emb[ids] * 1.5) @ emb.t(), targets).sum().backward()
    torch.testing.assert_close(got, emb.grad, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------
# Cross-entropy with an ignore index (SFT)
# --------------------------------------------------------------------------------------
def test_cross_entropy_equals_torch_with_ignore_index():
    hidden, weight, bias, labels = _inputs(b=3, t=5)
    labels = labels.clone()
    labels[0, :2] = -100   # a masked prompt
    labels[2, 3:] = -100   # padding
    got = chunked_cross_entropy(hidden, weight, bias, labels, chunk_size=4)
    logits = hidden @ weight.t() + bias
    want = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for x, y in zip(_grads(got, (hidden, weight, bias)), _grads(want, (hidden, weight, bias))):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_cross_entropy_of_all_ignored_rows_is_zero():
    hidden, weight, bias, labels = _inputs(b=1, t=3)
    out = chunked_cross_entropy(hidden, weight, bias, torch.full_like(labels, -100))
    assert out.item() == 0.0
    out.backward()
    assert weight.grad.abs().sum() == 0


# --------------------------------------------------------------------------------------
# What the graph keeps
# --------------------------------------------------------------------------------------
def _saved_numels(fn) -> list[int]:
    """Element counts of every tensor autograd saves while `fn()` builds its graph."""
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_no_saved_tensor_is_as_large_as_the_logits():
    b, t, h, v = 4, 32, 16, 5000                    # N = 128 rows; logits N x V = 640,000 floats
    hidden, weight, bias, targets = _inputs(b, t, h, v)
    n = b * t
    chunked = _saved_numels(lambda: chunked_logprobs(hidden, weight, bias, targets, chunk_size=16,
                                                     with_entropy=True))
    # Saved: hidden (N*H = 2,048), weight (V*H = 80,000), bias (V), targets, logZ and H (N each).
    assert max(chunked) == v * h
    assert sum(chunked) == n * h + v * h + v + 3 * n
    unchunked = _saved_numels(lambda: _reference(hidden, weight, bias, targets))
    assert max(unchunked) >= n * v  # the full path keeps at least one (N, V) tensor
