"""Mixed precision: `training.mixed_precision: no | bf16`, float32 master weights.

The weights, their gradients and the optimizer state stay float32 (the model is loaded
as `model.torch_dtype` says, float32 by default); only the forward passes of the
decoders run under `torch.autocast`, which computes the matmuls (linear layers,
attention) in bfloat16 and keeps the residual stream, the norms and the softmax in
float32. The backward pass follows the dtypes of the forward; the optimizer step is
float32. This is the other way to bfloat16 beside `model.torch_dtype: bfloat16`, which
stores the weights themselves in bfloat16 (half the memory, no float32 master copy).

What stays float32 under autocast (each place turns autocast off for itself):
- the LM head's log-probs and entropy: `ops.chunked_logprobs` computes each chunk of
  logits in float32, and the full-logits fallback (`token_stats`) applies the head in
  float32;
- the value head (`ValueHead`) and a reward model's score head (`sequence_scores`);
- everything after the forward pass: log-prob differences and ratios, the KL, the
  advantages, the losses. They are elementwise ops on the float32 log-probs and values,
  and the trainers compute them outside the autocast region.

float16 is refused: its 5 exponent bits underflow small gradients, so it needs a loss
scaler (`torch.amp.GradScaler`), which rlhflab does not run.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from rlhflab.errors import UserError

MIXED_PRECISION = ("no", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16}


def device_type(device: torch.device | str) -> str:
    """"cpu" or "cuda" (what torch.autocast takes) from a device or its name."""
    return torch.device(device).type


def autocast(mode: str, device: torch.device | str) -> ContextManager:
    """The autocast region of a forward pass under `mode` ("no": nothing changes)."""
    if mode in (None, "no"):
        return contextlib.nullcontext()
    if mode not in AUTOCAST_DTYPES:
        raise UserError(f"training.mixed_precision: {mode!r} is not supported; use bf16 or no")
    return torch.autocast(device_type=device_type(device), dtype=AUTOCAST_DTYPES[mode])


def float32_region(device: torch.device | str) -> ContextManager:
    """A region computed in the inputs' own dtype inside an autocast one (autocast off)."""
    return torch.autocast(device_type=device_type(device), enabled=False)


def check_mixed_precision(mode: str, device: torch.device | str) -> None:
    """A one-line UserError when `mode` cannot train on `device`.

    fp16 is refused everywhere (no loss scaler); bf16 is refused on a GPU without it
    (before Ampere), and otherwise a tiny forward and backward under autocast is run, so
    a kernel the device lacks becomes the error rather than a traceback mid-run.
    """
    if mode in (None, "no"):
        return
    if mode == "fp16":
        raise UserError("training.mixed_precision: fp16 needs a loss scaler, which rlhflab does not run; "
                        "use training.mixed_precision=bf16 (CPU, or a GPU from Ampere on) or no")
    if mode not in AUTOCAST_DTYPES:
        raise UserError(f"training.mixed_precision: {mode!r}; choose one of {', '.join(MIXED_PRECISION)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("training.mixed_precision: bf16 is not supported by this GPU; "
                        "use training.mixed_precision=no")
    try:
        w = torch.full((8, 8), 0.1, device=dev, requires_grad=True)
        with autocast(mode, dev):
            h = torch.nn.functional.linear(torch.ones(2, 8, device=dev), w)
            y = torch.softmax(torch.nn.functional.silu(h) @ h.t(), dim=-1)
        y.float().sum().backward()
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"training.mixed_precision: bf16 cannot run on {dev.type} ({first}); "
                        "use training.mixed_precision=no") from None
