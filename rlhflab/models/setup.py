"""The models of a policy-optimisation run, built once: the policy (+LoRA), its critic
when the method has one, and the frozen reference when a KL term needs it.

Every trainer that optimises a policy (PPO, GRPO, RLOO, REINFORCE++, TRPO, DPO) builds
its models here, so a resume, LoRA and the reference follow one rule:

- The reference is always the *starting* policy, also when resuming: a frozen copy
  (`model.reference: copy`), and under LoRA always the policy with its adapter switched
  off (the base weights never train, so that *is* the starting policy; a copy would
  compute the same function in twice the memory).
- `need_reference=False` loads no reference at all (a KL weight of 0).
- `model.load_in_4bit` / `load_in_8bit` load the policy's base quantised (QLoRA, CUDA
  only: `models.quant`); the adapter trains on it and the reference is the same base
  with the adapter off.
- The policy's logits are those of its own forward: `models.head.logit_transform` (a soft
  cap, a scale) is applied wherever log-probs come from hidden states, and a model whose
  transform rlhflab cannot map is refused here, before any step.
- The value head (and a separate critic's) is as wide as the decoder's output really is
  (`hidden_size_of`: the LM head's input, OPT's word_embed_proj_dim).
- Dropout is switched off everywhere, so before the first update the ratio π/π_old is
  exactly 1. The one exception is the value head's own `model.value_head_dropout` (0 by
  default), which touches no log-prob and runs only in passes with gradients.
- `model.lean_mlp` switches the gated MLPs of the trained models (policy, separate critic)
  to `models.lean.GatedMLP`: the same function, half the MLP's saved activations.
- Nothing here is CPU-specific: oneDNN linears, the lean RMSNorm, the critic's worker
  thread and `mallopt` are the run context's (`rlhflab.cpu`), on a CPU only.
- `mixed_precision` ("no" or "bf16", `training.mixed_precision`) is set on the actor and
  the reference alike: their decoders run under the same autocast, so the old log-probs,
  the reference's and the update's are computed the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from rlhflab.models.actor_critic import (ActorCritic, Critic, PolicyOnly, Reference, ValueHead, hidden_size_of,
                                         load_value_head)
from rlhflab.models.head import logit_transform
from rlhflab.models.lean import make_lean
from rlhflab.models.load import add_lora, disable_dropout, load_adapter, load_model, resolve_device
from rlhflab.models.precision import check_mixed_precision
from rlhflab.models.quant import prepare_quantized, quantization_kwargs

CriticKind = Literal["value_head", "separate"]


@dataclass
class PolicyModels:
    actor: PolicyOnly            # an ActorCritic when the method has a critic
    reference: Reference | None  # None when no KL is used: then no reference is loaded at all
    tokenizer: object
    device: torch.device

    @property
    def policy(self) -> nn.Module:
        return self.actor.policy


def _compile_layers(actor, reference, model_cfg, dev: torch.device, world_size: int) -> None:
    """`model.compile_layers`: the policy's, a separate critic's and a frozen reference's
    decoder layers prepared for the teacher-forced passes (rlhflab/models/compiled.py)."""
    from rlhflab.errors import UserError
    from rlhflab.models.compiled import compile_layers
    from rlhflab.cpu import matmul_library

    if world_size > 1:
        raise UserError(f"model.compile_layers: not measured with several processes ({world_size} launched; DDP, "
                        f"FSDP and ZeRO wrap the layers themselves); set model.compile_layers: false, or run one "
                        f"process")
    if dev.type == "cpu" and matmul_library() == "onednn":
        raise UserError("model.compile_layers: the oneDNN linear layers that cpu.matmul puts on this CPU do not "
                        "compile; set cpu.matmul: torch, or model.compile_layers: false (oneDNN's eager linears "
                        "were faster than the compiled layers on torch's, docs/howto_gpu.md)")
    models = [actor.policy]
    if getattr(actor, "critic", None) is not None:
        models.append(actor.critic.base)
    if reference is not None and reference.model is not None:  # lora_disabled runs the policy's own layers
        models.append(reference.model)
    for model in models:
        compile_layers(model)


def build_models(model_cfg, lora_cfg, device: str, *, need_reference: bool,
                 critic: CriticKind | None = None, resume_dir: Path | None = None,
                 mixed_precision: str = "no", world_size: int = 1) -> PolicyModels:
    """Policy (+LoRA), the critic (`critic`: value_head, separate or None) and, when
    `need_reference`, the frozen reference; weights from `resume_dir` when resuming.
    `mixed_precision`: the autocast of every decoder pass ("no" or "bf16"); `world_size`:
    the run's processes (`model.compile_layers` serves one)."""
    dev = resolve_device(device)
    check_mixed_precision(mixed_precision, dev)
    load_kw = dict(torch_dtype=model_cfg.torch_dtype, device=str(dev),
                   trust_remote_code=model_cfg.trust_remote_code, tokenizer=model_cfg.tokenizer,
                   attn_implementation=model_cfg.attn_implementation)
    quant = quantization_kwargs(model_cfg, lora_cfg, dev)  # {} unless model.load_in_4bit/8bit (QLoRA)
    full_resume = resume_dir is not None and not lora_cfg.enabled
    policy, tok = load_model(str(resume_dir) if full_resume else model_cfg.name_or_path, **load_kw, **quant)
    logit_transform(policy)  # a family whose logit transform rlhflab cannot map: refused before anything runs
    reference = None
    if need_reference and not lora_cfg.enabled:
        # The reference is always the starting policy, also when resuming.
        src = load_model(model_cfg.name_or_path, **load_kw)[0] if full_resume else policy
        reference = Reference.frozen_copy(src)
        disable_dropout(reference.model)
        del src
    if lora_cfg.enabled:
        policy = prepare_quantized(policy, model_cfg.gradient_checkpointing)
        if resume_dir is not None:
            policy = load_adapter(policy, resume_dir / "adapter", trainable=True)
        else:
            policy = add_lora(policy, lora_cfg.r, lora_cfg.alpha, lora_cfg.dropout, lora_cfg.target_modules)
        if need_reference:
            reference = Reference.lora_disabled(policy)
    disable_dropout(policy)
    make_lean(policy, model_cfg)  # after LoRA
    if model_cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    if critic is None:
        actor = PolicyOnly(policy)
    elif critic == "separate":
        src = str(resume_dir / "critic") if resume_dir is not None else (
            model_cfg.critic_name_or_path or model_cfg.name_or_path)
        base = load_model(src, **load_kw)[0]
        disable_dropout(base)
        make_lean(base, model_cfg)
        head = ValueHead.from_config(hidden_size_of(base), model_cfg).to(dev)
        if resume_dir is not None:
            load_value_head(head, resume_dir / "critic")
        actor = ActorCritic(policy, critic=Critic(base, head))
    else:
        head = ValueHead.from_config(hidden_size_of(policy), model_cfg).to(dev)
        if resume_dir is not None:
            load_value_head(head, resume_dir)
        actor = ActorCritic(policy, value_head=head)
    actor.mixed_precision = mixed_precision
    if reference is not None:
        reference.mixed_precision = mixed_precision
    if getattr(model_cfg, "compile_layers", False):
        _compile_layers(actor, reference, model_cfg, dev, world_size)
    actor.train()
    return PolicyModels(actor, reference, tok, dev)

