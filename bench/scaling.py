#!/usr/bin/env python
"""PPO episodes/s at 1 and 2 processes with the same global batch, and the memory each
strategy needs per GPU.

    .venv/bin/python bench/scaling.py [--steps 6] [--repeats 3] [--episodes 64]
    .venv/bin/python bench/scaling.py --memory-only --params 0.5e9 7e9

Part 1 (measured): `rlhflab ppo` on the project's tiny model and the arithmetic task,
the same global rollout (episodes per step), minibatch and seed in every run; 1 process
with the machine's cores as torch threads, then 2 processes under `accelerate launch`
with the cores shared equally: DDP (configs/accelerate/cpu_2proc.yaml, gloo) and FSDP2
(configs/accelerate/fsdp_cpu.yaml: the trained module sharded over the 2 ranks during the
update, its weights gathered whole for generation and scoring). Each run's
episodes/s is its `train_result.json` figure (every step, the first included, on both
sides alike); the table shows the median and the range over `--repeats` runs and the
ratio 2 processes / 1 process, and each run's peak resident memory (the process's, or
rank 0's, lifetime `ru_maxrss` with the imports: `peak_memory_mb.txt`). On one 2-core CPU, two
processes cannot be faster than one using both cores for its matmuls: the ratio
measures the cost of the distribution itself (communication and the duplicated Python
work), which on a GPU node is what stays small next to the per-rank compute.

Part 2 (arithmetic, not measured): bytes per parameter for weights, gradients, Adam state
(fp32, two moments), the frozen reference and a separate critic, under DDP, ZeRO-2
(gradients and Adam sharded), FSDP2 as rlhflab runs it (sharded for the update, weights
whole between updates), the fully sharded bound (ZeRO-3), and LoRA (only the adapter
trains), for the model sizes given.

Last line: `scaling: 1 process X eps/s, 2 processes Y eps/s, ratio Z (tiny model, 64 episodes/step);
FSDP2 2 processes W eps/s, ratio V`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import _common  # noqa: E402

VENV_BIN = Path(sys.executable).parent


def _inputs(work: Path) -> tuple[Path, Path]:
    model = _common.ensure_tiny_model(_common.BENCH_DIR / "tiny-model")
    data = work / "arith"
    if not (data / "train.jsonl").exists():
        from rlhflab.data.arith import write_task
        write_task(data, n_train=512, n_test=16)
    return model, data


def _free_port() -> int:
    """A TCP port nobody listens on now: the rendezvous's default 29500 may be taken by
    another distributed job on the machine (the launch then fails with EADDRINUSE)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SIDES = {"1": None, "2 DDP": "cpu_2proc.yaml", "2 FSDP2": "fsdp_cpu.yaml"}  # side -> accelerate config


def _run(side: str, model: Path, data: Path, out: Path, a: argparse.Namespace) -> tuple[float, float]:
    """One `rlhflab ppo` run: (episodes/s, the peak resident MiB of the process or of rank 0)."""
    processes = 1 if SIDES[side] is None else 2
    args = ["ppo", "--config", str(REPO / "configs" / "ppo_debug.yaml"), f"model.name_or_path={model}",
            f"dataset.path={data / 'train.jsonl'}", f"dataset.eval_path={data / 'test.jsonl'}",
            f"training.output_dir={out}", f"training.total_steps={a.steps}", "training.eval_interval=0",
            "training.save_interval=0", "logging.progress_bar=false", "logging.plots=false",
            f"ppo.rollout_samples={a.episodes}", f"ppo.batch_size={a.episodes // processes}",
            f"ppo.mini_batch_size={a.episodes // 2}", "ppo.epochs=2", "generation.max_new_tokens=16",
            "generation.seeded_sampling=true"]
    if processes == 1:
        cmd = [str(VENV_BIN / "rlhflab"), *args]
    else:
        cmd = [str(VENV_BIN / "accelerate"), "launch", "--config_file",
               str(REPO / "configs" / "accelerate" / SIDES[side]), "--main_process_port", str(_free_port()),
               "-m", "rlhflab", *args]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    if out.exists():
        shutil.rmtree(out)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"scaling: the {side} run failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    eps = json.loads((out / "train_result.json").read_text())["episodes_per_s"]
    return eps, float((out / "peak_memory_mb.txt").read_text())  # ru_maxrss, imports included


def memory_table(sizes: list[float], ranks: int) -> None:
    """GiB per GPU for each strategy, fp32 master weights and Adam, a bf16 frozen reference.

    FSDP2 as rlhflab runs it holds the policy's weights whole on every rank between updates
    (generation, scoring, evaluation) and shards weights, gradients and Adam for the update:
    its peak is in the rollout, whole fp32 weights (4 B) beside the shards of the weights and
    Adam (12 B / N; the gradients are freed after each step), which is ZeRO-2's figure.
    The fully sharded column is the bound a strategy reaches that never gathers a whole
    model (ZeRO-3 with layer-by-layer gathers in generation too): 16 B / N."""
    gib = 2**30
    print(f"\n## memory per GPU, {ranks} GPUs (GiB; weights fp32 4 B, grads 4 B, Adam 8 B, bf16 reference 2 B)\n")
    print("| parameters | DDP | DDP + critic | ZeRO-2 | FSDP2 (rlhflab) | FSDP2 + critic | fully sharded (bound) "
          "| LoRA (ref = adapter off) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in sizes:
        train = 16 * p                      # weights + grads + Adam (2 moments), fp32
        ref = 2 * p                         # a frozen bf16 copy, unsharded on every rank
        ddp = train + ref
        zero2 = 4 * p + 12 * p / ranks + ref
        fsdp = 4 * p + 12 * p / ranks + ref  # whole weights in the rollout + the shards of weights and Adam
        bound = train / ranks + ref
        lora = 2 * p                        # bf16 base (its adapter-off pass is the reference) + a tiny adapter
        print(f"| {p / 1e9:.1f}B | {ddp / gib:.1f} | {(ddp + train) / gib:.1f} | {zero2 / gib:.1f} | "
              f"{fsdp / gib:.1f} | {(fsdp + 4 * p + 12 * p / ranks) / gib:.1f} | {bound / gib:.1f} | {lora / gib:.1f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="PPO steps per run (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per side (default: %(default)s)")
    ap.add_argument("--episodes", type=int, default=64, help="global episodes per step (default: %(default)s)")
    ap.add_argument("--params", type=float, nargs="+", default=[0.5e9, 1.5e9, 7e9, 8e9],
                    help="model sizes for the memory table")
    ap.add_argument("--ranks", type=int, default=8, help="GPUs for the memory table (default: %(default)s)")
    ap.add_argument("--memory-only", action="store_true", help="print only the memory table")
    a = ap.parse_args(argv)
    if not a.memory_only:
        work = Path(tempfile.mkdtemp(prefix="rlhflab-scaling-"))
        model, data = _inputs(work)
        rates, peaks = {side: [] for side in SIDES}, {side: [] for side in SIDES}
        for r in range(a.repeats):  # the sides interleaved, so a change in the machine's load hits each alike
            for side in SIDES:
                eps, peak = _run(side, model, data, work / f"run{side.replace(' ', '_')}_{r}", a)
                rates[side].append(eps)
                peaks[side].append(peak)
                print(f"run {r + 1}/{a.repeats}, {side} process(es): {eps:.2f} episodes/s, peak RSS {peak:.0f} MiB",
                      flush=True)
        med = {side: statistics.median(v) for side, v in rates.items()}
        print(f"\n## PPO episodes/s, {a.episodes} episodes per step, {a.steps} steps, {os.cpu_count()} CPU cores\n")
        print("| processes | episodes/s (median) | range | peak RSS MiB per process (rank 0), range |")
        print("| --- | --- | --- | --- |")
        for side in SIDES:
            print(f"| {side} | {med[side]:.2f} | {min(rates[side]):.2f}-{max(rates[side]):.2f} | "
                  f"{min(peaks[side]):.0f}-{max(peaks[side]):.0f} |")
        shutil.rmtree(work, ignore_errors=True)
    memory_table(a.params, a.ranks)
    if not a.memory_only:
        one, ddp, fsdp = med["1"], med["2 DDP"], med["2 FSDP2"]
        print(f"\nscaling: 1 process {one:.2f} eps/s, 2 processes {ddp:.2f} eps/s, ratio {ddp / one:.2f} "
              f"(tiny model, {a.episodes} episodes/step); FSDP2 2 processes {fsdp:.2f} eps/s, ratio {fsdp / one:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
