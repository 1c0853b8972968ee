"""Rollouts: sample responses with the KV cache, then score them in one teacher-forced pass.

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
from typing import Sequence

import torch
from torch import Tensor

from rlhflab.ops import entropy_from_logits, logprobs_from_logits


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

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)  # (B, P+T)

    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.response_mask.to(self.prompt_mask.dtype)], dim=1)

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
        hit_limit=torch.cat([r.hit_limit for r in parts]),
        prompts=[s for r in parts for s in r.prompts],
        responses=[s for r in parts for s in r.responses],
        examples=[e for r in parts for e in r.examples],
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


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[str], *, max_new_tokens: int,
             min_new_tokens: int = 0, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, greedy: bool = False, max_prompt_length: int | None = None,
             batch_size: int = 64, examples: Sequence[dict] | None = None) -> Rollout:
    """Sample (or greedily decode) one response per prompt, in batches, with the KV cache."""
    device = next(model.parameters()).device
    eos = eos_ids_of(model, tokenizer)
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"  # keep the end of a long prompt, where the question is
    parts = []
    examples = list(examples) if examples is not None else [{} for _ in prompts]
    was_training = model.training
    model.eval()
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False,
                        truncation=max_prompt_length is not None, max_length=max_prompt_length)
        enc = {k: v.to(device) for k, v in enc.items()}
        kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens or None,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, use_cache=True)
        if greedy:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:
            kwargs.update(do_sample=True, temperature=temperature, top_k=top_k or None,
                          top_p=top_p if top_p < 1.0 else None)
        out = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], **kwargs)
        parts.append(finish_rollout(out, enc["input_ids"], enc["attention_mask"], tokenizer, eos,
                                    chunk, examples[start : start + batch_size]))
    if was_training:
        model.train()
    return collate(parts, tokenizer.pad_token_id)


class ForwardOutput:
    """What one teacher-forced pass returns for a (mini)batch."""

    __slots__ = ("logprobs", "values", "entropy")

    def __init__(self, logprobs: Tensor, values: Tensor | None, entropy: Tensor | None):
        self.logprobs = logprobs  # (B, T) float32
        self.values = values      # (B, T) float32 or None
        self.entropy = entropy    # (B, T) float32 or None


def forward_response(actor_critic, input_ids: Tensor, attention_mask: Tensor, response_ids: Tensor,
                     prompt_len: int, temperature: float = 1.0, with_values: bool = True,
                     with_entropy: bool = False, entropy_grad: bool = True) -> ForwardOutput:
    """One pass of the actor-critic over prompt+response: logprobs, values, entropy.

    `entropy_grad=False` computes the entropy for logging only, with no autograd graph.
    """
    out = actor_critic.forward_response(input_ids, attention_mask, prompt_len, with_values)
    logits = out.logits if temperature == 1.0 else out.logits / temperature  # (B, T, V)
    logprobs = logprobs_from_logits(logits, response_ids)
    entropy = None
    if with_entropy:
        if entropy_grad:
            entropy = entropy_from_logits(logits)
        else:
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach())
    return ForwardOutput(logprobs, out.values, entropy)


@torch.no_grad()
def score_rollout(actor_critic, reference, rollout: Rollout, temperature: float = 1.0,
                  micro_batch: int = 64, with_values: bool = True) -> Rollout:
    """Fill rollout.logprobs, .values and (when a reference is given) .ref_logprobs.

    Each is one teacher-forced pass per micro-batch: every response token's logprob at
    once, where sampling produced them one at a time.
    """
    ids, am = rollout.input_ids(), rollout.attention_mask()
    p = rollout.prompt_len
    lps, vals, refs = [], [], []
    for s in range(0, len(rollout), micro_batch):
        sl = slice(s, s + micro_batch)
        out = forward_response(actor_critic, ids[sl], am[sl], rollout.response_ids[sl], p,
                               temperature, with_values=with_values)
        lps.append(out.logprobs)
        if out.values is not None:
            vals.append(out.values)
        if reference is not None:
            ref_logits = reference.response_logits(ids[sl], am[sl], p)
            if temperature != 1.0:
                ref_logits = ref_logits / temperature
            refs.append(logprobs_from_logits(ref_logits, rollout.response_ids[sl]))
    mask = rollout.response_mask.float()
    rollout.logprobs = torch.cat(lps) * mask
    rollout.values = torch.cat(vals) * mask if vals else None
    rollout.ref_logprobs = torch.cat(refs) * mask if refs else None
    return rollout
