"""PPO throughput and peak memory: rlhflab beside TRL 1.12.0, same model and settings.

    python bench/ppo_throughput.py                 # full run (see --help for the knobs)
    python bench/ppo_throughput.py --sides rlhflab # rlhflab only, no TRL needed
    python bench/ppo_throughput.py --model-dir outputs/models/smollm2-135m-instruct  # the real model
                                                   # (sides one at a time, see --sequential)
    python bench/ppo_throughput.py --device cuda [--mixed-precision bf16] [--peak-tflops T]
                                                   # on a GPU: sides one at a time, peak CUDA memory

Prints a table (episodes/s, seconds and tokens/s per phase, peak memory) and, last, the
line `ppo_throughput: rlhflab X eps/s, trl Y eps/s, speed ratio Z, memory ratio W, critic
speed ratio Z2, critic memory ratio W2` (ratios are rlhflab / TRL in float32: Z, W with
rlhflab's value head, Z2, W2 with its separate critic, like for like; a side that did not
run reads nan). The bfloat16-autocast pair (TRL's PPOConfig default) is in the table, and
above the last line one line per side gives seconds, model FLOPs and MFU of generate,
forward (no-grad scoring) and update against the float32 peak measured here (bench/_common.py;
on CUDA the GPU's matmul peak in the run's precision, or --peak-tflops).

What it measures, its options and its latest figures: bench/README.md; its history: bench/NOTES.md and git.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (the bench folder is not a package)

TRL_VERSION = "1.12.0"
TRL_DIR = _common.BENCH_DIR / "trl"
TRL_INSTALL = (f"{_common.REPO / '.venv/bin/pip'} install --no-deps --target {TRL_DIR} "
               f"trl=={TRL_VERSION}")
# name: (label, precision). fp32: everything float32; bf16: bfloat16 autocast of the forward
# passes with float32 weights on both sides (rlhflab's training.mixed_precision=bf16,
# TRL's PPOConfig bf16=True, its default).
SIDES = {
    "rlhflab": ("rlhflab (value head)", "fp32"),
    "rlhflab-critic": ("rlhflab (separate critic)", "fp32"),
    # the same with cpu.matmul=torch: PyTorch's own float32 matmul (MKL), as TRL runs
    "rlhflab-critic-torchmm": ("rlhflab (separate critic), torch mm", "fp32"),
    # generation.old_logprobs=sampler: the old log-probs from the draw, no policy pass in scoring (as TRL)
    "rlhflab-critic-samplerlp": ("rlhflab critic, sampler lp", "fp32"),
    "rlhflab-critic-torchmm-samplerlp": ("rlhflab critic, torch mm, sampler lp", "fp32"),
    "trl": (f"trl {TRL_VERSION} (experimental.ppo)", "fp32"),
    "rlhflab-critic-bf16": ("rlhflab (separate critic) bf16", "bf16"),
    "trl-bf16": (f"trl {TRL_VERSION} bf16", "bf16"),
    "rlhflab-bf16": ("rlhflab (value head) bf16", "bf16"),
    "rlhflab-bf16-weights": ("rlhflab (value head) bf16 weights", "bf16-weights"),  # model.torch_dtype
    # bf16 autocast with model.attn_implementation=eager (the CPU's bf16 SDPA backward is slow)
    "rlhflab-bf16-eager": ("rlhflab (value head) bf16, eager attention", "bf16"),
}
DEFAULT_SIDES = ("rlhflab", "rlhflab-critic", "rlhflab-critic-torchmm", "trl", "rlhflab-critic-bf16", "trl-bf16")
LABELS = {name: label for name, (label, _) in SIDES.items()}
PHASES = ("generate", "score", "forward", "update", "other")
SEQUENTIAL_ABOVE = 50_000_000  # parameters: above this the sides run one at a time (--sequential)


@dataclass
class BenchSettings:
    """The algorithm settings both sides share."""

    model_dir: str
    episodes: int = 32          # episodes per PPO step (prompts generated at once)
    response_length: int = 16   # new tokens per response, fixed (min = max)
    epochs: int = 4             # PPO epochs over the step's episodes
    learning_rate: float = 1e-5
    kl_coeff: float = 0.05      # KL penalty in the reward, k1 estimator, frozen-copy reference
    vf_coeff: float = 0.1
    clip_eps: float = 0.2
    value_clip: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    temperature: float = 1.0
    threads: int = 2
    seed: int = 0
    device: str = "cpu"         # cpu or cuda (--device)
    mixed_precision: str = "no"  # bf16: every float32 side in bfloat16 autocast (--mixed-precision)
    hf_cache: str = "dynamic"  # rlhflab's generation.hf.cache (--hf-cache)
    compile_layers: bool = False  # rlhflab's model.compile_layers (--compile-layers)
    attn: str | None = None  # the attention of every side's models (--attn-implementation; None: transformers')


# --------------------------------------------------------------------------------------
# rlhflab: driven through its public PPO pieces, config set by code
# --------------------------------------------------------------------------------------
class RlhflabSide:
    """rlhflab's PPO step: `collect_rollout` (phases 1-4) then `ppo_update` (phase 5)."""

    def __init__(self, s: BenchSettings, critic: str = "value_head", precision: str = "fp32",
                 cpu_matmul: str = "auto", attn: str | None = None, old_logprobs: str = "recompute"):
        import torch  # noqa: F401  (imported before the memory baseline)

        from rlhflab.trainers import ppo  # noqa: F401
        self.s, self.critic, self.precision, self.cpu_matmul = s, critic, precision, cpu_matmul
        self.attn = attn  # model.attn_implementation (None: transformers' default)
        self.old_logprobs = old_logprobs  # generation.old_logprobs

    def config(self):
        from rlhflab.trainers.ppo import PPORunConfig

        s, cfg = self.s, PPORunConfig()
        cfg.model.name_or_path = s.model_dir
        cfg.model.torch_dtype = "bfloat16" if self.precision == "bf16-weights" else "float32"
        cfg.model.gradient_checkpointing, cfg.model.critic, cfg.model.reference = False, self.critic, "copy"
        cfg.cpu.matmul, cfg.model.attn_implementation = self.cpu_matmul, self.attn or s.attn
        cfg.model.compile_layers = s.compile_layers
        cfg.lora.enabled = False
        cfg.dataset.max_prompt_length = 128
        g = cfg.generation
        g.max_new_tokens = g.min_new_tokens = s.response_length
        g.temperature, g.top_k, g.top_p = s.temperature, 0, 1.0
        g.hf.cache = s.hf_cache
        g.old_logprobs = self.old_logprobs
        cfg.reward.missing_eos_penalty, cfg.reward.score_clip = None, None
        p = cfg.ppo
        p.rollout_samples = p.batch_size = p.mini_batch_size = s.episodes
        p.gradient_accumulation_steps, p.epochs = 1, s.epochs
        p.learning_rate, p.lr_schedule, p.warmup_steps, p.weight_decay = s.learning_rate, "constant", 0, 0.0
        p.max_grad_norm = None  # TRL's PPO loop does not clip gradients
        p.kl_coeff, p.kl_estimator, p.kl_in = s.kl_coeff, "k1", "reward"
        p.vf_coeff, p.entropy_coeff, p.clip_eps, p.value_clip = s.vf_coeff, 0.0, s.clip_eps, s.value_clip
        p.dual_clip, p.gamma, p.lam = None, s.gamma, s.lam
        p.whiten_advantages, p.whiten_rewards, p.loss_aggregation = True, False, "token_mean"
        cfg.training.device, cfg.training.seed, cfg.training.num_threads = s.device, s.seed, s.threads
        cfg.training.mixed_precision = "bf16" if self.precision == "bf16" else "no"
        errors = cfg.check() + cfg.generation.check() + cfg.ppo.check()  # what the YAML loader would say
        if errors:
            raise ValueError("bench config: " + "; ".join(errors))
        return cfg

    def build(self) -> dict:
        from rlhflab.data.prompts import PromptExample
        from rlhflab.trainers import ppo
        from rlhflab.trainers.common import make_optimizer, make_scheduler
        from rlhflab.trainers.loop import build_run

        self.release()
        self.cfg = cfg = self.config()
        self.run = build_run(cfg, ppo.method(cfg))
        self.models = self.run.models
        p = cfg.ppo
        params = self.models.actor.trainable_parameters()
        self.optimizer = self.run.optimizer = make_optimizer(params, p.learning_rate, p.weight_decay,
                                                             (p.adam_beta1, p.adam_beta2), p.adam_eps)
        self.scheduler = self.run.scheduler = make_scheduler(self.optimizer, 10_000, 0, "constant")
        rows = _common.bench_rows(self.s.episodes, self.s.seed)
        self.examples = [PromptExample(_common.format_bench_prompt(r["question"]), r) for r in rows]
        self.step_idx = 0
        return {"trainable_params": sum(x.numel() for x in params)}

    def release(self) -> None:
        self.run = self.models = self.optimizer = self.scheduler = None
        _common.release_freed_memory()

    def state_tensors(self) -> list:
        """Every tensor held between steps: weights (policy, critic, reference) and optimizer state."""
        mods = [self.models.actor] + ([self.models.reference.model] if self.models.reference else [])
        return _held_tensors(mods, self.optimizer)

    def step(self) -> dict:
        from rlhflab.trainers import ppo
        from rlhflab.trainers.common import Timer
        from rlhflab.trainers.loop import run_update

        self.step_idx += 1
        timer = Timer()  # synchronizes CUDA around each phase itself
        t0 = _common.clock()
        roll = ppo.collect_rollout(self.run, self.examples, timer)
        with timer("update"):
            run_update(self.run, roll, self.step_idx)
        total = _common.clock() - t0
        phases = {k: timer.seconds.get(k, 0.0) for k in PHASES[:-1]}
        phases["other"] = total - sum(phases.values())
        return {"total": total, **phases, "episodes": len(roll),
                "tokens": int(roll.response_mask.sum()), "response_width": roll.response_ids.shape[1]}

    def counted_step(self) -> dict:
        """The step whose tensors the profiler counts."""
        return self.step()


# --------------------------------------------------------------------------------------
# TRL 1.12.0 experimental PPO, with the rule reward wrapped as a reward "model"
# --------------------------------------------------------------------------------------
def _import_trl():
    """trl from .bench/trl (never from the project environment); exits with the install command."""
    if str(TRL_DIR) not in sys.path:
        sys.path.insert(0, str(TRL_DIR))
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        import trl
        from trl.experimental.ppo import ppo_trainer
    except ImportError as exc:
        raise SystemExit(f"ppo_throughput: cannot import trl.experimental.ppo from {TRL_DIR} ({exc}); "
                         f"install it with:\n  {TRL_INSTALL}") from None
    if trl.__version__ != TRL_VERSION:
        raise SystemExit(f"ppo_throughput: {TRL_DIR} holds trl {trl.__version__}, not {TRL_VERSION}; "
                         f"reinstall with:\n  {TRL_INSTALL} --upgrade")
    return ppo_trainer


def trl_installed() -> str | None:
    """The version of trl in .bench/trl, or None (read from its metadata; imports nothing)."""
    from importlib import metadata
    for dist in metadata.distributions(path=[str(TRL_DIR)]):
        if dist.metadata["Name"] == "trl":
            return dist.version
    return None


def make_rule_reward_module(tokenizer, answers: dict[str, str], separator: str = "\nAnswer:"):
    """The GSM8K rule reward as the module TRL's `get_reward` expects.

    `get_reward(model, ...)` runs ``getattr(model, model.base_model_prefix)`` on the
    padded prompt+response ids and reads ``model.score(output.hidden_states[-1])`` at
    each row's last real token. Here the "backbone" decodes each row's real tokens,
    splits the prompt (ending at `separator`, as the template makes it) from the
    response, applies rlhflab's `gsm8k` rule with the prompt's answer, and returns the
    score at every position; `score` is the identity.
    """
    import torch
    from torch import nn

    from rlhflab.rewards import resolve_rule

    rule = resolve_rule("gsm8k")

    class _Output:
        def __init__(self, hidden):
            self.hidden_states = (hidden,)

    class RuleBackbone(nn.Module):
        def forward(self, input_ids, attention_mask, **_ignored):
            rewards = []
            for ids, keep in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
                text = tokenizer.decode([t for t, k in zip(ids, keep, strict=True) if k],
                                        skip_special_tokens=True)
                head, sep, response = text.partition(separator)
                prompt = head + sep
                rewards.append(float(rule(prompt, response, {"answer": answers[prompt]})))
            score = torch.tensor(rewards, dtype=torch.float32, device=input_ids.device)  # (B,)
            return _Output(score[:, None, None].expand(*input_ids.shape, 1))                # (B, L, 1)

    class RuleRewardModel(nn.Module):
        base_model_prefix = "backbone"

        def __init__(self):
            super().__init__()
            self.backbone = RuleBackbone()
            self.score = nn.Identity()

    return RuleRewardModel()


def load_trl_models(s: BenchSettings):
    """TRL's side's policy and value model, float32, with --attn-implementation's attention
    (as rlhflab's sides) when given."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    attn = {"attn_implementation": s.attn} if s.attn else {}
    policy = AutoModelForCausalLM.from_pretrained(s.model_dir, dtype=torch.float32, **attn)
    value_model = AutoModelForSequenceClassification.from_pretrained(s.model_dir, num_labels=1,
                                                                     dtype=torch.float32, **attn)
    return policy, value_model


class TrlSide:
    """One call of `PPOTrainer.train()` per step (total_episodes = one batch).

    Phase times come from wrapping the module-level functions TRL's loop calls
    (`batch_generation`, `get_reward`, `forward`) and from callbacks; the step is timed
    from `on_train_begin` to `on_train_end`, so per-run set-up is not counted.
    """

    def __init__(self, s: BenchSettings, precision: str = "fp32"):
        import torch  # noqa: F401
        import transformers  # noqa: F401

        from rlhflab.rewards import resolve_rule  # noqa: F401
        self.trl_ppo = trl_ppo = _import_trl()
        import datasets  # noqa: F401
        self.s, self.trainer, self.reward, self.precision = s, None, None, precision
        self.marks: dict = {}
        marks, wrapper_type = self.marks, trl_ppo.PolicyAndValueWrapper
        orig_gen, orig_reward, orig_forward = (trl_ppo.batch_generation, trl_ppo.get_reward, trl_ppo.forward)

        def batch_generation(model, queries, *a, **k):
            t = _common.clock()
            out = orig_gen(model, queries, *a, **k)
            marks["generate_end"] = end = _common.clock()
            marks["generate"] = marks.get("generate", 0.0) + end - t
            marks["response_width"] = out[0].shape[1] - queries.shape[1]  # (query_responses, logits)
            return out

        def get_reward(model, *a, **k):
            t = _common.clock()
            out = orig_reward(model, *a, **k)
            if model is self.reward:
                marks["score"] = marks.get("score", 0.0) + _common.clock() - t
            return out

        def forward(model, *a, **k):
            if isinstance(model, wrapper_type):  # the policy+value pass of the update
                if "update_start" not in marks:
                    marks["update_start"] = _common.clock()
            return orig_forward(model, *a, **k)

        trl_ppo.batch_generation, trl_ppo.get_reward, trl_ppo.forward = batch_generation, get_reward, forward

    def build(self) -> dict:
        from datasets import Dataset
        from transformers import AutoTokenizer, PrinterCallback, ProgressCallback, TrainerCallback

        s, trl_ppo = self.s, self.trl_ppo
        self.release()
        tok = AutoTokenizer.from_pretrained(s.model_dir)
        tok.padding_side = "left"
        policy, value_model = load_trl_models(s)
        value_model.config.pad_token_id = tok.pad_token_id
        rows = _common.bench_rows(s.episodes, s.seed)
        prompts = [_common.format_bench_prompt(r["question"]) for r in rows]
        answers = {p: r["answer"] for p, r in zip(prompts, rows, strict=True)}
        self.reward = reward = make_rule_reward_module(tok, answers)
        ds = Dataset.from_dict({"input_ids": [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]})
        self._out = tempfile.TemporaryDirectory(prefix="ppo_throughput_trl_")  # TRL insists on one
        # TRL 1.12's PPOTrainer builds its own Accelerator(gradient_accumulation_steps=...),
        # which reads the precision from the environment only: bf16=True alone leaves every
        # pass in float32. This is what `accelerate launch --mixed_precision bf16` sets.
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if self.precision == "bf16" else "no"
        out_dir = self._out.name
        args = trl_ppo.PPOConfig(
            output_dir=str(out_dir), per_device_train_batch_size=s.episodes, gradient_accumulation_steps=1,
            num_mini_batches=1, num_ppo_epochs=s.epochs, total_episodes=s.episodes,
            local_rollout_forward_batch_size=s.episodes, response_length=s.response_length,
            temperature=s.temperature, stop_token=None, missing_eos_penalty=None,
            learning_rate=s.learning_rate, lr_scheduler_type="constant", weight_decay=0.0,
            kl_coef=s.kl_coeff, kl_estimator="k1", vf_coef=s.vf_coeff, cliprange=s.clip_eps,
            cliprange_value=s.value_clip, gamma=s.gamma, lam=s.lam, whiten_rewards=False,
            bf16=self.precision == "bf16", fp16=False, gradient_checkpointing=False, use_cpu=s.device == "cpu",
            num_sample_generations=0, report_to=[], save_strategy="no", logging_steps=1,
            disable_tqdm=True, seed=s.seed, dataloader_num_workers=0)
        self.trainer = trainer = trl_ppo.PPOTrainer(
            args=args, processing_class=tok, model=policy, ref_model=None, reward_model=reward,
            train_dataset=ds, value_model=value_model, eval_dataset=ds)
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        marks = self.marks

        class Clock(TrainerCallback):
            def on_train_begin(self, *a, **k):
                marks["begin"] = _common.clock()

            def on_step_end(self, *a, **k):
                marks["update_end"] = _common.clock()

            def on_train_end(self, *a, **k):
                marks["end"] = _common.clock()

        trainer.add_callback(Clock())
        params = [x for x in trainer.model.parameters() if x.requires_grad]
        return {"trainable_params": sum(x.numel() for x in params)}

    def release(self) -> None:
        self.trainer = self.reward = None
        _common.release_freed_memory()

    def state_tensors(self) -> list:
        t = self.trainer
        return _held_tensors([t.model, t.ref_model, t.reward_model], getattr(t.optimizer, "optimizer", t.optimizer))

    def step(self) -> dict:
        self.marks.clear()
        t0 = _common.clock()
        self.trainer.train()
        call = _common.clock() - t0
        m = self.marks
        total = m["end"] - m["begin"]
        phases = {"generate": m["generate"], "score": m["score"],
                  "forward": m["update_start"] - m["generate_end"] - m["score"],
                  "update": m["update_end"] - m["update_start"]}
        phases["other"] = total - sum(phases.values())
        n, width = self.s.episodes, m["response_width"]
        # No stop token: every response runs to the full width (an EOS sampled mid-way is
        # just another token), so all n x width response tokens are trained on.
        return {"total": total, **phases, "episodes": n, "tokens": n * width,
                "response_width": width, "call_overhead": call - total}


def _held_tensors(modules, optimizer) -> list:
    tensors = [t for m in modules if m is not None for t in (*m.parameters(), *m.buffers())]
    return tensors + [v for st in optimizer.state.values() for v in st.values()]


# --------------------------------------------------------------------------------------
# Workers: one process per side, stepped by the parent
# --------------------------------------------------------------------------------------
def count_prompt_tokens(s: BenchSettings) -> int:
    """Tokens of the step's prompts (the same every step, on every side), no special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(s.model_dir)
    rows = _common.bench_rows(s.episodes, s.seed)
    return sum(len(tok(_common.format_bench_prompt(r["question"]), add_special_tokens=False)["input_ids"])
               for r in rows)


def make_side(name: str, s: BenchSettings):
    if name not in SIDES:
        raise ValueError(f"unknown side {name!r}; choose from {', '.join(SIDES)}")
    precision = SIDES[name][1]
    if s.mixed_precision == "bf16" and precision == "fp32":  # --mixed-precision bf16
        precision = "bf16"
    if name.startswith("trl"):
        return TrlSide(s, precision)
    return RlhflabSide(s, "separate" if name.startswith("rlhflab-critic") else "value_head", precision,
                       "torch" if "-torchmm" in name else "auto", "eager" if name.endswith("-eager") else None,
                       "sampler" if name.endswith("-samplerlp") else "recompute")


def worker(name: str, settings: dict, conn, tensor_memory: bool = True) -> None:
    """Build one side, then answer "step" with a timing dict and "finish" with memory.

    A priming build and step come first and are thrown away: they load the modules that
    transformers and torch import lazily, start the thread pools and warm the allocator,
    so the memory baseline taken after them holds that footprint and no PPO state.
    """
    try:
        # Library chatter goes to stderr; the parent's stdout holds only the report.
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        import warnings
        warnings.simplefilter("ignore", FutureWarning)
        s = BenchSettings(**settings)
        import torch
        _common.sync_clock_with_cuda(s.device == "cuda")
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        torch.set_num_threads(s.threads)
        side = make_side(name, s)
        torch.manual_seed(s.seed)
        side.build()
        side.step()
        side.release()
        baseline = _common.rss_mb()        # libraries loaded, no models
        resettable = _common.reset_peak_rss()
        cuda_baseline = 0.0
        if s.device == "cuda":  # the PPO peak is CUDA memory above what the priming run left
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            cuda_baseline = torch.cuda.memory_allocated() / 2**20
        torch.manual_seed(s.seed)
        info = side.build()
        conn.send(("ready", {**info, "baseline_rss_mb": baseline,
                             "models_mb": _common.rss_mb() - baseline}))
        while True:
            cmd = conn.recv()
            if cmd == "step":
                c0, r0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
                out = side.step()
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                out["cpu"] = time.process_time() - c0
                # the kernel's share: system CPU time and minor page faults (fresh pages of freed and
                # re-allocated buffers)
                out["sys"], out["faults"] = r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt
                conn.send(("step", out))
            elif cmd == "finish":
                peak = _common.peak_rss_mb()  # read before the profiled step below adds its own
                memory = {"baseline_rss_mb": baseline, "peak_rss_mb": peak,
                          "ppo_peak_mb": peak - baseline if resettable else float("nan"),
                          "process_peak_rss_mb": _common.lifetime_peak_rss_mb()}
                if s.device == "cuda":
                    memory.update(cuda_baseline_mb=cuda_baseline, rss_peak_mb=memory["ppo_peak_mb"],
                                  ppo_peak_mb=torch.cuda.max_memory_allocated() / 2**20 - cuda_baseline)
                if tensor_memory:  # exact cross-check: held state + one profiled step's own peak
                    held = _common.tensor_bytes(side.state_tensors()) / 2**20
                    step_peak = _common.profiled_tensor_peak_mb(getattr(side, "counted_step", side.step))
                    memory.update(held_tensor_mb=held, step_tensor_peak_mb=step_peak,
                                  tensor_peak_mb=held + step_peak)
                conn.send(("memory", memory))
                return
    except BaseException:  # noqa: BLE001  (reported to the parent, which exits nonzero)
        conn.send(("error", traceback.format_exc()))


class Worker:
    def __init__(self, ctx, name: str, s: BenchSettings, tensor_memory: bool = True):
        self.name, self.tensor_memory = name, tensor_memory
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(name, asdict(s), child, tensor_memory), daemon=True)
        self.proc.start()
        child.close()

    def expect(self, kind: str):
        try:
            got, payload = self.conn.recv()
        except EOFError:
            raise SystemExit(self.death(kind)) from None
        if got == "error":
            raise SystemExit(f"ppo_throughput: the {self.name} worker failed:\n{payload}")
        assert got == kind, (got, kind)
        return payload

    def death(self, kind: str) -> str:
        """The line for a worker that died while the parent waited for `kind`."""
        self.proc.join(timeout=10)  # the exit code is known once the process is reaped
        code = self.proc.exitcode
        why = f"exit code {code}"
        if code == -signal.SIGKILL:
            why += ": killed, most likely by the kernel for memory"
        hint = f"run it alone with --sides {self.name}"
        if kind == "memory" and self.tensor_memory:  # after the timed steps, in the profiled tensor count
            hint = (f"it died in the profiled step that counts tensor bytes, after its timed steps: "
                    f"--no-tensor-memory skips that step, or {hint}")
        return f"ppo_throughput: the {self.name} worker died ({why}); {hint}"

    def call(self, cmd: str, kind: str):
        self.conn.send(cmd)
        return self.expect(kind)


def run_sequential(sides: list[str], s: BenchSettings, repeats: int, warmup: int, tensor_memory: bool = True,
                   log=print) -> dict:
    """The sides one at a time: each side's worker is started, stepped, finished and gone
    before the next starts. On a real model every side's process alive at once does not
    fit (SmolLM2-135M: TRL's side was killed for memory on 24 GiB); the price is that load
    from other work on the machine no longer falls on every side alike."""
    merged: dict = {}
    for name in sides:
        one = run([name], s, repeats, warmup, tensor_memory, log)
        if not merged:
            merged = one
        else:
            for key in ("info", "steps", "memory"):
                merged[key].update(one[key])
    return merged


def run(sides: list[str], s: BenchSettings, repeats: int, warmup: int, tensor_memory: bool = True,
        log=print) -> dict:
    """Start one worker per side, warm each up, then step them in rotating order."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    workers = [Worker(ctx, name, s, tensor_memory) for name in sides]
    info = {w.name: w.expect("ready") for w in workers}
    steps: dict[str, list[dict]] = {w.name: [] for w in workers}
    for _ in range(warmup):
        for w in workers:
            w.call("step", "step")
    for r in range(repeats):
        order = workers[r % len(workers):] + workers[: r % len(workers)]
        for w in order:
            steps[w.name].append(w.call("step", "step"))
        log(f"  round {r + 1}/{repeats}: " + ", ".join(
            f"{w.name} {steps[w.name][-1]['total']:.2f}s" for w in workers), file=sys.stderr)
    memory = {w.name: w.call("finish", "memory") for w in workers}
    for w in workers:
        w.proc.join(timeout=60)
    return {"settings": asdict(s), "repeats": repeats, "warmup": warmup, "info": info,
            "steps": steps, "memory": memory}


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------
def summarize(result: dict) -> dict[str, dict]:
    """Per side: median step and phase seconds, episodes/s, tokens/s per phase, memory."""
    out = {}
    for name, steps in result["steps"].items():
        total = [st["total"] for st in steps]
        med = _common.median(total)
        tokens = _common.median([st["tokens"] for st in steps])
        phases = {k: _common.median([st[k] for st in steps]) for k in PHASES}
        cpu = _common.median([st["cpu"] for st in steps])
        out[name] = {
            "step_s": med, "eps_per_s": steps[0]["episodes"] / med if med else float("nan"),
            "cpu_s": cpu, "eps_per_cpu_s": steps[0]["episodes"] / cpu if cpu else float("nan"),
            "spread": _common.spread(total), "phases_s": phases,
            "sys_s": _common.median([st.get("sys", float("nan")) for st in steps]),
            "faults": _common.median([st.get("faults", float("nan")) for st in steps]),
            "tokens_per_s": {k: tokens / v if v > 0 else float("nan") for k, v in phases.items() if k != "other"},
            "tokens": tokens, **result["memory"][name]}
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def final_line(summary: dict[str, dict]) -> str:
    nan = {"eps_per_s": float("nan"), "ppo_peak_mb": float("nan")}
    r, t, c = summary.get("rlhflab", nan), summary.get("trl", nan), summary.get("rlhflab-critic", nan)
    return (f"ppo_throughput: rlhflab {r['eps_per_s']:.2f} eps/s, trl {t['eps_per_s']:.2f} eps/s, "
            f"speed ratio {ratio(r['eps_per_s'], t['eps_per_s']):.2f}, "
            f"memory ratio {ratio(r['ppo_peak_mb'], t['ppo_peak_mb']):.2f}, "
            f"critic speed ratio {ratio(c['eps_per_s'], t['eps_per_s']):.2f}, "
            f"critic memory ratio {ratio(c['ppo_peak_mb'], t['ppo_peak_mb']):.2f}")


# (rlhflab side, TRL side) pairs the report compares: the headline (value head), the
# like-for-like (both with a separate critic), and the same in bfloat16 autocast.
PAIRS = (("rlhflab", "trl", "value head vs TRL"), ("rlhflab-critic", "trl", "like for like (separate critics)"),
         ("rlhflab-critic-torchmm", "trl", "... and torch's matmul on both"),
         ("rlhflab-critic-samplerlp", "trl", "like for like, old lp from the sampler (as TRL)"),
         ("rlhflab-critic-torchmm-samplerlp", "trl", "... and torch's matmul on both"),
         ("rlhflab-critic-bf16", "trl-bf16", "like for like, bf16 autocast"),
         ("rlhflab-bf16", "trl-bf16", "value head vs TRL, bf16 autocast"))


def phase_flops(name: str, n: "_common.LinearParams", prompt_tokens: float, response_tokens: float,
                epochs: int) -> dict[str, float]:
    """Model FLOPs of one PPO step's phases on side `name`: the passes that side runs
    (bench/_common.py says how a pass is counted). generate: one policy forward over prompt +
    response tokens. forward: rlhflab's policy pass (old log-probs; with the value head, the
    values too) and the reference's, plus the critic's where there is one; TRL takes the
    old log-probs from the sampling logits, so it runs the reference's and its critic's
    only, as rlhflab does with `generation.old_logprobs=sampler` (the -samplerlp sides).
    update: `epochs` x forward + backward of the policy, and of the critic where there is
    one (TRL always has one)."""
    seq = prompt_tokens + response_tokens
    policy = _common.pass_flops(n, seq, response_tokens)
    critic = _common.pass_flops(_common.LinearParams(n.body, 0), seq, 0) \
        if name.startswith(("trl", "rlhflab-critic")) else 0.0
    scoring = (1 if name.startswith("trl") or name.endswith("-samplerlp") else 2) * policy + critic
    return {"generate": policy, "forward": scoring, "update": epochs * 3 * (policy + critic)}


def mfu_lines(summary: dict[str, dict], n: "_common.LinearParams", prompt_tokens: float, epochs: int,
              peak: float, peak_what: str | None = None) -> list[str]:
    """Per side: seconds, model FLOPs and MFU of generate, forward (no-grad scoring) and update;
    the MFU goes into the summary too."""
    peak_what = peak_what or f"the float32 matmul peak measured here ({_common.cpu_name()})"
    lines = [f"MFU per phase: model FLOPs / phase seconds / {peak_what}, "
             f"{peak / 1e9:.1f} GFLOP/s; N = {n.body / 1e6:.1f}M decoder + "
             f"{n.head / 1e6:.1f}M LM-head linear weights, {prompt_tokens:.0f} prompt tokens a step; "
             f"2N per token forward, 6N forward+backward (bench/_common.py)"]
    for name, m in summary.items():
        flops = phase_flops(name, n, prompt_tokens, m["tokens"], epochs)
        seconds = {k: m["phases_s"][k] for k in flops}
        m["mfu"] = _common.mfu_cells(flops, seconds, peak)
        lines.append(_common.format_mfu(f"  {LABELS[name]}", flops, seconds, peak))
    return lines


def format_report(result: dict, summary: dict[str, dict]) -> str:
    from rlhflab.openmp import describe

    s, nan = result["settings"], float("nan")
    on_cuda = s.get("device") == "cuda"
    where = "CUDA" if on_cuda else f"CPU, {s['threads']} threads ({describe()})"
    mem = "peak CUDA MiB" if on_cuda else "peak MiB"
    lines = [
        f"PPO step: {s['episodes']} episodes x {s['response_length']} new tokens, {s['epochs']} epochs of "
        f"one {s['episodes']}-episode minibatch, KL {s['kl_coeff']} in the reward (k1, frozen-copy reference), "
        f"lr {s['learning_rate']:g}, no grad clipping, float32 weights (bf16 rows: bfloat16 autocast), "
        f"{where}; model {s['model_dir']}"
        + (f"; rlhflab's generation.hf.cache={s['hf_cache']} (TRL's generate keeps its default cache)"
           if s.get("hf_cache", "dynamic") != "dynamic" else "")
        + ("; rlhflab's model.compile_layers=true (its decoder layers compiled for the teacher-forced passes; "
           "TRL 1.12's PPOTrainer has no such switch: it builds its own Accelerator, which its torch_compile "
           "setting does not reach)" if s.get("compile_layers") else "")
        + (f"; attention {s['attn']} on every side (rlhflab's model.attn_implementation, TRL's "
           f"from_pretrained(attn_implementation=))" if s.get("attn") else ""),
        f"medians of {result['repeats']} steps per side after {result['warmup']} warm-up steps, sides "
        + ("run one after the other (--sequential)" if result.get("sequential") else "interleaved step by step"),
        "",
        f"{'side':<34} {'eps/s':>6} {'step s':>7} {'noise':>6} {'cpu s':>6} {'eps/cpu-s':>9}"
        f" {mem:>8} {'tensor MiB':>10} {'proc RSS':>8}",
    ]
    for name, m in summary.items():
        lines.append(f"{LABELS[name]:<34} {m['eps_per_s']:>6.2f} {m['step_s']:>7.3f} {m['spread']:>6.0%} "
                     f"{m['cpu_s']:>6.3f} {m['eps_per_cpu_s']:>9.2f} {m['ppo_peak_mb']:>8.1f} "
                     f"{m.get('tensor_peak_mb', nan):>10.1f} {m['process_peak_rss_mb']:>8.1f}")
    lines += ["", "per phase: median seconds (response tokens / phase seconds)",
              f"{'side':<34} " + " ".join(f"{k:>16}" for k in PHASES)]
    for name, m in summary.items():
        cells = []
        for k in PHASES:
            tps = m["tokens_per_s"].get(k)
            cells.append(f"{m['phases_s'][k]:>6.3f}" + (f" ({tps:>7.0f})" if tps is not None else " " * 10))
        lines.append(f"{LABELS[name]:<34} " + " ".join(cells))
    lines += ["", "the kernel's share of a step: median system CPU seconds and minor page faults"]
    for name, m in summary.items():
        lines.append(f"{LABELS[name]:<34} sys {m['sys_s']:>6.2f} s, {m['faults'] / 1e6:>5.2f} M page faults "
                     f"(of {m['cpu_s']:.1f} CPU s)")
    lines += [
        "",
        "eps/s     episodes per second: episodes / median wall seconds of a step",
        "noise     (slowest - fastest) / median of the measured wall times",
        "cpu s     median CPU seconds of a step, all threads (steadier than wall time on a shared machine)",
        ("peak CUDA MiB  torch.cuda.max_memory_allocated of the side's own process above what it held "
         "after a priming build and step (reset_peak_memory_stats)" if on_cuda else
         "peak MiB  peak resident set of the side's own process minus its resident set with libraries "
         "loaded and no models"),
        "tensor MiB  exact cross-check: bytes of weights and optimizer state plus the peak of tensors "
        "allocated in one profiled step",
        "proc RSS  the process's ru_maxrss, library imports included",
        "phases    generate: sampling; score: the reward; forward: no-grad passes, KL-shaped rewards, GAE; "
        "update: the epochs; other: the rest of the step (TRL: its gc.collect calls, logging)",
    ]
    pairs = [(a, b, what) for a, b, what in PAIRS if a in summary and b in summary]
    if pairs:
        lines += ["", "ratios (rlhflab / TRL; targets: speed >= 2.00, memory <= 0.70)"]
    for a, b, what in pairs:
        r, t = summary[a], summary[b]
        lines.append(f"  {what:<36} speed {ratio(r['eps_per_s'], t['eps_per_s']):.2f} "
                     f"(on CPU seconds {ratio(r['eps_per_cpu_s'], t['eps_per_cpu_s']):.2f}), "
                     f"memory {ratio(r['ppo_peak_mb'], t['ppo_peak_mb']):.2f} "
                     f"(tensor count {ratio(r.get('tensor_peak_mb', nan), t.get('tensor_peak_mb', nan)):.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", default=",".join(DEFAULT_SIDES),
                    help=f"comma-separated, from {', '.join(SIDES)} (default: {','.join(DEFAULT_SIDES)})")
    ap.add_argument("--repeats", type=int, default=7, help="measured steps per side (median taken)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side first")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--response-length", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="torch threads in every worker")
    ap.add_argument("--model-dir", default=str(_common.BENCH_DIR / "tiny-model"),
                    help="model folder (default: the tiny model, built there when missing); a real one, e.g. "
                         "outputs/models/smollm2-135m-instruct (make models), runs its sides one at a time")
    ap.add_argument("--sequential", action="store_true",
                    help="run the sides one at a time instead of interleaved (on by itself for a model of "
                         f"more than {SEQUENTIAL_ABOVE // 10**6}M parameters)")
    ap.add_argument("--interleaved", action="store_true",
                    help="interleave the sides step by step even on a real model, every side's process alive at "
                         "once (check they fit: SmolLM2's separate-critic side and TRL's take about 8 + 11 GiB); "
                         "the machine's drift then falls on every side alike")
    ap.add_argument("--peak-sizes", nargs="+", type=int, default=[2048, 4096],
                    help="square float32 matmuls that measure the machine's peak for the MFU")
    ap.add_argument("--json", default=None, help="also write the raw timings and summary here")
    ap.add_argument("--no-tensor-memory", action="store_true",
                    help="skip the profiled step that counts tensor bytes exactly (it counts CPU tensors: "
                         "always skipped on --device cuda)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where every side runs; cuda runs the sides one at a time (they share the GPU)")
    ap.add_argument("--mixed-precision", choices=["no", "bf16"], default="no",
                    help="bf16: every float32 side in bfloat16 autocast with float32 weights "
                         "(rlhflab's training.mixed_precision=bf16, TRL's bf16=True)")
    ap.add_argument("--hf-cache", choices=["dynamic", "static"], default="dynamic",
                    help="rlhflab's generation.hf.cache on every rlhflab side: static compiles the decoding step "
                         "on a CUDA GPU (its first, warm-up step pays the compile); TRL's side is not changed")
    ap.add_argument("--compile-layers", action="store_true",
                    help="rlhflab's model.compile_layers=true on every rlhflab side (on a CPU only the torch-matmul "
                         "sides take it: oneDNN's linears do not compile); its warm-up step pays the compile")
    ap.add_argument("--attn-implementation", choices=["sdpa", "eager"], default=None,
                    help="the attention of every side's models: rlhflab's model.attn_implementation, TRL's "
                         "from_pretrained(attn_implementation=) (default: transformers' choice, sdpa); eager ran "
                         "faster on a CPU at short sequences (docs/cpu_matmul.md)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the peak FLOP/s (in TFLOP/s) the MFU divides by; default: measured here (on CUDA: "
                         "square matmuls of --peak-sizes in bfloat16 under --mixed-precision bf16, else float32)")
    args = ap.parse_args(argv)

    sides = [x.strip() for x in args.sides.split(",") if x.strip()]
    unknown = [x for x in sides if x not in SIDES]
    if unknown or not sides:
        ap.error(f"--sides: unknown {unknown}; choose from {', '.join(SIDES)}")
    if any(x.startswith("trl") for x in sides):
        version = trl_installed()
        if version != TRL_VERSION:
            found = f"found trl {version}" if version else "trl is not installed"
            print(f"ppo_throughput: the TRL side needs trl {TRL_VERSION} in {TRL_DIR} ({found}); "
                  f"install it for the benchmark only with:\n  {TRL_INSTALL}"
                  + (" --upgrade" if version else "")
                  + "\nor run without it: --sides rlhflab,rlhflab-critic", file=sys.stderr)
            return 3
    default_dir = _common.BENCH_DIR / "tiny-model"
    if Path(args.model_dir).resolve() != default_dir.resolve() and not (Path(args.model_dir) / "config.json").is_file():
        ap.error(f"--model-dir {args.model_dir}: no config.json there; for SmolLM2-135M-Instruct run "
                 f"`make models` first (outputs/models/smollm2-135m-instruct), or leave --model-dir out")
    settings = BenchSettings(model_dir=str(_common.ensure_tiny_model(args.model_dir)),
                             episodes=args.episodes, response_length=args.response_length,
                             epochs=args.epochs, threads=args.threads, device=args.device,
                             mixed_precision=args.mixed_precision, hf_cache=args.hf_cache, attn=args.attn_implementation,
                             compile_layers=args.compile_layers)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device")
    if args.mixed_precision == "bf16":  # the float32 sides' rows say they ran in bf16 autocast
        for name, (label, precision) in SIDES.items():
            if precision == "fp32":
                LABELS[name] = f"{label} bf16"
    n = _common.linear_params(settings.model_dir)
    if args.interleaved and (args.sequential or args.device == "cuda"):
        ap.error("--interleaved: not with --sequential or --device cuda (the sides would share the GPU)")
    sequential = args.sequential or (n.total > SEQUENTIAL_ABOVE and not args.interleaved) or args.device == "cuda"
    prompt_tokens = count_prompt_tokens(settings)
    print(f"ppo_throughput: {', '.join(sides)}; {args.warmup} warm-up + {args.repeats} measured steps each"
          f"{', sides one at a time' if sequential else ''} ({_common.cpu_count()} CPUs visible)", file=sys.stderr)
    from rlhflab.openmp import apply_default_wait
    apply_default_wait()  # as the CLI: idle OpenMP threads poll briefly, then sleep
    # before any worker computes; on CUDA in this process, which then holds a CUDA context
    # while the workers run (a few hundred MiB of GPU memory, not in any worker's peak)
    peak, peak_what = _common.device_peak(args.device, args.threads, tuple(args.peak_sizes),
                                       "bfloat16" if args.mixed_precision == "bf16" else "float32", args.peak_tflops)
    result = (run_sequential if sequential else run)(
        sides, settings, args.repeats, args.warmup,
        tensor_memory=not args.no_tensor_memory and args.device == "cpu")
    result.update(sequential=sequential, peak_flops=peak, prompt_tokens=prompt_tokens,
                  linear_params={"body": n.body, "head": n.head})
    summary = summarize(result)
    mfu = mfu_lines(summary, n, prompt_tokens, settings.epochs, peak, peak_what)
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "summary": summary}, indent=1))
    print(format_report(result, summary))
    print()
    print("\n".join(mfu))
    print(final_line(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
