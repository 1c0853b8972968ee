"""How often does a rank of a 2-process gloo launch abort on its way out, after finishing?

    python bench/exit_teardown.py [--launches 50] [--ways ddp,ddp-leave,allreduce]

Each launch is `torchrun --nproc_per_node 2` of a small script that does its work, destroys
its process group in an exit handler (as rlhflab's ranks do), and then leaves one way:

- `ddp`:        a few DDP steps (a 2-layer MLP, AdamW), then a plain exit through Python's
                teardown;
- `ddp-leave`:  the same steps, then `rlhflab.engine.dist.leave(0)`: the exit handlers,
                then `os._exit`, which skips the teardown (what `rlhflab` does on a launch);
- `allreduce`:  five plain all-reduces and no DDP, then a plain exit.

A launch fails when a rank dies after the script's last line, which torchrun reports as a
failed launch (the abort shows as "terminate called without an active exception", SIGABRT).
The table gives the failed launches of each way and the first such line. One thread and
OMP_WAIT_POLICY=PASSIVE per rank, as the 2-process tests run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RANK_SCRIPT = r"""
import atexit, sys, torch, torch.distributed as td
from rlhflab.engine import dist

way = sys.argv[1]
td.init_process_group("gloo")
atexit.register(dist._close_process_group)  # as rlhflab's init_dist does
if way == "allreduce":
    t = torch.ones(64)
    for _ in range(5):
        td.all_reduce(t)
else:
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(5):
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
td.barrier()
if way == "ddp-leave":
    dist.leave(0)
"""
WAYS = ("ddp", "ddp-leave", "allreduce")


def launch(script: Path, way: str, port: int) -> tuple[bool, str]:
    """One torchrun launch: (it failed, the first line naming the failure)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", str(port),
           str(script), way]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    first = next((line for line in text.splitlines() if "terminate" in line or "Signal" in line), "")
    return out.returncode != 0, first.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=50, help="launches of each way")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    args = ap.parse_args()
    ways = [w for w in args.ways.split(",") if w]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        raise SystemExit(f"exit_teardown: unknown way(s) {', '.join(unknown)}; choose from {', '.join(WAYS)}")
    import torch

    print(f"torch {torch.__version__}; {args.launches} launches of 2 processes (gloo) per way, "
          f"one after another; load average {os.getloadavg()[0]:.1f}")
    print(f"{'way':<12} {'failed':>8}  first failure")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK_SCRIPT)
        for way in ways:
            failed, seen = 0, ""
            for i in range(args.launches):
                bad, line = launch(script, way, 29500 + 17 + i % 40)
                failed += bad
                seen = seen or line
            print(f"{way:<12} {failed:>3}/{args.launches:<4}  {seen}", flush=True)


if __name__ == "__main__":
    main()
