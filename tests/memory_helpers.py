"""Exact tensor-memory measurement for tests (CPU): the profiler's running count of bytes."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def tensor_peak_bytes(fn) -> int:
    """Peak bytes of CPU tensors allocated while fn() runs (see `tensor_bytes`)."""
    return tensor_bytes(fn)[0]


def tensor_bytes(fn) -> tuple[int, int]:
    """(peak, still held at the end): bytes of CPU tensors allocated while fn() runs.

    torch.profiler(profile_memory=True) records every allocation and free with the running
    total; the peak of the total minus its value before the call is the call's own peak,
    exact and the same from run to run (no allocator slack, unlike RSS).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = sorted((e for e in json.loads(path.read_text())["traceEvents"]
                         if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in events) - start, events[-1]["args"]["Total Allocated"] - start
