"""Exact tensor-memory measurement for tests (CPU): the profiler's running count of bytes.

One implementation serves the tests and the benchmarks: `bench/_common.py` `profiled_tensor_bytes`,
loaded here from its file (the bench folder is not a package).
"""

from __future__ import annotations

from pathlib import Path

from file_modules import load_file

_common = load_file("rlhflab_bench_common", Path(__file__).resolve().parents[1] / "bench" / "_common.py")

tensor_bytes = _common.profiled_tensor_bytes  # (peak, still held at the end) in bytes while fn() runs


def tensor_peak_bytes(fn) -> int:
    """Peak bytes of CPU tensors allocated while fn() runs (see `tensor_bytes`)."""
    return tensor_bytes(fn)[0]
