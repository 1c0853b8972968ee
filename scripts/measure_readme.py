"""Re-measure every figure that README.md and docs/quickstart.md quote, and print them.

    .venv/bin/python scripts/measure_readme.py [--runs 3] [--out outputs/measure] [--skip-pipeline]

Each figure is the median of `--runs` runs with its range (min-max), so a quoted
figure can be checked against what this machine does. It runs, as a user would, in
fresh processes:

- `rlhflab quickstart` (the README's first command after `make venv`), `--runs` times:
  held-out greedy accuracy and mean reward after SFT and after PPO (and at PPO step 10),
  the wall time of the five stages and of SFT alone, PPO episodes/s, and the accuracy of
  *sampled* answers (temperature 1) after SFT. The second run has OMP_NUM_THREADS=1 in
  its environment, which must change nothing: the quickstart fixes its thread count;
- the quickstart's warm start with another thread count (`--thread-counts`), to show
  why the count is fixed: the accuracy after SFT depends on it;
- `scripts/pipeline_debug.sh`, `--runs` times: its wall time, and the figures of its
  stages (SFT accuracy, the reward model's held-out accuracy, PPO's reward-model score
  and checker accuracy before and after);
- the tiny model's parameter count and the standard error of an accuracy on 200 problems.

It writes the quickstart's runs to `docs/figures/results/quickstart.json` (`--results`;
`''` skips): the machine, the date, the command and every run's figures, from which
`scripts/insert_figures.py` writes the figures README.md and docs/quickstart.md quote.

It also copies the first quickstart run's reward plot (`ppo/plots/reward.png`) to
`docs/figures/quickstart_reward.png`, the plot README.md and docs/quickstart.md show
(`--figure ''` leaves it alone).

How busy the machine was matters (the CPU is shared): the 1-minute load average before
and after each run is printed with the CPU count. Nothing here is asserted; the output is
what the docs quote.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE = ROOT / "docs" / "figures" / "quickstart_reward.png"
RESULTS = ROOT / "docs" / "figures" / "results" / "quickstart.json"
# the run whose printed table README.md shows (1-based): the one with OMP_NUM_THREADS=1 set
SHOWN_RUN = 2


def rlhflab_command() -> list[str]:
    """$RLHFLAB (split like a shell would) when set, else the repo's .venv/bin/rlhflab, else
    this Python's `-m rlhflab` (scripts/find_rlhflab.sh picks the same way)."""
    import shlex

    if os.environ.get("RLHFLAB"):
        return shlex.split(os.environ["RLHFLAB"])
    venv = ROOT / ".venv" / "bin" / "rlhflab"
    return [str(venv)] if venv.exists() else [sys.executable, "-m", "rlhflab"]


def load() -> float:
    return os.getloadavg()[0]


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    """Run `cmd` from the repo root, its output to `log`; returns wall seconds."""
    start = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log}")
    return seconds


def metrics_at(path: Path, step: int, key: str) -> float | None:
    from rlhflab.metrics import read_metrics

    for row in read_metrics(path):
        if row.get("step") == step and key in row:
            return float(row[key])
    return None


def sampled_accuracy(model_dir: Path, data: Path, seed: int) -> float:
    """Accuracy of one sampled answer (temperature 1) per held-out problem, by `rlhflab eval`'s
    numeric rule."""
    import torch

    from rlhflab.data.arith import PROMPT_TEMPLATE
    from rlhflab.data.loading import read_rows
    from rlhflab.models.load import load_model
    from rlhflab.rewards.checks import numeric_correct
    from rlhflab.rollout import generate

    torch.manual_seed(seed)
    model, tok = load_model(str(model_dir))
    rows = read_rows(str(data))
    prompts = [PROMPT_TEMPLATE.replace("{prompt}", r["question"]) for r in rows]
    roll = generate(model.eval(), tok, prompts, max_new_tokens=16, temperature=1.0, batch_size=100)
    return sum(numeric_correct(resp, r["answer"]) for resp, r in zip(roll.responses, rows)) / len(rows)


def quickstart_run(out: Path, i: int) -> dict:
    """Run i of `rlhflab quickstart`; run 1 (the second) with OMP_NUM_THREADS=1 in the
    environment, which must change nothing (the quickstart fixes its thread count)."""
    folder = out / f"quickstart_{i}"
    shutil.rmtree(folder, ignore_errors=True)
    before = load()
    wall = run([*rlhflab_command(), "quickstart", "--out", str(folder)], out / f"quickstart_{i}.log",
               env={"OMP_NUM_THREADS": "1"} if i == 1 else None)
    after = load()
    s = json.loads((folder / "summary.json").read_text())
    metrics = folder / "ppo" / "metrics.jsonl"
    return {
        "accuracy after SFT (greedy)": s["accuracy_before"],
        "accuracy after PPO step 10": metrics_at(metrics, 10, "eval/accuracy"),
        "accuracy after PPO (greedy)": s["accuracy_after"],
        "reward after SFT": s["reward_before"],
        "reward after PPO": s["reward_after"],
        "seconds, all five stages (summary.json)": s["seconds"],
        "seconds, SFT warm start": s["sft_seconds"],
        "seconds, the whole command": wall,
        "PPO episodes/s": s["ppo_episodes_per_s"],
        "accuracy after SFT (sampled, temperature 1)": sampled_accuracy(folder / "sft" / "final",
                                                                         folder / "data" / "test.jsonl", i),
        "load average before": before, "load average after": after,
    }


def accuracy_after_sft_with(threads: int, out: Path) -> float:
    """Held-out greedy accuracy after SFT when the whole quickstart uses `threads` threads
    (one PPO step: the figure is its step-0 evaluation)."""
    folder = out / f"threads_{threads}"
    shutil.rmtree(folder, ignore_errors=True)
    run([*rlhflab_command(), "quickstart", "--out", str(folder), "--threads", str(threads),
         "training.total_steps=1"], out / f"threads_{threads}.log")
    return json.loads((folder / "summary.json").read_text())["accuracy_before"]


def pipeline_run(out: Path, i: int) -> dict:
    folder = out / f"pipeline_{i}"
    shutil.rmtree(folder, ignore_errors=True)
    before = load()
    wall = run(["bash", "scripts/pipeline_debug.sh", str(folder)], out / f"pipeline_{i}.log")
    after = load()

    def result(name: str) -> dict:
        return json.loads((folder / name / "train_result.json").read_text())

    sft, rm, ppo = result("sft_debug"), result("rm_debug"), result("ppo_rm_debug")
    return {
        "seconds, the whole script": wall,
        "SFT policy: held-out accuracy": sft["eval_after"].get("eval/accuracy"),
        "reward model: held-out pair accuracy": rm["eval_after"]["eval/accuracy"],
        "PPO: reward-model score before": ppo["eval_before"]["eval/reward_mean"],
        "PPO: reward-model score after": ppo["eval_after"]["eval/reward_mean"],
        "PPO: checker accuracy before": ppo["eval_before"]["eval/accuracy"],
        "PPO: checker accuracy after": ppo["eval_after"]["eval/accuracy"],
        "load average before": before, "load average after": after,
    }


def machine_name() -> str:
    """'2-core Intel Xeon with AVX-512 and AMX': the core count, the CPU's model name without its
    trademark signs and generic words, and the matmul features that change the figures."""
    import re

    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = re.sub(r"\((R|TM)\)|\bProcessor\b|\bCPU\b|@.*", "", value).split()
                model = " ".join(model)
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    features = [name for flag, name in (("avx512f", "AVX-512"), ("amx_tile", "AMX")) if flag in flags]
    return f"{os.cpu_count()}-core {model}" + (f" with {' and '.join(features)}" if features else "")


def quickstart_record(runs: list[dict], command: str, conditions: str | None = None) -> dict:
    """The results file scripts/insert_figures.py reads: every run's figures, and where
    and how they were measured. `runs` are quickstart_run's dicts."""
    import datetime

    loads = [v for r in runs for v in (r["load average before"], r["load average after"])]
    if conditions is None:
        busy = max(loads) > 0.75 * (os.cpu_count() or 1)
        conditions = "with other jobs on the same cores" if busy else "on a quiet machine"
    return {
        "name": "quickstart",
        "script": "scripts/measure_readme.py",
        "command": command,
        "machine": machine_name(),
        "date": datetime.date.today().isoformat(),
        "conditions": conditions,
        "load_average": [round(min(loads), 1), round(max(loads), 1)],
        "shown_run": min(SHOWN_RUN, len(runs)),
        "runs": [{
            "accuracy_sft": r["accuracy after SFT (greedy)"],
            "accuracy_step10": r["accuracy after PPO step 10"],
            "accuracy_ppo": r["accuracy after PPO (greedy)"],
            "reward_sft": r["reward after SFT"],
            "reward_ppo": r["reward after PPO"],
            "seconds": r["seconds, all five stages (summary.json)"],
            "sft_seconds": r["seconds, SFT warm start"],
            "ppo_episodes_per_s": r["PPO episodes/s"],
            "sampled_accuracy_sft": r["accuracy after SFT (sampled, temperature 1)"],
            "omp_num_threads": "1" if i == 1 else None,
            "load_average_before": round(r["load average before"], 2),
            "load_average_after": round(r["load average after"], 2),
        } for i, r in enumerate(runs)],
    }


def fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def report(title: str, runs: list[dict]) -> None:
    print(f"\n{title} ({len(runs)} runs): median (min-max) [each run]")
    for key in runs[0]:
        vals = [r[key] for r in runs]
        if any(v is None for v in vals):
            print(f"  {key:<46} n/a {vals}")
            continue
        print(f"  {key:<46} {fmt(statistics.median(vals))} ({fmt(min(vals))}-{fmt(max(vals))}) "
              f"[{', '.join(fmt(v) for v in vals)}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each measurement (default: 3)")
    ap.add_argument("--out", default="outputs/measure", help="working folder (default: outputs/measure)")
    ap.add_argument("--skip-pipeline", action="store_true", help="measure the quickstart only")
    ap.add_argument("--figure", default=str(FIGURE.relative_to(ROOT)),
                    help="where to copy the first quickstart run's reward plot ('' skips; default: %(default)s)")
    ap.add_argument("--results", default=str(RESULTS.relative_to(ROOT)),
                    help="write the quickstart's runs here for scripts/insert_figures.py "
                         "('' skips; default: %(default)s)")
    ap.add_argument("--conditions", default=None,
                    help="how busy the machine was, as the pages should say it (default: from the load average)")
    ap.add_argument("--thread-counts", default="1",
                    help="also train the warm start with these thread counts, to show the accuracy after SFT "
                         "depends on it (comma-separated; '' skips; default: %(default)s)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from rlhflab.openmp import describe  # standard library only

    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"rlhflab: {' '.join(rlhflab_command())}; machine: {os.cpu_count()} CPUs, load average {load():.1f} at the start; "
          f"OpenMP: {describe()} (unset: the CLI's default, rlhflab/openmp.py)")

    quick = []
    for i in range(args.runs):
        quick.append(quickstart_run(out, i))
        print(f"quickstart run {i + 1}: " + json.dumps({k: round(v, 3) for k, v in quick[-1].items()
                                                        if v is not None}), flush=True)
    if args.results:
        results = ROOT / args.results if not Path(args.results).is_absolute() else Path(args.results)
        results.parent.mkdir(parents=True, exist_ok=True)
        command = f".venv/bin/python scripts/measure_readme.py --runs {args.runs}"
        results.write_text(json.dumps(quickstart_record(quick, command, args.conditions), indent=2) + "\n")
        print(f"results written to {results}; run .venv/bin/python scripts/insert_figures.py to update the pages",
              flush=True)
    if args.figure:
        figure = ROOT / args.figure if not Path(args.figure).is_absolute() else Path(args.figure)
        figure.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "quickstart_0" / "ppo" / "plots" / "reward.png", figure)
        size = figure.stat().st_size
        print(f"reward plot of run 1 copied to {figure} ({size // 1024} KB"
              + ("; over the docs' 100 KB limit" if size >= 100_000 else "") + ")", flush=True)
    pipe = []
    if not args.skip_pipeline:
        for i in range(args.runs):
            pipe.append(pipeline_run(out, i))
            print(f"pipeline run {i + 1}: " + json.dumps({k: round(v, 3) for k, v in pipe[-1].items()
                                                          if v is not None}), flush=True)

    by_threads = {int(t): accuracy_after_sft_with(int(t), out) for t in args.thread_counts.split(",") if t.strip()}

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "quickstart_0" / "tiny-model")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"\ntiny model (quickstart): {n_params / 1e6:.2f}M parameters "
          f"({model.config.hidden_size} hidden, {model.config.num_hidden_layers} layers)")
    print(f"standard error of an accuracy near 50% on 200 problems: {100 * math.sqrt(0.25 / 200):.1f} points")
    report("rlhflab quickstart", quick)
    if by_threads:
        print("\naccuracy after SFT by torch thread count (quickstart --threads N; the default is 2): " +
              ", ".join(f"{t} thread(s): {acc:.3f}" for t, acc in by_threads.items()))
    if pipe:
        report("scripts/pipeline_debug.sh", pipe)


if __name__ == "__main__":
    main()
