"""One PPO step at the size of a real model, on this CPU: peak memory and time per phase.

    python bench/real_scale.py                      # full fine-tuning, then LoRA
    python bench/real_scale.py --variants lora      # one of them
    python bench/real_scale.py --no-gradient-checkpointing

The model is shaped as Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP
4864, vocabulary 151,936, tied embeddings, q/k/v biases: 494M parameters), built from
transformers' `Qwen2Config` with random weights (no hub) and saved once in
`.bench/qwen2-0.5b-shaped/` (about 2 GB). One PPO step through rlhflab's public pieces
(`build_run`, `collect_rollout`, `run_update`): 8 episodes of 128-token prompts and
exactly 128 sampled tokens (min = max), the GSM8K rule as the reward, a value head, a KL
penalty (0.05, k1) to the reference, one epoch of one 8-episode minibatch, float32
weights and AdamW (fused).

What it measures, its options and its latest figures: bench/README.md; its history: bench/NOTES.md and git.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (the bench folder is not a package)

MODEL_DIR = _common.BENCH_DIR / "qwen2-0.5b-shaped"
QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151_936, max_position_embeddings=32_768,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
PHASES = ("generate", "score", "forward", "update", "update_2")
VARIANTS = ("full", "lora")
GIB = 2**30


# --------------------------------------------------------------------------------------
# The model: Qwen2.5-0.5B's shape, random weights, the project's small BPE tokenizer
# --------------------------------------------------------------------------------------
def build_model(folder: Path, **shape) -> Path:
    """Save a random-weight Qwen2 causal LM of `shape` (default Qwen2.5-0.5B's) and a
    tokenizer to `folder`; the embedding rows beyond the tokenizer's 512 are padding, as in
    real models."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhflab.models.tiny import build_tokenizer

    tok = build_tokenizer(512)
    cfg = Qwen2Config(**{**QWEN2_05B, **shape}, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def prompts(n: int, seed: int = 0) -> list:
    """`n` prompts longer than 128 tokens (eight arithmetic questions each; the run cuts
    them to their last 128), each with the answer of its last question for the reward."""
    from rlhflab.data import arith
    from rlhflab.data.prompts import PromptExample

    rows = arith.make_split(8 * n, seed)
    out = []
    for i in range(n):
        group = rows[8 * i : 8 * i + 8]
        text = "\n".join(f"Question: {r['question']}\nAnswer: {r['answer']}" for r in group[:-1])
        out.append(PromptExample(f"{text}\nQuestion: {group[-1]['question']}\nAnswer:", group[-1]))
    return out


def config(model_dir: Path, variant: str, a) -> object:
    from rlhflab.trainers.ppo import PPORunConfig

    cfg = PPORunConfig()
    m = cfg.model
    m.name_or_path, m.torch_dtype, m.critic = str(model_dir), "float32", "value_head"
    m.gradient_checkpointing = a.gradient_checkpointing
    m.reference = "lora_disabled" if variant == "lora" else "copy"
    cfg.lora.enabled = variant == "lora"
    cfg.dataset.max_prompt_length = a.prompt_len
    g = cfg.generation
    g.max_new_tokens = g.min_new_tokens = a.response_len
    g.temperature, g.top_k, g.top_p = 1.0, 0, 1.0
    p = cfg.ppo
    p.rollout_samples = p.batch_size = p.mini_batch_size = a.episodes
    p.gradient_accumulation_steps, p.epochs = 1, a.epochs
    p.learning_rate, p.kl_coeff, p.kl_estimator = 1e-6, 0.05, "k1"
    cfg.training.device, cfg.training.seed, cfg.training.num_threads = "cpu", 0, a.threads
    cfg.training.mixed_precision = a.mixed_precision
    errors = cfg.check() + cfg.generation.check() + cfg.ppo.check()
    if errors:
        raise SystemExit("real_scale: bad settings: " + "; ".join(errors))
    return cfg


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------
def vocab_meter(vocab_size: int, exclude: set[int]):
    """A TorchDispatchMode counting the bytes held by tensors whose last dimension is
    `vocab_size` (storages in `exclude`, the parameters', left out); `.peak` is the most
    held at one time. A storage is counted once however many views of it exist, until
    the last of them is freed."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    import torch

    class VocabMeter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, views alive]
            self.now = self.peak = 0

        def _release(self, key: int) -> None:
            entry = self.live.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                self.now -= entry[0]
                del self.live[key]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == vocab_size:
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if key in exclude or key == 0:
                        continue
                    if key not in self.live:
                        self.live[key] = [storage.nbytes(), 0]
                        self.now += storage.nbytes()
                        self.peak = max(self.peak, self.now)
                    self.live[key][1] += 1
                    weakref.finalize(t, self._release, key)
            return out

    return VocabMeter()


class PhaseTimer:
    """rlhflab's Timer plus the peak resident set of each phase (the kernel's mark reset
    as the phase starts), above `baseline`."""

    def __init__(self, baseline: float, resettable: bool):
        from rlhflab.trainers.common import Timer
        self.timer, self.baseline, self.resettable = Timer(), baseline, resettable
        self.peak_mb: dict[str, float] = {}
        self.seconds = self.timer.seconds

    def __call__(self, name: str):
        from contextlib import contextmanager

        @contextmanager
        def phase():
            if self.resettable:
                _common.reset_peak_rss()
            with self.timer(name):
                yield
            self.peak_mb[name] = max(self.peak_mb.get(name, 0.0), _common.peak_rss_mb() - self.baseline)
        return phase()

    def metrics(self) -> dict[str, float]:
        return self.timer.metrics()


def prime(variant: str, a) -> None:
    """One step of the same variant on a small Qwen2 (hidden 64, 2 layers, the full
    vocabulary), so the modules that torch and transformers load lazily are loaded before
    the baseline; thrown away."""
    from rlhflab.trainers import ppo
    from rlhflab.trainers.loop import build_run, run_update

    with tempfile.TemporaryDirectory() as tmp:
        small = build_model(Path(tmp) / "small", hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=128)
        b = argparse.Namespace(**{**vars(a), "episodes": 2, "prompt_len": 16, "response_len": 4})
        cfg = config(small, variant, b)
        run = build_run(cfg, ppo.method(cfg))
        roll = ppo.collect_rollout(run, prompts(2), PhaseTimer(0.0, False))
        run_update(run, roll, 1)
    del run, roll


def worker(variant: str, a) -> dict:
    """Run one variant in this process; returns the measurements."""
    import torch

    from rlhflab.trainers import ppo
    from rlhflab.trainers.loop import build_run, run_update

    torch.set_num_threads(a.threads)
    prime(variant, a)
    _common.release_freed_memory()
    baseline = _common.rss_mb()
    resettable = _common.reset_peak_rss()
    t0 = time.perf_counter()
    cfg = config(Path(a.model_dir), variant, a)
    torch.manual_seed(0)
    run = build_run(cfg, ppo.method(cfg))
    build = {"seconds": time.perf_counter() - t0, "rss_mb": _common.rss_mb() - baseline,
             "peak_mb": _common.peak_rss_mb() - baseline}
    actor = run.models.actor
    trainable = sum(p.numel() for p in actor.trainable_parameters())
    params = [p for m in (actor, run.models.reference and run.models.reference.model) if m is not None
              for p in m.parameters()]
    exclude = {p.untyped_storage().data_ptr() for p in params}
    vocab = run.models.policy.get_output_embeddings().weight.shape[0]
    before = {n: p.detach().clone() for n, p in actor.named_parameters() if p.requires_grad and p.numel() < 2**20}
    timer = PhaseTimer(baseline, resettable)
    meter = vocab_meter(vocab, exclude) if a.logits_meter else None
    if resettable:
        _common.reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    with meter if meter is not None else _nullcontext():
        roll = ppo.collect_rollout(run, prompts(a.episodes), timer)
        with timer("update"):
            upd = run_update(run, roll, 1)
    step_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    if a.second_update:
        # A run's later optimizer steps hold Adam's moments from the start of their
        # backward pass; the first creates them only after it. Outside the meter: under a
        # Python dispatch mode autograd sums a tied weight's two gradients out of place.
        with timer("update_2"):
            run_update(run, roll, 2)
    peak = max(timer.peak_mb.values())  # every part of the step is inside a phase
    moved = sum(int(not torch.equal(p, dict(actor.named_parameters())[n])) for n, p in before.items())
    return {
        "variant": variant, "baseline_rss_mb": baseline, "build": build, "trainable_params": trainable,
        "phases_s": {k: timer.seconds.get(k, 0.0) for k in PHASES}, "phase_peak_mb": timer.peak_mb,
        "step_s": step_s, "cpu_s": cpu_s, "peak_mb": peak, "process_peak_rss_mb": _common.lifetime_peak_rss_mb(),
        "logits_peak_mb": meter.peak / 2**20 if meter is not None else float("nan"),
        "response_tokens": int(roll.response_mask.sum()), "prompt_width": int(roll.prompt_ids.shape[1]),
        "loss_total": upd["loss/total"], "small_tensors_moved": moved, "resettable": resettable,
    }


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------
def mem_available_gib() -> float:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def run_worker(variant: str, a) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--model-dir", str(a.model_dir), "--threads", str(a.threads),
           "--episodes", str(a.episodes), "--prompt-len", str(a.prompt_len), "--response-len", str(a.response_len),
           "--epochs", str(a.epochs), "--mixed-precision", a.mixed_precision]
    cmd += [] if a.second_update else ["--no-second-update"]
    cmd += [] if a.gradient_checkpointing else ["--no-gradient-checkpointing"]
    cmd += [] if a.logits_meter else ["--no-logits-meter"]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
           "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"real_scale: the {variant} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(results: dict[str, dict], a) -> str:
    lines = [f"one PPO step, Qwen2.5-0.5B-shaped (494M parameters, random weights), {a.episodes} episodes x "
             f"{a.prompt_len}-token prompts x {a.response_len} sampled tokens, {a.epochs} epoch(s) of one minibatch, "
             f"value head, KL 0.05, float32 weights (mixed_precision {a.mixed_precision}), gradient checkpointing "
             f"{'on' if a.gradient_checkpointing else 'off'}, {a.threads} threads, CPU",
             "memory: peak RSS above the warmed-up, post-import baseline, GiB", "",
             f"{'variant':<6} {'trainable':>11} {'build GiB':>9} {'peak GiB':>8} {'step s':>7} {'cpu s':>7} "
             + " ".join(f"{p + ' s':>10}" for p in PHASES) + f" {'logits MiB':>10} {'share':>6}"]
    for name, r in results.items():
        lines.append(f"{name:<6} {r['trainable_params']:>11,} {r['build']['rss_mb'] / 1024:>9.2f} "
                     f"{r['peak_mb'] / 1024:>8.2f} {r['step_s']:>7.1f} {r['cpu_s']:>7.1f} "
                     + " ".join(f"{r['phases_s'][p]:>10.1f}" for p in PHASES)
                     + f" {r['logits_peak_mb']:>10.1f} {r['logits_peak_mb'] / r['peak_mb']:>6.1%}")
    lines += ["", "peak GiB per phase (above the baseline)",
              f"{'variant':<6} " + " ".join(f"{p:>10}" for p in PHASES)]
    for name, r in results.items():
        lines.append(f"{name:<6} " + " ".join(f"{r['phase_peak_mb'].get(p, float('nan')) / 1024:>10.2f}"
                                              for p in PHASES))
    lines += ["", "update_2: a second optimizer step on the same rollout (a second PPO epoch), Adam's moments "
              "alive from its start, as in every step of a run after the first; peak GiB is the most of all phases",
              "build GiB: RSS after loading the policy, value head and reference (and, for full, before Adam's "
              "moments exist: they are made at the first optimizer step)",
              "logits MiB: most bytes held at once by tensors whose last dimension is the vocabulary "
              "(chunks of the log-prob op, generation's next-token logits); share: of the step's peak"]
    for name, r in results.items():
        lines.append(f"{name}: {r['response_tokens']} response tokens, prompts {r['prompt_width']} wide, "
                     f"{r['small_tensors_moved']} small trainable tensors changed by the step, loss/total "
                     f"{r['loss_total']:.4f}")
    return "\n".join(lines)


def final_line(results: dict[str, dict]) -> str:
    nan = {"peak_mb": float("nan"), "step_s": float("nan")}
    full, lora = results.get("full", nan), results.get("lora", nan)
    return (f"real_scale: qwen2-0.5b-shaped full peak_gib {full['peak_mb'] / 1024:.2f} step_s "
            f"{full['step_s']:.1f}, lora peak_gib {lora['peak_mb'] / 1024:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="full,lora", help="comma-separated, from full, lora (default: both)")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--response-len", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mixed-precision", choices=["no", "bf16"], default="no")
    ap.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false",
                    help="keep every activation (default: model.gradient_checkpointing on)")
    ap.add_argument("--no-second-update", dest="second_update", action="store_false",
                    help="skip the second optimizer step on the same rollout (default: taken, and in the peak)")
    ap.add_argument("--no-logits-meter", dest="logits_meter", action="store_false",
                    help="skip the exact count of vocabulary-sized tensors (it adds a Python call per op)")
    ap.add_argument("--model-dir", default=str(MODEL_DIR), help="built there when missing")
    ap.add_argument("--min-free-gib", type=float, default=13.0,
                    help="refuse to start with less MemAvailable than this (full fine-tuning needs ~12 GiB)")
    ap.add_argument("--json", default=None, help="also write the raw measurements here")
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a)))
        return 0
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: choose from {', '.join(VARIANTS)}")
    free = mem_available_gib()
    if "full" in variants and free < a.min_free_gib:
        print(f"real_scale: only {free:.1f} GiB of memory available (MemAvailable); full fine-tuning needs about "
              f"12 GiB. Run it when the machine is quieter, or --variants lora", file=sys.stderr)
        return 3
    if not (Path(a.model_dir) / "config.json").is_file():
        print(f"real_scale: building the model in {a.model_dir} (about 2 GB, once)", file=sys.stderr)
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                        f"import real_scale; real_scale.build_model(__import__('pathlib').Path({a.model_dir!r}))"],
                       check=True)
    print(f"real_scale: {', '.join(variants)}; MemAvailable {free:.1f} GiB, load average "
          f"{os.getloadavg()[0]:.1f} ({_common.cpu_count()} CPUs)", file=sys.stderr)
    results = {}
    for v in variants:
        results[v] = run_worker(v, a)
        print(f"  {v}: peak {results[v]['peak_mb'] / 1024:.2f} GiB, step {results[v]['step_s']:.1f} s", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    print(report(results, a))
    print(final_line(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
