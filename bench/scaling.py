#!/usr/bin/env python
"""PPO episodes/s at 1 and 2 processes with the same global batch, and the memory each
strategy needs per GPU.

    .venv/bin/python bench/scaling.py [--steps 6] [--repeats 3] [--episodes 64] [--sides 1,ddp,fsdp2,zero2,zero3]
    .venv/bin/python bench/scaling.py --memory-only --params 0.5e9 7e9
    .venv/bin/python bench/scaling.py --memory-model 512x8 [--repeats 2]

Part 1 (measured): `rlhflab ppo` on the project's tiny model and the arithmetic task,
the same global rollout (episodes per step), minibatch and seed in every run; 1 process
with the machine's cores as torch threads, then 2 processes under `accelerate launch`
with the cores shared equally: DDP (configs/accelerate/cpu_2proc.yaml, gloo), FSDP2
(fsdp_cpu.yaml) and, with the deepspeed extra installed, ZeRO-2 and ZeRO-3 (zero2_cpu.yaml,
zero3_cpu.yaml). The sharded strategies trade communication for memory: every layer's
weights are gathered for each forward pass, generation included (lockstep), which on one
CPU is pure cost. Each run's
episodes/s is its `train_result.json` figure (every step, the first included, on both
sides alike); the table shows the median and the range over `--repeats` runs and the
ratio 2 processes / 1 process, and each run's peak resident memory (the process's, or
rank 0's, lifetime `ru_maxrss` with the imports: `peak_memory_mb.txt`). On one 2-core CPU, two
processes cannot be faster than one using both cores for its matmuls: the ratio
measures the cost of the distribution itself (communication and the duplicated Python
work), which on a GPU node is what stays small next to the per-rank compute.

What it measures, its options and its latest figures: bench/README.md; its history: bench/NOTES.md and git.
"""

from __future__ import annotations

import argparse
import importlib.util
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


def _model_spec(text: str) -> str:
    """`--memory-model`'s value: HxL, two positive integers."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give HxL, hidden size H and L layers, e.g. 512x8")
    return text.lower()


def _larger_model(spec: str) -> tuple[Path, int]:
    """The model `HxL` (hidden H, L layers, the tiny model's vocabulary), built once; its
    parameter count."""
    hidden, layers = (int(x) for x in spec.lower().split("x"))
    folder = _common.BENCH_DIR / f"scaling-model-{hidden}x{layers}"
    if not (folder / "config.json").is_file():
        from rlhflab.models.tiny import make_tiny_model
        make_tiny_model(folder, hidden_size=hidden, num_layers=layers, num_heads=max(1, hidden // 64))
    return folder, _param_count(folder)


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def memory_run(spec: str, work: Path, a: argparse.Namespace) -> None:
    """Part 3: per side, peak RSS on the larger model minus peak RSS on the tiny one."""
    tiny, data = _inputs(work)
    big, n_params = _larger_model(spec)
    extra = n_params - _param_count(tiny)
    runs = argparse.Namespace(**{**vars(a), "steps": 2})
    rows = {}
    for side in a.sides:
        deltas = []
        for r in range(a.repeats):
            _, small_peak = _run(side, tiny, data, work / f"mem_tiny_{r}", runs)
            _, big_peak = _run(side, big, data, work / f"mem_big_{r}", runs)
            deltas.append(big_peak - small_peak)
            print(f"run {r + 1}/{a.repeats}, {side}: tiny {small_peak:.0f} MiB, {spec} {big_peak:.0f} MiB, "
                  f"difference {big_peak - small_peak:.0f} MiB", flush=True)
        rows[side] = deltas
    print(f"\n## peak RSS per rank (rank 0) for {extra / 1e6:.1f}M extra parameters ({spec} against the tiny "
          f"model), 2 PPO steps, value head, reference copy\n")
    print("| side | MiB (median) | range | bytes per extra parameter |")
    print("| --- | --- | --- | --- |")
    for side, d in rows.items():
        med = statistics.median(d)
        print(f"| {side} | {med:.0f} | {min(d):.0f}-{max(d):.0f} | {med * 2**20 / extra:.1f} |")
    names = {"1": "1 process", "2 DDP": "DDP", "2 FSDP2": "FSDP2", "2 ZeRO-2": "ZeRO-2", "2 ZeRO-3": "ZeRO-3"}
    print(f"\nscaling memory: MiB per rank for {extra / 1e6:.1f}M extra parameters: "
          + ", ".join(f"{names[side]} {statistics.median(d):.0f}" for side, d in rows.items()))


def _param_count(folder: Path) -> int:
    """The parameter count of a saved model folder."""
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())


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
if importlib.util.find_spec("deepspeed") is not None:  # the optional extra (make venv installs it)
    SIDES.update({"2 ZeRO-2": "zero2_cpu.yaml", "2 ZeRO-3": "zero3_cpu.yaml"})
SIDE_NAMES = {"1": "1", "ddp": "2 DDP", "fsdp2": "2 FSDP2", "zero2": "2 ZeRO-2", "zero3": "2 ZeRO-3"}  # --sides


def _sides(text: str) -> list[str]:
    """`--sides`' value: comma-separated names from SIDE_NAMES, as the SIDES keys."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if not names or any(n not in SIDE_NAMES for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated, from {', '.join(SIDE_NAMES)}")
    absent = [n for n in names if SIDE_NAMES[n] not in SIDES]
    if absent:
        raise argparse.ArgumentTypeError(f"{', '.join(absent)} need the deepspeed extra "
                                         "(pip install -e '.[deepspeed]')")
    return [SIDE_NAMES[n] for n in dict.fromkeys(names)]


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
    FSDP / ZeRO-3 as rlhflab runs them gather one decoder layer at a time outside the update
    too (generation in lockstep); FSDP also keeps its root unit (embeddings, LM head, final
    norm, value head) gathered between updates, not counted here (at a 150k vocabulary the
    embeddings are a large share of a small model)."""
    gib = 2**30
    print(f"\n## memory per GPU, {ranks} GPUs (GiB; weights fp32 4 B, grads 4 B, Adam 8 B, bf16 reference 2 B)\n")
    print("| parameters | DDP | DDP + critic | ZeRO-2 | FSDP / ZeRO-3 | FSDP + critic | LoRA (ref = adapter off) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for p in sizes:
        train = 16 * p                      # weights + grads + Adam (2 moments), fp32
        ref = 2 * p                         # a frozen bf16 copy, unsharded on every rank
        ddp = train + ref
        zero2 = 4 * p + 12 * p / ranks + ref
        fsdp = train / ranks + ref
        lora = 2 * p                        # bf16 base (its adapter-off pass is the reference) + a tiny adapter
        print(f"| {p / 1e9:.1f}B | {ddp / gib:.1f} | {(ddp + train) / gib:.1f} | {zero2 / gib:.1f} | "
              f"{fsdp / gib:.1f} | {(fsdp + train / ranks) / gib:.1f} | {lora / gib:.1f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="PPO steps per run (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per side (default: %(default)s)")
    ap.add_argument("--episodes", type=int, default=64, help="global episodes per step (default: %(default)s)")
    ap.add_argument("--params", type=float, nargs="+", default=[0.5e9, 1.5e9, 7e9, 8e9],
                    help="model sizes for the memory table")
    ap.add_argument("--ranks", type=int, default=8, help="GPUs for the memory table (default: %(default)s)")
    ap.add_argument("--memory-only", action="store_true", help="print only the memory table")
    ap.add_argument("--memory-model", default=None, metavar="HxL", type=_model_spec,
                    help="measure each side's peak RSS on a larger model (hidden H, L layers) against the tiny one")
    ap.add_argument("--sides", type=_sides, default=list(SIDES),
                    help=f"comma-separated, from {', '.join(SIDE_NAMES)} (default: all installed)")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.steps < 1 or a.episodes < 4:
        ap.error("--repeats and --steps must be at least 1, --episodes at least 4 (2 processes x 2 minibatches)")
    if a.memory_model:
        work = Path(tempfile.mkdtemp(prefix="rlhflab-scaling-"))
        memory_run(a.memory_model, work, a)
        shutil.rmtree(work, ignore_errors=True)
        return 0
    if not a.memory_only:
        work = Path(tempfile.mkdtemp(prefix="rlhflab-scaling-"))
        model, data = _inputs(work)
        rates, peaks = {side: [] for side in a.sides}, {side: [] for side in a.sides}
        for r in range(a.repeats):  # the sides interleaved, so a change in the machine's load hits each alike
            for side in a.sides:
                eps, peak = _run(side, model, data, work / f"run{side.replace(' ', '_')}_{r}", a)
                rates[side].append(eps)
                peaks[side].append(peak)
                print(f"run {r + 1}/{a.repeats}, {side} process(es): {eps:.2f} episodes/s, peak RSS {peak:.0f} MiB",
                      flush=True)
        med = {side: statistics.median(v) for side, v in rates.items()}
        print(f"\n## PPO episodes/s, {a.episodes} episodes per step, {a.steps} steps, {os.cpu_count()} CPU cores\n")
        print("| processes | episodes/s (median) | range | peak RSS MiB per process (rank 0), range |")
        print("| --- | --- | --- | --- |")
        for side in a.sides:
            print(f"| {side} | {med[side]:.2f} | {min(rates[side]):.2f}-{max(rates[side]):.2f} | "
                  f"{min(peaks[side]):.0f}-{max(peaks[side]):.0f} |")
        shutil.rmtree(work, ignore_errors=True)
    memory_table(a.params, a.ranks)
    if not a.memory_only:
        one, ddp, fsdp = (med.get(side, float("nan")) for side in ("1", "2 DDP", "2 FSDP2"))
        print(f"\nscaling: 1 process {one:.2f} eps/s, 2 processes {ddp:.2f} eps/s, ratio {ddp / one:.2f} "
              f"(tiny model, {a.episodes} episodes/step); FSDP2 2 processes {fsdp:.2f} eps/s, ratio {fsdp / one:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
