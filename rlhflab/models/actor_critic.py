"""The actor-critic: a causal LM (the policy) and a value estimate per token.

Two layouts:
- ``value_head`` (default): a linear head on the policy's last hidden state. One pass
  of the shared base gives both the logits and the values.
- ``separate``: a critic model of its own (its own base and head), as in the notebook
  seed's ``PPOModel(actor, critic)``; two passes, twice the memory, no shared gradients.

A critic-free method (GRPO, RLOO, REINFORCE++, DPO) uses `PolicyOnly`: the same
interface with no critic.

Only the response positions are needed, so the forward pass runs the decoder over
prompt+response once and applies the LM head and the value head to the T hidden
states that predict response tokens (the ``prompt_len-1 : prompt_len+T-1`` slice),
not to all L positions: the (B, L, V) logits of the prompt are never made. For the same
reason the last decoder layer's MLP runs on those T rows only (`last_layer_rows`): a
prompt position's output from the last layer feeds nothing (its keys and values, read by
later positions, come from the layer's input), so the results equal the full pass's.

Prompt sharing: when the rows of a batch come in groups of ``group_size`` answers to the
same prompt (GRPO, RLOO), the shared layout (`models.layout.shared_plan`) gives the decoder
each group's prompt once with its responses after it in one packed row, each response
attending to the prompt and to itself; the prompt's state that predicts every response's
first token is read once per row, so the prompt's gradient is the sum over its rows, as
in the full pass. The results equal the plain pass up to float rounding.

The value head computes in float32 whatever the model dtype (values are regression
targets of a few units; bfloat16's 8 bits of mantissa are too coarse for them).

Mixed precision (`training.mixed_precision: bf16`): each module here runs its decoder
under autocast (its `mixed_precision` attribute, set by `models.setup.build_models`) and
computes the log-probs, entropy and values from the decoder's output in float32, so
every caller (the engine, the scoring pass, the reference, TRPO, DPO) gets the same
split without wrapping anything (`rlhflab.models.precision`).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Literal, NamedTuple

import torch
from torch import Tensor, nn

from rlhflab import ops
from rlhflab.models.compiled import compiled_layers
from rlhflab.models import layout as layouts
from rlhflab.models.head import linear_lm_head, logit_transform
from rlhflab.models.precision import autocast, float32_region


ValueHeadInit = Literal["normal", "zero", "uniform"]


class ValueHead(nn.Module):
    """hidden (…, H) -> value (…), a linear layer in float32 (`model.value_head_*`).

    `init`: ``normal`` (default): weight ~ N(0, init_std²), bias 0, so the first values
    are small (std init_std·|h|); ``zero``: weight and bias 0, every first value is
    exactly 0; ``uniform``: PyTorch's own `nn.Linear` init, U(±1/√H) for weight and bias
    (TRL's ``v_head_init_strategy: null``).

    `dropout` (TRL's ``summary_dropout_prob``) drops hidden features before the linear
    layer, only in a pass that trains the head: train mode *and* gradients on. The
    no-grad scoring of a rollout (old values, the GAE targets and the value-clip centre)
    runs in train mode too, and there it would add noise to the targets, so it gets the
    full head; `eval()` switches it off as usual. With 0 there is no dropout module at
    all: the head computes exactly what it did before these options existed.
    """

    def __init__(self, hidden_size: int, init_std: float = 1e-2, init: ValueHeadInit = "normal",
                 dropout: float = 0.0):
        super().__init__()
        if init not in ("normal", "zero", "uniform"):
            raise ValueError(f"value head init must be normal, zero or uniform, got {init!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"value head dropout must be in [0, 1), got {dropout}")
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.summary = nn.Linear(hidden_size, 1, dtype=torch.float32)  # PyTorch's init: the "uniform" case
        if init == "normal":
            nn.init.normal_(self.summary.weight, std=init_std)
            nn.init.zeros_(self.summary.bias)
        elif init == "zero":
            nn.init.zeros_(self.summary.weight)
            nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        with float32_region(hidden.device):  # float32 also inside an autocast region
            hidden = hidden.float()
            if self.dropout is not None and self.training and torch.is_grad_enabled():
                hidden = self.dropout(hidden)
            return self.summary(hidden).squeeze(-1)

    @classmethod
    def from_config(cls, hidden_size: int, model_cfg) -> "ValueHead":
        """The head `model.value_head_init`, `_init_std` and `_dropout` describe."""
        return cls(hidden_size, init_std=model_cfg.value_head_init_std, init=model_cfg.value_head_init,
                   dropout=model_cfg.value_head_dropout)


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
    """The width of the decoder's last hidden state (what `response_hidden` returns and the
    value head reads): the LM head's input features, since the head reads that state. For
    OPT-350m that is word_embed_proj_dim (512, after the decoder's project_out), not
    hidden_size (1024). The config's hidden_size (or n_embd) where the head shows no width."""
    base = unwrap(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    width = getattr(head, "in_features", None)  # nn.Linear, FastLinear, peft's LoRA layer, bitsandbytes'
    if isinstance(width, int) and width > 0:
        return width
    cfg = base.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd"))


def position_ids_from(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: 0 at each row's first real token. (B, L)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def is_checkpointing(model: nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on; it rules out reusing a KV cache."""
    base = unwrap(model)
    flag = getattr(type(base), "is_activation_checkpointing", None) or getattr(type(base), "is_gradient_checkpointing", None)
    return bool(flag.__get__(base)) if isinstance(flag, property) else False


def _last_hidden(out) -> Tensor:
    return out[0] if isinstance(out, tuple) else out.last_hidden_state


def _last_mlp(decoder: nn.Module) -> nn.Module | None:
    """The last decoder layer's MLP when it is a dense, per-token block (gate, up and down
    projections: Llama, Qwen2, Mistral, Gemma, with or without LoRA), else None."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return None
    mlp = getattr(layers[-1], "mlp", None)
    if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return None
    return mlp


@contextmanager
def last_layer_rows(model: nn.Module, decoder: nn.Module, start: int) -> Iterator[None]:
    """While a decoder pass runs, its last layer's MLP computes positions [start:] only and
    gives zeros for the rest: for a caller that reads the last hidden state at positions
    >= `start` alone, the same values and gradients for less work. (A position's last-layer
    output feeds nothing but the final norm and the heads; the attention of later
    positions reads keys and values made from the layer's input.) The MLP is the bulk of a
    layer's product (about 3/4 of its weights in a Llama-style block); the attention part
    of the layer still runs on every position. A no-op where the MLP is not a dense
    per-token block (mixture-of-experts routing, unknown layouts) and under activation
    checkpointing, whose recomputation in the backward pass runs outside this context."""
    mlp = _last_mlp(decoder)
    if mlp is None or start <= 0 or is_checkpointing(model):
        yield
        return

    def rows_in(module, args, kwargs):
        if not args:  # called with a keyword input: left whole
            return None
        return (args[0][:, start:], *args[1:]), kwargs

    def rows_out(module, args, kwargs, out):  # args: the input as rows_in left it
        if not args:
            return None
        return torch.nn.functional.pad(out, (0, 0, start, 0))  # (B, start + n, H): zeros first

    handles = (mlp.register_forward_pre_hook(rows_in, with_kwargs=True),
               mlp.register_forward_hook(rows_out, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def response_hidden(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                    response_mask: Tensor, group_size: int = 1, layout: str = "padded") -> Tensor:
    """Hidden states (B, T, H) that predict each response token.

    prompt_ids, prompt_mask: (B, P) left-padded, or (G, P) with one row per group when
    `group_size` k > 1 (rows [g·k, (g+1)·k) of the responses answer prompt g);
    response_ids, response_mask: (B, T) right-padded. `layout` (`models.layout`): padded,
    packed, or shared (packed with each group's prompt once); the same states, to float
    rounding, with zeros on padding under packed and shared. padded and packed give each row
    its own copy of a group's prompt (the prompt's gradient sums over them, as shared's does).
    """
    if layout not in ("padded", "packed", "shared"):
        raise ValueError(f"layout must be padded, packed or shared, got {layout!r}")
    decoder, _ = decoder_and_head(model)
    k = group_size
    if layout == "shared":  # where packing would not be exact (`layouts.choose`): padded
        rows_mask = prompt_mask.repeat_interleave(k, 0) if k > 1 else prompt_mask
        layout = "shared" if layouts.choose(decoder.config, "packed", rows_mask, response_mask) == "packed" else "padded"
        if layout == "shared" and getattr(decoder.config, "_attn_implementation", None) in layouts.FLASH:
            layouts.note_once("flash-shared", "layout: shared runs packed under FlashAttention (each row its own "
                              "prompt): its varlen kernel cannot run a prompt shared by several sequences")
            layout = "packed"
    if layout != "shared" and k > 1:
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(k, 0), prompt_mask.repeat_interleave(k, 0)
    if layout == "packed":
        layout = layouts.choose(decoder.config, layout, prompt_mask, response_mask)
    if layout != "padded":
        # rows up to `row_budget`; under SDPA attention runs per sequence (`layouts.attention`:
        # shared's sequences are each response with its group's prompt), under eager the mask
        budget = layouts.row_budget(decoder.config)
        packing = (layouts.shared_plan(prompt_ids, prompt_mask, response_ids, response_mask, k, budget)
                   if layout == "shared" else layouts.plan(prompt_ids, prompt_mask, response_ids, response_mask, budget))
        dtype = next(decoder.parameters()).dtype
        with compiled_layers(decoder), layouts.attention(decoder):
            hidden = _last_hidden(decoder(**layouts.decoder_inputs(decoder, packing, dtype), use_cache=False))
        return packing.unpack(hidden)                                                  # (B, T, H)
    ids = torch.cat([prompt_ids, response_ids], 1)                                     # (B, P+T)
    am = torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], 1)
    # The last token predicts nothing we use, and attention is causal: leave it out.
    ids, am = ids[:, :-1], am[:, :-1]
    start = prompt_ids.shape[1] - 1  # position P-1+t holds the state that predicts response token t
    with last_layer_rows(model, decoder, start), compiled_layers(decoder):
        hidden = _last_hidden(decoder(input_ids=ids, attention_mask=am, position_ids=position_ids_from(am),
                                      use_cache=False))                                 # (B, P+T-1, H)
    return hidden[:, start:]                                                           # (B, T, H)


class ForwardOutput(NamedTuple):
    """What one teacher-forced pass returns for a (mini)batch."""

    logprobs: Tensor | None   # (B, T) float32, at the sampling temperature; None when not asked (values only)
    values: Tensor | None     # (B, T) float32, or None
    entropy: Tensor | None    # (B, T) float32, or None
    lm_loss: Tensor | None = None  # token-mean NLL of an extra LM batch (PPO-ptx), or None


def packed_label_nll(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, labels: Tensor,
                     budget: int | None = None) -> Tensor:
    """Summed next-token NLL over the positions whose next label is not -100, from one packed
    pass of (B, L) right-padded whole sequences (`layout.plan_sequences`): the decoder on the
    packed rows, then the LM head on the read positions only (chunked when it is a plain
    linear map). The same sum as the padded pass, to float rounding. The caller has chosen
    the packed layout (`layout.choose_sequences`)."""
    decoder, head = decoder_and_head(model)
    packing = layouts.plan_sequences(input_ids, attention_mask, budget)
    target = labels[:, 1:]                                                             # (B, L-1)
    keep = target != -100
    at = packing.gather[:, :-1][keep]                                                  # (N,) the states read
    lin = linear_lm_head(model)
    if lin is not None:
        with compiled_layers(decoder):
            hidden = layouts.flat_states(layouts.packed_states(decoder, packing))[at]  # (N, H)
        return ops.chunked_cross_entropy(hidden, lin.weight, lin.bias, target[keep], onednn=lin.onednn,
                                         transform=lin.transform)
    dtype = next(decoder.parameters()).dtype
    logits = model(**layouts.decoder_inputs(decoder, packing, dtype), use_cache=False).logits   # (R, W, V)
    flat = layouts.flat_states(logits)[at].float()                                     # (N, V)
    return torch.nn.functional.cross_entropy(flat, target[keep], reduction="sum")


def lm_loss(model: nn.Module, batch: dict[str, Tensor], mixed_precision: str = "no",
            layout: str = "padded") -> Tensor:
    """Token-mean next-token NLL of `model` on an LM batch (input_ids, attention_mask, and
    labels with -100 where nothing is trained); chunked over the vocabulary when the head
    is a plain linear map. The decoder runs under `mixed_precision`'s autocast. `layout`:
    packed runs the rows packed (`packed_label_nll`; PPO-ptx follows its method's layout)."""
    labels = batch["labels"][:, 1:]                                                    # (b, L-1)
    n = (labels != -100).sum().clamp(min=1)
    lin = linear_lm_head(model)
    ids, am = batch["input_ids"], batch["attention_mask"]
    if layout != "padded":
        decoder, _ = decoder_and_head(model)
        layout = layouts.choose_sequences(decoder.config, layout, am)
    if layout == "packed":
        with autocast(mixed_precision, ids.device):
            return packed_label_nll(model, ids, am, batch["labels"]) / n
    if lin is not None:
        decoder, _ = decoder_and_head(model)
        with autocast(mixed_precision, ids.device), compiled_layers(decoder):
            hidden = _last_hidden(decoder(input_ids=ids, attention_mask=am, use_cache=False))[:, :-1]  # (b, L-1, H)
        return ops.chunked_cross_entropy(hidden, lin.weight, lin.bias, labels, onednn=lin.onednn,
                                         transform=lin.transform) / n
    with autocast(mixed_precision, ids.device):
        logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits[:, :-1]  # (b, L-1, V)
    keep = labels != -100
    lp = ops.logprobs_from_logits(logits, labels.clamp(min=0))
    return -(lp * keep).sum() / n


def token_stats(hidden: Tensor, head: nn.Module, response_ids: Tensor, temperature: float = 1.0,
                with_entropy: bool = False, entropy_grad: bool = True,
                model: nn.Module | None = None) -> tuple[Tensor, Tensor | None]:
    """Log-probs (B, T) of `response_ids` and, when asked, the entropy (B, T) from hidden (B, T, H).

    Both ways apply the model's own logit transform (`models.head.logit_transform`: Gemma 2's
    soft cap, Cohere's, Granite's, MiniCPM3's and Falcon-H1's scales) before the temperature,
    as the model's forward and so the sampler do. When `model`'s head is a plain linear map
    (`models.head.linear_lm_head`), the chunked op computes them without ever holding more
    than one chunk of (B, T, V) logits, in the forward pass and in backward; otherwise (LoRA
    on the head) from the head's full logits. `entropy_grad=False` computes the entropy for
    logging only, with no autograd graph. Both ways compute in float32 (or the head's own
    dtype), also inside an autocast region. A model whose transform rlhflab cannot map
    raises `UserError`.
    """
    lin = linear_lm_head(model) if model is not None else None
    if lin is not None:
        out = ops.chunked_logprobs(hidden, lin.weight, lin.bias, response_ids, temperature=temperature,
                                   with_entropy=with_entropy, onednn=lin.onednn, transform=lin.transform)
        entropy = out.entropy if (out.entropy is None or entropy_grad) else out.entropy.detach()
        return out.logprobs, entropy
    logits = head_logits(head, hidden, logit_transform(model) if model is not None else None)  # (B, T, V)
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = ops.logprobs_from_logits(logits, response_ids)
    entropy = None
    if with_entropy:
        if entropy_grad:
            entropy = ops.entropy_from_logits(logits)
        else:
            with torch.no_grad():
                entropy = ops.entropy_from_logits(logits.detach())
    return logprobs, entropy


def head_logits(head: nn.Module, hidden: Tensor, transform: ops.LogitTransform | None = None) -> Tensor:
    """f(head(hidden)) (B, T, V): the logits the model's forward returns, with its transform f
    (`models.head.logit_transform`; None: the identity), in the head's own dtype (float32
    master weights: float32), not in autocast's bfloat16: log-probs and their differences
    need the precision."""
    dtype = next(head.parameters()).dtype
    with float32_region(hidden.device):
        return ops.transform_logits(head(hidden.to(dtype)), transform)


class ResponseOutput(NamedTuple):
    logits: Tensor        # (B, T, V) logits predicting each response token
    values: Tensor | None  # (B, T) float32 value of the state before each response token


def _split(input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (input_ids[:, :prompt_len], attention_mask[:, :prompt_len],
            input_ids[:, prompt_len:], attention_mask[:, prompt_len:])


def stats_for(layout: str, hidden: Tensor, head: nn.Module, response_ids: Tensor, response_mask: Tensor,
              *args, **kwargs) -> tuple[Tensor, Tensor | None]:
    """`token_stats`; under the packed layout on the real response tokens only (its states
    are zeros on padding, whose log-probs no one reads), (B, T) back with 0 on padding."""
    if layout != "packed":
        return token_stats(hidden, head, response_ids, *args, **kwargs)
    real = response_mask.bool()
    out = token_stats(hidden[real], head, response_ids[real], *args, **kwargs)          # (N,) each

    def back(x):
        if x is None:
            return None
        full = x.new_zeros(real.shape)
        full[real] = x
        return full                                                                    # (B, T)
    return back(out[0]), back(out[1])


class PolicyOnly(nn.Module):
    """A causal LM behind the response interface, with no critic (GRPO, RLOO, DPO, ...)."""

    def __init__(self, policy: nn.Module, mixed_precision: str = "no"):
        super().__init__()
        self.policy = policy
        self.critic = None
        self.value_head = None
        self.mixed_precision = mixed_precision  # "no" or "bf16": autocast of the decoder passes

    def autocast(self, device: torch.device | str):
        """The autocast region of this module's decoder passes (nothing under "no")."""
        return autocast(self.mixed_precision, device)

    @property
    def has_values(self) -> bool:
        return self.critic is not None or self.value_head is not None

    def _values(self, hidden: Tensor, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                response_mask: Tensor, group_size: int, layout: str = "padded") -> Tensor | None:
        return None

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
                group_size: int = 1, temperature: float = 1.0, with_values: bool = False,
                with_entropy: bool = False, entropy_grad: bool = True,
                lm_batch: dict[str, Tensor] | None = None, with_logprobs: bool = True,
                layout: str = "padded") -> ForwardOutput:
        """Log-probs (B, T) of the response tokens, and values and entropy when asked;
        with `lm_batch`, also the policy's LM loss on it (PPO-ptx). `with_logprobs=False`
        (values only: the old log-probs came from the sampler) skips the LM head; a
        separate critic's values then need no policy pass at all.

        Shapes and `layout` as in `response_hidden`. This is the module's `forward`, so a wrapper
        (DDP, FSDP) sees the whole pass.
        """
        if not with_logprobs:
            if not with_values or with_entropy or lm_batch is not None:
                raise ValueError("with_logprobs=False computes values only")
            if self.critic is not None:
                return ForwardOutput(None, self._values(None, prompt_ids, prompt_mask, response_ids, response_mask,
                                                        group_size, layout), None)
        with self.autocast(prompt_ids.device):
            hidden = response_hidden(self.policy, prompt_ids, prompt_mask, response_ids, response_mask,
                                     group_size, layout)
        if not with_logprobs:
            return ForwardOutput(None, self._values(hidden, prompt_ids, prompt_mask, response_ids, response_mask,
                                                    group_size, layout), None)
        _, head = decoder_and_head(self.policy)
        logprobs, entropy = stats_for(layout, hidden, head, response_ids, response_mask, temperature, with_entropy,
                                      entropy_grad, model=self.policy)
        values = None
        if with_values:
            values = self._values(hidden, prompt_ids, prompt_mask, response_ids, response_mask, group_size, layout)
        extra = lm_loss(self.policy, lm_batch, self.mixed_precision, layout) if lm_batch is not None else None
        return ForwardOutput(logprobs, values, entropy, extra)

    def forward_response(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                         with_values: bool = True, layout: str = "padded") -> ResponseOutput:
        """Logits (B, T, V) (and values) for the response part of prompt+response (B, L).

        The full-logits view, for learner mode and DPO; training uses `forward`.
        `layout` as in `response_hidden`.
        """
        pi, pm, ri, rm = _split(input_ids, attention_mask, prompt_len)
        with self.autocast(input_ids.device):
            hidden = response_hidden(self.policy, pi, pm, ri, rm, layout=layout)
        _, head = decoder_and_head(self.policy)
        values = self._values(hidden, pi, pm, ri, rm, 1, layout) if with_values else None
        return ResponseOutput(head_logits(head, hidden, logit_transform(self.policy)), values)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


class ActorCritic(PolicyOnly):
    """Policy LM plus a critic; see the module docstring for the two layouts."""

    def __init__(self, policy: nn.Module, value_head: ValueHead | None = None,
                 critic: nn.Module | None = None):
        super().__init__(policy)
        if value_head is None and critic is None:
            raise ValueError("give a value_head (shared base) or a critic (separate model)")
        self.value_head = value_head
        self.critic = critic  # a Critic: base decoder + its own ValueHead

    @property
    def separate_critic(self) -> bool:
        return self.critic is not None

    def _values(self, hidden, prompt_ids, prompt_mask, response_ids, response_mask, group_size, layout="padded"):
        if self.critic is not None:
            return self.critic(prompt_ids, prompt_mask, response_ids, response_mask, group_size,
                               mixed_precision=self.mixed_precision, layout=layout)
        return self.value_head(hidden)

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
                group_size: int = 1, temperature: float = 1.0, with_values: bool = True,
                with_entropy: bool = False, entropy_grad: bool = True,
                lm_batch: dict[str, Tensor] | None = None, with_logprobs: bool = True,
                layout: str = "padded") -> ForwardOutput:
        return super().forward(prompt_ids, prompt_mask, response_ids, response_mask, group_size, temperature,
                               with_values, with_entropy, entropy_grad, lm_batch, with_logprobs, layout)


class Critic(nn.Module):
    """A separate critic: a causal LM's decoder plus a value head."""

    def __init__(self, base: nn.Module, value_head: ValueHead | None = None):
        super().__init__()
        self.base = base
        self.value_head = value_head or ValueHead(hidden_size_of(base))

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
                group_size: int = 1, mixed_precision: str = "no", layout: str = "padded") -> Tensor:
        """Values (B, T) of the states before each response token (float32; the decoder
        under `mixed_precision`'s autocast; `layout` as in `response_hidden`)."""
        with autocast(mixed_precision, prompt_ids.device):
            hidden = response_hidden(self.base, prompt_ids, prompt_mask, response_ids, response_mask, group_size,
                                     layout)
        return self.value_head(hidden)


class Reference:
    """The frozen reference policy π_ref for the KL penalty.

    - ``copy``: a deep copy of the policy taken before training, frozen (no grads, eval).
    - ``lora_disabled``: the policy itself with its LoRA adapter switched off: the base
      weights never train under LoRA, so this *is* the starting policy, with no second
      copy in memory.
    """

    def __init__(self, model: nn.Module | None, policy: nn.Module | None = None, mixed_precision: str = "no"):
        self.model = model    # the frozen copy, or None with lora_disabled
        self.policy = policy  # the peft policy whose adapter is switched off
        self.mixed_precision = mixed_precision  # autocast of its decoder pass, as the policy's

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
    def active(self) -> Iterator[nn.Module]:
        """The reference as a model: the frozen copy, or the policy with its adapter off."""
        if self.model is not None:
            yield self.model
        else:
            with self.policy.disable_adapter():
                yield self.policy

    @torch.no_grad()
    def logprobs(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
                 group_size: int = 1, temperature: float = 1.0, layout: str = "padded") -> Tensor:
        """(B, T) log-probs of the response tokens under the reference (`layout` as in
        `response_hidden`)."""
        with self.active() as model:
            with autocast(self.mixed_precision, prompt_ids.device):
                hidden = response_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, group_size,
                                         layout)
            _, head = decoder_and_head(model)
            return stats_for(layout, hidden, head, response_ids, response_mask, temperature, model=model)[0]

    @torch.no_grad()
    def response_logits(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
        """(B, T, V) logits of the reference on the response part."""
        with self.active() as model:
            with autocast(self.mixed_precision, input_ids.device):
                hidden = response_hidden(model, *_split(input_ids, attention_mask, prompt_len))
            _, head = decoder_and_head(model)
            return head_logits(head, hidden, logit_transform(model))


def save_value_head(head: nn.Module, folder: str | Path, name: str = "value_head.safetensors") -> Path:
    from safetensors.torch import save_file

    path = Path(folder) / name
    save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}, str(path))
    return path


def load_value_head(head: nn.Module, folder: str | Path, name: str = "value_head.safetensors") -> None:
    from safetensors.torch import load_file

    head.load_state_dict(load_file(str(Path(folder) / name)))
