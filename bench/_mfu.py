"""Model FLOPs and MFU per phase, for the benches' real-model options.

How FLOPs are counted (the same rule on every side of a bench; each side is counted for the
passes it runs, a bench's `phase_flops` says which):

- `N_body`: the weights of the decoder's linear layers (every layer's attention and MLP
  projections). `N_head`: the LM head's weights (vocabulary x hidden), counted whether
  or not they are tied to the input embedding, since the head's product runs either way;
  the embedding lookup and the norms cost nothing here.
- A forward pass costs 2 x N_body per token it runs through the decoder plus 2 x N_head
  per token whose logits the algorithm needs (the response tokens: the log-prob of
  token t is read from the logits at t-1). A value head or a separate critic has no LM
  head: its passes cost 2 x N_body per token. Forward + backward costs 3x the forward.
- Tokens are real tokens only: prompt tokens (once per prompt; a GRPO group's prompt
  once per group) plus response tokens; padding is waste, not work.
- Attention's QK^T and AV products are left out: 4 x layers x hidden x context per token,
  about 1.5% of 2 x N_body per token at 135M with contexts under 100 tokens.

MFU = those FLOPs / the phase's wall seconds / the machine's float32 matmul peak, measured
in the bench's own process (`measure_peak`: the best square float32 matmul through
PyTorch's own matmul and through oneDNN). A bf16 run (`--mixed-precision bf16`) divides by
the bfloat16 peak measured the same way (`measure_peak(dtype="bfloat16")`: torch's matmul,
which reaches AMX where the CPU has it), as on CUDA; its float32 passes (the log-probs'
chunks) then count against the faster rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
