"""Does each CPU-only speed trick earn its place on a real model? A/B on SmolLM2-135M-Instruct.

    python bench/cpu_tricks.py                              # every trick, 2 rounds, 2 threads
    python bench/cpu_tricks.py --tricks lean_norm --methods grpo --repeats 1 --steps 1

The tricks of the CPU seam (rlhflab/cpu/), each as side A (on) and side B (off):

    cpu_matmul      model.cpu_matmul=onednn (FastLinear on oneDNN)  vs  =torch (MKL)
    lean_norm       model.lean_norm=true (the hand-written RMSNorm)  vs  false (the model's own)
    critic_overlap  model.critic_overlap=true (the separate critic's pass in a second
                    thread)  vs  false (one pass after the other); the separate-critic config only
    mallopt         model.cpu_allocator=release: glibc's mmap threshold pinned at 4 MiB
                    (`rlhflab.cpu.map_large_allocations`)  vs  glibc's default (the call skipped)
    cpu_allocator   model.cpu_allocator=reuse (freed blocks below 256 MiB kept in glibc's heap
                    for the next allocation, `rlhflab.cpu.reuse_freed_blocks`)  vs  =release
    fast_draw       generation.fast_draw=true (sampled tokens drawn by inverse transform,
                    ops/sampling.py)  vs  false (generate's torch.multinomial); both sides
                    generate with the hf backend (the shipped PPO and GRPO configs use vLLM)

and one setting outside the seam that a CPU user may want to try:

    eager_attention model.attn_implementation=eager (transformers' matmul-and-softmax
                    attention)  vs  =sdpa (its default: torch's scaled_dot_product_attention)

Each round runs side A, then side B (the order alternates between rounds: A,B then B,A),
each in a fresh process running `rlhflab <method>` on the repo's SmolLM2 config
(configs/ppo_smollm2.yaml, ppo_smollm2_critic.yaml, grpo_smollm2.yaml) with `--episodes`
episodes per step, 1 warm-up step and `--steps` timed steps, no evaluation, seed 0. A
step's time is the run's own `time/step` (rollout, scoring, update); `update s` is the
median of its `time/update` (the optimisation passes alone, where the tricks act most). Interleaving the
sides puts a shared machine's load on both alike; the table says what the load was
(the 1-minute load average, sampled every 5 s while the processes ran; our own process
counts in it, about `--threads`).

Numerics, per trick and method: the loss, gradient norm and mean response length of the
first and the last step of each side's first run (same seed: the same rollout unless the
sampled tokens diverge, which `resp len` shows; `step1 |dA-B|` is the first step's gap), and `probe` (cpu_matmul, lean_norm) the largest
difference of log-probs and of one weight's gradient over a fixed random batch of 4 x 96
tokens through the model with the trick on and off (`n/a` for the tricks that cannot change
a forward pass). `peak MiB` is the process's peak resident set (ru_maxrss), median over rounds.

The last line: `cpu_tricks: <trick>/<method> ratio R ...` (median s/step on / off: below
1 the trick is faster; the rule in docs/cpu_matmul.md keeps a trick on by default only
where it saves at least 10% of step time or of memory).

Needs outputs/models/smollm2-135m-instruct (`rlhflab fetch-model smollm2`); the configs'
task, outputs/wordproblems-easy, is written when missing (as `rlhflab make-data --task
word-problems --level easy --out outputs/wordproblems-easy` writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _mfu import cpu_name  # noqa: E402  (bench/_mfu.py: no torch import)

MODEL = REPO / "outputs/models/smollm2-135m-instruct"
DATA = REPO / "outputs/wordproblems-easy"  # the dataset folder of every config in CONFIGS
CONFIGS = {"ppo": ("ppo", "configs/ppo_smollm2.yaml"),
           "ppo_critic": ("ppo", "configs/ppo_smollm2_critic.yaml"),
           "grpo": ("grpo", "configs/grpo_smollm2.yaml")}
# trick -> (side A overrides, side B overrides, methods it is measured on by default)
TRICKS = {
    "cpu_matmul": (["model.cpu_matmul=onednn"], ["model.cpu_matmul=torch"], ("ppo", "grpo")),
    "lean_norm": (["model.lean_norm=true"], ["model.lean_norm=false"], ("ppo", "grpo")),
    "critic_overlap": (["model.critic_overlap=true"], ["model.critic_overlap=false"], ("ppo_critic",)),
    "mallopt": (["model.cpu_allocator=release"], ["model.cpu_allocator=release", "+no-mallopt"], ("grpo",)),
    "cpu_allocator": (["model.cpu_allocator=reuse"], ["model.cpu_allocator=release"], ("ppo", "ppo_critic", "grpo")),
    "fast_draw": (["generation.fast_draw=true", "generation.backend=hf"],
                  ["generation.fast_draw=false", "generation.backend=hf"], ("ppo", "grpo")),
    "eager_attention": (["model.attn_implementation=eager"], ["model.attn_implementation=sdpa"],
                        ("ppo_critic", "grpo")),
}
PROBED = ("cpu_matmul", "lean_norm")


# --------------------------------------------------------------------------------------
# The child: one training run (and the probe) in a fresh process
# --------------------------------------------------------------------------------------
def child(spec: dict) -> int:
    overrides = [o for o in spec["overrides"] if not o.startswith("+")]
    if "+no-mallopt" in spec["overrides"]:
        import rlhflab.cpu

        rlhflab.cpu.map_large_allocations = lambda *a, **k: False  # glibc's own threshold
    import rlhflab.cpu

    applied, plain_apply = [], rlhflab.cpu.apply

    def apply(module, *a, **k):  # record what the seam changed on each model
        result = plain_apply(module, *a, **k)
        applied.append(result._asdict())
        return result

    rlhflab.cpu.apply = apply
    from rlhflab.cli import main

    rc = main([spec["command"], "--config", spec["config"], *overrides])
    (Path(spec["out"]) / "applied.json").write_text(json.dumps(applied))
    if rc == 0 and spec.get("probe"):
        probe(spec["probe"], overrides, Path(spec["out"]) / "probe.pt")
    return rc


def probe(trick: str, overrides: list[str], path: Path) -> None:
    """Log-probs and one weight's gradient of a fixed random batch, the trick as `overrides` set it."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    import rlhflab.cpu as cpu

    cfg = SimpleNamespace(cpu_matmul="torch", lean_norm=False, critic_overlap=False)
    for o in overrides:
        key, _, value = o.partition("=")
        if key in ("model.cpu_matmul", "model.lean_norm"):
            setattr(cfg, key.split(".")[1], value if key.endswith("matmul") else value == "true")
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    device = torch.device("cpu")
    cpu.setup_process(device, cfg)
    cpu.apply(model, cfg, device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 96), generator=g)  # (B, L)
    logits = model(input_ids=ids).logits[:, :-1]  # (B, L-1, V)
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, L-1)
    logprobs.mean().backward()
    weight = model.model.layers[0].self_attn.q_proj.weight
    torch.save({"logprobs": logprobs.detach(), "grad": weight.grad.detach()}, path)


# --------------------------------------------------------------------------------------
# The parent
# --------------------------------------------------------------------------------------
class Run:
    def __init__(self, side, seconds, update, first, last, peak_mib, loads, probe_path, applied):
        self.side, self.seconds, self.update, self.first, self.peak_mib = side, seconds, update, first, peak_mib
        self.last = last
        self.loads, self.probe_path, self.applied = loads, probe_path, applied


def run_side(trick, method, side, overrides, args, workdir: Path, tag: str) -> Run:
    command, config = CONFIGS[method]
    out = workdir / tag
    episodes = args.episodes
    sizes = ([f"ppo.rollout_samples={episodes}", f"ppo.batch_size={episodes}"] if command == "ppo" else
             [f"grpo.prompts_per_step={episodes // 8}", f"grpo.batch_size={episodes}"])
    spec = {"command": command, "config": config, "out": str(out),
            "probe": trick if trick in PROBED else None,
            "overrides": [*overrides, *sizes, f"training.total_steps={1 + args.steps}",
                          "training.eval_interval=0", f"training.num_threads={args.threads}", "generation.backend=hf",
                          f"training.output_dir={out}", "training.overwrite=true"]}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    log = open(workdir / f"{tag}.log", "w")
    proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    loads = [os.getloadavg()[0]]
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        time.sleep(5)
        loads.append(os.getloadavg()[0])
    proc.returncode = os.waitstatus_to_exitcode(status)
    log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{trick}/{method} side {side} failed (rc {proc.returncode}); see {workdir / tag}.log")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "time/step" in r]
    return Run(side, [r["time/step"] for r in steps[1:]], [r["time/update"] for r in steps[1:]], steps[0], steps[-1], usage.ru_maxrss / 1024, loads,
               out / "probe.pt" if spec["probe"] else None, json.loads((out / "applied.json").read_text()))


def probe_diff(a: Run, b: Run) -> str:
    if a.probe_path is None:
        return "n/a"
    import torch

    pa, pb = torch.load(a.probe_path), torch.load(b.probe_path)
    dl = (pa["logprobs"] - pb["logprobs"]).abs().max().item()
    dg = ((pa["grad"] - pb["grad"]).abs().max() / pb["grad"].abs().max()).item()
    return f"logprob {dl:.1e}, grad {dg:.1e} (rel. to max)"


def stats(xs):
    return min(xs), statistics.median(xs), max(xs)


def report(trick, method, runs: list[Run]) -> float:
    a = [r for r in runs if r.side == "A"]
    b = [r for r in runs if r.side == "B"]
    sa = [s for r in a for s in r.seconds]
    sb = [s for r in b for s in r.seconds]
    loads = [x for r in runs for x in r.loads]
    ratio = statistics.median(sa) / statistics.median(sb)
    print(f"\n== {trick} / {method}  (A = on, B = off; {len(a)} rounds, {len(sa)} timed steps a side; "
          f"load avg {statistics.mean(loads):.1f} mean, {min(loads):.1f}-{max(loads):.1f})")
    print(f"  {'side':<6}{'s/step min':>11}{'median':>9}{'max':>9}{'update s':>10}{'peak MiB':>10}"
          "  loss, grad norm, resp len: step 1 | last step")
    for name, rs, ss in (("A on", a, sa), ("B off", b, sb)):
        f1 = rs[0].first
        lo, md, hi = stats(ss)
        update = statistics.median(u for r in rs for u in r.update)
        print(f"  {name:<6}{lo:>11.2f}{md:>9.2f}{hi:>9.2f}{update:>10.2f}{statistics.median(r.peak_mib for r in rs):>10.0f}"
              f"  {f1['loss/total']:.6f}, {f1['params/grad_norm']:.5f}, {f1['rollout/response_length']:.3f} | "
              f"{rs[0].last['loss/total']:.6f}, {rs[0].last['params/grad_norm']:.5f}, "
              f"{rs[0].last['rollout/response_length']:.3f}")
    for name, r in (("A", a[0]), ("B", b[0])):
        changed = "; ".join(", ".join(f"{k} {v}" for k, v in d.items()) for d in r.applied)
        print(f"  the seam changed, side {name}: {changed or 'nothing'}  (one entry per model)")
    fa, fb = a[0].first, b[0].first
    print(f"  ratio of medians A/B {ratio:.3f} ({(1 - ratio) * 100:+.1f}% step time saved by the trick); "
          f"step1 |dA-B| loss {abs(fa['loss/total'] - fb['loss/total']):.1e}, "
          f"grad norm {abs(fa['params/grad_norm'] - fb['params/grad_norm']):.1e}; probe: {probe_diff(a[0], b[0])}")
    return ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--tricks", nargs="+", choices=list(TRICKS), default=list(TRICKS))
    parser.add_argument("--methods", nargs="+", choices=list(CONFIGS),
                        help="the methods to measure each trick on (default: the trick's own list)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of A,B (alternating order)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run, after 1 warm-up step")
    parser.add_argument("--episodes", type=int, default=16, help="episodes per step (a multiple of 8)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (training.num_threads)")
    parser.add_argument("--workdir", default=None, help="where the runs write (default: a temporary folder)")
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.episodes % 8 or args.episodes < 8:
        parser.error("--episodes must be a positive multiple of 8 (mini_batch_size 8, GRPO groups of 8)")
    if not (MODEL / "config.json").is_file():
        sys.exit(f"cpu_tricks: no model at {MODEL}; run `rlhflab fetch-model smollm2` first")
    if not all((DATA / f).is_file() for f in ("train.jsonl", "test.jsonl")):
        from rlhflab.data.wordproblems import write_task

        print(f"cpu_tricks: writing the word-problem task (easy level) to {DATA}", flush=True)
        write_task(DATA, level="easy")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="cpu_tricks-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"cpu_tricks: {cpu_name()}, {os.cpu_count()} CPUs, "
          f"{args.threads} threads, {args.episodes} episodes/step, 1 warm-up + {args.steps} timed steps, "
          f"{args.repeats} rounds; runs in {workdir}")
    summary = []
    for trick in args.tricks:
        on, off, methods = TRICKS[trick]
        for method in args.methods or methods:
            runs = []
            try:
                for r in range(args.repeats):
                    order = (("A", on), ("B", off)) if r % 2 == 0 else (("B", off), ("A", on))
                    for side, overrides in order:
                        runs.append(run_side(trick, method, side, overrides, args, workdir, f"{trick}-{method}-{r}{side}"))
            except RuntimeError as exc:  # the other tricks still run
                print(f"\n== {trick} / {method}: {exc}")
                summary.append(f"{trick}/{method} failed")
                continue
            summary.append(f"{trick}/{method} ratio {report(trick, method, runs):.3f}")
            sys.stdout.flush()
    print("\ncpu_tricks: " + ", ".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
