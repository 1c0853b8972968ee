"""The actor-critic: a causal LM (the policy) and a value estimate per token.

Two layouts:
- ``value_head`` (default): a linear head on the policy's last hidden state. One pass
  of the shared base gives both the logits and the values.
- ``separate``: a critic model of its own (its own base and head), as in the notebook
  seed's ``PPOModel(actor, critic)``; two passes, twice the memory, no shared gradients.

Only the response positions are needed, so `forward_response` runs the decoder over
prompt+response once and applies the LM head and the value head to the T hidden
states that predict response tokens (the ``prompt_len-1 : prompt_len+T-1`` slice),
not to all L positions: the (B, L, V) logits of the prompt are never made.

The value head computes in float32 whatever the model dtype (values are regression
targets of a few units; bfloat16's 8 bits of mantissa are too coarse for them).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NamedTuple

import torch
from torch import Tensor, nn


class ValueHead(nn.Module):
    """hidden (…, H) -> value (…), a linear layer in float32 with a small-normal init."""

    def __init__(self, hidden_size: int, init_std: float = 1e-2):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.normal_(self.summary.weight, std=init_std)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.summary(hidden.float()).squeeze(-1)


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder stack returning hidden states, LM head) of a *ForCausalLM model."""
    base = unwrap(model)
    head = base.get_output_embeddings()
    decoder = getattr(base, base.base_model_prefix, None)
    if decoder is None or head is None:
        raise TypeError(f"{type(base).__name__} does not expose a decoder and an LM head")
    return decoder, head


def hidden_size_of(model: nn.Module) -> int:
    cfg = unwrap(model).config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd"))


def position_ids_from(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: 0 at each row's first real token. (B, L)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class ResponseOutput(NamedTuple):
    logits: Tensor        # (B, T, V) logits predicting each response token
    values: Tensor | None  # (B, T) float32 value of the state before each response token


def _response_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                     prompt_len: int) -> Tensor:
    decoder, _ = decoder_and_head(model)
    # The last token predicts nothing we use, and attention is causal: leave it out.
    ids, am = input_ids[:, :-1], attention_mask[:, :-1]
    out = decoder(input_ids=ids, attention_mask=am, position_ids=position_ids_from(am), use_cache=False)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state  # (B, L-1, H)
    # Position prompt_len-1+t holds the state that predicts response token t.
    return hidden[:, prompt_len - 1 :]                                   # (B, T, H)


class ActorCritic(nn.Module):
    """Policy LM plus a critic; see the module docstring for the two layouts."""

    def __init__(self, policy: nn.Module, value_head: ValueHead | None = None,
                 critic: nn.Module | None = None):
        super().__init__()
        if value_head is None and critic is None:
            raise ValueError("give a value_head (shared base) or a critic (separate model)")
        self.policy = policy
        self.value_head = value_head
        self.critic = critic  # a _Critic: base decoder + its own ValueHead

    @property
    def separate_critic(self) -> bool:
        return self.critic is not None

    def forward_response(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                         with_values: bool = True) -> ResponseOutput:
        """Logits (B, T, V) and values (B, T) for the response part of prompt+response."""
        hidden = _response_hidden(self.policy, input_ids, attention_mask, prompt_len)
        _, head = decoder_and_head(self.policy)
        logits = head(hidden)
        values = None
        if with_values:
            if self.critic is not None:
                values = self.critic(input_ids, attention_mask, prompt_len)
            else:
                values = self.value_head(hidden)
        return ResponseOutput(logits, values)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


class Critic(nn.Module):
    """A separate critic: a causal LM's decoder plus a value head."""

    def __init__(self, base: nn.Module, value_head: ValueHead | None = None):
        super().__init__()
        self.base = base
        self.value_head = value_head or ValueHead(hidden_size_of(base))

    def forward(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
        return self.value_head(_response_hidden(self.base, input_ids, attention_mask, prompt_len))


class Reference:
    """The frozen reference policy π_ref for the KL penalty.

    - ``copy``: a deep copy of the policy taken before training, frozen (no grads, eval).
    - ``lora_disabled``: the policy itself with its LoRA adapter switched off: the base
      weights never train under LoRA, so this *is* the starting policy, with no second
      copy in memory.
    """

    def __init__(self, model: nn.Module | None, policy: nn.Module | None = None):
        self.model = model    # the frozen copy, or None with lora_disabled
        self.policy = policy  # the peft policy whose adapter is switched off

    @classmethod
    def frozen_copy(cls, policy: nn.Module) -> "Reference":
        ref = copy.deepcopy(unwrap(policy) if not hasattr(policy, "disable_adapter") else policy)
        if hasattr(ref, "merge_and_unload"):  # a peft copy: fold the adapter in, drop peft
            ref = ref.merge_and_unload()
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return cls(ref)

    @classmethod
    def lora_disabled(cls, policy: nn.Module) -> "Reference":
        if not hasattr(policy, "disable_adapter"):
            raise ValueError("reference lora_disabled needs a peft (LoRA) policy")
        return cls(None, policy)

    @contextmanager
    def _active(self) -> Iterator[nn.Module]:
        if self.model is not None:
            yield self.model
        else:
            with self.policy.disable_adapter():
                yield self.policy

    @torch.no_grad()
    def response_logits(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
        """(B, T, V) logits of the reference on the response part."""
        with self._active() as model:
            hidden = _response_hidden(model, input_ids, attention_mask, prompt_len)
            _, head = decoder_and_head(model)
            return head(hidden)


def save_value_head(head: nn.Module, folder: str | Path, name: str = "value_head.safetensors") -> Path:
    from safetensors.torch import save_file

    path = Path(folder) / name
    save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}, str(path))
    return path


def load_value_head(head: nn.Module, folder: str | Path, name: str = "value_head.safetensors") -> None:
    from safetensors.torch import load_file

    head.load_state_dict(load_file(str(Path(folder) / name)))

