"""A quantised base with a LoRA adapter (QLoRA): `model.load_in_4bit` / `model.load_in_8bit`.

The base weights are loaded by bitsandbytes in 4 bits (NF4 with double quantisation, the
QLoRA paper's choice, Dettmers et al. 2023) or 8 bits (LLM.int8), frozen, and a LoRA
adapter in full precision trains on top of them. Before the adapter is attached the
model goes through peft's `prepare_model_for_kbit_training` (as in the notebook seed):
the layer norms and the output head are cast to float32 and the input embeddings'
output requires grad, so gradients reach the adapters of the first layer also under
gradient checkpointing.

Where it runs: bitsandbytes' kernels need CUDA, so a run on any other device, a machine
without bitsandbytes, or a config without LoRA is refused with one line saying what to
do (`check_quantization` in the config schema refuses the last at load time already).
Not covered: the reward model, the classifier, `rlhflab tpo` and `label generate`, whose
models load in full precision (`refuse_quantization` stops them with one line instead of
ignoring the key); and FSDP or DeepSpeed ZeRO-3 sharding of a quantised
base, which is untested.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from rlhflab.config.schema import check_quantization
from rlhflab.errors import UserError


def quantization_key(model_cfg) -> str | None:
    """The key that asks for a quantised base, or None."""
    if getattr(model_cfg, "load_in_4bit", False):
        return "model.load_in_4bit"
    if getattr(model_cfg, "load_in_8bit", False):
        return "model.load_in_8bit"
    return None


def refuse_quantization(model_cfg, what: str) -> None:
    """A `UserError` when `model_cfg` asks for a quantised base where `what` (a command, a
    model) loads in full precision, instead of ignoring the key."""
    key = quantization_key(model_cfg)
    if key is not None:
        raise UserError(f"{key}: {what} loads its model in full precision (a 4- or 8-bit base is for LoRA "
                        f"training of a policy: sft, dpo and the RL methods); set {key}=false")


def quantization_kwargs(model_cfg, lora_cfg, device: torch.device | str) -> dict[str, Any]:
    """The `from_pretrained` keywords of the quantised base the config asks for ({} for
    none); a `UserError` naming the key and the fix where it cannot run here."""
    key = quantization_key(model_cfg)
    if key is None:
        return {}
    errs = check_quantization(model_cfg, lora_cfg)
    if errs:
        raise UserError(errs[0])
    device = torch.device(device)
    if device.type != "cuda":
        raise UserError(f"{key}: bitsandbytes' quantised layers run on CUDA only and this run's device is "
                        f"{device.type}; set {key}=false (LoRA on the {model_cfg.torch_dtype} model) or run on a "
                        f"CUDA GPU")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(f"{key}: bitsandbytes is not installed; pip install bitsandbytes (or "
                        f"'rlhflab[bnb]'), or set {key}=false")
    from transformers import BitsAndBytesConfig

    if key == "model.load_in_8bit":
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        compute = model_cfg.torch_dtype if model_cfg.torch_dtype in ("bfloat16", "float16") else "float32"
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                    bnb_4bit_compute_dtype=getattr(torch, compute))
    return {"quantization_config": config}


def prepare_quantized(model: torch.nn.Module, gradient_checkpointing: bool) -> torch.nn.Module:
    """peft's `prepare_model_for_kbit_training` on a quantised base (a no-op otherwise);
    call before the LoRA adapter is attached."""
    if not getattr(model, "is_quantized", False):
        return model
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
