"""Float32 linear layers on this CPU: PyTorch's own matmul (MKL) beside oneDNN.

    .venv/bin/python bench/cpu_matmul.py                  # about a minute
    .venv/bin/python bench/cpu_matmul.py --threads 1 --repeats 9

The two libraries `model.cpu_matmul` chooses between (rlhflab/models/cpu_matmul.py), on the
shapes rlhflab's trainers run, all float32:

    tiny      (1920, 192) x (192 -> 768)     the PPO benchmarks' tiny model: 32 episodes
                                             of about 60 tokens, an MLP up-projection
    25M       (12800, 512) x (512 -> 1376)   the 25M model (bench/rollout_backends.py),
                                             128 sequences x 100 tokens
    decode    (128, 512) x (512 -> 1376)     one decoding step of 128 sequences at 25M
    0.5B      (1024, 896) x (896 -> 4864)    Qwen2.5-0.5B's MLP, 8 episodes x 128 tokens
    lm_head   (128, 896) x (896 -> 151936)   one chunk of its LM head (ops.chunked)
    square    (2048, 2048) x (2048 -> 2048)  a large square product: near each library's peak

`--shapes smollm2` (not in the default run) times the linear layers of one update pass of
`bench/ppo_throughput.py` on SmolLM2-135M-Instruct instead: 32 episodes of 43 tokens (1376
rows) through a decoder layer's q/o (576 -> 576), k/v (576 -> 192), gate/up (576 -> 1536)
and down (1536 -> 576) projections, and the LM head over the 512 response rows (576 ->
49,152). A last line weighs them as an update pass has them (30 layers, one head), the rate
at which a whole update's linear layers can run with each library.

Each shape is timed forward (`F.linear` against `ops.matmul.linear` with oneDNN) and
forward + backward (the input and the weight gradients); medians over `--repeats` runs
after a warm-up, in GFLOP/s (2 FLOPs per multiply-add; the backward is two more products
of the forward's size). `torch` is exactly what any PyTorch program runs; `onednn` the
same products in the same precision through the oneDNN PyTorch ships. The header line
says which the `auto` mode picks on this CPU and why. The last line is for scripts:
`cpu_matmul: onednn/torch X forward, Y forward+backward (25M)`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (the bench folder is not a package)

SHAPES = {  # name: (rows, in_features, out_features)
    "tiny": (1920, 192, 768),
    "25M": (12800, 512, 1376),
    "decode": (128, 512, 1376),
    "0.5B": (1024, 896, 4864),
    "lm_head": (128, 896, 151_936),
    "square": (2048, 2048, 2048),
}
HEADLINE = "25M"
DEFAULT_SHAPES = list(SHAPES)
# bench/ppo_throughput.py's update on SmolLM2-135M-Instruct: (rows, in, out) and how many such
# products one update pass runs (30 decoder layers; the LM head on the response rows only)
SMOLLM2 = {
    "smol-qo": ((1376, 576, 576), 60),
    "smol-kv": ((1376, 576, 192), 60),
    "smol-up": ((1376, 576, 1536), 60),
    "smol-down": ((1376, 1536, 576), 30),
    "smol-head": ((512, 576, 49_152), 1),
}
SHAPES.update({name: shape for name, (shape, _) in SMOLLM2.items()})


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return _common.median(times)


def measure(name: str, repeats: int) -> dict[str, float]:
    """GFLOP/s of forward and forward+backward of one shape under each library."""
    import torch

    from rlhflab.ops import matmul

    n, i, o = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, i, generator=g)
    w = torch.empty(o, i).normal_(0, i ** -0.5, generator=g)
    up = torch.randn(n, o, generator=g)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    flops = 2 * n * i * o
    out = {}
    for mode in ("torch", "onednn"):
        on = mode == "onednn"

        def fwd(on=on):
            with torch.no_grad():
                matmul.linear(x, w, onednn=on)

        def fwd_bwd(on=on):
            xg.grad = wg.grad = None
            matmul.linear(xg, wg, onednn=on).backward(up)

        out[f"{mode} fwd"] = flops / _time(fwd, repeats) / 1e9
        out[f"{mode} fwd+bwd"] = 3 * flops / _time(fwd_bwd, repeats) / 1e9
    return out


def smollm2_line(results: dict[str, dict[str, float]]) -> str:
    """Each library's forward+backward rate over one SmolLM2 update pass's linear layers:
    total FLOPs over total time, each product counted as often as the pass runs it."""
    flops = {name: 6 * n * i * o * count for name, ((n, i, o), count) in SMOLLM2.items()}
    total = sum(flops.values())
    rate = {mode: total / sum(f / results[name][f"{mode} fwd+bwd"] for name, f in flops.items())
            for mode in ("torch", "onednn")}
    return (f"smollm2 update pass ({total / 1e9:.0f} GFLOP of linear layers): torch {rate['torch']:.1f}, "
            f"onednn {rate['onednn']:.1f} GFLOP/s forward+backward, ratio {rate['onednn'] / rate['torch']:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per case (default: 5)")
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES) + ["smollm2"],
                    help="shapes to time (default: the first six; smollm2: SmolLM2's update, see above)")
    args = ap.parse_args(argv)
    args.shapes = [x for name in args.shapes for x in (SMOLLM2 if name == "smollm2" else [name])]
    if args.threads < 1 or args.repeats < 1:
        ap.error("--threads and --repeats must be at least 1")
    from rlhflab.openmp import apply_default_wait
    apply_default_wait()  # as the CLI: idle OpenMP threads poll briefly, then sleep
    import torch

    from rlhflab.models import cpu_matmul
    from rlhflab.ops import matmul

    if not matmul.onednn_available():
        print("cpu_matmul: this torch build has no oneDNN linear op; nothing to compare")
        return 1
    torch.set_num_threads(args.threads)
    vendor, flags = cpu_matmul.cpu_info()
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.repeats} repeats; CPU vendor "
          f"{vendor or 'unknown'}, AVX-512 {'yes' if 'avx512f' in flags else 'no'}; "
          f"model.cpu_matmul=auto picks {cpu_matmul.resolve('auto')} here")
    print(f"{'shape':<9}{'rows x in -> out':>24}{'torch fwd':>11}{'onednn fwd':>12}{'ratio':>7}"
          f"{'torch f+b':>11}{'onednn f+b':>12}{'ratio':>7}   (GFLOP/s)")
    results = {}
    for name in args.shapes:
        r = results[name] = measure(name, args.repeats)
        n, i, o = SHAPES[name]
        print(f"{name:<9}{f'{n} x {i} -> {o}':>24}{r['torch fwd']:>11.1f}{r['onednn fwd']:>12.1f}"
              f"{r['onednn fwd'] / r['torch fwd']:>7.2f}{r['torch fwd+bwd']:>11.1f}{r['onednn fwd+bwd']:>12.1f}"
              f"{r['onednn fwd+bwd'] / r['torch fwd+bwd']:>7.2f}", flush=True)
    if all(name in results for name in SMOLLM2):
        print(smollm2_line(results))
    if HEADLINE in results:
        r = results[HEADLINE]
        print(f"cpu_matmul: onednn/torch {r['onednn fwd'] / r['torch fwd']:.2f} forward, "
              f"{r['onednn fwd+bwd'] / r['torch fwd+bwd']:.2f} forward+backward ({HEADLINE})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
