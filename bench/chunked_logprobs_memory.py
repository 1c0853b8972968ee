"""Peak memory of token log-probs + entropy, forward and backward, at a 151,936-token vocabulary.

    .venv/bin/python bench/chunked_logprobs_memory.py            # about 2 minutes on one core
    .venv/bin/python bench/chunked_logprobs_memory.py --rows 256 --vocab 32000

The work is what a PPO update does with the LM head: hidden states (N, H) of N = 8
episodes x 128 response tokens, a Qwen2.5-0.5B-shaped head (H = 896, V = 151,936, the
weight float32), log-probs of given tokens and the entropy at temperature 0.7, and the
backward of sum(logprobs) + 0.01 sum(entropy) into the hidden states and the weight.

Two ways:
- `unchunked`: logits = hidden @ W^T (N, V), then `ops.logprobs_from_logits` and
  `ops.entropy_from_logits` (today's path in the trainers);
- `chunked`: `ops.chunked_logprobs(hidden, W, None, targets, ...)` at the default chunk
  size and at a few others.

Each way runs in a fresh process (spawn), so no allocator state is shared. Columns:
- `tensor MiB`: the peak of the bytes of tensors allocated during forward+backward and
  alive at once (torch.profiler's running "Total Allocated"), above what existed before
  (hidden, weight): exact, no allocator slack. The weight's gradient (V x H x 4 bytes =
  519 MiB here) is in it on both sides: it is the result, not overhead.
- `peak RSS MiB`: the process's peak resident set during the call above its resident set
  just before (VmHWM reset through /proc/self/clear_refs).
- `above grad`: `tensor MiB` less the weight's gradient: what the way itself costs.
- `s`, `cpu s`: wall and CPU seconds of one forward+backward (timed without the
  profiler). On a machine shared with other jobs the wall time swings by 3x between
  runs; the CPU time is steadier.

The last line is for scripts: `chunked_logprobs_memory: V 151936 N 1024
unchunked_tensor_mib X chunked_tensor_mib Y ratio Z, above the weight gradient Wx less`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _work(kind: str, rows: int, hidden_size: int, vocab: int, chunk: int, threads: int):
    """One forward+backward; returns (tensor MiB, peak RSS MiB above start, wall s, CPU s)."""
    import torch

    from _common import peak_rss_mb, profiled_tensor_peak_mb, release_freed_memory, reset_peak_rss, rss_mb
    from rlhflab import ops

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, hidden_size, generator=g).requires_grad_()              # (N, H)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.02).requires_grad_()    # (V, H)
    targets = torch.randint(0, vocab, (rows,), generator=g)                            # (N,)

    def step():
        if kind == "unchunked":
            logits = (hidden @ weight.t()) / 0.7                                       # (N, V)
            lp = ops.logprobs_from_logits(logits[None], targets[None])
            ent = ops.entropy_from_logits(logits[None])
        else:
            lp, ent = ops.chunked_logprobs(hidden, weight, None, targets, temperature=0.7,
                                           chunk_size=chunk or None, with_entropy=True)
        (lp.sum() + 0.01 * ent.sum()).backward()
        hidden.grad = weight.grad = None

    step()  # warm the allocator and the kernels
    release_freed_memory()
    tensor_mib = profiled_tensor_peak_mb(step)
    release_freed_memory()
    base = rss_mb()
    reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    return tensor_mib, peak_rss_mb() - base, seconds, cpu_seconds


def _child(conn, *args):
    conn.send(_work(*args))
    conn.close()


def measure(*args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, *args))
    proc.start()
    out = parent.recv()
    proc.join()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8 * 128, help="N = episodes x response tokens (default 1024)")
    ap.add_argument("--hidden", type=int, default=896, help="hidden size H (default 896, Qwen2.5-0.5B)")
    ap.add_argument("--vocab", type=int, default=151_936, help="vocabulary V (default 151,936, Qwen2.5)")
    ap.add_argument("--chunks", default="0,32,512", help="chunk sizes to try; 0 is the default size (default 0,32,512)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    args = ap.parse_args(argv)
    from rlhflab.openmp import apply_default_wait
    apply_default_wait()  # as the CLI: idle OpenMP threads poll briefly, then sleep

    from rlhflab.ops.chunked import default_chunk_size

    n, h, v = args.rows, args.hidden, args.vocab
    logits_mib = n * v * 4 / 2**20
    print(f"N={n} rows, H={h}, V={v}: one float32 (N, V) logits copy = {logits_mib:.0f} MiB; "
          f"weight and its gradient {v * h * 4 / 2**20:.0f} MiB each; default chunk {default_chunk_size(v)} rows")
    grad_mib = v * h * 4 / 2**20
    print(f"{'way':<22}{'tensor MiB':>12}{'above grad':>12}{'peak RSS MiB':>14}{'s':>8}{'cpu s':>8}")
    results = {}
    ways = [("unchunked", 0)] + [("chunked", int(c)) for c in args.chunks.split(",")]
    for kind, chunk in ways:
        name = kind if kind == "unchunked" else f"chunked ({chunk or default_chunk_size(v)} rows)"
        tensor_mib, rss, seconds, cpu_seconds = measure(kind, n, h, v, chunk, args.threads)
        results[(kind, chunk)] = tensor_mib
        print(f"{name:<22}{tensor_mib:>12.0f}{tensor_mib - grad_mib:>12.0f}{rss:>14.0f}{seconds:>8.2f}"
              f"{cpu_seconds:>8.2f}", flush=True)
    un, ch = results[("unchunked", 0)], results[("chunked", int(args.chunks.split(",")[0]))]
    print(f"chunked_logprobs_memory: V {v} N {n} unchunked_tensor_mib {un:.0f} chunked_tensor_mib {ch:.0f} "
          f"ratio {ch / un:.2f}, above the weight gradient {(un - grad_mib) / (ch - grad_mib):.1f}x less")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
