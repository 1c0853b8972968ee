"""Matmul speed in float32, bfloat16 and float16 on this machine's CPU.

    .venv/bin/python bench/matmul_dtypes.py                # about a minute
    .venv/bin/python bench/matmul_dtypes.py --threads 2 --repeats 9

Shapes are a Qwen2.5-0.5B-sized model's (hidden 896, MLP 4864, vocab 151,936) at
1,024 tokens (8 episodes x 128 tokens):

    mlp       (1024, 896) @ (896, 4864)       an MLP up-projection
    lm_head   (1024, 896) @ (896, 151936)     the LM head (in chunks of 128 rows, as
                                              ops.chunked_logprobs runs it)
    linear    forward + backward of an 896 -> 4864 nn.Linear on 1,024 tokens

Each case is timed `--repeats` times after one warm-up; the table gives the median
seconds and GFLOP/s and each dtype's speed relative to float32 (>1 is faster). The last
line is for scripts: `matmul_dtypes: bf16/fp32 X, fp16/fp32 Y` (the `mlp` case).
"""

from __future__ import annotations

import argparse
import statistics
import time


def _cases(torch, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 896, generator=g).to(dtype)
    w_mlp = torch.randn(896, 4864, generator=g).to(dtype)
    w_head = (torch.randn(896, 151_936, generator=g) * 0.02).to(dtype)
    lin = torch.nn.Linear(896, 4864, bias=False).to(dtype)
    xg = x.clone().requires_grad_()

    def mlp():
        return x @ w_mlp

    def lm_head():
        for s in range(0, 1024, 128):
            x[s:s + 128] @ w_head

    def linear():
        lin(xg).sum().backward()
        lin.weight.grad = xg.grad = None

    flops = {"mlp": 2 * 1024 * 896 * 4864, "lm_head": 2 * 1024 * 896 * 151_936, "linear": 3 * 2 * 1024 * 896 * 4864}
    return {"mlp": mlp, "lm_head": lm_head, "linear": linear}, flops


def _half_flags() -> list[str]:
    """The CPU's half-precision matmul features (Linux /proc/cpuinfo): AMX and AVX-512 BF16/FP16."""
    from rlhflab.models.cpu_matmul import cpu_info

    flags = cpu_info()[1]
    return sorted(f for f in flags if f in ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per case (default: 5)")
    args = ap.parse_args(argv)
    from rlhflab.openmp import apply_default_wait
    apply_default_wait()  # as the CLI: idle OpenMP threads poll briefly, then sleep
    import torch

    torch.set_num_threads(args.threads)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    medians: dict[tuple[str, str], float] = {}
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.repeats} repeats; "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}; "
          f"bf16/fp16 CPU flags: {' '.join(_half_flags()) or 'none'}")
    print(f"{'case':<9}{'dtype':<10}{'median s':>10}{'GFLOP/s':>10}{'vs fp32':>9}")
    for name in ("mlp", "lm_head", "linear"):
        for dname, dtype in dtypes.items():
            cases, flops = _cases(torch, dtype)
            fn = cases[name]
            fn()  # warm-up
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            medians[(name, dname)] = med
            rel = medians[(name, "float32")] / med
            print(f"{name:<9}{dname:<10}{med:>10.4f}{flops[name] / med / 1e9:>10.1f}{rel:>9.2f}", flush=True)
    bf = medians[("mlp", "float32")] / medians[("mlp", "bfloat16")]
    fp = medians[("mlp", "float32")] / medians[("mlp", "float16")]
    print(f"matmul_dtypes: bf16/fp32 {bf:.2f}, fp16/fp32 {fp:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
