"""Token log-probs and entropy from hidden states, one chunk of logits at a time.

At a 151,936-token vocabulary the logits dominate memory: 8 episodes x 128 response
tokens x 151,936 x 4 bytes is 622 MB per float32 copy, and `log_softmax` plus its
backward keep several copies. `chunked_logprobs` takes the decoder's hidden states and
the LM head's weight instead of the logits and never holds more than one chunk of
rows of the (N, V) logits (N = B*T rows), in the forward pass or in the backward pass:

    forward   per chunk of rows:  z = (h W^T + b) / temperature            (c, V)
              logZ = logsumexp(z);  log p = z - logZ;  H = -sum_v p_v log p_v
              keeps logZ (N,) and H (N,) only
    backward  per chunk again: recompute z, then log p = z - logZ and
              dlogp(y)/dz = onehot(y) - p
              dH/dz       = -p (z - E_p[z]) = -p (log p + H)
              g_z = g_logp * dlogp/dz + g_H * dH/dz;  dL/dlogits = g_z / temperature
              grad_h = g_logits W,  grad_W += g_logits^T h,  grad_b += sum_rows g_logits

The autograd graph saves only the hidden states, the weight (which exist anyway), the
targets and two numbers per row. A tied embedding shares the weight tensor with the
input embedding; autograd adds the two gradients, nothing special is needed here.

Precision: each chunk is computed in float32 whatever the input dtype (float64 stays
float64, which `torch.autograd.gradcheck` needs), and the results are float32. A
bfloat16 weight is upcast once per call (a transient V x H float32 copy, not saved).
Inside an autocast region (mixed precision) autocast is switched off for the op's
forward and backward, so its matmuls stay float32 there too.

Departures from the unchunked path (`logprobs_from_logits`, `entropy_from_logits`):
none in value; the logits are recomputed in backward, which costs one more (N, H) x
(H, V) matmul per step: memory traded for compute, as in activation checkpointing.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from rlhflab.ops.matmul import linear, mm

# One float32 chunk of logits is about this many bytes (64 MiB): 110 rows at V = 151,936.
CHUNK_BYTES = 64 * 2**20


class TokenLogprobs(NamedTuple):
    logprobs: Tensor           # (B, T) log p(target) at the temperature, float32
    entropy: Optional[Tensor]  # (B, T) entropy of the softmax at the temperature, or None


def default_chunk_size(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so one float32 chunk of logits is about `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 when an input is float64, else float32 (bfloat16/float16 are upcast)."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, onednn: bool) -> Tensor:
    """(c, H) x (V, H) -> (c, V) logits divided by the temperature, in weight's dtype."""
    z = linear(h, weight, bias, onednn=onednn)
    return z.div_(temperature) if temperature != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    """Rows (N, H) -> (log p(target) (N,), entropy (N,) or an empty tensor); see the module docstring."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                temperature: float, chunk_size: int, with_entropy: bool, onednn: bool):
        dtype = _compute_dtype(hidden, weight, bias)
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=dtype)                          # (N,)
        log_z = hidden.new_empty(n, dtype=dtype)                             # (N,)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=dtype)    # (N,) or (0,)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = _chunk_logits(hidden[s:e].to(dtype), w, b, temperature, onednn)  # (c, V)
            m = z.amax(-1)                                                   # (c,)
            d = z.sub_(m[:, None])                                           # (c, V) z - m <= 0, in z's storage
            picked = d.gather(-1, targets[s:e, None]).squeeze(-1)            # (c,) z_y - m
            if with_entropy:
                ex = d.exp()                                                 # (c, V) exp(z - m)
                sum_ex = ex.sum(-1)                                          # (c,)  S
                # sum_v exp(z_v - m) (z_v - m), one row-wise dot product per row
                dot = torch.bmm(ex.unsqueeze(1), d.unsqueeze(2)).view(-1)    # (c,)
            else:
                sum_ex = d.exp_().sum(-1)                                    # d is not needed again
            log_s = sum_ex.log()                                             # (c,) log S, >= 0
            log_z[s:e] = m + log_s                                           # logsumexp(z)
            logprobs[s:e] = picked - log_s                                   # z_y - logsumexp(z)
            if with_entropy:
                # H = -sum p log p = log S + sum_v p_v (m - z_v): two terms >= 0, so no
                # cancellation of two large sums
                entropy[s:e] = log_s - dot / sum_ex
                del ex
            del z, d  # before the next chunk's logits exist: one chunk alive between chunks
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.onednn = onednn
        ctx.set_materialize_grads(False)  # a None gradient (e.g. entropy unused) skips its work
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, g_logprobs: Tensor | None, g_entropy: Tensor | None):
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):  # float32 under autocast too
            return _ChunkedLogprobs._backward(ctx, g_logprobs, g_entropy)

    @staticmethod
    def _backward(ctx, g_logprobs: Tensor | None, g_entropy: Tensor | None):
        hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
        if not ctx.with_entropy:
            g_entropy = None
        if g_logprobs is None and g_entropy is None:
            return None, None, None, None, None, None, None, None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dtype = log_z.dtype
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        tau = ctx.temperature
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None               # (N, H)
        grad_w = torch.zeros_like(w) if need_w else None                    # (V, H)
        grad_b = torch.zeros_like(b) if need_b else None                    # (V,)
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            h = hidden[s:e].to(dtype)                                        # (c, H)
            logp = _chunk_logits(h, w, b, tau, ctx.onednn).sub_(log_z[s:e, None])  # (c, V) log p
            if g_entropy is None:
                # g_z = g (onehot(y) - p) / tau: the row scale -g / tau goes on the (c, H) side of
                # each product, so the (c, V) work is the softmax in place and one entry a row.
                q = logp.exp_()                                              # (c, V) p, in logp's storage
                rows = torch.arange(e - s, device=q.device)
                q[rows, targets[s:e]] -= 1                                   # p - onehot(y)
                scale = g_logprobs[s:e, None].mul(-1.0 / tau)                # (c, 1)
                if need_h:
                    grad_h[s:e] = mm(q, w, onednn=ctx.onednn).mul_(scale).to(hidden.dtype)
                if need_w:
                    grad_w.addmm_(q.t(), h * scale)                          # in place, as below
                if need_b:
                    grad_b += (scale.t() @ q).view(-1)                       # (1, c) x (c, V)
                del logp, q
                continue
            p = logp.exp()                                                   # (c, V) softmax
            # dH/dz = -p (z - E_p[z]) = -p (log p + H); built in log p's storage.
            g_z = logp.add_(entropy[s:e, None]).mul_(p).mul_(-g_entropy[s:e, None])
            if g_logprobs is not None:
                g_z.sub_(p.mul_(g_logprobs[s:e, None]))                      # - g p
                rows = torch.arange(e - s, device=g_z.device)
                g_z[rows, targets[s:e]] += g_logprobs[s:e]                   # + g onehot(y)
            if tau != 1.0:
                g_z.div_(tau)                                                # d/dlogits
            if need_h:
                grad_h[s:e] = mm(g_z, w, onednn=ctx.onednn).to(hidden.dtype)
            if need_w:
                # in place (torch's own matmul): oneDNN would need a (V, H) buffer of its own
                grad_w.addmm_(g_z.t(), h)
            if need_b:
                grad_b += g_z.sum(0)
            del logp, p, g_z  # before the next chunk's logits exist: two chunks alive at most, not three
        return (grad_h, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None, None, None)


def chunked_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                     temperature: float = 1.0, chunk_size: int | None = None,
                     with_entropy: bool = False, onednn: bool = False) -> TokenLogprobs:
    """log p(targets) (and the entropy) under softmax((hidden W^T + b) / temperature).

    hidden: (B, T, H) (any leading shape, or (N, H)); weight: (V, H), the LM head's;
    bias: (V,) or None; targets: (B, T) int in [0, V). Returns float32 (B, T) tensors
    (float64 for float64 inputs), differentiable in hidden, weight and bias, equal to
    `logprobs_from_logits` / `entropy_from_logits` of the full logits. At most
    `chunk_size` rows of logits exist at once (default: about 64 MiB of them).
    Padding positions are computed like any other; mask them afterwards (or leave
    them out first: `hidden[mask]`, `targets[mask]`). `onednn`: the products through
    oneDNN (`ops.matmul`; the caller's head is a `FastLinear`).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match targets {tuple(targets.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be (V, H) with H = {hidden.shape[-1]}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias {tuple(bias.shape)} must be (V,) = ({weight.shape[0]},)")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    lead = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])                            # (N, H)
    flat_t = targets.reshape(-1)                                             # (N,)
    with torch.autocast(hidden.device.type, enabled=False):  # float32 chunks also under autocast
        logprobs, entropy = _ChunkedLogprobs.apply(flat_h, weight, bias, flat_t, float(temperature),
                                                   int(chunk), bool(with_entropy), bool(onednn))
    return TokenLogprobs(logprobs.view(lead), entropy.view(lead) if with_entropy else None)


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
                          ignore_index: int = -100, chunk_size: int | None = None, onednn: bool = False) -> Tensor:
    """Summed token cross-entropy -sum log p(label) over positions whose label is not
    `ignore_index`; the ignored rows are left out before any logit is computed.

    hidden: (B, L, H) states that predict `labels` (B, L) (already shifted: row i
    predicts labels[:, i]); weight (V, H); bias (V,) or None. Returns a float32 scalar,
    equal to `F.cross_entropy(logits, labels, ignore_index=..., reduction="sum")`.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match labels {tuple(labels.shape)}")
    keep = labels != ignore_index                                            # (B, L)
    out = chunked_logprobs(hidden[keep], weight, bias, labels[keep], chunk_size=chunk_size, onednn=onednn)
    return -out.logprobs.sum()
