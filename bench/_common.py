"""Pieces the benchmarks share: where their files go, the tiny model and prompts, memory.

Imports only the standard library at module level, so a worker process that imports
this file pays nothing before it records its memory baseline.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from dataclasses import dataclass
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


# --------------------------------------------------------------------------------------
# Model FLOPs and MFU per phase, for the benches' real-model options.
#
# How FLOPs are counted (the same rule on every side of a bench; each side is counted for the
# passes it runs, a bench's `phase_flops` says which):
#
# - `N_body`: the weights of the decoder's linear layers (every layer's attention and MLP
#   projections). `N_head`: the LM head's weights (vocabulary x hidden), counted whether
#   or not they are tied to the input embedding, since the head's product runs either way;
#   the embedding lookup and the norms cost nothing here.
# - A forward pass costs 2 x N_body per token it runs through the decoder plus 2 x N_head
#   per token whose logits the algorithm needs (the response tokens: the log-prob of
#   token t is read from the logits at t-1). A value head or a separate critic has no LM
#   head: its passes cost 2 x N_body per token. Forward + backward costs 3x the forward.
# - Tokens are real tokens only: prompt tokens (once per prompt; a GRPO group's prompt
#   once per group) plus response tokens; padding is waste, not work.
# - Attention's QK^T and AV products are left out: 4 x layers x hidden x context per token,
#   about 1.5% of 2 x N_body per token at 135M with contexts under 100 tokens.
#
# MFU = those FLOPs / the phase's wall seconds / the machine's float32 matmul peak, measured
# in the bench's own process (`measure_peak`: the best square float32 matmul through
# PyTorch's own matmul and through oneDNN). A bf16 run (`--mixed-precision bf16`) divides by
# the bfloat16 peak measured the same way (`measure_peak(dtype="bfloat16")`: torch's matmul,
# which reaches AMX where the CPU has it), as on CUDA; its float32 passes (the log-probs'
# chunks) then count against the faster rate.

@dataclass(frozen=True)
class LinearParams:
    body: int  # decoder linear-layer weights (and biases)
    head: int  # LM head weights

    @property
    def total(self) -> int:
        return self.body + self.head


def linear_params(model_dir: str | Path) -> LinearParams:
    """Count the linear-layer parameters of the causal LM in `model_dir`, built on the meta
    device from its config (no weights read, no memory used)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head_module = model.get_output_embeddings()
    head = head_module.weight.numel()
    body = sum(sum(p.numel() for p in m.parameters(recurse=False))
               for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head_module)
    return LinearParams(body=body, head=head)


def pass_flops(n: LinearParams, seq_tokens: float, head_tokens: float, backward: bool = False) -> float:
    """FLOPs of one pass: 2 x (N_body x seq_tokens + N_head x head_tokens), 3x with backward."""
    return (6 if backward else 2) * (n.body * seq_tokens + n.head * head_tokens)


def measure_peak(threads: int, sizes: tuple[int, ...] = (2048, 4096), dtype: str = "float32") -> float:
    """This machine's `dtype` matmul peak in FLOP/s on `threads` threads (wall time), in
    this process (bench/rollout_backends.py's `matmul_peak`)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rollout_backends import matmul_peak

    return matmul_peak(threads, sizes, dtype=dtype).wall


def cuda_matmul_peak(sizes: tuple[int, ...] = (4096, 8192), dtype: str = "float32", trials: int = 10) -> float:
    """The GPU's best square matmul rate in FLOP/s (`dtype`: float32 or bfloat16; torch's
    default float32 precision, so no TF32 unless the process allowed it), timed with
    CUDA synchronization."""
    import time

    import torch

    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype))
        b = torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype))
        a @ b  # warm-up
        torch.cuda.synchronize()
        for _ in range(trials):
            t0 = time.perf_counter()
            a @ b
            torch.cuda.synchronize()
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
        del a, b
    torch.cuda.empty_cache()
    return best


def device_peak(device: str, threads: int, sizes: tuple[int, ...], dtype: str = "float32",
                peak_tflops: float | None = None) -> tuple[float, str]:
    """(peak FLOP/s, what it is) for the MFU: `peak_tflops` when given, else measured here:
    the CPU's or the GPU's `dtype` matmul peak."""
    if peak_tflops:
        return peak_tflops * 1e12, f"the given peak, {peak_tflops:g} TFLOP/s"
    if device == "cuda":
        return cuda_matmul_peak(sizes, dtype), f"the {dtype} matmul peak measured on {device_name(device)}"
    return measure_peak(threads, sizes, dtype), f"the {dtype} matmul peak measured here ({cpu_name()})"


def device_name(device: str) -> str:
    """The CPU's model name, or the CUDA device's name."""
    if device == "cuda":
        import torch
        return torch.cuda.get_device_name()
    return cpu_name()


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo ('unknown CPU' elsewhere): every figure
    says which machine it comes from."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def mfu_cells(flops: dict[str, float], seconds: dict[str, float], peak: float) -> dict[str, float]:
    """Per phase: FLOPs / seconds / peak (nan where a phase took no time or did no work)."""
    out = {}
    for phase, f in flops.items():
        s = seconds.get(phase, 0.0)
        out[phase] = f / s / peak if s > 0 and f > 0 and peak > 0 else float("nan")
    return out


def format_mfu(label: str, flops: dict[str, float], seconds: dict[str, float], peak: float) -> str:
    """One line: `label: generate 1.23 s 4.5 TFLOP MFU 12.3%; ...`."""
    mfu = mfu_cells(flops, seconds, peak)
    cells = [f"{p} {seconds.get(p, 0.0):.2f} s {flops[p] / 1e9:.3g} GFLOP MFU {100 * mfu[p]:.1f}%"
             for p in flops]
    return f"{label}: " + "; ".join(cells)
