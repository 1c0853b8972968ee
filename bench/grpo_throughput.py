"""GRPO throughput and peak memory: rlhflab's GRPO and TRL's `GRPOTrainer`, side by side.

    python bench/grpo_throughput.py [--steps 6] [--repeats 3] [--sides rlhflab,trl] [--out DIR]
                                    [--model DIR] [--data DIR] [--beta 0.0] [--device cpu|cuda]
                                    [--mixed-precision no|bf16] [--peak-tflops T]
                                    [--completions 32] [--group-size 8] [--max-new-tokens 16]
                                    [--generation hf|vllm]   # or --sides rlhflab,rlhflab-vllm,trl[,trl-vllm]
    python bench/grpo_throughput.py --model-dir outputs/models/smollm2-135m-instruct ...  # the real model

Both run the same GRPO on the same model (a tiny Llama built locally unless --model is
given), on the arithmetic task's prompts with the GSM8K checker as the reward: group
size 8, 32 completions per step (4 prompts), responses of up to 16 new tokens,
temperature 1, one optimizer step per generation batch (fully on-policy), the same
learning rate, `beta` and clip, fused AdamW, no gradient checkpointing (TRL turns it on
by default since 1.0; it is switched off here to match). Both are asked the same prompt
tokens: rlhflab's side renders each prompt as configs/grpo_debug.yaml says
(`use_chat_template: auto`: wrapped in the tokenizer's chat template when it has one, as
SmolLM2's ChatML), and TRL then gets the same text as one user message, which its trainer
renders with that template and the generation prompt; a model without a chat template
gets the raw `Question: ...\nAnswer:` on both sides. Before any run the bench tokenizes
the first 256 prompts as each side does (rlhflab's loading and encoding, TRL's own
`_tokenize_prompts`) and refuses to run if the token ids differ.
Each runs in a fresh subprocess, so its peak memory is its own. On CPU it is measured as
bench/ppo_throughput.py does: a priming run of one step (thrown away) loads what the
libraries import lazily, then the peak resident set (VmHWM) is reset and the peak of the
measured run is taken above the resident set at that point, so the libraries' import
footprint (TRL's imports are about 190 MiB larger than rlhflab's) is not counted; the
whole-process `ru_maxrss` is shown beside it. On CUDA: `torch.cuda.max_memory_allocated`.
The first step of each is a warm-up and is not timed; completions/s is the
completions of the other steps over their wall time, from the end of the first step
to the end of the last (generation, reward, forward, backward, optimizer, logging;
evaluation and saving off). On a shared machine wall time also counts other
processes' load, so the runs alternate and the median is reported, and the
completions per CPU-second of each process are shown beside it.

What it measures, its options and its latest figures: bench/README.md; its history: bench/NOTES.md and git.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_DIR = ROOT / ".bench" / "trl-grpo"  # its own folder: another benchmark may pin another TRL in .bench/trl
GROUP_SIZE, COMPLETIONS, MAX_NEW_TOKENS = 8, 32, 16
TEMPLATE = "Question: {prompt}\nAnswer:"
TRL_VERSION = "1.16.0"
INSTALL_HINT = (f"{ROOT / '.venv/bin/pip'} install --no-deps --target {TRL_DIR} trl=={TRL_VERSION} requests "
                f"charset_normalizer urllib3 certifi idna")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (the bench folder is not a package)

PHASES = ("generate", "score", "forward", "update")
# --sides: side -> (trainer, how it samples)
SIDES = {"rlhflab": ("rlhflab", "hf"), "trl": ("trl", "hf"),
         "rlhflab-vllm": ("rlhflab", "vllm"), "trl-vllm": ("trl", "vllm")}
# Ratio lines, for each pair that ran: (ours, theirs, what the pair is). The last line
# reports the first like-for-like pair any of whose sides ran.
PAIRS = (("rlhflab", "trl", "like for like, Hugging Face generate on both"),
         ("rlhflab-vllm", "trl-vllm", "like for like, vLLM on both"),
         ("rlhflab-vllm", "trl", "NOT like for like: rlhflab with vLLM against TRL with its default HF generate"))
MAX_PROMPT_TOKENS = 64  # rlhflab's prompt cut (configs/grpo_debug.yaml, dataset.max_prompt_length)
VLLM_CPU_KV_GIB = "1"   # TRL's engine on CPU: VLLM_CPU_KVCACHE_SPACE (whole GiB), unless set already


def _baseline(device: str) -> float:
    """After a priming run: free what it left, reset the peak mark, return the resident
    set now (MiB) that the measured run's peak is taken above (CPU); 0 on CUDA, whose
    counter is reset instead."""
    import torch

    _common.release_freed_memory()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return 0.0
    if not _common.reset_peak_rss():
        raise SystemExit("grpo_throughput: cannot reset the peak RSS mark (/proc/self/clear_refs); Linux >= 4.0 needed")
    return _common.rss_mb()


def _memory(device: str, baseline: float) -> dict:
    import torch

    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = _common.peak_rss_mb() - baseline
    return {"peak_memory_mb": peak, "baseline_rss_mb": baseline,
            "process_peak_rss_mb": _common.lifetime_peak_rss_mb()}


# --------------------------------------------------------------------------------------
# Workers (each in its own process)
# --------------------------------------------------------------------------------------
def _rates(marks: list[tuple[float, float]], completions: int) -> dict:
    """completions/s (wall) and completions per CPU-second from (wall, cpu) marks taken at
    the end of each step; the first step is the warm-up, so timing starts at its end."""
    (w0, c0), (w1, c1) = marks[0], marks[-1]
    n = completions * (len(marks) - 1)
    return {"completions_per_s": n / (w1 - w0), "completions_per_cpu_s": n / (c1 - c0), "steps_timed": len(marks) - 1,
            "step_s": [b[0] - a[0] for a, b in zip(marks, marks[1:])]}


def _prime(train, a: argparse.Namespace) -> None:
    """One step in `<out>/prime` (this worker's own folder), then the folder is removed:
    only what the libraries loaded lazily stays."""
    train(a, steps=1, out="prime")
    shutil.rmtree(Path(a.out) / "prime", ignore_errors=True)


def _engine_kv_mb(llm, model: str | Path) -> float:
    """MiB of KV cache a started vLLM engine reserved (its blocks x block size x bytes a token)."""
    from rlhflab.rollout.vllm import kv_bytes_per_token, read_model_config

    cache = llm.llm_engine.vllm_config.cache_config
    dtype = str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")
    return cache.num_gpu_blocks * cache.block_size * kv_bytes_per_token(read_model_config(str(model)), dtype) / 2**20


def _watch_engine_start(cls, name: str, get_llm, engines: list[dict], model) -> None:
    """Wrap `cls.name` (what starts a vLLM engine) to record, per start, the resident set it
    added (MiB) and the KV cache the engine reserved (MiB): the engine's share of the peak."""
    original = getattr(cls, name)  # a classmethod comes bound to cls; a method is a plain function

    def start(*args, **kwargs):
        before = _common.rss_mb()
        result = original(*args, **kwargs)
        engines.append({"rss_added_mb": _common.rss_mb() - before,
                        "kv_cache_mb": _engine_kv_mb(get_llm(args, result), model)})
        return result

    setattr(cls, name, staticmethod(start) if isinstance(inspect.getattr_static(cls, name), classmethod) else start)


def run_rlhflab(a: argparse.Namespace) -> dict:
    engines: list[dict] = []
    if a.generation == "vllm":
        from rlhflab.rollout.vllm import VLLMEngine
        _watch_engine_start(VLLMEngine, "create", lambda args, engine: engine.llm, engines, a.model)
    if a.prime:
        _prime(_train_rlhflab, a)  # priming, thrown away
    else:  # only the imports the run would make
        from rlhflab.trainers import grpo, loop  # noqa: F401
    baseline = _baseline(a.device)
    out = _train_rlhflab(a, steps=a.steps, out="run")
    return {**out, **_memory(a.device, baseline), **({"engine": engines[-1]} if engines else {})}


def _train_rlhflab(a: argparse.Namespace, steps: int, out: str) -> dict:
    from rlhflab.trainers import grpo
    from rlhflab.trainers.loop import PolicyMethod, run_policy_training

    cfg = _rlhflab_config(a, steps, out)
    marks: list[tuple[float, float]] = []

    def timed_update(*args):  # grpo_update, with a mark at the end of each step (as TRL's on_step_end)
        out = grpo.grpo_update(*args)
        marks.append((_common.clock(), time.process_time()))
        return out

    method = PolicyMethod("grpo", grpo.grpo_prepare, timed_update, need_reference=lambda c: c.grpo.kl_coeff > 0)
    res = run_policy_training(cfg, method, quiet=True)
    if steps < 2:
        return {}
    timed = res.history[1:]
    phases = {k: statistics.median(h.get(f"time/{k}", 0.0) for h in timed) for k in PHASES}
    return {**_rates(marks, a.completions), "phases_s": phases,
            "mean_response_length": sum(h["rollout/response_length"] for h in timed) / len(timed)}


def rlhflab_overrides(a: argparse.Namespace, steps: int, out: str) -> list[str]:
    """configs/grpo_debug.yaml's overrides for rlhflab's side: the GRPO TRL runs too."""
    return [
        f"model.name_or_path={a.model}", f"dataset.path={a.data}/train.jsonl", "dataset.eval_path=null",
        f"generation.max_new_tokens={a.max_new_tokens}", "generation.temperature=1.0",
        f"grpo.group_size={a.group_size}", f"grpo.prompts_per_step={a.completions // a.group_size}",
        f"grpo.batch_size={a.completions}", f"grpo.mini_batch_size={a.completions}",
        "grpo.gradient_accumulation_steps=1", "grpo.epochs=1",
        f"grpo.learning_rate={a.lr}", f"grpo.kl_coeff={a.beta}", "grpo.clip_eps=0.2", "grpo.max_grad_norm=1.0",
        f"grpo.layout={ {'true': 'shared', 'false': 'padded'}.get(a.share_prompt, 'auto')}", f"generation.hf.cache={a.hf_cache if a.generation == 'hf' else 'dynamic'}",
        f"training.total_steps={steps}", "training.eval_interval=0", "training.save_interval=0",
        f"training.output_dir={a.out}/{out}", f"training.device={a.device}", f"training.num_threads={a.threads}",
        f"training.mixed_precision={a.mixed_precision}", f"generation.backend={a.generation}",
        f"cpu.matmul={a.cpu_matmul}", f"model.compile_layers={str(a.compile_layers).lower()}",
        "logging.progress_bar=false", "logging.plots=false", "logging.doctor=false"]


def run_trl(a: argparse.Namespace) -> dict:
    engines: list[dict] = []
    if a.generation == "vllm":
        sys.path.insert(0, str(TRL_DIR))
        from trl.generation.vllm_generation import VLLMGeneration
        _watch_engine_start(VLLMGeneration, "_init_vllm", lambda args, _: args[0].llm, engines, a.model)
    if a.prime:
        _prime(_train_trl, a)  # priming, thrown away
    else:  # only the imports the run would make
        sys.path.insert(0, str(TRL_DIR))
        import datasets  # noqa: F401
        import trl  # noqa: F401
        from trl import GRPOTrainer  # noqa: F401
    baseline = _baseline(a.device)
    out = _train_trl(a, steps=a.steps, out="run")
    return {**out, **_memory(a.device, baseline), **({"engine": engines[-1]} if engines else {})}


def trl_config_kwargs(a: argparse.Namespace, out: str) -> dict:
    """GRPOConfig's arguments for the TRL side: the same GRPO as rlhflab's run, and with
    `--generation vllm` TRL's colocated vLLM engine (one process, no sleep mode, its
    context cut to rlhflab's engine's: the longest prompt rlhflab keeps + the new tokens)."""
    kw = dict(
        output_dir=f"{a.out}/{out}", per_device_train_batch_size=a.completions, num_generations=a.group_size,
        gradient_accumulation_steps=1, num_iterations=1, max_completion_length=a.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=a.lr, lr_scheduler_type="constant",
        beta=a.beta, epsilon=0.2, max_grad_norm=1.0, logging_steps=1,
        gradient_checkpointing=False,  # rlhflab's run does not checkpoint either
        save_strategy="no", report_to=[], use_cpu=a.device == "cpu", bf16=a.mixed_precision == "bf16", fp16=False,
        dataloader_num_workers=0, seed=42, disable_tqdm=True)
    if a.hf_cache == "static" and a.generation == "hf":  # TRL's own switch for the same cache
        kw.update(cache_implementation="static")
    if a.generation == "vllm":
        kw.update(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False,
                  vllm_max_model_length=MAX_PROMPT_TOKENS + a.max_new_tokens)
    return kw


def _train_trl(a: argparse.Namespace, steps: int, out: str) -> dict:
    sys.path.insert(0, str(TRL_DIR))
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhflab.data.loading import read_rows
    from rlhflab.rewards.gsm8k import gsm8k_reward

    torch.set_num_threads(a.threads)
    rows = read_rows(f"{a.data}/train.jsonl")
    ds = Dataset.from_list([{"prompt": p, "answer": r["answer"]}
                            for p, r in zip(trl_prompts(rows, TEMPLATE, a.chat_prompts), rows)])

    def reward(prompts, completions, answer, **kwargs):
        # a conversational prompt's completion comes as [{"role": "assistant", "content": text}]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [gsm8k_reward(c, a_) for c, a_ in zip(texts, answer)]

    class StepMarks(TrainerCallback):
        def __init__(self):
            self.marks, self.lengths = [], []

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append((_common.clock(), time.process_time()))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))

    tok = AutoTokenizer.from_pretrained(a.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    args = GRPOConfig(**trl_config_kwargs(a, out), max_steps=steps)
    cb = StepMarks()
    spent: dict[str, float] = {}  # seconds in TRL's own methods, summed since the last step end

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = _common.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + _common.clock() - t0
        return wrapper

    class TimedGRPOTrainer(GRPOTrainer):
        """TRL's trainer with its phases timed: `_generate` (sampling), `_calculate_rewards`
        (the reward), `_generate_and_score_completions` (both, plus the no-grad log-prob
        passes: old and reference); the rest of a step is the update."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for name in ("_generate", "_calculate_rewards", "_generate_and_score_completions"):
                setattr(self, name, timed(name, getattr(self, name)))

    class PhaseMarks(TrainerCallback):
        def __init__(self):
            self.phases, self.last = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.last is None:
                self.last = _common.clock()

        def on_step_end(self, args, state, control, **kwargs):
            now = _common.clock()
            step_s = now - self.last
            gen, rew = spent.get("_generate", 0.0), spent.get("_calculate_rewards", 0.0)
            prep = spent.get("_generate_and_score_completions", 0.0)
            self.phases.append({"generate": gen, "score": rew, "forward": max(prep - gen - rew, 0.0),
                                "update": max(step_s - prep, 0.0)})
            spent.clear()
            self.last = now

    phase_marks = PhaseMarks()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                               processing_class=tok, callbacks=[cb, phase_marks])
    trainer.train()
    if steps < 2:
        return {}
    timed_steps = phase_marks.phases[1:]
    phases = {k: statistics.median(p[k] for p in timed_steps) for k in PHASES}
    return {**_rates(cb.marks, a.completions), "phases_s": phases,
            "mean_response_length": sum(cb.lengths[1:]) / max(len(cb.lengths) - 1, 1)}


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------
def _matmul_here(a: argparse.Namespace) -> str:
    """What rlhflab's cpu.matmul resolves to on this machine (always torch on CUDA)."""
    if a.device != "cpu":
        return "torch"
    from rlhflab.cpu.matmul import resolve
    return resolve(a.cpu_matmul)


def _worker(side: str, a: argparse.Namespace, round_: int) -> dict:
    """One run of `side` in a fresh process and a fresh folder under the scratch folder
    (made here, so no round, and no earlier invocation with the same --out, can collide).
    A failed trl-vllm run gives {"error": its last line} (TRL's colocated engine does not
    run everywhere, bench/NOTES.md); any other failure stops the benchmark."""
    which, generation = SIDES[side]
    folder = tempfile.mkdtemp(prefix=f"{side}-round{round_}-", dir=a.out)
    cmd = [sys.executable, __file__, "--worker", which, "--model", str(a.model), "--data", str(a.data),
           "--out", folder, "--steps", str(a.steps), "--beta", str(a.beta), "--lr", str(a.lr),
           "--device", a.device, "--mixed-precision", a.mixed_precision,
           "--threads", str(a.threads), "--group-size", str(a.group_size),
           "--completions", str(a.completions), "--max-new-tokens", str(a.max_new_tokens),
           "--generation", generation, "--cpu-matmul", a.cpu_matmul] \
        + (["--chat-prompts"] if a.chat_prompts else []) \
        + (["--compile-layers"] if a.compile_layers else []) \
        + ["--share-prompt", a.share_prompt, "--hf-cache", a.hf_cache] \
        + ([] if a.prime else ["--no-prime"])
    env = worker_env(a, side)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 and side == "trl-vllm":
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        return {"error": (lines[-1] if lines else f"exit {proc.returncode}").removeprefix("[rank0]: ")}
    if proc.returncode != 0:
        raise SystemExit(f"the {side} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker_env(a: argparse.Namespace, side: str) -> dict[str, str]:
    """The worker's environment: its threads, and for TRL's vLLM engine on CPU a KV cache of
    VLLM_CPU_KV_GIB GiB (vLLM's CPU knob; without it the engine takes 0.3 of the machine)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false"}
    if side == "trl-vllm" and a.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", VLLM_CPU_KV_GIB)
    return env


# --------------------------------------------------------------------------------------
# The prompts each side sees
# --------------------------------------------------------------------------------------
def _rlhflab_config(a: argparse.Namespace, steps: int = 2, out: str = "run"):
    """rlhflab's worker config (configs/grpo_debug.yaml with this run's overrides); the
    prompts do not depend on `steps` and `out`."""
    from rlhflab.config import load_config
    from rlhflab.trainers import grpo

    cfg, _ = load_config(ROOT / "configs" / "grpo_debug.yaml", grpo.GRPORunConfig, rlhflab_overrides(a, steps, out))
    return cfg


def trl_prompts(rows: list[dict], template: str, use_chat: bool) -> list:
    """TRL's `prompt` column for `rows`: the text rlhflab's template makes, as one user
    message when rlhflab wraps it in the tokenizer's chat template (TRL's GRPOTrainer then
    applies that template with the generation prompt), else the plain string."""
    from rlhflab.data.prompts import format_prompt

    bodies = [format_prompt(str(r["question"]), template) for r in rows]
    return [[{"role": "user", "content": b}] for b in bodies] if use_chat else bodies


def rlhflab_prompt_ids(a: argparse.Namespace, limit: int) -> tuple[list[list[int]], bool]:
    """(the token ids rlhflab's worker feeds the model for the first `limit` training
    prompts, whether it wraps them in the chat template): its own loading, rendering
    (`dataset.use_chat_template`) and encoding (rollout.encode_prompts, with the prompt
    cut at `dataset.max_prompt_length`)."""
    from rlhflab.data.prompts import PromptFormat, load_prompts
    from rlhflab.models.load import load_tokenizer
    from rlhflab.rollout import encode_prompts

    cfg = _rlhflab_config(a)
    tok = load_tokenizer(cfg.model.name_or_path)
    examples = load_prompts(cfg.dataset, tok, "train")[:limit]
    ids, mask = encode_prompts(tok, [e.prompt for e in examples], cfg.dataset.max_prompt_length)  # (B, P)
    use_chat = PromptFormat.resolve(cfg.dataset.prompt_template, cfg.dataset.use_chat_template, tok).use_chat
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)], use_chat


def trl_prompt_ids(a: argparse.Namespace, limit: int, use_chat: bool) -> list[list[int]]:
    """The token ids TRL 1.16's GRPOTrainer makes of the same prompts: its own
    `_tokenize_prompts` (chat template with the generation prompt for a conversational
    prompt, else the tokenizer's plain call) on the column its worker builds."""
    if str(TRL_DIR) not in sys.path:
        sys.path.insert(0, str(TRL_DIR))
    from types import SimpleNamespace

    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from rlhflab.data.loading import read_rows

    tok = AutoTokenizer.from_pretrained(str(a.model), padding_side="left")  # as the TRL worker loads it
    prompts = trl_prompts(read_rows(f"{a.data}/train.jsonl")[:limit], TEMPLATE, use_chat)  # as its worker does
    # the trainer's state that method reads, as GRPOTrainer.__init__ sets it for a text model without tools
    state = SimpleNamespace(processing_class=tok, _is_vlm=False, environment_factories=None, tools=[],
                            chat_template=None, chat_template_kwargs={})
    ids, _, _ = GRPOTrainer._tokenize_prompts(state, prompts)
    return [list(r) for r in ids]


def check_same_prompts(ours: list[list[int]], theirs: list[list[int]]) -> str | None:
    """None when both sides feed the model the same prompt tokens, else one line naming the
    first prompt that differs."""
    if len(ours) != len(theirs):
        return f"rlhflab reads {len(ours)} prompts, TRL {len(theirs)}"
    for i, (o, t) in enumerate(zip(ours, theirs)):
        if o != t:
            return (f"prompt {i} differs: rlhflab feeds {len(o)} tokens {o[:12]}..., TRL {len(t)} tokens "
                    f"{t[:12]}...")
    return None


def side_prompt_tokens(a: argparse.Namespace, sides: list[str], limit: int = 256) -> tuple[dict[str, float], bool]:
    """({side: mean prompt tokens it feeds the model}, whether prompts are chat-templated),
    over the first `limit` training prompts (steps draw different prompts, so the MFU uses
    the mean). With a TRL side, both token lists are compared first and a difference
    stops the benchmark: the sides must be asked the same prompts."""
    ours, use_chat = rlhflab_prompt_ids(a, limit)
    counts = {s: statistics.mean(map(len, ours)) for s in sides if SIDES[s][0] == "rlhflab"}
    if any(SIDES[s][0] == "trl" for s in sides):
        theirs = trl_prompt_ids(a, limit, use_chat)
        why = check_same_prompts(ours, theirs)
        if why:
            raise SystemExit(f"grpo_throughput: rlhflab and TRL would not be asked the same prompts ({why}); "
                             f"not like for like, not run")
        counts.update({s: statistics.mean(map(len, theirs)) for s in sides if SIDES[s][0] == "trl"})
    return counts, use_chat


def phase_flops(a: argparse.Namespace, n: "_common.LinearParams", prompt_tokens: float,
                response_length: float) -> dict[str, float]:
    """Model FLOPs of one GRPO step's phases (bench/_common.py says how they are counted): each
    prompt counted once per group (the least work that gives the result; TRL computes it
    group-size times, rlhflab once), `completions` x `response_length` response tokens.
    generate: one forward; forward: the reference's pass when beta > 0 (one optimizer step
    per rollout: no pass for old log-probs on either side); update: forward + backward."""
    prompts = a.completions // a.group_size
    seq = prompts * prompt_tokens + a.completions * response_length
    head = a.completions * response_length
    once = _common.pass_flops(n, seq, head)
    return {"generate": once, "score": 0.0, "forward": once if a.beta > 0 else 0.0,
            "update": _common.pass_flops(n, seq, head, backward=True)}


def mfu_lines(results: dict[str, list[dict]], a: argparse.Namespace, n: "_common.LinearParams",
              prompt_tokens: dict[str, float], peak: float, peak_what: str | None = None) -> list[str]:
    """Per side: median seconds, model FLOPs and MFU of each phase of a timed step, the
    FLOPs counted with the mean prompt tokens that side feeds the model (`prompt_tokens`)."""
    peak_what = peak_what or f"the float32 matmul peak measured here ({_common.cpu_name()})"
    lines = [f"per phase (median seconds of the timed steps of every run); MFU against {peak_what}, "
             f"{peak / 1e9:.1f} GFLOP/s; N = {n.body / 1e6:.1f}M decoder + "
             f"{n.head / 1e6:.1f}M LM-head linear weights; mean prompt tokens as each side renders and "
             f"tokenizes them; "
             f"2N per token forward, 6N forward+backward (bench/_common.py)"]
    for name, runs in results.items():
        if not runs or "phases_s" not in runs[0]:
            continue
        seconds = {k: statistics.median(r["phases_s"][k] for r in runs) for k in PHASES}
        length = statistics.median(r["mean_response_length"] for r in runs)
        flops = phase_flops(a, n, prompt_tokens[name], length)
        lines.append(_common.format_mfu(f"  {name}", {k: flops[k] for k in PHASES if k != "score"}, seconds, peak)
                     + f"; score {seconds['score']:.2f} s; {prompt_tokens[name]:.1f} prompt tokens")
    return lines


def engine_lines(results: dict[str, list[dict]]) -> list[str]:
    """With --generation vllm: per side, the vLLM engine's share of the peak (median over runs)."""
    lines = []
    for name, runs in results.items():
        starts = [r["engine"] for r in runs if "engine" in r]
        if starts:
            added = statistics.median(e["rss_added_mb"] for e in starts)
            kv = statistics.median(e["kv_cache_mb"] for e in starts)
            lines.append(f"vLLM engine of {name}: its start added {added:.0f} MiB to the resident set (weights, "
                         f"compiled graphs, buffers), of which a KV cache of {kv:.0f} MiB reserved; median of "
                         f"{len(starts)} run(s), inside the peak above")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="GRPO steps per trainer (the first is not timed)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each trainer, alternating; the median is reported")
    p.add_argument("--model", "--model-dir", dest="model", default=None,
                   help="model folder; default: a tiny Llama built in a temp dir. The real model: "
                        "outputs/models/smollm2-135m-instruct (make models)")
    p.add_argument("--group-size", type=int, default=GROUP_SIZE, help="completions per prompt")
    p.add_argument("--completions", type=int, default=COMPLETIONS,
                   help="completions per step (a multiple of --group-size)")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--peak-sizes", nargs="+", type=int, default=[2048, 4096],
                   help="square float32 matmuls that measure the machine's peak for the MFU")
    p.add_argument("--data", default=None, help="folder with train.jsonl; default: the arithmetic task")
    p.add_argument("--out", default=None,
                   help="scratch folder: the inputs it builds, and one fresh folder per run (default: a temp dir)")
    p.add_argument("--sides", default="rlhflab,trl",
                   help="comma-separated, from rlhflab, trl (Hugging Face generate), rlhflab-vllm, trl-vllm "
                        "(vLLM); default: rlhflab,trl; rlhflab alone needs no TRL")
    p.add_argument("--beta", type=float, default=0.0, help="KL weight for both trainers (TRL's default is 0)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--mixed-precision", choices=["no", "bf16"], default="no",
                   help="bf16: bfloat16 autocast with float32 weights on both sides (rlhflab's "
                        "training.mixed_precision=bf16, TRL's bf16=True)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the peak FLOP/s (in TFLOP/s) the MFU divides by; default: measured here (on CUDA: "
                        "square matmuls of --peak-sizes in bfloat16 under --mixed-precision bf16, else float32)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads in each worker")
    p.add_argument("--generation", choices=["hf", "vllm"], default="hf",
                   help="how the sides named rlhflab and trl sample: hf (Hugging Face generate) or vllm "
                        "(they become rlhflab-vllm: generation.backend=vllm, and trl-vllm: use_vllm=True, "
                        "vllm_mode='colocate')")
    p.add_argument("--cpu-matmul", choices=["torch", "onednn", "auto"], default="auto",
                   help="rlhflab's cpu.matmul (its default, auto: oneDNN on non-Intel CPUs with AVX-512, "
                        "docs/cpu_matmul.md); torch runs MKL as TRL's side always does")
    p.add_argument("--share-prompt", choices=["auto", "true", "false"], default="auto",
                   help="rlhflab's shared prompt: true runs grpo.layout shared, auto its default (shared on a CPU, padded on a GPU); false computes "
                        "each prompt k times in the scoring and update passes, as TRL does")
    p.add_argument("--no-share-prompt", dest="share_prompt", action="store_const", const="false",
                   help="the same as --share-prompt false")
    p.add_argument("--hf-cache", choices=["dynamic", "static"], default="dynamic",
                   help="generate's KV cache on both sides with --generation hf: rlhflab's generation.hf.cache and "
                        "TRL's cache_implementation ('static': preallocated, so transformers compiles the "
                        "decoding step on a CUDA GPU; the first, untimed step pays the compile)")
    p.add_argument("--compile-layers", action="store_true",
                   help="rlhflab's model.compile_layers=true (its decoder layers compiled for the scoring and "
                        "update passes; on a CPU it needs --cpu-matmul torch); TRL's side is not changed")
    p.add_argument("--no-prime", dest="prime", action="store_false",
                   help="take the memory baseline right after the imports, without the priming run (what the "
                        "libraries import lazily during the run then counts)")
    p.add_argument("--worker", choices=["rlhflab", "trl"], help=argparse.SUPPRESS)
    # the TRL worker: prompts as chat messages (rlhflab's side wraps them in the chat template)
    p.add_argument("--chat-prompts", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _common.sync_clock_with_cuda(a.device == "cuda")
        out = run_rlhflab(a) if a.worker == "rlhflab" else run_trl(a)
        print(json.dumps(out))
        return 0

    sides = [s.strip() for s in a.sides.split(",") if s.strip()]
    if not sides or set(sides) - set(SIDES):
        p.error(f"--sides {a.sides!r}: give rlhflab, trl or rlhflab,trl, or with vLLM generation "
                f"rlhflab-vllm, trl-vllm (comma-separated)")
    if a.generation == "vllm":  # the plain names sample with vLLM too
        sides = list(dict.fromkeys(s if s.endswith("-vllm") else f"{s}-vllm" for s in sides))
    if a.repeats < 1 or a.steps < 2:
        p.error("--repeats must be at least 1 and --steps at least 2 (the first step is not timed)")
    if a.group_size < 2 or a.completions % a.group_size:
        p.error(f"--completions {a.completions} must be a multiple of --group-size {a.group_size} (at least 2)")
    if a.model is not None and not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model}: no config.json there; for SmolLM2-135M-Instruct run `make models` first")
    trl_version = "not run"
    if any(SIDES[s][0] == "trl" for s in sides):
        if not (TRL_DIR / "trl").is_dir():
            print(f"TRL is not installed for the benchmark; install it with:\n  {INSTALL_HINT}\n"
                  f"(or run rlhflab's side alone: --sides rlhflab)")
            return 1
        found = [d.name for d in TRL_DIR.glob("trl-*.dist-info")]
        if f"trl-{TRL_VERSION}.dist-info" not in found:
            print(f"grpo_throughput: {TRL_DIR} holds {found or 'no versioned trl'}, not trl {TRL_VERSION}; reinstall "
                  f"with:\n  {INSTALL_HINT} --upgrade", file=sys.stderr)
            return 1
        trl_version = TRL_VERSION
    scratch = Path(a.out or tempfile.mkdtemp(prefix="grpo_bench_"))
    scratch.mkdir(parents=True, exist_ok=True)
    if a.model is None:
        from rlhflab.models.tiny import make_tiny_model
        a.model = scratch / "tiny-model"
        if not (a.model / "config.json").exists():
            make_tiny_model(a.model)
    if a.data is None:
        from rlhflab.data.arith import write_task
        a.data = scratch / "arith"
        if not (a.data / "train.jsonl").exists():
            write_task(a.data, n_train=500, n_test=10)
    a.out = scratch
    n = _common.linear_params(a.model)
    prompt_tokens, a.chat_prompts = side_prompt_tokens(a, sides)
    peak, peak_what = _common.device_peak(a.device, a.threads, tuple(a.peak_sizes),
                                       "bfloat16" if a.mixed_precision == "bf16" else "float32", a.peak_tflops)

    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(a.repeats):  # alternate, so both see the same machine load on average
        for side in sides:
            results[side].append(_worker(side, a, r + 1))
    failed = {side: [r["error"] for r in runs if "error" in r] for side, runs in results.items()}
    results = {side: [r for r in runs if "error" not in r] for side, runs in results.items()}

    nan = float("nan")
    keys = ("completions_per_s", "completions_per_cpu_s", "peak_memory_mb", "process_peak_rss_mb",
            "mean_response_length")

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name]) if results[name] else nan

    med = {side: {k: median(side, k) for k in keys} for side in SIDES}
    mem_name = "peak CUDA MiB" if a.device == "cuda" else "peak RSS MiB above imports"
    print(f"model {a.model}; device {a.device}, {a.threads} thread(s), mixed precision {a.mixed_precision}; "
          f"group {a.group_size}, {a.completions} "
          f"completions/step, <= {a.max_new_tokens} new tokens, beta {a.beta}; {a.steps} steps (first untimed); "
          f"median of {a.repeats} alternating runs; trl {trl_version}; rlhflab share_prompt "
          f"{a.share_prompt} ({_share_here(a)} here); KV cache {a.hf_cache}; rlhflab cpu_matmul {a.cpu_matmul} ({_matmul_here(a)} here); "
          f"{'rlhflab compile_layers on; ' if a.compile_layers else ''}"
          f"memory baseline {'after a priming run' if a.prime else 'after the imports'}; "
          f"sides {', '.join(f'{s} ({SIDES[s][1]})' for s in sides)}; load average {os.getloadavg()[0]:.1f}")
    print(f"| trainer | completions/s (wall) | completions per CPU-s | {mem_name} | process ru_maxrss MiB "
          f"| mean response tokens | runs: completions/s (wall) | runs: {mem_name} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for name in sides:
        r = med[name]
        if not results[name]:
            continue
        runs = ", ".join(f"{x['completions_per_s']:.1f}" for x in results[name])
        mems = ", ".join(f"{x['peak_memory_mb']:.0f}" for x in results[name])
        print(f"| {name} | {r['completions_per_s']:.1f} | {r['completions_per_cpu_s']:.1f} | "
              f"{r['peak_memory_mb']:.0f} | {r['process_peak_rss_mb']:.0f} | {r['mean_response_length']:.1f} | "
              f"{runs} | {mems} |")
    for side, errors in failed.items():
        if errors:
            print(f"{side}: failed in {len(errors)} of {a.repeats} run(s): {errors[0]}")
    for line in engine_lines(results):
        print(line)
    for ours, theirs, what in PAIRS:
        if results[ours] and results[theirs]:
            o, t = med[ours], med[theirs]
            print(f"ratio {ours} / {theirs} ({what}): speed {o['completions_per_s'] / t['completions_per_s']:.2f} "
                  f"wall, {o['completions_per_cpu_s'] / t['completions_per_cpu_s']:.2f} by CPU time (less "
                  f"sensitive to other load on the machine); memory {o['peak_memory_mb'] / t['peak_memory_mb']:.2f}, "
                  f"whole-process ru_maxrss (imports included) "
                  f"{o['process_peak_rss_mb'] / t['process_peak_rss_mb']:.2f}")
    print()
    for line in mfu_lines(results, a, n, prompt_tokens, peak, peak_what):
        print(line)
    for name in sides:  # each timed step's wall seconds, end to end (a slow one shows here, not in the medians)
        if results[name] and "step_s" in results[name][0]:
            print(f"step seconds {name}: " + " | ".join(" ".join(f"{x:.2f}" for x in r["step_s"])
                                                         for r in results[name]))
    ours, theirs = last_line_pair(sides)
    o, t = med[ours], med[theirs]
    print(f"grpo_throughput: rlhflab {o['completions_per_s']:.1f} completions/s, trl "
          f"{t['completions_per_s']:.1f} completions/s, speed ratio {o['completions_per_s'] / t['completions_per_s']:.2f}, "
          f"memory ratio {o['peak_memory_mb'] / t['peak_memory_mb']:.2f}")
    return 0


def _share_here(a: argparse.Namespace) -> str:
    """Whether rlhflab's side computes a group's prompt once, as its --share-prompt resolves
    on this bench's device."""
    from rlhflab import cpu
    return "on" if cpu.share_prompt(a.device, {"true": True, "false": False}.get(a.share_prompt, "auto")) else "off"


def last_line_pair(sides: list[str]) -> tuple[str, str]:
    """The sides the last line compares: the first like-for-like pair (PAIRS) any of whose
    sides ran (HF generate before vLLM), so its `rlhflab` and `trl` always sample alike."""
    for ours, theirs, what in PAIRS:
        if what.startswith("like for like") and {ours, theirs} & set(sides):
            return ours, theirs
    return PAIRS[0][:2]


if __name__ == "__main__":
    sys.exit(main())
