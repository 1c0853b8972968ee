"""Token log-probabilities and entropy from logits, in float32 whatever the model dtype
(float64 logits stay float64)."""

from __future__ import annotations

import torch
from torch import Tensor


def logprobs_from_logits(logits: Tensor, tokens: Tensor, chunk_size: int = 0) -> Tensor:
    """log p(tokens) under softmax(logits).

    logits: (B, T, V); tokens: (B, T) int -> (B, T) float32 (float64 for float64 logits).

    Computed as logit[token] - logsumexp(logits), so no (B, T, V) log-softmax copy is
    kept; `chunk_size` > 0 processes that many rows of B at a time to cap the float32
    upcast of a half-precision batch.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match tokens {tuple(tokens.shape)}")
    if chunk_size and logits.shape[0] > chunk_size:
        return torch.cat([logprobs_from_logits(lg, tk) for lg, tk in
                          zip(logits.split(chunk_size), tokens.split(chunk_size))])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    picked = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position: (B, T, V) -> (B, T) float32 (float64 for
    float64 logits).

    H = -sum_v p_v log p_v with log p from `log_softmax`: every term is >= 0, so nothing
    cancels (the equal form logsumexp(z) - sum_v p_v z_v subtracts two sums of the size
    of the largest logit and loses ~1e-5 in float32 when H is small).
    A logit of -inf (a masked-out token) is clamped to its dtype's minimum first, so its
    term p_v log p_v is 0 rather than 0 * -inf = NaN (in the value and in the gradient);
    the clamp's (B, T, V) copy is made only when such a logit is present.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if torch.isneginf(logits).any():
        logits = logits.clamp(min=torch.finfo(logits.dtype).min)
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
