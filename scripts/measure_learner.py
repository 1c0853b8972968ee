"""Measure what `rlhflab learn run --compare` shows a learner: held-out accuracy by step.

    .venv/bin/python scripts/measure_learner.py [--runs 2] [--out outputs/measure_learner]
        [--inputs DIR] [--results docs/figures/results/learner.json]

As a learner would, in fresh processes: `rlhflab learn init` a workspace, fill the five
exercises with correct answers (the library's functions in the exercises' signatures, as
tests/test_learn.py's reference answers), then `--runs` times `rlhflab learn run --dir WS
--compare`: 10 PPO steps from the quickstart's SFT warm start with the workspace's
functions, then the same with the library's. Each run's held-out greedy accuracy at every
evaluation (steps 0, 5 and 10) is printed and written to `--results`, from which
`scripts/insert_figures.py` writes docs/learner_mode.md's figure.

The first `learn run` builds the warm start (the quickstart's stages 1-3: tiny model,
task, 400 SFT steps on 2 threads). `--inputs DIR` copies an existing one instead: a
quickstart output folder (its `tiny-model/`, `data/` and `sft/final/`, which is what
`learn run` would build; `scripts/measure_readme.py` leaves them in
`outputs/measure/quickstart_0`).

The PPO runs use torch's default thread count (set OMP_NUM_THREADS to choose); the
figures can depend on it, so it is recorded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "figures" / "results" / "learner.json"
# correct answers: the library's own functions under the exercises' names
ANSWERS = {
    "ex1_policy_loss.py": "from rlhflab.learn.reference import compute_policy_loss\n",
    "ex2_value_loss.py": "from rlhflab.learn.reference import compute_value_loss\n",
    "ex3_entropy_loss.py": "from rlhflab.learn.reference import compute_entropy_loss\n",
    "ex4_gae.py": "from rlhflab.learn.reference import compute_gae_advantages, whiten_advantages\n",
    "ex5_minibatch_update.py": "from rlhflab.learn.reference import minibatch_loss, update_step\n",
}


def rlhflab_command() -> list[str]:
    """As scripts/measure_readme.py: $RLHFLAB, else .venv/bin/rlhflab, else `-m rlhflab`."""
    import shlex

    if os.environ.get("RLHFLAB"):
        return shlex.split(os.environ["RLHFLAB"])
    venv = ROOT / ".venv" / "bin" / "rlhflab"
    return [str(venv)] if venv.exists() else [sys.executable, "-m", "rlhflab"]


def run(cmd: list[str], log: Path) -> float:
    start = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - start


def accuracy_by_step(metrics: Path) -> dict[str, float]:
    out = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "eval/accuracy" in row:
            out[str(row["step"])] = row["eval/accuracy"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="runs of `learn run --compare` (default: 2)")
    ap.add_argument("--out", default="outputs/measure_learner", help="working folder (default: %(default)s)")
    ap.add_argument("--inputs", default=None, help="a quickstart output folder to copy the warm start from")
    ap.add_argument("--results", default=str(RESULTS.relative_to(ROOT)),
                    help="results file ('' skips; default: %(default)s)")
    ap.add_argument("--conditions", default=None, help="how busy the machine was, as the page should say it")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    from measure_readme import machine_name  # noqa: E402  (same folder)

    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    ws = out / "ws"
    shutil.rmtree(ws, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    run([*rlhflab_command(), "learn", "init", str(ws)], out / "init.log")
    for name, text in ANSWERS.items():
        (ws / name).write_text(text)
    if args.inputs:
        src = Path(args.inputs)
        for part in ("tiny-model", "data", "sft/final"):
            shutil.copytree(src / part, ws / "inputs" / part)
    loads, runs = [os.getloadavg()[0]], []
    for i in range(args.runs):
        seconds = run([*rlhflab_command(), "learn", "run", "--dir", str(ws), "--compare"], out / f"run_{i}.log")
        loads.append(os.getloadavg()[0])
        folder = sorted((ws / "runs").iterdir())[-1]
        for who, metrics in (("learner", folder / "metrics.jsonl"), ("library", folder / "library" / "metrics.jsonl")):
            runs.append({"repeat": i + 1, "functions": who, "accuracy_by_step": accuracy_by_step(metrics),
                         "seconds_both": round(seconds, 1)})
            print(f"run {i + 1}, {who}: held-out accuracy by step {runs[-1]['accuracy_by_step']}", flush=True)
    threads = os.environ.get("OMP_NUM_THREADS")
    conditions = args.conditions or (f"OMP_NUM_THREADS={threads}" if threads else "torch's default threads")
    conditions += f", load average {min(loads):.1f}-{max(loads):.1f}"
    if args.inputs:
        conditions += ", the warm start copied from a quickstart run"
    if args.results:
        rec = {"name": "learner", "script": "scripts/measure_learner.py",
               "command": f".venv/bin/python scripts/measure_learner.py --runs {args.runs}"
               + (f" --inputs {args.inputs}" if args.inputs else ""),
               "learn_command": "rlhflab learn run --dir WS --compare",
               "machine": machine_name(), "date": datetime.date.today().isoformat(),
               "conditions": conditions, "runs": runs}
        path = ROOT / args.results if not Path(args.results).is_absolute() else Path(args.results)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec, indent=2) + "\n")
        print(f"results written to {path}; run .venv/bin/python scripts/insert_figures.py to update the pages")


if __name__ == "__main__":
    main()
