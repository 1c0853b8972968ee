#!/usr/bin/env python
"""The tutorial FAQ's two symptoms, made on purpose, and what the doctor says about them.

    .venv/bin/python scripts/doctor_symptoms.py [--warm outputs/quickstart] [--threads 1]
                                                [--variants healthy kl_high no_critic ...]

Each variant is the quickstart's PPO run (20 steps x 64 responses, eval off) on the warm
start `rlhflab quickstart` writes (made here first when the folder lacks it), with one
setting changed:

    healthy      as the quickstart (seed 0); healthy_seed1, healthy_seed2 with other seeds
    kl_high      ppo.kl_coeff 2.0 (100x): the KL penalty outweighs the reward; the FAQ's
                 "approx_kl decreasing, nothing is learning"
    no_critic    ppo.vf_coeff 0: the value head never trains; the FAQ's "loss/value flat
                 over the first rollouts"

It prints per variant the reward's first and last 3-step means and the doctor's findings
(rule and step) for kl_fading, value_flat_early and value_loss. The thresholds in
rlhflab.doctor.DoctorConfig (fade_factor, value_early_steps) were set from these runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "healthy": {}, "healthy_seed1": {"seed": 1}, "healthy_seed2": {"seed": 2},
    "kl_high": {"kl_coeff": 2.0}, "no_critic": {"vf_coeff": 0.0},
}
RULES = ("kl_fading", "value_flat_early", "value_loss")


def run_variant(name: str, warm: Path, out: Path, threads: int | None) -> list[dict]:
    from rlhflab.quickstart import ppo_defaults
    from rlhflab.trainers import ppo

    change = VARIANTS[name]
    cfg = ppo_defaults(warm, threads)
    cfg.training.output_dir = str(out / name)
    cfg.training.eval_interval = 0
    cfg.training.overwrite = True
    cfg.training.seed = change.get("seed", cfg.training.seed)
    cfg.logging.plots = False
    cfg.logging.progress_bar = False
    for key in ("kl_coeff", "vf_coeff"):
        if key in change:
            setattr(cfg.ppo, key, change[key])
    ppo.train(cfg, quiet=True)
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "step" in row]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm", type=Path, default=Path("outputs/quickstart"), help="warm-start folder (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("outputs/doctor_symptoms"), help="run folders (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (default: %(default)s)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    a = ap.parse_args()

    from rlhflab.doctor import diagnose

    if not (a.warm / "sft" / "final").is_dir():
        from rlhflab.quickstart import prepare_warm_start
        print(f"making the warm start in {a.warm} ...", flush=True)
        prepare_warm_start(a.warm, quiet=True)  # the quickstart's thread count: the same SFT model
    print(f"{'variant':<14} {'reward first 3 -> last 3':<26} findings")
    for name in a.variants:
        rows = run_variant(name, a.warm, a.out, a.threads)
        rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
        first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
        found = [f"{f.rule}@{f.step}" for f in diagnose(rows).findings if f.rule in RULES]
        print(f"{name:<14} {first:.3f} -> {last:.3f}{'':<12} {', '.join(found) or '-'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
