"""Put the measured figures into the pages, from the one results file each comes from.

    .venv/bin/python scripts/insert_figures.py            # rewrite every marked section
    .venv/bin/python scripts/insert_figures.py --check    # write nothing; exit 1 naming the pages that differ

A figure that more than one page quotes is measured by one script, which writes its
result to a results file (JSON, committed): `docs/figures/results/NAME.json` for the
docs' figures, `bench/results/NAME.json` for the benchmarks'. Each file says the script,
the command, the machine, the date and every run. A page quotes a figure only between
two marker comments:

    <!-- figure:VIEW -->
    ...written here by this script...
    <!-- /figure -->

where VIEW is one of VIEWS below: a results file and a function that renders it
(a code block, a sentence with its range, a table). Re-measuring is then: run the
script (it rewrites its results file), run this one, commit both. tests/test_figures.py
fails when a marked section differs from what this script writes, when a marker names
no view, and when a view is shown on no page.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULT_DIRS = (ROOT / "docs" / "figures" / "results", ROOT / "bench" / "results")
# The pages that may quote a figure: the front door, the docs (not the generated
# reference pages) and the benchmarks' page.
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md")
# A marker is a line of its own (a mention inside a sentence or code span is not one).
MARKED = re.compile(r"^(<!-- figure:([\w.-]+) -->\n)(.*?)^(<!-- /figure -->)$", re.S | re.M)
OPEN = re.compile(r"^<!-- figure:([\w.-]+) -->$", re.M)
CLOSE = re.compile(r"^<!-- /figure -->$", re.M)
REQUIRED = ("script", "command", "machine", "date", "runs")


# --------------------------------------------------------------------- results files

def results_path(name: str) -> Path:
    """The one results file called NAME.json (in docs/figures/results/ or bench/results/)."""
    found = [d / f"{name}.json" for d in RESULT_DIRS if (d / f"{name}.json").is_file()]
    if len(found) != 1:
        raise SystemExit(f"results file {name}.json: found {len(found)} in "
                         f"{', '.join(str(d.relative_to(ROOT)) for d in RESULT_DIRS)}; expected exactly one")
    return found[0]


def load_results(name: str) -> dict:
    path = results_path(name)
    rec = json.loads(path.read_text(encoding="utf-8"))
    missing = [k for k in REQUIRED if not rec.get(k)]
    if missing:
        raise SystemExit(f"{path.relative_to(ROOT)}: missing {', '.join(missing)}")
    return rec


# --------------------------------------------------------------------- formatting

def span(values: list[float], fmt: str = "{:.0f}", sep: str = "-") -> str:
    """'a-b' over the runs, or 'a' when every run printed the same (after formatting).

    span([145.2, 151.4, 161.8]) == '145-162'; span([0.2935] * 3, '{:.3f}') == '0.294'."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def pct_span(values: list[float]) -> str:
    """Accuracies (fractions) as percentages with one decimal: [0.215] * 3 -> '21.5%'."""
    return span([100 * v for v in values], "{:.1f}") + "%"


def column(rec: dict, key: str) -> list[float]:
    return [r[key] for r in rec["runs"]]


def runs_word(n: int) -> str:
    return {1: "one run", 2: "two runs", 3: "three runs", 4: "four runs", 5: "five runs", 6: "six runs"}.get(
        n, f"{n} runs")


# --------------------------------------------------------------------- the quickstart

def quickstart_output(rec: dict) -> str:
    """The quickstart's last lines as one run printed them (`shown_run`, 1-based)."""
    from rlhflab.quickstart import format_table

    run = rec["runs"][rec["shown_run"] - 1]
    summary = {"accuracy_before": run["accuracy_sft"], "accuracy_after": run["accuracy_ppo"],
               "reward_before": run["reward_sft"], "reward_after": run["reward_ppo"],
               "seconds": run["seconds"], "ppo_episodes_per_s": run["ppo_episodes_per_s"]}
    return "\n".join([
        "```text",
        "[5/5] held-out greedy evaluation (200 problems)",
        format_table(summary),
        "summary: outputs/quickstart/summary.json   plots: outputs/quickstart/ppo/plots   "
        "model: outputs/quickstart/ppo/final",
        "```",
    ])


def _load_text(rec: dict) -> str:
    load = rec.get("load_average")
    return f"load average {span(load, '{:.1f}')}" if load else "load average not recorded"


def quickstart_table(rec: dict) -> str:
    """docs/quickstart.md's table: one row, every figure as its range over the runs."""
    step10 = column(rec, "accuracy_step10")
    gain = [b - a for a, b in zip(column(rec, "accuracy_sft"), column(rec, "accuracy_ppo"))]
    sampled = [v for v in column(rec, "sampled_accuracy_sft") if v is not None]
    cells = [
        f"{rec['machine']}, {rec['date']}; {rec['conditions']} ({_load_text(rec)})",
        str(len(rec["runs"])),
        pct_span(column(rec, "accuracy_sft")),
        pct_span(step10) if None not in step10 else "n/a",
        f"{pct_span(column(rec, 'accuracy_ppo'))} (+{span([100 * g for g in gain], '{:.1f}')} points)",
        span(column(rec, "reward_sft"), "{:.3f}"),
        span(column(rec, "reward_ppo"), "{:.3f}"),
        span(column(rec, "seconds"), "{:.1f}") + " s",
        span(column(rec, "sft_seconds"), "{:.1f}") + " s",
        span(column(rec, "ppo_episodes_per_s"), "{:.1f}"),
        pct_span(sampled) if sampled else "not recorded",
    ]
    head = ["machine, date, conditions", "runs", "accuracy after SFT", "after 10 PPO steps", "after 20 PPO steps",
            "mean reward after SFT", "after PPO", "wall time, all 5 stages", "of which SFT", "PPO episodes/s",
            "accuracy after SFT, sampled (temperature 1)"]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + " --- |" * len(head), "| " + " | ".join(cells) + " |",
                      "", f"Command: `{rec['command']}`; every run is in `{_rel(rec)}`."])


def _rel(rec: dict) -> str:
    path = results_path(rec["name"])
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


# --------------------------------------------------------------------- PPO beside TRL

def _median_span(vals: list[float], fmt: str = "{:.2f}") -> str:
    return f"{span(vals, fmt)} (median {fmt.format(statistics.median(vals))})"


def ppo_trl_sentence(rec: dict) -> str:
    """docs/actor_critic.md's sentence: the separate critic beside TRL's PPO."""
    n = len(rec["runs"])
    return (f"Measured by `{rec['command']}` ({rec['machine']}, {rec['date']}, {rec['workload']}, "
            f"{runs_word(n)}): rlhflab's separate-critic PPO step ran at "
            f"{span(column(rec, 'critic_speed'), '{:.2f}')}x "
            f"(median {statistics.median(column(rec, 'critic_speed')):.2f}) "
            f"TRL {rec['trl_version']}'s episodes/s at "
            f"{span(column(rec, 'critic_memory'), '{:.2f}')}x its peak memory, both float32 with separate critics.")


def _known(rec: dict, key: str) -> str:
    """The range over the runs that recorded `key` ('runs 1-3' when not all did)."""
    idx = [i for i, r in enumerate(rec["runs"]) if r.get(key) is not None]
    if not idx:
        return "not recorded"
    text = span([rec["runs"][i][key] for i in idx], "{:.2f}")
    return text if len(idx) == len(rec["runs"]) else f"{text} (runs {idx[0] + 1}-{idx[-1] + 1})"


def ppo_trl_table(rec: dict) -> str:
    """bench/README.md's current result of ppo_throughput.py: ratios over every run."""
    n = len(rec["runs"])
    vh = rec["value_head"]
    rows = [
        "| pair (rlhflab / TRL, float32) | speed, wall | speed, CPU seconds | memory (peak MiB) |",
        "| --- | --- | --- | --- |",
        f"| like for like: separate critics | {_median_span(column(rec, 'critic_speed'))} | "
        f"{_median_span(column(rec, 'critic_speed_cpu'))} | {span(column(rec, 'critic_memory'), '{:.2f}')} |",
        f"| value head (rlhflab's default) vs TRL | {span(vh['speed'], '{:.2f}')} | "
        f"{_known(rec, 'value_head_speed_cpu')} "
        f"| {span(vh['memory'], '{:.2f}')} |",
    ]
    return "\n".join([
        f"{rec['machine']}, {rec['date']} ({rec['conditions']}), `{rec['command']}`, "
        f"{runs_word(n)}; {rec['workload']}:", "", *rows, "",
        f"Every run is in `{_rel(rec)}` ({rec['value_head']['note']})."])


# --------------------------------------------------------------------- learner mode

def learner_sentence(rec: dict) -> str:
    """docs/learner_mode.md: held-out accuracy at steps 0, 5 and 10 of `learn run`."""
    steps = sorted({int(k) for r in rec["runs"] for k in r["accuracy_by_step"]})

    def at(step: int, who: str) -> str:
        return pct_span([r["accuracy_by_step"][str(step)] for r in rec["runs"] if r["functions"] == who])

    yours = " → ".join(f"{at(s, 'learner')} (step {s})" for s in steps)
    lib = " → ".join(f"{at(s, 'library')} (step {s})" for s in steps)
    n = len({r["repeat"] for r in rec["runs"]})
    same = [at(s, "learner") for s in steps] == [at(s, "library") for s in steps]
    return (f"`{rec['learn_command']}` with correct exercises, measured by `{rec['command']}` on a "
            f"{rec['machine']} ({rec['date']}; {rec['conditions']}; {runs_word(n)}): held-out accuracy "
            f"went {yours} with the workspace's functions, and "
            + ("the same with the library's." if same else f"{lib} with the library's."))


def during(r: dict) -> str:
    """The run's own held-out evaluations between its first and last step: 'step 22: 47.5%'."""
    steps = sorted(int(k) for k in r.get("eval_by_step", {}))[1:-1]
    return ", ".join(f"step {k}: {100 * r['eval_by_step'][str(k)]:.1f}%" for k in steps) or "-"


def recipes_table(rec: dict) -> str:
    """docs/real_models.md: every recorded SmolLM2 recipe run, one row each (held-out greedy
    accuracy before and after, training time as run and the conditions it ran under; a
    row's `note` says how its settings differ from the config as it is now)."""
    lines = ["| recipe | seed | steps | held-out accuracy | gain | during the run | train min | wall min | s/step "
             "| generate / no-grad / update s | threads | load | overrides |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rec["runs"]:
        over = " ".join(o for o in r["overrides"] if not o.startswith("training.output_dir=")) or "-"
        note = "; ".join(x for x in (r.get("note"), r.get("machine") and f"on a {r['machine']}") if x)
        if note:
            over = f"{over} ({note})" if over != "-" else note
        wall = f"{r['train_wall_minutes']:.1f}" if "train_wall_minutes" in r else "-"
        ph = r.get("phase_seconds") or {}
        phases = " / ".join(f"{ph[k]:.1f}" for k in ("generate", "forward", "update")) if len(ph) == 3 else "-"
        lines.append(f"| {r['recipe']} | {r['seed']} | {r['steps']} | {100 * r['before']:.1f}% → "
                     f"{100 * r['after']:.1f}% ({r['n_eval']} rows) | {100 * (r['after'] - r['before']):+.1f} | "
                     f"{during(r)} | {r['train_minutes']:.1f} | {wall} | "
                     f"{r['s_per_step']:.0f} | {phases} | {r.get('threads', '?')} | {r['load']:.1f} | {over} |")
    return ("\n".join(lines) + f"\n\n{rec['machine']} unless a row names another, {rec['date']}; rows from "
            f"`{rec['script']}` ({rec['command']}).")


def recipes_summary(rec: dict) -> str:
    """README.md's one sentence: the gain in held-out greedy accuracy of every run of a shipped
    SmolLM2 recipe at its config as it is now (no `note`), on every machine, as one range."""
    runs = [r for r in rec["runs"] if not r.get("note") and r["n_eval"] >= 200]
    gains = [100 * (r["after"] - r["before"]) for r in runs]
    recipes = sorted({r["recipe"] for r in runs})
    cpus = sorted({r.get("machine", rec["machine"]) for r in runs})
    return (f"On SmolLM2-135M-Instruct, {len(runs)} runs of the {len(recipes)} shipped recipes (seeds, "
            f"{runs_word(len(cpus)).split()[0]} 2-core CPUs) raised held-out greedy accuracy on easy word problems "
            f"from {pct_span([r['before'] for r in runs])} by **{span(gains, '{:+.1f}', ' to ')} points**.")


VIEWS: dict[str, tuple[str, Callable[[dict], str]]] = {
    "real-model-recipes": ("real_model_recipes", recipes_table),
    "real-model-summary": ("real_model_recipes", recipes_summary),
    "quickstart-output": ("quickstart", quickstart_output),
    "quickstart-table": ("quickstart", quickstart_table),
    "ppo-trl-sentence": ("ppo_throughput", ppo_trl_sentence),
    "ppo-trl-table": ("ppo_throughput", ppo_trl_table),
    "learner-accuracy": ("learner", learner_sentence),
}


def render(view: str) -> str:
    name, fn = VIEWS[view]
    rec = load_results(name)
    rec.setdefault("name", name)
    return fn(rec).rstrip("\n") + "\n"


# --------------------------------------------------------------------- pages

def views_in(text: str) -> list[str]:
    return OPEN.findall(text)


def fill(text: str, where: str = "page") -> str:
    """The page with every marked section rewritten from its results file."""
    opened, closed = len(OPEN.findall(text)), len(CLOSE.findall(text))
    if opened != closed or opened != len(MARKED.findall(text)):
        raise SystemExit(f"{where}: {opened} '<!-- figure:VIEW -->' and {closed} '<!-- /figure -->' markers "
                         "do not pair up (each opening marker on its own line, then the closing one)")
    for view in views_in(text):
        if view not in VIEWS:
            raise SystemExit(f"{where}: unknown figure {view!r}; known: {', '.join(sorted(VIEWS))}")
    return MARKED.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)


def pages() -> dict[Path, str]:
    """{page: its text with every figure filled in} for every page that has a marker."""
    out = {}
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        if OPEN.search(text):
            out[page] = fill(text, str(page.relative_to(ROOT)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page differs")
    args = ap.parse_args(argv)
    stale = []
    for page, text in pages().items():
        if page.read_text(encoding="utf-8") != text:
            stale.append(page.relative_to(ROOT).as_posix())
            if not args.check:
                page.write_text(text, encoding="utf-8")
    if args.check and stale:
        print("figures differ from their results files in: " + ", ".join(stale)
              + "; run .venv/bin/python scripts/insert_figures.py")
        return 1
    print(("rewrote " + ", ".join(stale)) if stale and not args.check else "figures up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
