#!/usr/bin/env python
"""The SmolLM2-135M-Instruct recipes: one run of a recipe and seed, held-out greedy
accuracy before and after, and one table row.

    .venv/bin/python scripts/real_model_recipes.py --recipe grpo --seed 0 [key=value ...]
    .venv/bin/python scripts/real_model_recipes.py --table      (every row recorded so far)

A recipe is one of the SmolLM2 configs: grpo (configs/grpo_smollm2.yaml), ppo
(ppo_smollm2.yaml, value head), ppo_critic (ppo_smollm2_critic.yaml), rloo, reinforce_pp
and lora_grpo (grpo_smollm2_lora.yaml). The word-problem task is written to the config's data folder first when it is
missing (`rlhflab make-data --task word-problems --level easy`). The untrained model's accuracy is
measured once per evaluation setting and kept in `<out>/before_<key>.json` (the same
greedy decoding of the same model gives the same answers); the trained model is measured
the same way, in this process, right after training. Training minutes and s/step count
the training steps only (not the evaluations); `load` is the 1-minute load average,
sampled every 10 s during training, as a mean (other processes share the CPU). Each row is
appended to `<out>/results.jsonl`; `--table` prints them all, which is the table in
docs/real_models.md.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlhflab.openmp import apply_default_wait  # noqa: E402  (before torch loads, as the CLI does)

apply_default_wait()

RECIPES = {  # recipe -> (config, trainer module, run config class)
    "grpo": ("grpo_smollm2.yaml", "rlhflab.trainers.grpo", "GRPORunConfig"),
    "ppo": ("ppo_smollm2.yaml", "rlhflab.trainers.ppo", "PPORunConfig"),
    "ppo_critic": ("ppo_smollm2_critic.yaml", "rlhflab.trainers.ppo", "PPORunConfig"),
    "rloo": ("rloo_smollm2.yaml", "rlhflab.trainers.rloo", "RLOORunConfig"),
    "reinforce_pp": ("reinforce_pp_smollm2.yaml", "rlhflab.trainers.reinforce_pp", "ReinforcePPRunConfig"),
    "lora_grpo": ("grpo_smollm2_lora.yaml", "rlhflab.trainers.grpo", "GRPORunConfig"),
}
HEADER = ("| recipe | seed | steps | overrides | accuracy before -> after | gain | train min | s/step | load |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


class LoadSampler:
    """The 1-minute load average every `every` seconds in a thread, as a mean."""

    def __init__(self, every: float = 10.0):
        self.every, self.values, self._stop = every, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.values.append(os.getloadavg()[0])
            self._stop.wait(self.every)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values) if self.values else os.getloadavg()[0]


def load(recipe: str, overrides: list[str]):
    config, module_name, schema_name = RECIPES[recipe]
    from rlhflab.config import load_config

    module = importlib.import_module(module_name)
    cfg, eff = load_config(ROOT / "configs" / config, getattr(module, schema_name), overrides)
    return module, cfg, eff


def ensure_data(cfg) -> None:
    """The word-problem task in the config's folder, written when missing: the easy level,
    which every recipe config reads (`rlhflab make-data --task word-problems --level easy`)."""
    train, test = Path(cfg.dataset.path), Path(cfg.dataset.eval_path)
    if train.exists() and test.exists():
        return
    if train.parent != test.parent:
        sys.exit(f"error: {train} or {test} is missing; write them with "
                 f"`rlhflab make-data --task word-problems --level easy --out FOLDER`")
    from rlhflab.data.wordproblems import write_task
    print(f"writing the word-problem task (easy level) to {train.parent} ...", flush=True)
    write_task(train.parent, level="easy")


def evaluate(model, tokenizer, cfg) -> dict:
    """Greedy held-out accuracy as the training loop measures it (its settings and checks)."""
    from rlhflab.data.prompts import load_prompts
    from rlhflab.evaluate import build_eval_checks, evaluate_policy
    from rlhflab.rewards import build_reward

    device = next(model.parameters()).device
    examples = load_prompts(cfg.dataset, tokenizer, "eval")
    res = evaluate_policy(model, tokenizer, examples, build_reward(cfg.reward, device),
                          max_new_tokens=cfg.generation.max_new_tokens,
                          max_prompt_length=cfg.dataset.max_prompt_length,
                          batch_size=cfg.training.eval_batch_size, checks=build_eval_checks(cfg.eval, device))
    lengths = [len(tokenizer(s["response"], add_special_tokens=False)["input_ids"]) for s in res.samples]
    return {"accuracy": res.accuracy, "reward_mean": res.reward_mean, "n": len(res.samples),
            "mean_response_tokens": sum(lengths) / max(len(lengths), 1),
            "hit_limit_frac": sum(n >= cfg.generation.max_new_tokens for n in lengths) / max(len(lengths), 1)}


def before(cfg, out: Path) -> dict:
    """The untrained model's evaluation, measured once per setting and kept."""
    d, g = cfg.dataset, cfg.generation
    key = json.dumps([cfg.model.name_or_path, d.eval_path, d.prompt_template, str(d.use_chat_template),
                      d.num_eval_samples, d.max_prompt_length, g.max_new_tokens, cfg.eval.correct])
    path = out / f"before_{hashlib.sha1(key.encode()).hexdigest()[:10]}.json"
    if path.exists():
        return json.loads(path.read_text())
    from rlhflab.models.load import load_model, resolve_device

    print("evaluating the untrained model ...", flush=True)
    device = resolve_device(cfg.training.device)  # where the trained model is evaluated too
    model, tok = load_model(cfg.model.name_or_path, torch_dtype=cfg.model.torch_dtype, device=str(device))
    result = evaluate(model, tok, cfg)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def format_row(r: dict) -> str:
    over = " ".join(r["overrides"]) or "-"
    return (f"| {r['recipe']} | {r['seed']} | {r['steps']} | {over} | {100 * r['before']:.1f}% -> "
            f"{100 * r['after']:.1f}% | {100 * (r['after'] - r['before']):+.1f} | {r['train_minutes']:.1f} | "
            f"{r['s_per_step']:.1f} | {r['load']:.1f} |")


# The trainer's time/<phase> metrics: generation, the no-grad log-probs and values, the update.
PHASES = ("generate", "forward", "update")


def step_rows(rows: list[dict]) -> list[dict]:
    """The training steps' rows among a run's metrics rows (metrics.jsonl's or the result's
    history): those with `time/step`. An evaluation-only row (step 0's) has none."""
    return [r for r in rows if "time/step" in r]


def phase_seconds(rows: list[dict]) -> dict | None:
    """Median seconds of a step's phases (`PHASES`) over the training steps among `rows`,
    rounded to 0.01 s; a phase some step lacks is left out; None when no step has any
    (no timed steps: the table shows '-', never a 0)."""
    import statistics

    steps = step_rows(rows)
    medians = {phase: round(statistics.median(h[f"time/{phase}"] for h in steps), 2)
               for phase in PHASES if steps and all(f"time/{phase}" in h for h in steps)}
    return medians or None


def timing_fields(rows: list[dict], wall_seconds: float) -> dict:
    """A results row's timing fields from a run's metrics rows and the wall-clock seconds
    its `train()` call took (start-up included: model loads, a vLLM engine):
    `steps`, `train_minutes` (the steps' `time/step` summed; evaluations not counted),
    `s_per_step`, `train_wall_minutes` and `phase_seconds`. With no timed steps the
    minutes, s/step and phases are None."""
    seconds = [h["time/step"] for h in step_rows(rows)]
    return {"steps": len(seconds), "train_minutes": sum(seconds) / 60 if seconds else None,
            "train_wall_minutes": wall_seconds / 60, "phase_seconds": phase_seconds(rows),
            "s_per_step": sum(seconds) / len(seconds) if seconds else None}


def run_folder_fields(run_dir: Path) -> dict:
    """What `record` reads from a run folder's metrics.jsonl: `eval_by_step` (each held-out
    evaluation's accuracy by step) and `phase_seconds`; {} without a metrics.jsonl."""
    from rlhflab.metrics import read_metrics

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = read_metrics(path)
    return {"eval_by_step": {str(e["step"]): e["eval/accuracy"] for e in rows if "eval/accuracy" in e},
            "phase_seconds": phase_seconds(rows)}


def run_one(recipe: str, seed: int, overrides: list[str], out: Path, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    run_dir = out / f"{recipe}_s{seed}"
    base = [f"training.seed={seed}", f"training.output_dir={run_dir}", f"training.num_threads={threads}"]
    quiet = ["training.eval_interval=0", "training.save_interval=0", "logging.progress_bar=false",
             "logging.plots=false"]
    module, cfg, eff = load(recipe, base + quiet + overrides)
    ensure_data(cfg)
    start = before(cfg, out)
    print(f"{recipe} seed {seed}: untrained accuracy {100 * start['accuracy']:.1f}%; training "
          f"{cfg.training.total_steps} steps ...", flush=True)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # this script's own folder
    with LoadSampler() as sampler:
        t0 = time.perf_counter()
        res = module.train(cfg, effective=eff, quiet=True)
        wall = time.perf_counter() - t0  # the steps plus start-up (model loads, a vLLM engine)
    timing = timing_fields(res.history, wall)
    print("evaluating the trained model ...", flush=True)
    end = evaluate(res.models.policy, res.models.tokenizer, cfg)
    last = res.history[-1]
    row = {"recipe": recipe, "seed": seed, "steps": timing["steps"], "overrides": overrides,
           "before": start["accuracy"], "after": end["accuracy"], "train_minutes": timing["train_minutes"],
           "train_wall_minutes": timing["train_wall_minutes"], "phase_seconds": timing["phase_seconds"],
           "s_per_step": timing["s_per_step"], "load": sampler.mean,
           "after_response_tokens": end["mean_response_tokens"],
           "before_response_tokens": start["mean_response_tokens"],
           "last_hit_limit_frac": last.get("rollout/hit_limit_frac"), "last_kl_to_ref": last.get("params/kl_to_ref"),
           "reward_first_steps": [round(h["rollout/reward_mean"], 3) for h in res.history[:3]],
           "reward_last_steps": [round(h["rollout/reward_mean"], 3) for h in res.history[-3:]],
           "n_eval": end["n"], "threads": threads, "run_dir": str(Path(cfg.training.output_dir))}
    with (out / "results.jsonl").open("a") as fh:
        fh.write(json.dumps(row) + "\n")
    return row


def machine() -> str:
    """The CPU (measure_readme.machine_name), and the GPU when one is visible: a run's minutes
    depend on both."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from measure_readme import machine_name  # as scripts/measure_learner.py does

    if torch.cuda.is_available():
        return f"one {torch.cuda.get_device_name(0)} GPU on a {machine_name()} host"
    return machine_name()


def record(results: Path, row: dict, command: str) -> None:
    """Add `row` (with the command that made it) to the results file's runs."""
    import datetime

    here = machine()
    rec = json.loads(results.read_text()) if results.exists() else {
        "name": results.stem, "script": "scripts/real_model_recipes.py",
        "command": "scripts/real_model_recipes.py --recipe RECIPE --seed SEED --results " + str(results),
        "machine": here, "date": datetime.date.today().isoformat(), "runs": []}
    if here != rec["machine"]:  # the file names the machine of its first rows; a row from another says its own
        row = {**row, "machine": here}
    out = [o.split("=", 1)[1] for o in row["overrides"] if o.startswith("training.output_dir=")]
    run_dir = Path(row["run_dir"]) if row.get("run_dir") else Path(out[-1]) if out else None
    if "threads" not in row and run_dir is not None and (run_dir / "effective_config.yaml").is_file():
        import yaml  # a row written before rows kept it: the run folder's effective config has it

        row = {**row, "threads": yaml.safe_load((run_dir / "effective_config.yaml").read_text())["training"]["num_threads"]}
    if run_dir is not None:  # the run's own held-out evaluations (and phases, for a row written before rows kept them)
        found = run_folder_fields(run_dir)
        row = {**row, **{k: v for k, v in found.items() if k == "eval_by_step" or k not in row}}
    rec["runs"].append({**row, "command": command, "date": datetime.date.today().isoformat()})
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(rec, indent=2) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=list(RECIPES), help="which SmolLM2 config to run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("outputs/real_model_recipes"),
                    help="run folders, the kept baseline and results.jsonl (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--table", action="store_true", help="print every recorded row and stop")
    ap.add_argument("--eval-only", action="store_true",
                    help="only the untrained model's held-out accuracy under the recipe's settings and the overrides "
                         "(e.g. another dataset.prompt_template), one line; kept like the baseline of a run")
    ap.add_argument("--results", type=Path, default=None,
                    help="also add each finished run's row to this results file (JSON; the docs' table is "
                         "docs/figures/results/real_model_recipes.json, put into docs/real_models.md by "
                         "scripts/insert_figures.py)")
    ap.add_argument("--record", type=Path, default=None, metavar="RESULTS_JSONL",
                    help="with --results: add the rows of an earlier results.jsonl (runs made without --results) "
                         "and stop")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.total_steps=10")
    a = ap.parse_args(argv)
    if a.record:
        if not a.results:
            ap.error("--record needs --results")
        for line in a.record.read_text().splitlines():
            record(a.results, json.loads(line), f"(recorded from {a.record})")
        return 0
    if a.table:
        path = a.out / "results.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        print(HEADER)
        for r in rows:
            print(format_row(r))
        return 0
    if not a.recipe:
        ap.error("--recipe is required (or --table)")
    if a.eval_only:
        import torch

        torch.set_num_threads(a.threads)
        _, cfg, _ = load(a.recipe, a.overrides)
        ensure_data(cfg)
        r = before(cfg, a.out)
        print(f"untrained | {cfg.dataset.prompt_template!r} | max_new_tokens {cfg.generation.max_new_tokens} | "
              f"accuracy {100 * r['accuracy']:.1f}% | {r['mean_response_tokens']:.1f} tokens on average | {r['n']} rows")
        return 0
    row = run_one(a.recipe, a.seed, a.overrides, a.out, a.threads)
    if a.results:
        record(a.results, row, " ".join(["scripts/real_model_recipes.py", *(argv if argv is not None else sys.argv[1:])]))
    print(HEADER)
    print(format_row(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
