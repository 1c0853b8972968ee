#!/usr/bin/env python
"""Every policy method on the quickstart's warm start, with the same budget: held-out
greedy accuracy before and after, and the wall time.

    .venv/bin/python scripts/compare_methods.py [--warm outputs/quickstart] [--seeds 0 1 2]
                                                [--methods ppo grpo ...] [--threads N]

The warm start (tiny model, arithmetic task, SFT on sloppy demonstrations) is the one
`rlhflab quickstart` writes; it is made here first when the folder lacks it. Each method
runs its `configs/<method>_quickstart.yaml` (20 steps x 64 responses) with the warm
start's paths and the given seed. With several seeds the table shows the median and the
range. The figures in docs/methods.md and docs/knobs.md are what this prints.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlhflab.config.methods import METHODS as REGISTRY  # noqa: E402

# command -> (trainer module, run config class): the registry's policy methods that have
# a configs/<section>_quickstart.yaml
METHODS = {m.command: (m.module, m.schema) for m in REGISTRY if m.compare}


def warm_start(folder: Path, threads: int | None) -> Path:
    """The quickstart's stages 1-3 in `folder`, made once."""
    if not (folder / "sft" / "final" / "config.json").exists():
        from rlhflab.quickstart import prepare_warm_start
        print(f"making the warm start in {folder} ...", flush=True)
        prepare_warm_start(folder, threads=threads, quiet=True)
    return folder


def run_one(command: str, warm: Path, out: Path, seed: int, threads: int | None, extra: list[str]) -> dict:
    from rlhflab.config import load_config

    module_name, schema_name = METHODS[command]
    module = importlib.import_module(module_name)
    overrides = [f"model.name_or_path={warm / 'sft' / 'final'}", f"dataset.path={warm / 'data' / 'train.jsonl'}",
                 f"dataset.eval_path={warm / 'data' / 'test.jsonl'}", f"training.output_dir={out}",
                 f"training.seed={seed}", "logging.progress_bar=false", "logging.plots=false", *extra]
    if threads:
        overrides.append(f"training.num_threads={threads}")
    cfg, eff = load_config(ROOT / "configs" / f"{command.replace('-', '_')}_quickstart.yaml",
                           getattr(module, schema_name), overrides)
    if out.exists():
        shutil.rmtree(out)  # this script's own folder
    t0 = time.perf_counter()
    res = module.train(cfg, effective=eff, quiet=True)
    seconds = time.perf_counter() - t0
    before, after = res.eval_before["eval/accuracy"], res.eval_after["eval/accuracy"]
    return {"method": command, "seed": seed, "before": before, "after": after, "gain": after - before,
            "seconds": seconds, "episodes_per_s": res.samples_per_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm", type=Path, default=Path("outputs/quickstart"), help="warm-start folder (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("outputs/quickstart_methods"), help="run folders (default: %(default)s)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. training.total_steps=10")
    a = ap.parse_args(argv)
    warm = warm_start(a.warm, a.threads)
    rows = []
    for command in a.methods:
        for seed in a.seeds:
            row = run_one(command, warm, a.out / f"{command}_seed{seed}", seed, a.threads, a.overrides)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| method | seeds | accuracy before | accuracy after | gain (points) | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for command in a.methods:
        mine = [r for r in rows if r["method"] == command]

        def fmt(key, scale=100.0, digits=1):
            vals = [r[key] * scale for r in mine]
            med = statistics.median(vals)
            return f"{med:.{digits}f}" if len(vals) == 1 else f"{med:.{digits}f} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"

        print(f"| {command} | {len(mine)} | {fmt('before')}% | {fmt('after')}% | {fmt('gain')} | "
              f"{fmt('seconds', 1.0, 0)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
