"""Where one PPO step of bench/ppo_throughput.py spends its CPU time, by kind of operator.

    python bench/profile_step.py                          # rlhflab's separate-critic side
    python bench/profile_step.py --side trl --rows 25     # TRL's, with the 25 costliest operators

Builds one side of bench/ppo_throughput.py in this process (same model and settings),
runs warm-up steps, then one step under torch.profiler, and sums the operators' self CPU
time into kinds:

    matmul     aten::mm, addmm, bmm, baddbmm, matmul, linear (forward and backward)
    attention  scaled_dot_product attention kernels (forward and backward)
    optimizer  the fused AdamW kernel
    other      everything else: elementwise ops (RMSNorm, rotary embedding, SiLU, the
               residual adds, their backward), copies, indexing, the log-prob op's own work

The profiler's overhead inflates small operators, so the shares lean towards `other`; the
point is the matmul share, which is the same work on every side. The last line:

    profile_step: SIDE cpu_s X, matmul A%, attention B%, optimizer C%, other D%
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import ppo_throughput  # noqa: E402

KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
               "aten::_addmm_activation", "mkldnn::_linear_pointwise"),
    "attention": ("aten::_scaled_dot_product",),
    "optimizer": ("aten::_fused_adamw",),
}


def kind_of(name: str) -> str:
    for kind, prefixes in KINDS.items():
        if name.startswith(prefixes):
            return kind
    return "other"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", default="rlhflab-critic", choices=list(ppo_throughput.SIDES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: no thread waits in the times)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rows", type=int, default=12, help="the costliest operators to list")
    ap.add_argument("--model-dir", default=str(_common.BENCH_DIR / "tiny-model"))
    a = ap.parse_args(argv)
    from rlhflab.openmp import apply_default_wait
    apply_default_wait()  # as the CLI: idle OpenMP threads poll briefly, then sleep
    import torch
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(a.threads)
    settings = ppo_throughput.BenchSettings(model_dir=str(_common.ensure_tiny_model(a.model_dir)), threads=a.threads)
    side = ppo_throughput.make_side(a.side, settings)
    torch.manual_seed(0)
    side.build()
    for _ in range(a.warmup):
        side.step()
    c0 = time.process_time()
    side.step()
    cpu = time.process_time() - c0
    # every thread's operators: rlhflab's separate critic runs its pass in a second thread
    # (model.critic_overlap)
    with profile(activities=[ProfilerActivity.CPU],
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        side.step()
    by_kind: dict[str, float] = defaultdict(float)
    ops = []
    for e in prof.key_averages():  # self time: a parent (aten::linear) does not count its child (aten::mm)
        by_kind[kind_of(e.key)] += e.self_cpu_time_total
        ops.append((e.self_cpu_time_total, e.count, e.key))
    total = sum(by_kind.values())
    print(f"{ppo_throughput.LABELS[a.side]}: one step {cpu:.3f} CPU s unprofiled, {a.threads} thread(s); "
          f"profiled self CPU time {total / 1e6:.3f} s")
    print(f"{'operator':<56} {'calls':>6} {'self ms':>9} {'share':>6}")
    for t, n, key in sorted(ops, reverse=True)[: a.rows]:
        print(f"{key[:56]:<56} {n:>6} {t / 1e3:>9.1f} {t / total:>6.1%}")
    shares = {k: by_kind.get(k, 0.0) / total for k in ("matmul", "attention", "optimizer", "other")}
    print(f"profile_step: {a.side} cpu_s {cpu:.3f}, " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
