"""PPO episodes/s in float32, under bfloat16 autocast, and with bfloat16 weights, on this CPU.

    python bench/precision_speed.py             # builds a ~25M-parameter Llama once, then measures
    python bench/precision_speed.py --repeats 3

The four ways to run rlhflab's PPO (value head) on the same model and settings as
bench/ppo_throughput.py (32 episodes x 16 new tokens, 4 epochs of one minibatch, KL in
the reward, a frozen reference), through that script's harness: one worker process per
way, stepped in turn, medians of the measured steps, CPU seconds beside wall seconds.

    fp32          model.torch_dtype float32, training.mixed_precision no
    bf16 autocast model.torch_dtype float32, training.mixed_precision bf16 (float32 master weights)
    bf16 + eager  the same with model.attn_implementation eager (attention as plain matmuls and a
                  softmax: the CPU's bfloat16 SDPA backward is slower than its float32 one)
    bf16 weights  model.torch_dtype bfloat16 (weights, gradients and Adam state in bfloat16)

The model: the project's tiny Llama builder at hidden 512, 6 layers, 8 heads, a 512-token
vocabulary (25.4M parameters), saved once in .bench/llama-25m. The last line:

    precision_speed: fp32 X eps/s, bf16 autocast Y eps/s (Y/X), with eager attention E eps/s (E/X), bf16 weights Z eps/s (Z/X)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import ppo_throughput  # noqa: E402

MODEL_DIR = _common.BENCH_DIR / "llama-25m"
SIDES = {"rlhflab": "fp32", "rlhflab-bf16": "bf16 autocast", "rlhflab-bf16-eager": "bf16 + eager",
         "rlhflab-bf16-weights": "bf16 weights"}


def ensure_model(folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        from rlhflab.models.tiny import make_tiny_model
        make_tiny_model(folder, hidden_size=512, num_layers=6, num_heads=8, vocab_size=512)
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="measured steps per way (median taken)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-dir", default=str(MODEL_DIR), help="built there when missing")
    a = ap.parse_args(argv)
    model = ensure_model(Path(a.model_dir))
    settings = ppo_throughput.BenchSettings(model_dir=str(model), threads=a.threads)
    from rlhflab.openmp import apply_default_wait
    apply_default_wait()  # as the CLI: idle OpenMP threads poll briefly, then sleep
    print(f"precision_speed: {a.warmup} warm-up + {a.repeats} measured steps per way, load average "
          f"{os.getloadavg()[0]:.1f} ({_common.cpu_count()} CPUs)", file=sys.stderr)
    result = ppo_throughput.run(list(SIDES), settings, a.repeats, a.warmup, tensor_memory=False)
    summary = ppo_throughput.summarize(result)
    n_params = result["info"]["rlhflab"]["trainable_params"]
    print(f"PPO (value head), {n_params / 1e6:.1f}M trainable parameters ({model}), 32 episodes x 16 new tokens, "
          f"4 epochs, {a.threads} threads; medians of {a.repeats} steps per way")
    print(f"{'way':<14} {'eps/s':>6} {'step s':>7} {'noise':>6} {'cpu s':>6} {'eps/cpu-s':>9} {'peak MiB':>8}   "
          + " ".join(f"{p:>8}" for p in ("generate", "forward", "update")))
    base = summary["rlhflab"]
    for side, name in SIDES.items():
        m = summary[side]
        print(f"{name:<14} {m['eps_per_s']:>6.2f} {m['step_s']:>7.2f} {m['spread']:>6.0%} {m['cpu_s']:>6.2f} "
              f"{m['eps_per_cpu_s']:>9.2f} {m['ppo_peak_mb']:>8.1f}   "
              + " ".join(f"{m['phases_s'][p]:>8.2f}" for p in ("generate", "forward", "update")))
    auto, eager, weights = summary["rlhflab-bf16"], summary["rlhflab-bf16-eager"], summary["rlhflab-bf16-weights"]
    r = ppo_throughput.ratio
    print(f"speed over fp32 on CPU seconds: bf16 autocast {r(auto['eps_per_cpu_s'], base['eps_per_cpu_s']):.2f}, "
          f"with eager attention {r(eager['eps_per_cpu_s'], base['eps_per_cpu_s']):.2f}, "
          f"bf16 weights {r(weights['eps_per_cpu_s'], base['eps_per_cpu_s']):.2f}")
    print(f"precision_speed: fp32 {base['eps_per_s']:.2f} eps/s, bf16 autocast {auto['eps_per_s']:.2f} eps/s "
          f"({r(auto['eps_per_s'], base['eps_per_s']):.2f}x), with eager attention {eager['eps_per_s']:.2f} eps/s "
          f"({r(eager['eps_per_s'], base['eps_per_s']):.2f}x), bf16 weights {weights['eps_per_s']:.2f} eps/s "
          f"({r(weights['eps_per_s'], base['eps_per_s']):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
