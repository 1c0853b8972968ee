"""Sampling that does not depend on how a batch is split.

`torch.multinomial` draws from one random stream for the whole batch, so the sample a
row gets depends on which rows share its batch: 2 processes × 16 prompts do not sample
what 1 process × 32 prompts sample, nor does batch_size 8 sample what batch_size 64 does.
Here every (row, position, token) gets its own uniform number from a counter-based
hash of (key of the row, position, token id), and the Gumbel-max trick turns them into
a sample: argmax_v (z_v + g_v) with g = −log(−log u) is distributed as softmax(z)
(Gumbel, 1954; e.g. Maddison et al., 2014). The row's key comes from (seed, step, the
row's index in the whole step), so the sample is the same wherever the row is computed.

The hash is two xorshift-multiply rounds on 32-bit values held in int64 (every product
stays below 2^63), enough for uniformity at these scales (tested), not cryptographic.
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


def gumbel_noise(keys: Tensor, position: int, vocab: int) -> Tensor:
    """g = −log(−log u) per (row, token id): argmax(logits + g) samples softmax(logits). (B, V) float32."""
    u = counter_uniform(keys, position, vocab)
    return (-torch.log(-torch.log(u))).float()
