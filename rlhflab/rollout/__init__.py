"""Rollouts: a batch of sampled responses, and the backends that sample them.

Layout of a batch (B episodes):

    prompt_ids   (B, P)  left-padded, so every prompt ends at column P-1
    response_ids (B, T)  right-padded; tokens after the first EOS are padding
    response_mask(B, T)  1 up to and including the first EOS, 0 after it and on padding

The logits that predict response token t sit at position P-1+t of the full sequence,
hence the slice ``P-1 : P+T-1`` (see `rlhflab.models.actor_critic`). Logprobs are taken
at the sampling temperature, so the "old" policy of PPO is exactly the one that sampled.
That holds for plain temperature sampling; ``top_k``, ``top_p`` and ``min_new_tokens``
truncate the sampling distribution, while the logprobs stay those of the full softmax at
temperature T (as in TRL and OpenRLHF).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, Sequence

import torch
from torch import Tensor

from rlhflab.data.tokens import adds_bos, leading_ids  # adds_bos: re-exported for callers of rollout


@dataclass
class Rollout:
    """A batch of episodes and everything PPO computes about them."""

    prompt_ids: Tensor                 # (B, P)
    prompt_mask: Tensor                # (B, P)
    response_ids: Tensor               # (B, T)
    response_mask: Tensor              # (B, T)
    hit_limit: Tensor                  # (B,) True when no EOS within max_new_tokens
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    examples: list[dict] = field(default_factory=list)
    logprobs: Tensor | None = None     # (B, T) under the sampling policy
    values: Tensor | None = None       # (B, T)
    ref_logprobs: Tensor | None = None  # (B, T)
    scores: Tensor | None = None       # (B,)
    rewards: Tensor | None = None      # (B, T) KL-shaped per-token rewards
    kl: Tensor | None = None           # (B, T) per-token KL estimate
    advantages: Tensor | None = None   # (B, T)
    returns: Tensor | None = None      # (B, T)
    group_size: int = 1                # rows [i·k, (i+1)·k) answer the same prompt (GRPO, RLOO)
    sample_logprobs: Tensor | None = None  # (B, T) the sampler's own log-probs (vLLM; hf when asked), 0 on padding
    old_from_sampler: bool = False     # logprobs are sample_logprobs (generation.old_logprobs: sampler)
    # Multi-turn episodes (rlhflab.envs): 1 on every real response-part token, the
    # environment's context included, which the forward attends to; response_mask stays the
    # action mask (loss, KL, entropy, advantages). None: single-turn, the two are one mask.
    response_attention_mask: Tensor | None = None  # (B, T)
    episodes: object | None = None     # the rlhflab.envs.EpisodeBatch the rollout came from

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)  # (B, P+T)

    @property
    def attend_mask(self) -> Tensor:
        """(B, T) what the forward attends to in the response part: `response_attention_mask`
        for multi-turn episodes, else `response_mask` itself (the same tensor)."""
        return self.response_mask if self.response_attention_mask is None else self.response_attention_mask

    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.attend_mask.to(self.prompt_mask.dtype)], dim=1)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]


def response_mask_from(response_ids: Tensor, eos_token_id: int | Sequence[int]) -> Tensor:
    """1 up to and including the first EOS, 0 after it. (B, T) -> (B, T) long."""
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    is_eos = torch.zeros_like(response_ids, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= response_ids == e
    eos_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # an EOS strictly earlier
    return (~eos_before).long()


def _pad_right(t: Tensor, width: int, value: int | float) -> Tensor:
    if t.shape[1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def _pad_left(t: Tensor, width: int, value: int | float) -> Tensor:
    if t.shape[1] == width:
        return t
    return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)


def collate(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Join rollouts of different P and T: prompts re-padded left, responses right."""
    if len(parts) == 1:
        return parts[0]
    p = max(r.prompt_ids.shape[1] for r in parts)
    t = max(r.response_ids.shape[1] for r in parts)
    return Rollout(
        prompt_ids=torch.cat([_pad_left(r.prompt_ids, p, pad_token_id) for r in parts]),
        prompt_mask=torch.cat([_pad_left(r.prompt_mask, p, 0) for r in parts]),
        response_ids=torch.cat([_pad_right(r.response_ids, t, pad_token_id) for r in parts]),
        response_mask=torch.cat([_pad_right(r.response_mask, t, 0) for r in parts]),
        response_attention_mask=(None if all(r.response_attention_mask is None for r in parts) else
                                 torch.cat([_pad_right(r.attend_mask, t, 0) for r in parts])),
        hit_limit=torch.cat([r.hit_limit for r in parts]),
        sample_logprobs=(None if any(r.sample_logprobs is None for r in parts) else
                         torch.cat([_pad_right(r.sample_logprobs, t, 0.0) for r in parts])),
        prompts=[s for r in parts for s in r.prompts],
        responses=[s for r in parts for s in r.responses],
        examples=[e for r in parts for e in r.examples],
        group_size=parts[0].group_size,
    )


def finish_rollout(sequences: Tensor, prompt_ids: Tensor, prompt_mask: Tensor, tokenizer,
                   eos: list[int], prompts: list[str], examples: list[dict]) -> Rollout:
    """A Rollout from `generate`'s output (B, P+T'): response cut at the first EOS, the
    rest replaced by padding, `hit_limit` for responses without EOS, decoded text."""
    pad = tokenizer.pad_token_id
    response_ids = sequences[:, prompt_ids.shape[1]:]                 # (B, T')
    if response_ids.shape[1] == 0:  # nothing generated at all
        response_ids = torch.full((len(prompt_ids), 1), pad, device=sequences.device)
    mask = response_mask_from(response_ids, eos)                      # (B, T')
    has_eos = torch.zeros(len(prompt_ids), dtype=torch.bool, device=sequences.device)
    for e in eos:
        has_eos |= ((response_ids == e) & mask.bool()).any(-1)
    response_ids = torch.where(mask.bool(), response_ids, torch.full_like(response_ids, pad))
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                   response_mask=mask, hit_limit=~has_eos, prompts=list(prompts),
                   responses=tokenizer.batch_decode(response_ids, skip_special_tokens=True),
                   examples=list(examples))


def encode_prompts(tokenizer, prompts: Sequence[str], max_length: int | None = None) -> tuple[Tensor, Tensor]:
    """Prompt texts as (ids, mask), each (B, P), left-padded: the one place prompts become
    tokens for training rollouts, evaluation and the sampler (both backends).

    Each text's ids follow `rlhflab.data.tokens.leading_ids` (the rule SFT, DPO and the
    reward model use too): the tokenizer's BOS in front when it is configured to add one
    and the text does not already start with it; a tokenizer without a BOS gets exactly the
    ids of ``tokenizer(text, add_special_tokens=False)``. `max_length` keeps the end of a
    longer prompt (where the question is), and the BOS.
    """
    out = leading_ids(tokenizer, prompts, max_length)
    width = max((len(r) for r in out), default=0)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(out), width), pad, dtype=torch.long)                  # (B, P)
    mask = torch.zeros((len(out), width), dtype=torch.long)                     # (B, P)
    for i, r in enumerate(out):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def eos_ids_of(model, tokenizer) -> list[int]:
    """Token ids that end a response: the generation_config's EOS ids (else the tokenizer's
    EOS), plus the chat template's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``)
    when the tokenizer has a template and the list lacks it, as some hub models'
    generation_config does. Stopping there is right whether or not the prompt was
    templated: a chat model closes its turn with it."""
    from rlhflab.data.chat import end_of_turn_id

    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = ids if ids is not None else tokenizer.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids)
    eot = end_of_turn_id(tokenizer)
    if eot is not None and eot not in ids:
        ids.append(eot)
    return ids




class Generated(NamedTuple):
    """What an engine returns per token-id prompt: the sampled ids and their log-probs."""

    ids: list[int]
    logprobs: list[float] | None = None


class RolloutBackend(Protocol):
    """What the rollout service (`rlhflab.rollout.service`) asks of an engine
    (`generation.backend`; docs/adding_a_backend.md). `seed`: the row-keyed sampling seed
    (None: the engine's own random stream); `context_limit`: the longest sequence it holds
    (None: no limit of its own)."""

    seed: int | None
    context_limit: int | None

    def generate_ids(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
                     greedy: bool = False, keys: Tensor | None = None) -> list[Generated]:
        """Token-id prompts -> the ids sampled after each (uncut past a stop id) and the
        sampler's log-prob of each; `keys` (one per prompt): row-keyed seeded sampling."""

    def idle(self) -> None:
        """Sampling is over until the next step (a multi-turn batch is done): free what can be."""

    def generate(self, prompts: Sequence[str], *, n: int = 1, examples: Sequence[dict] | None = None,
                 greedy: bool = False, max_new_tokens: int | None = None, step: int = 0) -> Rollout:
        """`n` responses per prompt (rows [i·n, (i+1)·n) answer prompt i), as a Rollout;
        `step` keys seeded sampling."""

    def sync(self, policy: torch.nn.Module, updates: int = 1) -> None:
        """The policy's weights changed (`updates` optimizer steps): make sampling follow them."""

    def close(self) -> None:
        """The run is over (finished or raised): free what the backend holds (an engine)."""


from rlhflab.rollout.hf import LOCKSTEP_ATTR, HFBackend, generate, hf_generate_ids  # noqa: E402,F401 (builds on the above)


def make_backend(gen_cfg, policy: torch.nn.Module, tokenizer, *, max_prompt_length: int | None,
                 batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1) -> RolloutBackend:
    """The configured backend, built once per run: `hf` (the default) or `vllm`."""
    backend = getattr(gen_cfg, "backend", "hf")
    if backend == "hf":
        return HFBackend(policy, tokenizer, gen_cfg, max_prompt_length=max_prompt_length, batch_size=batch_size,
                         seed=seed, rank=rank, world_size=world_size)
    if backend == "vllm":
        from rlhflab.rollout.vllm import VLLMBackend
        return VLLMBackend(policy, tokenizer, gen_cfg, max_prompt_length=max_prompt_length,
                           batch_size=batch_size, seed=seed, rank=rank)
    from rlhflab.errors import UserError
    raise UserError(f"generation.backend: {backend!r} is not available; use hf or vllm")
