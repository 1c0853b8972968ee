"""How should idle OpenMP threads wait? Time SFT steps under OpenMP's default, PASSIVE and
short spins (GOMP_SPINCOUNT), on the machine as it is and beside a competing torch process.

    python bench/omp_wait_policy.py [--repeats 3] [--steps 15] [--spincounts 1000,10000]

Each measurement is a fresh process (the setting is read when OpenMP starts): the
quickstart's tiny model (192 wide, 4 layers), batches of 32 x 64 tokens, forward,
backward and an AdamW step, torch's default thread count; the median step time of
`--steps` steps after 3 warm-up steps. "loaded" runs a second process doing the same
work beside it for the whole measurement (the competitor uses the setting under test too,
as two users of one shared machine would). The table shows the median over `--repeats`
runs and the range, and the load average before the measurement.

OpenMP's default lets idle threads spin for a while before they sleep (GNU libgomp:
OMP_WAIT_POLICY unset is an active spin of about 300k iterations); on a machine with
fewer free cores than threads, the spinning threads steal the cores the working ones need.
PASSIVE sleeps at once and pays a wake-up at every parallel region. GOMP_SPINCOUNT=N
spins N iterations (about 100 a microsecond), then sleeps: the CLI's default is 1000
(rlhflab/openmp.py), the row this bench exists to justify.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r"""
import json, sys, time, statistics
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(0)
ids = torch.randint(3, model.config.vocab_size, (32, 64), generator=g)
steps, forever = int(sys.argv[2]), sys.argv[3] == "forever"
times = []
i = 0
while forever or i < steps + 3:
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if i >= 3:
        times.append(time.perf_counter() - t0)
    i += 1
print(json.dumps({"step_s": statistics.median(times), "threads": torch.get_num_threads()}))
"""


# label -> the OpenMP variables of that setting (GOMP_SPINCOUNT: how many times an idle
# libgomp thread polls for work before it sleeps; about 100,000 polls a millisecond)
BASE_SETTINGS = {
    "unset (OpenMP default)": {},
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
}
OMP_VARS = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")


def settings(spincounts: list[int]) -> dict[str, dict[str, str]]:
    out = dict(BASE_SETTINGS)
    for n in spincounts:
        out[f"GOMP_SPINCOUNT={n}"] = {"GOMP_SPINCOUNT": str(n)}
    return out


def _env(variables: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    env.update(variables)
    return env


def measure(model: Path, variables: dict[str, str], loaded: bool, steps: int) -> dict:
    competitor = None
    if loaded:
        competitor = subprocess.Popen([sys.executable, "-c", WORKER, str(model), "0", "forever"], env=_env(variables),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(8)  # let it import torch and start working
    try:
        proc = subprocess.run([sys.executable, "-c", WORKER, str(model), str(steps), "once"], env=_env(variables),
                              capture_output=True, text=True, timeout=3600)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--machine", choices=["as-is", "loaded", "both"], default="both",
                    help="measure on the machine as it is, beside a competing process, or both")
    ap.add_argument("--spincounts", default="1000",
                    help="comma-separated GOMP_SPINCOUNT values to time beside the two policies")
    ap.add_argument("--only", default="", help="comma-separated labels of the settings to time (default: all)")
    args = ap.parse_args()
    table = settings([int(n) for n in args.spincounts.split(",") if n])
    if args.only:
        table = {k: v for k, v in table.items() if k in args.only.split(",")}
    machines = {"as-is": (False,), "loaded": (True,), "both": (False, True)}[args.machine]
    from rlhflab.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", seed=0)
        rows = []
        for loaded in machines:
            for setting, variables in table.items():
                load = os.getloadavg()[0]
                runs = [measure(model, variables, loaded, args.steps)["step_s"] for _ in range(args.repeats)]
                rows.append((("loaded" if loaded else "as is"), setting,
                             statistics.median(runs), min(runs), max(runs), load))
                print(f"# {rows[-1][0]:<6} {rows[-1][1]:<22} runs {['%.3f' % r for r in runs]}", flush=True)
    print(f"\n{os.cpu_count()} CPUs; SFT step of the quickstart model, 32 x 64 tokens, torch default threads")
    print(f"{'machine':<8} {'OpenMP setting':<24} {'s/step (median)':>15} {'range':>17} {'load avg before':>16}")
    for where, policy, med, lo, hi, load in rows:
        print(f"{where:<8} {policy:<24} {med:>15.3f} {f'{lo:.3f}-{hi:.3f}':>17} {load:>16.1f}")


if __name__ == "__main__":
    main()
