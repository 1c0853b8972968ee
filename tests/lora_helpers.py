"""A LoRA adapter that changes a model's outputs, for the tests that load adapter folders."""

from __future__ import annotations

from pathlib import Path


def save_lora_adapter(base_dir: Path, out: Path, std: float) -> Path:
    """A rank-4 LoRA adapter on the model in `base_dir`, its B drawn from N(0, std) (peft
    starts B at zero, which would leave the outputs unchanged), saved alone to `out`
    (adapter_config.json and the adapter weights, no config.json). Seeded: the same each call."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhflab.models.load import add_lora

    torch.manual_seed(0)
    model = add_lora(AutoModelForCausalLM.from_pretrained(str(base_dir)), r=4)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=std)
    model.save_pretrained(out)
    return out
