"""The LM head as a linear map plus the model's own logit transform, for log-probs
computed from hidden states.

`rlhflab.ops.chunked_logprobs` needs the head's weight (and bias) instead of the logits,
and the transform f the model's forward applies to ``a = hidden @ W^T + b`` before the
softmax (`ops.LogitTransform`): nothing for Llama, Qwen2, Mistral, Gemma (v1), GPT-2 and
OPT; a soft cap ``c tanh(a / c)`` for Gemma 2 (``final_logit_softcapping``); a scale for
Cohere (times ``logit_scale``), Granite and MiniCPM3 (divided by ``logits_scaling``) and
Falcon-H1 (times ``lm_head_multiplier``). `logit_transform` reads it from the config the
way transformers 5.19's forward of the model's class does (`_RULES`), so the training
log-probs are those of the logits the sampler (HF ``generate``, vLLM) samples from.

A model whose logits depend on a config key in a way rlhflab does not reproduce (a class
outside `_RULES` whose forward reads such a key, any remote-code class with one set, a
vocabulary cut to ``unpadded_vocab_size``) is refused with one `UserError` line rather
than trained on log-probs of other logits. `linear_lm_head` returns None for a head that
is not a plain linear layer (a LoRA adapter on the head itself) or for such a model; its
callers then use the model's own logits from its full forward (exact), and the callers
that only have hidden states apply the head and `logit_transform` themselves
(`models.actor_critic.head_logits`).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import NamedTuple, Optional

from torch import Tensor, nn

from rlhflab.errors import UserError
from rlhflab.cpu.matmul import is_fast, is_linear
from rlhflab.ops.chunked import IDENTITY, LogitTransform

# Config keys that change a model's logits after (or its hidden state before) the head,
# in the transformers families that have them or in remote code (MiniCPM 1/2's
# dim_model_base). A class outside `_RULES` with one of them set is checked by `_reads`.
TRANSFORM_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier",
                  "output_multiplier", "logits_soft_cap", "output_logit_soft_cap", "output_logit_scale",
                  "logits_mup_width_multiplier", "unpadded_vocab_size", "dim_model_base", "scale_width")

# What each transformers 5.19 class's forward does to lm_head(hidden), in order:
# ("mul", key): times the key; ("div", key): divided by it (on the logits, or on the hidden
# state before a bias-free head: the same map); ("cap", key): key * tanh(. / key).
# A key whose value is None is skipped, as the forwards' `if ... is not None` do.
_CAP = (("cap", "final_logit_softcapping"),)
_RULES: dict[str, tuple[tuple[str, str], ...]] = {
    **dict.fromkeys(("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3nForCausalLM",
                     "Gemma3nForConditionalGeneration", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
                     "Gemma4UnifiedForCausalLM", "Gemma4UnifiedForConditionalGeneration", "VaultGemmaForCausalLM",
                     "NanoChatForCausalLM"), _CAP),
    "RecurrentGemmaForCausalLM": (("cap", "logits_soft_cap"),),
    "xLSTMForCausalLM": (("cap", "output_logit_soft_cap"),),
    "MuseGlimmerForConditionalGeneration": (("mul", "output_multiplier"), ("cap", "final_logit_softcapping")),
    **dict.fromkeys(("CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM", "CohereCompassForCausalLM",
                     "CohereCompassForConditionalGeneration"), (("mul", "logit_scale"),)),
    **dict.fromkeys(("GraniteForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeForCausalLM",
                     "GraniteMoeSWAForCausalLM", "GraniteMoeHybridForCausalLM", "GraniteMoeSharedForCausalLM",
                     "Granite4VisionForConditionalGeneration"), (("div", "logits_scaling"),)),
    # the same key as Granite's, the other way round
    **dict.fromkeys(("HyperCLOVAXForCausalLM", "HyperCLOVAXVisionV2ForConditionalGeneration"),
                    (("mul", "logits_scaling"),)),
    "MiniCPM3ForCausalLM": (("div", "logits_scaling"),),  # hidden / (hidden_size / dim_model_base)
    "FalconH1ForCausalLM": (("mul", "lm_head_multiplier"),),
    **dict.fromkeys(("InklingForCausalLM", "InklingForConditionalGeneration"),
                    (("div", "logits_mup_width_multiplier"),)),
}


class LinearHead(NamedTuple):
    weight: Tensor          # (V, H), shared with the input embedding when tied
    bias: Optional[Tensor]  # (V,) or None
    onednn: bool = False    # a FastLinear head (the CPU seam chose oneDNN): the chunked op's products too
    transform: LogitTransform = IDENTITY  # the model's own f(hidden @ W^T + b), `logit_transform`


def _base_and_config(model: nn.Module):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return base, cfg, text


def _is_set(key: str, value, text) -> bool:
    """Whether a transform key's value changes anything (None, False and 1 do not)."""
    if value is None or value is False or (not isinstance(value, str) and value == 1):
        return False
    if key == "dim_model_base":
        return value != getattr(text, "hidden_size", value)
    if key == "unpadded_vocab_size":
        return value < getattr(text, "vocab_size", value)
    return True


@functools.lru_cache(maxsize=64)
def _reads(cls: type, keys: tuple[str, ...]) -> bool:
    """Whether `cls.forward`'s source names one of `keys` (True when the source is unreadable);
    cached, as every teacher-forced pass asks."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True
    return any(k in source for k in keys)


def _refuse(base: nn.Module, cfg, what: str) -> UserError:
    name = getattr(cfg, "_name_or_path", "") or type(base).__name__
    return UserError(f"model {name}: {what}, which rlhflab cannot reproduce from hidden states (its log-probs "
                     f"would not be those the model samples from); use a model family whose logits rlhflab maps "
                     f"(rlhflab/models/head.py lists them)")


def logit_transform(model: nn.Module) -> LogitTransform:
    """The transform the model's forward applies to its head's output; see the module docstring.
    A model rlhflab cannot map raises `UserError`."""
    base, cfg, text = _base_and_config(model)
    if text is None:
        return IDENTITY
    cls = type(base)
    native = cls.__module__.startswith("transformers.")
    rule = _RULES.get(cls.__name__) if native else None
    if rule is None:
        found = [k for k in TRANSFORM_KEYS if _is_set(k, getattr(text, k, None), text)]
        if not found or (native and not _reads(cls, tuple(found))):
            return IDENTITY  # no key set, or a transformers class that ignores them (MPT, PaliGemma, ...)
        shown = ", ".join(f"{k}={getattr(text, k)!r}" for k in found)
        raise _refuse(base, cfg, f"{cls.__name__} may change its logits by config {shown}")
    unpadded = getattr(text, "unpadded_vocab_size", None)
    if unpadded is not None and _is_set("unpadded_vocab_size", unpadded, text):
        raise _refuse(base, cfg, f"{cls.__name__} cuts its logits to unpadded_vocab_size={unpadded} of "
                                 f"{getattr(text, 'vocab_size', '?')}")
    scale, softcap = 1.0, None
    for op, key in rule:
        value = getattr(text, key, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise _refuse(base, cfg, f"config {key}={value!r} is not a positive number")
        if op == "mul":
            scale *= float(value)
        elif op == "div":
            scale /= float(value)
        else:  # "cap", always last in a rule
            softcap = float(value)
    if cls.__name__ in ("MiniCPM3ForCausalLM", "InklingForCausalLM", "InklingForConditionalGeneration"):
        head = base.get_output_embeddings()
        if scale != 1.0 and getattr(head, "bias", None) is not None:  # (h / d) W^T + b is not (h W^T + b) / d
            raise _refuse(base, cfg, f"{cls.__name__} divides its hidden state before a head with a bias")
    return LogitTransform(scale, softcap)


def linear_lm_head(model: nn.Module) -> LinearHead | None:
    """The head's (weight, bias) and the model's logit transform when the logits are exactly
    f(hidden @ W^T + b) with a plain linear head; None for a LoRA-adapted head or a model
    whose transform rlhflab cannot map (the caller then uses the model's own logits)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not is_linear(head):  # a peft LoRA layer on the head, or something else
        return None
    try:
        transform = logit_transform(model)
    except UserError:
        return None
    return LinearHead(head.weight, head.bias, is_fast(head), transform)
