"""One GRPO step and one PPO step on a large-vocabulary model (Gemma-3-270M: 262,144 tokens).

    .venv/bin/rlhflab fetch-model gemma3            # once (or `make models-gemma3`)
    .venv/bin/python bench/large_vocab.py           # outputs/models/gemma3-270m
    .venv/bin/python bench/large_vocab.py --methods grpo --steps 2 --model-dir DIR

What it shows: the trainers' log-probs and entropy go through the LM head one chunk of
rows at a time (rlhflab/ops/chunked.py), so no tensor of the full (B, T, V) logits is
ever made, at any vocabulary. Each method runs in a fresh process (spawn) on the
arithmetic task (configs/<method>_debug.yaml with the model and sizes set here, full
fine-tuning, float32, a frozen reference copy, PPO with its value head):

What it measures, its options and its latest figures: bench/README.md; its history: bench/NOTES.md and git.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (the bench folder is not a package)

DEFAULT_MODEL = _common.REPO / "outputs" / "models" / "gemma3-270m"
METHODS = ("grpo", "ppo")
PHASES = ("generate", "score", "forward", "update")


class LogitsRecorder:
    """The largest logits-shaped tensor any operator outputs while active (bytes, shape).

    Logits-shaped: last dimension `vocab` and the product of the other dimensions not
    `hidden` (that is the head's weight or its gradient, V x H or H x V)."""

    def __init__(self, vocab: int, hidden: int):
        self.vocab, self.hidden = vocab, hidden
        self.max_bytes, self.max_shape, self.max_op = 0, (), ""
        self._mode = None

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        rec = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.dim() >= 1:
                        rec.see(tuple(t.shape), t.element_size(), str(func))
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def see(self, shape: tuple, element_size: int, op: str = "") -> None:
        if not shape or shape[-1] != self.vocab:
            return
        rows = 1
        for d in shape[:-1]:
            rows *= d
        if rows == self.hidden:
            return
        nbytes = rows * self.vocab * element_size
        if nbytes > self.max_bytes:
            self.max_bytes, self.max_shape, self.max_op = nbytes, shape, op

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False


def _config(method: str, a: dict, data: Path, out: Path):
    from rlhflab.config import load_config

    if method == "grpo":
        from rlhflab.trainers.grpo import GRPORunConfig as Cfg
        completions = a["prompts"] * a["group_size"]
        sizes = [f"grpo.group_size={a['group_size']}", f"grpo.prompts_per_step={a['prompts']}",
                 f"grpo.batch_size={completions}", f"grpo.mini_batch_size={completions}",
                 "grpo.gradient_accumulation_steps=1", "grpo.epochs=1", f"grpo.kl_coeff={a['beta']}",
                 "grpo.learning_rate=1e-6", "training.total_steps=" + str(a["steps"])]
    else:
        from rlhflab.trainers.ppo import PPORunConfig as Cfg
        episodes = a["prompts"] * a["group_size"]
        sizes = [f"ppo.rollout_samples={episodes}", f"ppo.batch_size={episodes}",
                 f"ppo.mini_batch_size={episodes}", "ppo.gradient_accumulation_steps=1", "ppo.epochs=1",
                 "ppo.learning_rate=1e-6", "model.critic=value_head",
                 "training.total_ppo_steps=" + str(a["steps"])]
    overrides = [f"model.name_or_path={a['model_dir']}", "model.torch_dtype=float32",
                 "model.gradient_checkpointing=false", "model.reference=copy", "lora.enabled=false",
                 f"dataset.path={data}/train.jsonl", "dataset.eval_path=null", "dataset.use_chat_template=false",
                 f"generation.max_new_tokens={a['max_new_tokens']}", f"generation.min_new_tokens={a['max_new_tokens']}",
                 "generation.temperature=1.0", f"training.output_dir={out}", "training.eval_interval=0",
                 "training.save_interval=0", f"training.num_threads={a['threads']}",
                 "logging.progress_bar=false", "logging.plots=false", "logging.doctor=false", *sizes]
    cfg, _ = load_config(_common.REPO / "configs" / f"{method}_debug.yaml", Cfg, overrides)
    return cfg


def _run(method: str, a: dict) -> dict:
    """In a fresh process: `a['steps']` steps of `method`, the last under the recorder."""
    import dataclasses
    import os

    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # library chatter to stderr
    import torch
    from transformers import AutoConfig

    from rlhflab.data.arith import write_task
    from rlhflab.ops.chunked import default_chunk_size
    from rlhflab.trainers import grpo, ppo
    from rlhflab.trainers.loop import run_policy_training

    torch.set_num_threads(a["threads"])
    cfg_json = AutoConfig.from_pretrained(a["model_dir"])
    text = getattr(cfg_json, "text_config", None) or cfg_json
    vocab, hidden = text.vocab_size, text.hidden_size
    tmp = Path(tempfile.mkdtemp(prefix=f"large_vocab_{method}_"))
    data = tmp / "arith"
    write_task(data, n_train=256, n_test=8)
    cfg = _config(method, a, data, tmp / "run")
    base = grpo.method(cfg) if method == "grpo" else ppo.method(cfg)
    rec = LogitsRecorder(vocab, hidden)
    marks: dict = {"steps": 0}

    def prepare_fn(run, roll, step, timer):  # phases 2-4 (the loop sampled the step's episodes)
        if marks["steps"] == 0:  # the models and optimizer are built: the peak counts from here
            _common.release_freed_memory()
            marks["start_rss"] = _common.rss_mb()
            marks["resettable"] = _common.reset_peak_rss()
        marks["steps"] += 1
        if marks["steps"] == a["steps"]:
            with rec:
                return base.prepare(run, roll, step, timer)
        return base.prepare(run, roll, step, timer)

    def update_fn(run, roll, step):  # phase 5, recorded in the last step as its phases 2-4 are
        if marks["steps"] == a["steps"]:
            with rec:
                return base.update(run, roll, step)
        return base.update(run, roll, step)

    try:
        res = run_policy_training(cfg, dataclasses.replace(base, prepare=prepare_fn, update=update_fn), quiet=True)
    finally:  # the run folder holds a saved model (about 3 GB for Gemma-3-270M): never leave it behind
        shutil.rmtree(tmp, ignore_errors=True)
    peak = _common.peak_rss_mb() - marks["start_rss"] if marks["resettable"] else float("nan")
    timed = res.history[-2] if len(res.history) >= 2 else {}
    rows = (a["prompts"] * a["group_size"]) * a["max_new_tokens"]
    return {"method": method, "vocab": vocab, "hidden": hidden, "peak_mib": peak,
            "process_peak_rss_mib": _common.lifetime_peak_rss_mb(),
            "step_s": timed.get("time/step", float("nan")),
            "phases_s": {k: timed.get(f"time/{k}", 0.0) for k in PHASES},
            "max_logits_mib": rec.max_bytes / 2**20, "max_logits_shape": list(rec.max_shape),
            "max_logits_op": rec.max_op, "response_rows": rows,
            "full_logits_mib": rows * vocab * 4 / 2**20,
            "chunk_rows": default_chunk_size(vocab), "chunk_mib": default_chunk_size(vocab) * vocab * 4 / 2**20}


def _child(conn, method: str, a: dict) -> None:
    try:
        conn.send(("ok", _run(method, a)))
    except BaseException:  # noqa: BLE001  (reported to the parent)
        conn.send(("error", traceback.format_exc()))
    conn.close()


def measure(method: str, a: dict) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, method, a))
    proc.start()
    try:
        kind, payload = parent.recv()
    except EOFError:
        raise SystemExit(f"large_vocab: the {method} worker died (exit code {proc.exitcode}; out of memory?)") from None
    proc.join()
    if kind == "error":
        raise SystemExit(f"large_vocab: the {method} worker failed:\n{payload}")
    return payload


def final_line(results: dict[str, dict]) -> str:
    nan = float("nan")
    any_ = next(iter(results.values()), {})
    cells = []
    for m in METHODS:
        r = results.get(m, {})
        cells.append(f"{m} peak_mib {r.get('peak_mib', nan):.0f} step_s {r.get('step_s', nan):.1f} "
                     f"max_logits_mib {r.get('max_logits_mib', nan):.1f}")
    return (f"large_vocab: V {any_.get('vocab', 'nan')} " + ", ".join(cells)
            + f", full_logits_mib {any_.get('full_logits_mib', nan):.0f} chunk_mib {any_.get('chunk_mib', nan):.0f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=str(DEFAULT_MODEL),
                    help="a large-vocabulary model folder (default outputs/models/gemma3-270m)")
    ap.add_argument("--methods", default="grpo,ppo", help="comma-separated, from grpo, ppo")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=4,
                    help="GRPO completions per prompt; PPO takes prompts x group-size episodes")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="every response is exactly this long")
    ap.add_argument("--beta", type=float, default=0.04, help="GRPO's KL weight (> 0: a reference pass)")
    ap.add_argument("--steps", type=int, default=2, help="steps per method; the last is recorded, not timed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or set(methods) - set(METHODS):
        ap.error(f"--methods {args.methods!r}: choose from {', '.join(METHODS)}")
    if not (Path(args.model_dir) / "config.json").is_file():
        ap.error(f"--model-dir {args.model_dir}: no config.json there; for Gemma-3-270M run "
                 f"`.venv/bin/rlhflab fetch-model gemma3` (or `make models-gemma3`) first")
    if args.steps < 2:
        ap.error("--steps must be at least 2 (one timed, the last recorded)")
    from rlhflab.openmp import apply_default_wait
    apply_default_wait()

    from _common import cpu_name

    a = {**vars(args), "model_dir": str(Path(args.model_dir).resolve())}
    results = {}
    for m in methods:
        t0 = time.perf_counter()
        results[m] = measure(m, a)
        print(f"  {m}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    r0 = results[methods[0]]
    print(f"model {args.model_dir}: V = {r0['vocab']:,}, hidden {r0['hidden']}; {cpu_name()}, {args.threads} threads; "
          f"{args.prompts} prompts x {args.group_size} = {args.prompts * args.group_size} responses of exactly "
          f"{args.max_new_tokens} tokens, full fine-tuning, float32; chunk {r0['chunk_rows']} rows")
    print(f"one float32 (B, T, V) copy of the response logits: {r0['response_rows']} rows x {r0['vocab']:,} x 4 B "
          f"= {r0['full_logits_mib']:.0f} MiB; one chunk: {r0['chunk_rows']} x {r0['vocab']:,} x 4 B = "
          f"{r0['chunk_mib']:.0f} MiB")
    print(f"| method | step s | generate s | forward s | update s | peak MiB above the built run | ru_maxrss MiB "
          f"| largest logits tensor | its MiB | chunk MiB | full logits MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for m, r in results.items():
        ph = r["phases_s"]
        print(f"| {m} | {r['step_s']:.1f} | {ph['generate']:.1f} | {ph['forward']:.1f} | {ph['update']:.1f} | "
              f"{r['peak_mib']:.0f} | {r['process_peak_rss_mib']:.0f} | {tuple(r['max_logits_shape'])} "
              f"({r['max_logits_op']}) | {r['max_logits_mib']:.1f} | {r['chunk_mib']:.0f} | "
              f"{r['full_logits_mib']:.0f} |")
    within = all(r["max_logits_mib"] <= r["chunk_mib"] * 1.0001 for r in results.values())
    print(f"largest logits tensor within one chunk: {'yes' if within else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(final_line(results))
    return 0 if within else 1


if __name__ == "__main__":
    raise SystemExit(main())
