"""The LM head as a plain linear map, for log-probs computed from hidden states.

`rlhflab.ops.chunked_logprobs` needs the head's weight (and bias) instead of the logits.
That is exact only when the model's logits are nothing but ``hidden @ W^T + b``: true for
Llama, Qwen2, Mistral, Gemma (v1) and GPT-2, false for heads that soft-cap or scale the
logits (Gemma 2/3's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's
``logits_scaling``) or a LoRA adapter on the head itself. `linear_lm_head` returns None
for those, and callers fall back to the model's own logits.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from torch import Tensor, nn

from rlhflab.cpu.matmul import is_fast, is_linear

# Config fields that change the logits after the linear head when set (to anything but 1).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logit_scale")


class LinearHead(NamedTuple):
    weight: Tensor          # (V, H), shared with the input embedding when tied
    bias: Optional[Tensor]  # (V,) or None
    onednn: bool = False    # a FastLinear head (the CPU seam chose oneDNN): the chunked op's products too


def linear_lm_head(model: nn.Module) -> LinearHead | None:
    """The head's (weight, bias) when the model's logits are exactly hidden @ W^T + b, else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not is_linear(head):  # a peft LoRA layer on the head, or something else
        return None
    cfg = getattr(base, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for key in _LOGIT_TRANSFORMS:
        value = getattr(cfg, key, None)
        if value is not None and value != 1.0 and value is not False:
            return None
    return LinearHead(head.weight, head.bias, is_fast(head))
