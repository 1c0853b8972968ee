"""A policy's weights in the Hugging Face checkpoint layout, as every engine loads them:
``(name, tensor)`` pairs, a peft LoRA model merged on the fly (the training model is not
modified). The vLLM engine streams them into its in-place reload; the rollout producer
(`rlhflab.rollout.service`) receives them as one state dict per version."""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor


def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of a causal LM as its checkpoint names them; a peft model merged.

    For a peft LoRA model each adapted layer yields ``W + Δ`` with ``Δ`` from peft's own
    ``get_delta_weight`` (scale x B @ A, transposed where the layer needs it); the
    adapter factors are not sent and the training model is not modified.

    Tied weights go out under every name (``remove_duplicate=False``): vLLM re-processes
    each layer from the tensors it receives, and a tied LM head that receives nothing
    keeps serving the old weights (measured: greedy agreement fell to 23% after an
    update of the embeddings).
    """
    if not hasattr(model, "get_base_model"):  # a plain transformers model
        for name, p in model.named_parameters(remove_duplicate=False):
            yield name, p.detach()
        return
    base = model.get_base_model()
    merged: dict[str, Tensor] = {}
    for name, module in base.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            weight = module.base_layer.weight.detach()
            for adapter in module.active_adapters:
                if adapter in module.lora_A and adapter not in module.merged_adapters:
                    weight = weight + module.get_delta_weight(adapter).detach().to(weight.dtype)
            merged[f"{name}.weight"] = weight
    for name, p in base.named_parameters(remove_duplicate=False):
        if ".lora_" in name or ".original_module." in name:
            continue  # adapter factors (merged above) and a modules_to_save original
        name = name.replace(".base_layer.", ".")
        for adapter in getattr(model, "active_adapters", []):
            name = name.replace(f".modules_to_save.{adapter}.", ".")
        yield name, merged.pop(name, p.detach())
    for name, weight in merged.items():  # adapted layers whose base weight is frozen elsewhere
        yield name, weight
