"""Token log-probs and entropy from hidden states, one chunk of logits at a time.

At a 151,936-token vocabulary the logits dominate memory: 8 episodes x 128 response
tokens x 151,936 x 4 bytes is 622 MB per float32 copy, and `log_softmax` plus its
backward keep several copies. `chunked_logprobs` takes the decoder's hidden states and
the LM head's weight instead of the logits and never holds more than one chunk of
rows of the (N, V) logits (N = B*T rows), in the forward pass or in the backward pass:

    forward   per chunk of rows:  a = h W^T + b,  z = f(a) / temperature    (c, V)
              logZ = logsumexp(z);  log p = z - logZ;  H = -sum_v p_v log p_v
              keeps logZ (N,) and H (N,) only
    backward  per chunk again: recompute z, then log p = z - logZ and
              dlogp(y)/dz = onehot(y) - p
              dH/dz       = -p (z - E_p[z]) = -p (log p + H)
              g_z = g_logp * dlogp/dz + g_H * dH/dz;  dL/da = g_z f'(a) / temperature
              grad_h = g_a W,  grad_W += g_a^T h,  grad_b += sum_rows g_a

f is the model's own logit transform (`LogitTransform`), identity by default:
    f(a) = s a                          scale s only (Cohere's logit_scale, Granite's 1/logits_scaling)
    f(a) = c tanh(s a / c)              with a soft cap c (Gemma 2's final_logit_softcapping),
                                        f'(a) = s (1 - tanh^2(s a / c))
so the log-probs are those of the logits the model itself samples from.

The autograd graph saves only the hidden states, the weight (which exist anyway), the
targets and two numbers per row. A tied embedding shares the weight tensor with the
input embedding; autograd adds the two gradients, nothing special is needed here.

Precision: each chunk is computed in float32 whatever the input dtype (float64 stays
float64, which `torch.autograd.gradcheck` needs), and the results are float32. A
bfloat16 weight is upcast once per call (a transient V x H float32 copy, not saved).
Inside an autocast region (mixed precision) autocast is switched off for the op's
forward and backward, so its matmuls stay float32 there too.

Departures from the unchunked path (`logprobs_from_logits`, `entropy_from_logits` of
`transform_logits(h W^T + b)`): none in value (the scale and the cap's 1/c are one product
here, two in the model's forward: a rounding apart); the logits are recomputed in backward,
which costs one more (N, H) x (H, V) matmul per step: memory traded for compute, as in
activation checkpointing.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from rlhflab.ops.matmul import linear, mm

# One float32 chunk of logits is about this many bytes (64 MiB): 110 rows at V = 151,936.
CHUNK_BYTES = 64 * 2**20


class LogitTransform(NamedTuple):
    """What a model does to its head's output a = h W^T + b before the softmax:
    f(a) = softcap * tanh(scale * a / softcap) when `softcap` is set, else scale * a.
    The identity (scale 1, no cap) is the plain linear head."""

    scale: float = 1.0              # multiplies a (a divisor d is given as 1 / d)
    softcap: Optional[float] = None  # c > 0 of c tanh(. / c), applied after the scale; None: no cap

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def check(self) -> "LogitTransform":
        """Itself, or ValueError for a scale that is not finite and non-zero or a cap that is not > 0."""
        if not (math.isfinite(self.scale) and self.scale != 0.0):
            raise ValueError(f"logit transform scale must be finite and non-zero, got {self.scale}")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0.0):
            raise ValueError(f"logit transform softcap must be finite and > 0, got {self.softcap}")
        return self


IDENTITY = LogitTransform()


def transform_logits(logits: Tensor, transform: LogitTransform | None) -> Tensor:
    """f(logits) (a new tensor, or `logits` itself for the identity): the full-logits form
    of what `chunked_logprobs` computes per chunk, in the model's order (scale, then cap)."""
    if transform is None or transform.is_identity:
        return logits
    out = logits * transform.scale if transform.scale != 1.0 else logits
    if transform.softcap is not None:
        out = torch.tanh(out / transform.softcap) * transform.softcap
    return out


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


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, onednn: bool,
                  tf: LogitTransform = IDENTITY, keep_tanh: bool = False) -> tuple[Tensor, Tensor | None]:
    """(c, H) x (V, H) -> (c, V) logits f(h W^T + b) / temperature in weight's dtype, and with
    `keep_tanh` and a soft cap the (c, V) tanh(s a / c) too (f' needs it in backward), else None."""
    z = linear(h, weight, bias, onednn=onednn)
    if tf.softcap is None:
        factor = tf.scale / temperature
        return (z.mul_(factor) if factor != 1.0 else z), None
    t = z.mul_(tf.scale / tf.softcap).tanh_()                               # (c, V) tanh(s a / c), in z's storage
    post = tf.softcap / temperature
    return (t * post if keep_tanh else t.mul_(post)), (t if keep_tanh else None)


class _ChunkedLogprobs(torch.autograd.Function):
    """Rows (N, H) -> (log p(target) (N,), entropy (N,) or an empty tensor); see the module docstring."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                temperature: float, chunk_size: int, with_entropy: bool, onednn: bool, tf: LogitTransform):
        dtype = _compute_dtype(hidden, weight, bias)
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=dtype)                          # (N,)
        log_z = hidden.new_empty(n, dtype=dtype)                             # (N,)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=dtype)    # (N,) or (0,)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z, _ = _chunk_logits(hidden[s:e].to(dtype), w, b, temperature, onednn, tf)  # (c, V)
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
        ctx.onednn, ctx.tf = onednn, tf
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
            return None, None, None, None, None, None, None, None, None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dtype = log_z.dtype
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        tau, tf = ctx.temperature, ctx.tf
        capped = tf.softcap is not None
        da = tf.scale / tau  # dL/da = g_z * da (* (1 - tanh^2) under a soft cap)
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None               # (N, H)
        grad_w = torch.zeros_like(w) if need_w else None                    # (V, H)
        grad_b = torch.zeros_like(b) if need_b else None                    # (V,)
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            h = hidden[s:e].to(dtype)                                        # (c, H)
            z, t = _chunk_logits(h, w, b, tau, ctx.onednn, tf, keep_tanh=capped)
            logp = z.sub_(log_z[s:e, None])                                  # (c, V) log p
            if capped:
                slope = t.square_().neg_().add_(1.0)                         # (c, V) 1 - tanh^2, in t's storage
            del t
            if g_entropy is None:
                # g_a = g (onehot(y) - p) s / tau (times 1 - tanh^2 under a cap): the row scale
                # -g s / tau goes on the (c, H) side of each product, so the (c, V) work is the
                # softmax in place and one entry a row.
                q = logp.exp_()                                              # (c, V) p, in logp's storage
                rows = torch.arange(e - s, device=q.device)
                q[rows, targets[s:e]] -= 1                                   # p - onehot(y)
                if capped:
                    q.mul_(slope)                                            # times f'(a) / s
                    del slope
                scale = g_logprobs[s:e, None].mul(-da)                       # (c, 1)
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
            if capped:
                g_z.mul_(slope)                                              # times f'(a) / s
                del slope
            if da != 1.0:
                g_z.mul_(da)                                                 # d/da, a = h W^T + b
            if need_h:
                grad_h[s:e] = mm(g_z, w, onednn=ctx.onednn).to(hidden.dtype)
            if need_w:
                # in place (torch's own matmul): oneDNN would need a (V, H) buffer of its own
                grad_w.addmm_(g_z.t(), h)
            if need_b:
                grad_b += g_z.sum(0)
            # before the next chunk's logits exist: two chunks alive at most (three under a soft cap)
            del logp, p, g_z
        return (grad_h, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None, None, None, None)


def chunked_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                     temperature: float = 1.0, chunk_size: int | None = None,
                     with_entropy: bool = False, onednn: bool = False,
                     transform: LogitTransform | None = None) -> TokenLogprobs:
    """log p(targets) (and the entropy) under softmax(f(hidden W^T + b) / temperature).

    hidden: (B, T, H) (any leading shape, or (N, H)); weight: (V, H), the LM head's;
    bias: (V,) or None; targets: (B, T) int in [0, V). Returns float32 (B, T) tensors
    (float64 for float64 inputs), differentiable in hidden, weight and bias, equal to
    `logprobs_from_logits` / `entropy_from_logits` of the full logits. At most
    `chunk_size` rows of logits exist at once (default: about 64 MiB of them).
    Padding positions are computed like any other; mask them afterwards (or leave
    them out first: `hidden[mask]`, `targets[mask]`). `onednn`: the products through
    oneDNN (`ops.matmul`; the caller's head is a `FastLinear`). `transform`: the model's
    logit transform f (`LogitTransform`: scale, soft cap), applied before the temperature as
    the model's own forward does; None is the identity.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match targets {tuple(targets.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be (V, H) with H = {hidden.shape[-1]}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias {tuple(bias.shape)} must be (V,) = ({weight.shape[0]},)")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    tf = (transform or IDENTITY).check()
    tf = LogitTransform(float(tf.scale), None if tf.softcap is None else float(tf.softcap))
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    lead = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])                            # (N, H)
    flat_t = targets.reshape(-1)                                             # (N,)
    with torch.autocast(hidden.device.type, enabled=False):  # float32 chunks also under autocast
        logprobs, entropy = _ChunkedLogprobs.apply(flat_h, weight, bias, flat_t, float(temperature),
                                                   int(chunk), bool(with_entropy), bool(onednn), tf)
    return TokenLogprobs(logprobs.view(lead), entropy.view(lead) if with_entropy else None)


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
                          ignore_index: int = -100, chunk_size: int | None = None, onednn: bool = False,
                          transform: LogitTransform | None = None) -> Tensor:
    """Summed token cross-entropy -sum log p(label) over positions whose label is not
    `ignore_index`; the ignored rows are left out before any logit is computed.

    hidden: (B, L, H) states that predict `labels` (B, L) (already shifted: row i
    predicts labels[:, i]); weight (V, H); bias (V,) or None. Returns a float32 scalar,
    equal to `F.cross_entropy(logits, labels, ignore_index=..., reduction="sum")` of the
    logits f(hidden W^T + b) (`transform`, as in `chunked_logprobs`).
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match labels {tuple(labels.shape)}")
    keep = labels != ignore_index                                            # (B, L)
    out = chunked_logprobs(hidden[keep], weight, bias, labels[keep], chunk_size=chunk_size, onednn=onednn,
                           transform=transform)
    return -out.logprobs.sum()
