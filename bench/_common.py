"""Pieces the benchmarks share: where their files go, the tiny model and prompts, memory.

Imports only the standard library at module level, so a worker process that imports
this file pays nothing before it records its memory baseline.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / ".bench"  # git-ignored: models, outputs, the benchmark-only TRL install
PROMPT_TEMPLATE = "Question: {prompt}\nAnswer:"


# --------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------
def ensure_tiny_model(folder: str | Path) -> Path:
    """The project's tiny causal LM in `folder`, built once (rlhflab.models.tiny)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        from rlhflab.models.tiny import make_tiny_model
        make_tiny_model(folder)
    return folder


def bench_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` arithmetic problems in GSM8K format: {"question", "answer", ...}."""
    from rlhflab.data import arith
    return arith.make_split(n, seed)


def format_bench_prompt(question: str) -> str:
    from rlhflab.data.prompts import format_prompt
    return format_prompt(question, PROMPT_TEMPLATE)


# --------------------------------------------------------------------------------------
# Memory (Linux /proc; ru_maxrss as the fallback)
# --------------------------------------------------------------------------------------
def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_mb() -> float:
    """Resident set size of this process now, in MiB."""
    kib = _status_kib("VmRSS")
    if kib is None:
        return float("nan")
    return kib / 1024


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (VmHWM) to the current RSS; False if unsupported.

    Writing "5" to /proc/self/clear_refs does this on Linux >= 4.0 (proc(5)).
    """
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """Peak RSS of this process since start (or since `reset_peak_rss`), in MiB."""
    kib = _status_kib("VmHWM")
    if kib is None:  # no /proc: the lifetime peak from getrusage (KiB on Linux)
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc malloc_trim)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS may keep freed pages, peaks stay valid
        pass


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (shared storage counted once)."""
    import torch

    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def profiled_tensor_bytes(fn) -> tuple[int, int]:
    """(peak, still held at the end): bytes of CPU tensors allocated while `fn()` runs.

    torch.profiler(profile_memory=True) records every CPU allocation and free with the
    running total of the bytes allocated since profiling began; the peak of that total
    minus its value before the call is the call's own peak, exact and the same from run
    to run (no allocator slack, unlike RSS). Tensors that existed before the call are not
    in it. (0, 0) when nothing was allocated. The tests use it too (tests/memory_helpers.py).
    """
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = sorted((e for e in json.loads(path.read_text())["traceEvents"]
                         if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                        key=lambda e: e["ts"])
    if not events:
        return 0, 0
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in events) - start, events[-1]["args"]["Total Allocated"] - start


def profiled_tensor_peak_mb(fn) -> float:
    """Peak MiB of CPU tensors allocated while `fn()` runs (`profiled_tensor_bytes`); nan
    when the profiler saw no allocation."""
    peak, _ = profiled_tensor_bytes(fn)
    return peak / 2**20 if peak else float("nan")


def lifetime_peak_rss_mb() -> float:
    """ru_maxrss of this process: its peak RSS over its whole life, imports included."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------
def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> float:
    """(max - min) / median: the relative noise of repeated timings."""
    if len(xs) < 2:
        return 0.0
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m if m else float("nan")


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_SYNC_CUDA = False  # a worker on --device cuda turns it on: `clock()` then waits for the GPU


def sync_clock_with_cuda(on: bool) -> None:
    """Make `clock()` wait for the GPU's queued work before it reads the time (a bench
    worker on --device cuda), or not."""
    global _SYNC_CUDA
    _SYNC_CUDA = on


def clock() -> float:
    """time.perf_counter(), after the GPU has finished its queued work when
    `sync_clock_with_cuda(True)` was called in this process."""
    if _SYNC_CUDA:
        import torch
        torch.cuda.synchronize()
    return time.perf_counter()
