"""The Hugging Face backend: `model.generate` with the KV cache, in batches.

How a sampled token is drawn. By default `generate` draws it (torch.multinomial, from one
random stream for the whole batch). Seeded sampling replaces that draw with rlhflab's own,
`InverseCDFDraw`: the first token whose cumulative probability passes u × total, from the
processed logits (temperature, top-k, top-p) and one uniform number u per row
(`ops.inverse_cdf_draw`); `generate` is then run greedy and takes that token. With
`generation.seeded_sampling` u is keyed by (seed, step, the row's index
  in the whole step, the response position) (`ops.counter_uniform`), so a row samples the
  same tokens whatever the batch size, the number of processes, or the other prompts'
  lengths (which set the batch's left padding).
It keeps the sampling distribution; it draws other tokens than `generate` for a given seed.
The sampler's log-probs (`generation.old_logprobs: sampler`) are taken by the same draw:
`InverseCDFDraw` records log softmax(scores) of the token it draws, so asking for them also
switches a plain sampled run to this draw. They are the policy's log-probs at the sampling
temperature, as the update computes them: the draw itself keeps the end tokens out of the
first `min_new_tokens` positions (generate's own ban is then not used), after recording.

`n` > 1 answers per prompt (GRPO, RLOO groups) share the prompt: each prompt is
prefilled once (all but its last token) and its KV cache repeated n times before
`generate` continues from it. The sampling itself is `generate`'s, so the results equal
n separate copies of the prompt up to float rounding. Left padding and left truncation
keep the end of a long prompt, where the question is.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rlhflab import ops
from rlhflab.models.actor_critic import decoder_and_head, is_checkpointing, position_ids_from
from rlhflab.rollout import Generated, Rollout, collate, encode_prompts, eos_ids_of, finish_rollout


class InverseCDFDraw:
    """The last logits processor of a sampled `generate` call that rlhflab draws itself (see
    the module docstring): the row's token drawn from softmax(scores) by
    `ops.inverse_cdf_draw`, which leaves it the only finite score for `generate`, run
    greedy, to take. u per row: keyed by (`keys`, the response position) when seeded, else
    from torch's global generator (so `torch.manual_seed` still fixes the samples).

    The position is the number of tokens generated so far, not the padded sequence
    length, which depends on the longest prompt in the batch (`prompt_len`: the padded
    prompt width of this generate call).

    `record`: keep the log-probability of each drawn token under softmax(scores), one (B,)
    tensor per step (`drawn_logprobs` stacks them). `ban`: (end token ids, n): those ids are not drawn in the
    first n positions (generate's min_new_tokens, applied after recording)."""

    def __init__(self, keys: torch.Tensor | None = None, prompt_len: int = 0, record: bool = False,
                 ban: tuple[list[int], int] | None = None):
        self.keys = keys  # (B,) int64, or None: unseeded
        self.prompt_len = prompt_len
        self.logprobs: list[torch.Tensor] | None = [] if record else None
        self.ban = ban

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1] - self.prompt_len
        if self.keys is None:
            u = torch.rand(scores.shape[0], dtype=torch.float64, device=scores.device)
        else:
            u = ops.counter_uniform(self.keys.to(scores.device), position, 1).squeeze(1)
        allowed = scores
        if self.ban is not None and position < self.ban[1]:
            allowed = scores.clone()
            allowed[:, self.ban[0]] = float("-inf")
        token = ops.inverse_cdf_draw(allowed, u)
        if self.logprobs is not None:
            z = scores.float()                                                            # (B, V)
            self.logprobs.append(z.gather(1, token.unsqueeze(1)).squeeze(1) - torch.logsumexp(z, dim=-1))
        return torch.full_like(scores, float("-inf")).scatter_(1, token.unsqueeze(1), 0.0)


def draw_kwargs(*, greedy: bool, temperature: float, top_k: int, top_p: float, keys: torch.Tensor | None = None,
                prompt_len: int = 0, record: bool = False,
                ban: tuple[list[int], int] | None = None) -> dict:
    """`model.generate` arguments that replace its own multinomial draw with `InverseCDFDraw`:
    seeded when `keys` are given (`generation.seeded_sampling`), else with
    `record` (the sampler's log-probs; `drawn_logprobs` reads them after the call; `ban`,
    the end tokens and min_new_tokens, when generate is not to apply that itself).
    `generate` then runs greedy over our processors (temperature, top-k, top-p, then the
    draw), after its own (min_new_tokens). {} when greedy or none applies."""
    if greedy or (keys is None and not record):
        return {}
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    procs = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return dict(do_sample=False, temperature=None, top_k=None, top_p=None,
                logits_processor=LogitsProcessorList([*procs, InverseCDFDraw(keys, prompt_len, record, ban)]))


def drawn_logprobs(call_kw: dict) -> torch.Tensor | None:
    """The sampler's log-probs (B, steps) of a `generate` call made with `draw_kwargs(...,
    record=True)`, step t in column t (as the generated tokens); None when the call drew
    no samples (greedy) or recorded none."""
    procs = call_kw.get("logits_processor") or []
    draw = procs[-1] if procs and isinstance(procs[-1], InverseCDFDraw) else None
    if draw is None or draw.logprobs is None:
        return None
    return torch.stack(draw.logprobs, 1)


LOCKSTEP_ATTR = "_rlhflab_lockstep"  # set on every submodule by engine.dist.mark_lockstep


def lockstep_of(module: torch.nn.Module) -> bool | None:
    """Whether `module` must decode in step with the other ranks: True (sharded weights
    gathered as it runs), False (whole weights held: one rank may run alone), None (not
    under a sharded strategy: the caller's default)."""
    return getattr(module, LOCKSTEP_ATTR, None)


def decode_kwargs(model, *, greedy: bool, temperature: float, top_k: int, top_p: float) -> dict:
    """`model.generate`'s decoding arguments: greedy or sampled (top-k 0 and top-p 1 mean
    off), and `synced_gpus` under FSDP / ZeRO-3 (set by engine.dist.mark_lockstep): with
    sharded layers every rank decodes until the last is done; with whole weights, alone."""
    kwargs: dict = {}
    lockstep = lockstep_of(model)
    if lockstep is not None:
        kwargs["synced_gpus"] = lockstep
    if greedy:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        kwargs.update(do_sample=True, temperature=temperature, top_k=top_k or None,
                      top_p=top_p if top_p < 1.0 else None)
    return kwargs


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[str], *, n: int = 1, max_new_tokens: int,
             min_new_tokens: int = 0, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             greedy: bool = False, max_prompt_length: int | None = None, batch_size: int = 64,
             examples: Sequence[dict] | None = None, share_prompt: bool = True,
             seed: int | None = None, step: int = 0, row_offset: int = 0,
             sample_logprobs: bool = False, static_cache: bool = False) -> Rollout:
    """Sample (or greedily decode) `n` responses per prompt, `batch_size` responses at a time.

    Rows [i·n, (i+1)·n) of the result answer prompt i. With `share_prompt` (and n > 1,
    no gradient checkpointing) each prompt is prefilled once for its n rows. With `seed`,
    sampling is seeded per row (row r of this call is row `row_offset + r` of the step).
    `sample_logprobs` (sampled, not greedy): the
    rollout's `sample_logprobs` (B, T) hold the log-probability the draw gave each token
    (0 on padding), taken by rlhflab's draw. `static_cache` (`generation.hf.cache: static`):
    generate's KV cache is a `StaticCache` of max_prompt_length + max_new_tokens positions, the
    same size every call, which transformers compiles the decoding step around on a GPU; each
    of a group's rows then prefills its own copy of the prompt.
    """
    device = next(model.parameters()).device
    eos = eos_ids_of(model, tokenizer)
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"  # keep the end of a long prompt, where the question is
    examples = list(examples) if examples is not None else [{} for _ in prompts]
    shared = share_prompt and n > 1 and not is_checkpointing(model) and not static_cache
    # recording: the draw bans the end tokens itself, after taking the unbanned log-prob
    ban = (eos, min_new_tokens) if sample_logprobs and min_new_tokens and not greedy else None
    kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=None if ban else (min_new_tokens or None),
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, use_cache=True,
                  **decode_kwargs(model, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p))
    was_training = model.training
    model.eval()
    parts = []
    per_call = max(1, batch_size // n)  # prompts per generate call
    for start in range(0, len(prompts), per_call):
        chunk = list(prompts[start : start + per_call])
        ids, am = encode_prompts(tokenizer, chunk, max_prompt_length)
        ids, am = ids.to(device), am.to(device)                                         # (G, P)
        call_kw = dict(kwargs)
        if static_cache:  # one size for every call, so a compiled decoding step is reused
            call_kw.update(cache_implementation="static",
                           max_cache_len=max(max_prompt_length or 0, ids.shape[1]) + max_new_tokens)
        if shared and ids.shape[1] > 1:  # prefill all but the last prompt token once, then copy the cache
            decoder, _ = decoder_and_head(model)
            cache = decoder(input_ids=ids[:, :-1], attention_mask=am[:, :-1],
                            position_ids=position_ids_from(am[:, :-1]), use_cache=True).past_key_values
            cache.batch_repeat_interleave(n)
            call_kw["past_key_values"] = cache
        ids_n, am_n = ids.repeat_interleave(n, dim=0), am.repeat_interleave(n, dim=0)  # (G·n, P)
        keys = None
        if seed is not None and not greedy:
            keys = ops.row_keys(seed, step, row_offset + start * n + torch.arange(ids_n.shape[0]))
        call_kw.update(draw_kwargs(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, keys=keys,
                                   prompt_len=ids_n.shape[1], record=sample_logprobs,
                                   ban=ban))
        out = model.generate(input_ids=ids_n, attention_mask=am_n, **call_kw)
        rows = examples[start : start + per_call]
        part = finish_rollout(out, ids_n, am_n, tokenizer, eos, [p for p in chunk for _ in range(n)],
                              [e for e in rows for _ in range(n)])
        drawn = drawn_logprobs(call_kw)  # (G·n, T): one column per generated token
        if drawn is not None:
            part.sample_logprobs = drawn * part.response_mask
        parts.append(part)
    if was_training:
        model.train()
    roll = collate(parts, tokenizer.pad_token_id)
    roll.group_size = n
    return roll


def _has_max_cache_len() -> bool:
    import transformers

    return hasattr(transformers.GenerationConfig(), "max_cache_len")


def static_cache_for(setting: str, model: torch.nn.Module, world_size: int = 1) -> bool:
    """Whether generate gets a static KV cache (`generation.hf.cache`): static and dynamic as
    set; auto where transformers compiles the decoding step around it: a CUDA GPU, a single
    process, a base whose quantization (if any) can be compiled, a transformers that can size
    the cache (on one H200, SmolLM2-135M, GRPO: generation 0.24-0.27 s a step against 1.44 s).
    A CPU compiles nothing; several processes (DDP, FSDP, ZeRO) have not been measured with
    it. Explicit static on a transformers without generate's `max_cache_len` (< 5.16) is
    refused: it would fail at the first rollout."""
    if setting == "auto":
        quantizer = getattr(model, "hf_quantizer", None)
        return (next(model.parameters()).device.type == "cuda" and world_size == 1 and _has_max_cache_len()
                and (quantizer is None or bool(getattr(quantizer, "is_compileable", False))))
    if setting == "static" and not _has_max_cache_len():
        import transformers

        from rlhflab.errors import UserError
        raise UserError(f"generation.hf.cache: static needs transformers 5.16 or newer (generate's "
                        f"max_cache_len); this is {transformers.__version__}: upgrade transformers, or set "
                        f"generation.hf.cache: dynamic")
    return setting == "static"


@torch.no_grad()
def hf_generate_ids(model, tokenizer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    stop_ids: Sequence[int], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    greedy: bool = False, batch_size: int = 64, keys: torch.Tensor | None = None,
                    sample_logprobs: bool = False) -> list[Generated]:
    """`model.generate` on token-id prompts (left-padded in batches); the ids after each
    prompt, uncut (the episode runner cuts at the first stop id). `keys` (one per prompt):
    seeded sampling as `rlhflab.rollout.hf`'s;
    `sample_logprobs`: each id's log-probability under that draw, too."""
    from rlhflab.errors import UserError

    if lockstep_of(model):
        # Sharded layers make every rank run each generate call together, but episodes
        # end after different numbers of turns on different ranks: the calls would not pair up.
        raise UserError("env: multi-turn episodes with generation.backend=hf do not run under FSDP or "
                        "ZeRO-3 (sharded layers); use DDP or ZeRO-2 (configs/accelerate/ddp.yaml, zero2.yaml), "
                        "or generation.backend=vllm")
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=list(stop_ids), use_cache=True,
                  **decode_kwargs(model, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p))
    was_training = model.training
    model.eval()
    out: list[Generated] = []
    for s in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[s : s + batch_size]]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)          # (G, P)
        am = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)  # (G, P)
        call_kw = dict(kwargs)
        call_kw.update(draw_kwargs(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
                                   keys=None if keys is None else keys[s : s + batch_size], prompt_len=width,
                                   record=sample_logprobs))
        seqs = model.generate(input_ids=ids, attention_mask=am, **call_kw)[:, width:]
        drawn = drawn_logprobs(call_kw)
        if drawn is None:
            out.extend(Generated(row.tolist()) for row in seqs.cpu())
        else:
            out.extend(Generated(row.tolist(), lp.tolist()) for row, lp in zip(seqs.cpu(), drawn.cpu()))
    if was_training:
        model.train()
    return out



class HFBackend:
    """`generation.backend: hf`: sampling from the training model itself, so there is
    nothing to synchronise after an optimizer step."""

    def __init__(self, policy, tokenizer, gen_cfg, *, max_prompt_length: int | None, batch_size: int,
                 seed: int | None = None, rank: int = 0, world_size: int = 1):
        self.policy, self.tokenizer, self.gen = policy, tokenizer, gen_cfg
        self.max_prompt_length, self.batch_size = max_prompt_length, batch_size
        self.seed = seed if getattr(gen_cfg, "seeded_sampling", False) else None
        self.rank = rank
        # generation.old_logprobs: sampler: the draw records its log-probs (rollout.sample_logprobs)
        self.sample_logprobs = getattr(gen_cfg, "old_logprobs", "recompute") == "sampler"
        self.static_cache = static_cache_for(getattr(getattr(gen_cfg, "hf", None), "cache", "dynamic"), policy, world_size)

    def generate(self, prompts: Sequence[str], *, n: int = 1, examples: Sequence[dict] | None = None,
                 greedy: bool = False, max_new_tokens: int | None = None, batch_size: int | None = None,
                 share_prompt: bool = True, step: int = 0) -> Rollout:
        """`n` responses per prompt. Under several processes every rank holds an equal share
        of the step's prompts, so this rank's rows start at rank × len(prompts) × n."""
        g = self.gen
        return generate(self.policy, self.tokenizer, prompts, n=n,
                        max_new_tokens=max_new_tokens or g.max_new_tokens, min_new_tokens=g.min_new_tokens,
                        temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, greedy=greedy,
                        max_prompt_length=self.max_prompt_length, batch_size=batch_size or self.batch_size,
                        examples=examples, share_prompt=share_prompt, seed=self.seed, step=step,
                        row_offset=self.rank * len(prompts) * n,
                        sample_logprobs=self.sample_logprobs, static_cache=self.static_cache)

    def generate_ids(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
                     greedy: bool = False, keys: torch.Tensor | None = None) -> list:
        """The engine's primitive on token-id prompts (multi-turn episodes): `hf_generate_ids`."""
        g = self.gen
        return hf_generate_ids(self.policy, self.tokenizer, prompts, max_new_tokens=max_new_tokens,
                               stop_ids=stop_ids, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                               greedy=greedy, batch_size=self.batch_size, keys=keys,
                               sample_logprobs=self.sample_logprobs)

    context_limit = None  # no engine context: an episode is as long as env.max_length lets it

    def idle(self) -> None:  # sampling is over until the next step: nothing to free
        return None

    def sync(self, policy, updates: int = 1) -> None:
        return None

    def close(self) -> None:  # it samples from the training model: nothing of its own to free
        return None
