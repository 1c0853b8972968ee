"""What the chunked log-prob op holds at its peak: at most two chunks of logits at once."""

from __future__ import annotations

import torch
from memory_helpers import tensor_peak_bytes

from rlhflab import ops


def test_chunked_backward_holds_at_most_two_chunks_of_logits():
    # N = 64 rows, H = 8, V = 5,000, 16-row chunks: one float32 chunk of logits is
    # 16 x 5,000 x 4 = 320,000 bytes. The backward pass returns grad_h (64 x 8 x 4 =
    # 2,048 bytes) and grad_w (5,000 x 8 x 4 = 160,000 bytes) and needs, per chunk, the
    # log-probs and the softmax (two chunks). Measured: 802,696 bytes (grads + 2 chunks +
    # 648); when the last chunk's tensors were still referenced as the next chunk's were
    # made, 1,442,184 (four chunks).
    torch.manual_seed(0)
    n, h, v, c = 64, 8, 5_000, 16
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    out = ops.chunked_logprobs(hidden, weight, None, targets, chunk_size=c, with_entropy=True)
    loss = out.logprobs.sum() + 0.1 * out.entropy.sum()
    chunk = c * v * 4
    peak = tensor_peak_bytes(loss.backward)
    grads = n * h * 4 + v * h * 4
    assert grads + 2 * chunk <= peak < grads + 2.5 * chunk, (peak, grads, chunk)


def test_chunked_forward_holds_at_most_two_chunks_of_logits():
    # The forward with the entropy keeps, per chunk, the logits (shifted in place) and
    # their exponential: two chunks. Measured: 640,528 bytes (2 chunks + the outputs);
    # when the last chunk's tensors were still referenced as the next chunk's logits were
    # made, three chunks.
    torch.manual_seed(0)
    n, h, v, c = 64, 8, 5_000, 16
    hidden, weight = torch.randn(n, h), torch.randn(v, h)
    targets = torch.randint(0, v, (n,))
    chunk = c * v * 4
    with torch.no_grad():
        peak = tensor_peak_bytes(lambda: ops.chunked_logprobs(hidden, weight, None, targets, chunk_size=c,
                                                               with_entropy=True))
    assert 2 * chunk <= peak < 2.5 * chunk, (peak, chunk)
