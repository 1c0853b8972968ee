"""How many aten operators one GRPO step dispatches in its scoring and its update, with
`grpo.share_prompt` on and off: a stand-in for kernel launches, which set a GPU's pace when
the model is small (SmolLM2-135M on an H200 uses under 1% of the card's matrix rate).

    python bench/op_counts.py --model-dir outputs/models/smollm2-135m-instruct
    python bench/op_counts.py                    # the tiny model and the arithmetic task

Runs `rlhflab grpo` for one step in this process on the CPU, with torch's own matmul
(`model.cpu_matmul=torch`: the plain path a GPU run takes) and Hugging Face generate,
and counts every aten call inside `score_rollout` (the old and reference log-probs) and
`run_update` (forward, loss, backward, optimizer step) with a TorchDispatchMode. Views and
other metadata-only ops are counted too: on a GPU they launch nothing but still cost the
dispatcher's time. The counts do not depend on the machine; the last line:

    op_counts: scoring A / B ops, update C / D ops (share_prompt true / false)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

PHASES = ("score_rollout", "run_update")


def counting_ops(into: Counter):
    """A context in which every aten call adds one to `into[op name]` (a TorchDispatchMode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            into[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    return Count()


def count_ops(fn) -> int:
    """The aten calls `fn()` makes."""
    into: Counter = Counter()
    with counting_ops(into):
        fn()
    return sum(into.values())


def count_step(config: str, overrides: list[str]) -> dict[str, Counter]:
    """Aten ops per phase of one `rlhflab grpo` step (each phase's calls summed)."""
    from rlhflab.cli import main
    from rlhflab.trainers import grpo

    counts = {name: Counter() for name in PHASES}
    plain = {name: getattr(grpo, name) for name in PHASES}

    def counted(name):
        def call(*args, **kwargs):
            with counting_ops(counts[name]):
                return plain[name](*args, **kwargs)
        return call

    try:
        for name in PHASES:  # grpo_step calls them by these module names
            setattr(grpo, name, counted(name))
        rc = main(["grpo", "--config", config, *overrides])
    finally:
        for name, fn in plain.items():
            setattr(grpo, name, fn)
    if rc != 0:
        raise SystemExit(f"op_counts: rlhflab grpo exited with {rc}")
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None,
                    help="model folder; default: the tiny model (built in .bench/tiny-model) on the arithmetic task")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=6, help="the most frequent ops to list per phase")
    a = ap.parse_args(argv)
    from rlhflab.openmp import apply_default_wait

    apply_default_wait()
    if a.model_dir is None:  # the tiny model reads the arithmetic task
        from rlhflab.data import arith

        model = str(_common.ensure_tiny_model(_common.BENCH_DIR / "tiny-model"))
        config, data = "configs/grpo_debug.yaml", _common.BENCH_DIR / "arith"
        if not (data / "train.jsonl").is_file():
            arith.write_task(data)
    else:  # a real chat model: the SmolLM2 recipe's config and its word problems
        from rlhflab.data.wordproblems import write_task

        model, config, data = a.model_dir, "configs/grpo_smollm2.yaml", _common.REPO / "outputs" / "wordproblems-easy"
        if not (data / "train.jsonl").is_file():
            write_task(data, level="easy")
    n = a.prompts * a.group_size
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for share in ("true", "false"):
            rows[share] = count_step(str(_common.REPO / config), [
                f"model.name_or_path={model}", f"dataset.path={data}/train.jsonl", "dataset.eval_path=null",
                "generation.backend=hf", f"generation.max_new_tokens={a.max_new_tokens}",
                f"grpo.prompts_per_step={a.prompts}", f"grpo.group_size={a.group_size}", f"grpo.batch_size={n}",
                f"grpo.mini_batch_size={n}", "grpo.gradient_accumulation_steps=1", "grpo.epochs=1",
                f"grpo.share_prompt={share}", "training.total_steps=1", "training.eval_interval=0",
                "training.save_interval=0", "training.device=cpu", f"training.output_dir={tmp}/{share}",
                "model.cpu_matmul=torch", "logging.progress_bar=false", "logging.plots=false",
                "logging.doctor=false", "logging.report_to=[]"])
    print(f"op_counts: one rlhflab grpo step on {model}, {a.prompts} prompts x {a.group_size}, <= {a.max_new_tokens} "
          f"new tokens, one minibatch of {n}, torch's own matmul, Hugging Face generate")
    print(f"{'grpo.share_prompt':<18} {'scoring ops':>12} {'update ops':>11}")
    for share, c in rows.items():
        print(f"{share:<18} {sum(c['score_rollout'].values()):>12} {sum(c['run_update'].values()):>11}")
    for share, c in rows.items():
        for name in PHASES:
            top = ", ".join(f"{op} {k}" for op, k in c[name].most_common(a.top))
            print(f"  share_prompt {share}, {name}: {top}")
    t, f = rows["true"], rows["false"]
    print(f"op_counts: scoring {sum(t['score_rollout'].values())} / {sum(f['score_rollout'].values())} ops, "
          f"update {sum(t['run_update'].values())} / {sum(f['run_update'].values())} ops (share_prompt true / false)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
