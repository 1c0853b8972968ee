"""Drawing a token from a distribution: by inverse transform, from one uniform number per
row, and that number keyed so the draw does not depend on how a batch is split.

`inverse_cdf_draw` takes the first token whose cumulative probability passes u × total.
`torch.multinomial` (what `generate` calls) instead draws a random number for every
vocabulary entry. Both draw from the same distribution; for
a given seed they draw different tokens.

Seeded sampling: multinomial draws from one random stream for the whole batch, so the
sample a row gets depends on which rows share its batch: 2 processes × 16 prompts do not
sample what 1 process × 32 prompts sample, nor does batch_size 8 sample what batch_size 64
does. `counter_uniform` instead gives each (row, position) its own uniform number from a
counter-based hash of (key of the row, position), and the row's key comes from (seed,
step, the row's index in the whole step), so the sample is the same wherever the row is
computed. The hash is two xorshift-multiply rounds on 32-bit values held in int64 (every
product stays below 2^63), enough for uniformity at these scales (tested), not
cryptographic; its numbers have 32 bits, so a token's share of the draw is exact to
2^-32 of the row's mass.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK = 0xFFFFFFFF


def _mix32(h: Tensor) -> Tensor:
    """A 32-bit integer mixer on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _MASK
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & _MASK
    return h ^ (h >> 16)


def row_keys(seed: int, step: int, rows: Tensor) -> Tensor:
    """One 32-bit key per row from (seed, step, the row's global index). (B,) int64."""
    base = _mix32(torch.tensor([(seed * 1_000_003 + step) & _MASK], dtype=torch.int64))
    return _mix32((base + rows.to(torch.int64) * 0x61C88647) & _MASK)


def counter_uniform(keys: Tensor, position: int, vocab: int) -> Tensor:
    """Uniform numbers in (0, 1), one per (row, token id) at `position`: (B,) keys -> (B, V) float64."""
    pos = _mix32((keys ^ ((position * 0x3C6EF372) & _MASK)) & _MASK)                  # (B,)
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    h = _mix32((pos.unsqueeze(1) + ids * 0x9E3779B9) & _MASK)                          # (B, V)
    h = _mix32(h ^ pos.unsqueeze(1))
    return (h.double() + 0.5) / 2.0**32


def inverse_cdf_draw(scores: Tensor, u: Tensor) -> Tensor:
    """One token id per row drawn from softmax(scores) by inverse transform: the first id
    whose cumulative probability exceeds u × total. (B, V) scores (logits after any
    temperature, top-k or top-p processing; −inf marks a token that may not be drawn),
    (B,) uniform numbers in [0, 1) -> (B,) int64.

    The weights are exp(scores − max) and their running sum is taken in float64, so each
    token's share of [0, total) is its probability to float64 rounding; a token of weight 0
    has an empty share and is never drawn. A row with no finite score, or a NaN, is refused
    (as torch.multinomial refuses it)."""
    if scores.dim() != 2 or u.shape != scores.shape[:1]:
        raise ValueError(f"inverse_cdf_draw: scores (B, V) and u (B,) expected, got {tuple(scores.shape)} "
                         f"and {tuple(u.shape)}")
    z = scores.float()
    cum = (z - z.amax(dim=-1, keepdim=True)).exp().cumsum(dim=-1, dtype=torch.float64)   # (B, V)
    total = cum[:, -1:]                                                                     # (B, 1)
    if not bool(torch.isfinite(total).all()):
        raise ValueError("inverse_cdf_draw: a row of scores has no finite value or holds NaN/inf "
                         "(the model's logits diverged?)")
    # u × total < total for u < 1; the clamp keeps u = 1 (or a rounding) off total itself,
    # where no running sum is larger
    point = torch.minimum(u.to(torch.float64).unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, point, right=True).squeeze(-1)
