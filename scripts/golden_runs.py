"""Golden runs: short seeded runs of every policy method on the tiny quickstart-style model
and task, printed as JSON (per run: the sha256 of each final weight file and every metric
of every step, time/ and perf/ left out). Run it before and after a change to the training
loop, on the same machine, and compare: synchronous training (generation.max_staleness 0)
must reproduce the numbers bit for bit.

    python scripts/golden_runs.py --out golden.json [--only grpo,ppo_value_head] [--work DIR]
    (with --only and an existing --out, the named runs are replaced in it, the rest kept)
    python scripts/golden_runs.py --compare before.json after.json

Hashes differ between CPUs (Intel's and AMD's BLAS round differently): compare two outputs
of the same machine only. Each run is its own process with one thread.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOLATILE = ("time/", "perf/")
STEPS = 3

COMMON = ["generation.max_new_tokens=8", "dataset.num_eval_samples=8", f"training.total_steps={STEPS}",
          f"training.eval_interval={STEPS}", "training.save_interval=0", "logging.progress_bar=false",
          "logging.plots=false", "logging.doctor=false", "training.num_threads=1", "training.seed=3"]
GROUP = ["prompts_per_step=4", "batch_size=16", "mini_batch_size=8", "gradient_accumulation_steps=1", "epochs=1"]

# name -> (command, config, extra overrides); {chat} and {games} are filled in.
RUNS: dict[str, tuple[str, str, list[str]]] = {
    "ppo_value_head": ("ppo", "ppo_debug.yaml", ["ppo.rollout_samples=8", "ppo.batch_size=8",
                                                 "ppo.mini_batch_size=4", "ppo.epochs=2"]),
    "ppo_critic": ("ppo", "ppo_debug.yaml", ["model.critic=separate", "ppo.rollout_samples=8", "ppo.batch_size=8",
                                             "ppo.mini_batch_size=4", "ppo.epochs=2"]),
    "grpo": ("grpo", "grpo_debug.yaml", [f"grpo.{g}" for g in GROUP] + ["grpo.group_size=4"]),
    "grpo_two_updates": ("grpo", "grpo_debug.yaml", [f"grpo.{g}" for g in GROUP] + ["grpo.group_size=4",
                                                                                   "grpo.epochs=2"]),
    "rloo": ("rloo", "rloo_debug.yaml", [f"rloo.{g}" for g in GROUP] + ["rloo.k=4"]),
    "reinforce_pp": ("reinforce-pp", "reinforce_pp_debug.yaml",
                     [f"reinforce_pp.{g}" for g in GROUP] + ["reinforce_pp.n_samples=4",
                                                             "reinforce_pp.baseline=group_mean"]),
    "dr_grpo": ("dr-grpo", "dr_grpo_debug.yaml", [f"dr_grpo.{g}" for g in GROUP]),
    "gspo": ("gspo", "gspo_debug.yaml", [f"gspo.{g}" for g in GROUP]),
    "trpo": ("trpo", "trpo_debug.yaml", ["trpo.rollout_samples=8", "trpo.batch_size=8",
                                         "trpo.value_mini_batch_size=4", "trpo.value_epochs=2"]),
    "grpo_multiturn": ("grpo", "grpo_debug.yaml", [f"grpo.{g}" for g in GROUP] + [
        "grpo.group_size=2", "model.name_or_path={chat}", "dataset.path={games}/train.jsonl",
        "dataset.eval_path={games}/test.jsonl", "dataset.prompt_field=prompt", "dataset.answer_field=answer",
        'dataset.prompt_template="{prompt}"',
        "dataset.use_chat_template=true", "env.name=guess_env:GuessTheNumber", "env.kwargs.high=10",
        "env.max_turns=3", "env.max_length=128", f"env.plugin_dir={ROOT / 'examples' / 'guess_the_number'}",
        "reward.sources=[{type: rule, name: 'guess_env:no_reward'}]",
        f"reward.plugin_dir={ROOT / 'examples' / 'guess_the_number'}", "generation.seeded_sampling=true"]),
    "grpo_vllm": ("grpo", "grpo_debug.yaml", [f"grpo.{g}" for g in GROUP] + [
        "grpo.group_size=4", "generation.backend=vllm", "generation.vllm.enforce_eager=true",
        "generation.seeded_sampling=false"]),
}


# The untrained tiny model never answers right, so the task's rule would give every response
# 0 and no update would move the weights: the share of digits in the response varies instead.
REWARD = '''def digits(prompt, response, example):
    return sum(c.isdigit() for c in response) / max(len(response), 1)
'''


def prepare(work: Path) -> dict[str, Path]:
    """The tiny model (head_dim 32, as vLLM's CPU attention needs), a ChatML one for the
    environment, the arithmetic task and guess-the-number games, each built once in `work`."""
    sys.path.insert(0, str(ROOT))
    from rlhflab.data.arith import write_jsonl, write_task
    from rlhflab.models.tiny import make_tiny_model

    paths = {"work": work, "model": work / "tiny", "chat": work / "tiny-chat", "task": work / "arith", "games": work / "games"}
    if not (paths["model"] / "config.json").is_file():
        make_tiny_model(paths["model"], hidden_size=64, num_layers=2, num_heads=2)
    if not (paths["chat"] / "config.json").is_file():
        make_tiny_model(paths["chat"], hidden_size=64, num_layers=2, num_heads=2, chat_template="chatml")
    if not (paths["task"] / "train.jsonl").is_file():
        write_task(paths["task"], n_train=200, n_test=40)
    if not (paths["games"] / "train.jsonl").is_file():
        import random
        paths["games"].mkdir(parents=True, exist_ok=True)
        for split, n, seed in (("train", 64, 0), ("test", 8, 1)):
            rng = random.Random(seed)
            write_jsonl(
                        [{"prompt": f"game {seed}-{i}", "secret": rng.randint(1, 10)} for i in range(n)],
                        paths["games"] / f"{split}.jsonl")
    (work / "golden_reward.py").write_text(REWARD)
    return paths


def run_one(name: str, paths: dict[str, Path], out: Path, extra: list[str]) -> dict:
    command, config, over = RUNS[name]
    def fill(text: str) -> str:
        for key, path in paths.items():
            text = text.replace("{" + key + "}", str(path))
        return text

    args = [f"model.name_or_path={paths['model']}", f"dataset.path={paths['task'] / 'train.jsonl'}",
            f"dataset.eval_path={paths['task'] / 'test.jsonl'}", f"training.output_dir={out}",
            "training.overwrite=true", *COMMON, "reward.sources=[{type: rule, name: 'golden_reward:digits'}]",
            f"reward.plugin_dir={out.parents[1]}", *[fill(o) for o in over], *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "rlhflab", command, "--config", str(ROOT / "configs" / config),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    metrics = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]
    hashes = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
              for p in sorted((out / "final").glob("*.safetensors"))}
    return {"weights": hashes, "metrics": metrics}


def compare(a: dict, b: dict) -> list[str]:
    diffs = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            diffs.append(f"{name}: only in {'the first' if name in a else 'the second'}")
        elif a[name] != b[name]:
            ra, rb = a[name], b[name]
            if "error" in ra or "error" in rb:
                diffs.append(f"{name}: error {ra.get('error', rb.get('error'))[-500:]}")
                continue
            if ra["weights"] != rb["weights"]:
                diffs.append(f"{name}: final weights differ")
            for i, (x, y) in enumerate(zip(ra["metrics"], rb["metrics"])):
                for k in sorted(set(x) | set(y)):
                    if x.get(k) != y.get(k):
                        diffs.append(f"{name}: row {i} {k}: {x.get(k)} vs {y.get(k)}")
            if len(ra["metrics"]) != len(rb["metrics"]):
                diffs.append(f"{name}: {len(ra['metrics'])} vs {len(rb['metrics'])} metric rows")
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the JSON here (else stdout)")
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    ap.add_argument("--work", type=Path, default=None, help="where the model, task and runs go (default: a temp dir)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two outputs and exit")
    ap.add_argument("overrides", nargs="*", help="dotted overrides added to every run")
    args = ap.parse_args()
    if args.compare:
        diffs = compare(*(json.loads(p.read_text()) for p in args.compare))
        print("\n".join(diffs) if diffs else "identical")
        return 1 if diffs else 0
    work = args.work or Path(tempfile.mkdtemp(prefix="golden-"))
    paths = prepare(work)
    names = [n for n in args.only.split(",") if n] or list(RUNS)
    result = {}
    for name in names:
        result[name] = run_one(name, paths, work / "runs" / name, args.overrides)
        status = "error" if "error" in result[name] else "ok"
        print(f"{name}: {status}", file=sys.stderr, flush=True)
    if args.out and args.only and args.out.is_file():  # some runs again: the others' results kept
        result = {**json.loads(args.out.read_text()), **result}
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 1 if any("error" in r for r in result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
