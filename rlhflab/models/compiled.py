"""`model.compile_layers`: the decoder layers of the training passes compiled with
`torch.compile`, one layer at a time ("regional" compilation).

At a small model's size a GPU spends a training pass launching kernels, not computing:
inductor fuses each layer's elementwise work (norms, rotary embedding, the gated MLP's
activation, residual adds) into a few kernels. A probe (since removed from bench/; in git history) measured the update
step of SmolLM2-135M (forward, backward, AdamW; bf16 autocast) on one H200 at 119.8 ms eager
against 78.6 ms compiled. On a CPU it needs torch's own linear layers (inductor does not
lower oneDNN's): on a 2-core AMD EPYC, 8.9-9.0 s compiled against 10.3-11.4 s eager, 8.9 s
eager with rlhflab's lean MLP and 6.5 s eager on oneDNN's linears, which `cpu.matmul:
auto` picks there. It replaces the lean MLP (`models.lean.make_lean` leaves it out): each
lean MLP's own forward made dynamo recompile per layer and fall back to eager.

The compiled layers are used only inside `compiled_layers(decoder)`, which the teacher-forced
passes (scoring, update, the reference's pass) enter around their one full decoder call:
generation keeps the eager layers (transformers compiles it by itself around a static KV
cache), as does the shared-prompt pass, whose layers carry a KV cache. Every layer but the
last is compiled: the last keeps the MLP hooks of `actor_critic.last_layer_rows`. The
compiled wrappers are kept beside the model, not in it, so state dicts, saving and
optimizers see the model's own modules.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from rlhflab.errors import UserError

# decoder -> (its own layers, the list with every layer but the last compiled)
_COMPILED: "weakref.WeakKeyDictionary[nn.Module, tuple[nn.ModuleList, nn.ModuleList]]" = weakref.WeakKeyDictionary()


def compile_layers(model: nn.Module) -> int:
    """Prepare `model`'s decoder layers for `compiled_layers` (compiled lazily, at the first
    pass: dynamic shapes, since a run's lengths change); returns how many were wrapped."""
    from rlhflab.models.actor_critic import decoder_and_head

    decoder, _ = decoder_and_head(model)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) < 2:
        raise UserError(f"model.compile_layers: {type(decoder).__name__} keeps no list of decoder layers under "
                        f"`.layers` (Llama, Qwen, Mistral and Gemma decoders do); set model.compile_layers: false")
    if decoder not in _COMPILED:
        _COMPILED[decoder] = (layers, compiled_list(layers))
    return len(layers) - 1


def compiled_list(layers: nn.ModuleList, dynamic: bool = True) -> nn.ModuleList:
    """`layers` with every one but the last wrapped in `torch.compile` (the same modules and
    weights; compiled at the first call); `dynamic`: shapes marked dynamic, as a run's
    changing lengths need (the probe also timed static ones)."""
    return nn.ModuleList([*(torch.compile(layer, dynamic=dynamic) for layer in layers[:-1]), layers[-1]])


@contextmanager
def compiled_layers(decoder: nn.Module) -> Iterator[None]:
    """While inside, `decoder` runs its compiled layers (nothing changes for a decoder that
    `compile_layers` did not prepare)."""
    pair = _COMPILED.get(decoder)
    if pair is None:
        yield
        return
    own, compiled = pair
    decoder.layers = compiled
    try:
        yield
    finally:
        decoder.layers = own
