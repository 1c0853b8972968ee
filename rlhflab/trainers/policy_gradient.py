"""Pieces shared by the critic-free trainers (GRPO, RLOO) and DPO's model set-up.

Each trainer keeps its own short loop; this module holds what they have in common:

- `PolicyOnly`: a causal LM behind the `forward_response` interface of `ActorCritic`,
  with no critic, so `rlhflab.rollout.forward_response` and `score_rollout` work on it.
- `build_policy_models`: the policy (+LoRA) and, only when asked for, the reference.
  Under LoRA the reference is always the adapter-disabled policy (the base weights never
  train, so it *is* the starting policy, with no second copy in memory).
- `sample_groups`: `k` responses per prompt, each prompt's responses contiguous, which
  is the layout `ops.group_advantages` and `ops.rloo_advantages` expect.
- `policy_update`: epochs of minibatches of the clipped surrogate on per-token
  advantages, optionally plus a KL-to-reference term in the loss.
- checkpoints are `rlhflab.models.checkpoint.save_checkpoint` of the `PolicyOnly` (an
  HF-loadable folder plus `trainer_state.pt`, atomically, no value head).

Prompt sharing (`share_prompt`, on by default): the k responses to one prompt share
it, so the prompt is run through the model once per group, not k times. Sampling
prefills each prompt once and copies its KV cache to the k rows before `generate`
continues; the teacher-forced passes (update, old and reference log-probs) run the
prompt once with `use_cache`, repeat its keys and values k times (a differentiable
`repeat_interleave`, so the prompt's gradient is the sum over its k responses, exactly
as in the full pass) and run only the responses on top. Minibatches then hold whole
groups. This removes (k−1)/k of the prompt compute; the results equal the plain pass
up to float rounding. It falls back to the plain pass with gradient checkpointing, or
when a minibatch size is not a multiple of k.

Where this departs from a naive recipe: the "old" log-probs of the clipped ratio are
those of the policy that sampled the responses. When a step makes exactly one
optimizer step (one epoch, every minibatch in one accumulation group) the policy has
not moved before the loss is taken, so the old log-probs are the detached log-probs
of the same forward pass and the extra scoring pass is skipped; the ratio is then
exactly 1 and the loss is plain REINFORCE with the group baseline. With more than one
optimizer step per rollout they are computed in a no-grad pass before the update.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Literal, NamedTuple, Optional

import torch
from torch import Tensor, nn

from rlhflab import ops
from rlhflab.config.schema import f
from rlhflab.evaluate import evaluate_policy, save_samples
from rlhflab.models.actor_critic import (Reference, ResponseOutput, _response_hidden, decoder_and_head,
                                         position_ids_from, unwrap)
from rlhflab.models.load import add_lora, disable_dropout, load_model, resolve_device
from rlhflab.rollout import (ForwardOutput, Rollout, collate, eos_ids_of, finish_rollout, forward_response,
                             generate, score_rollout)
from rlhflab.config import save_effective_config
from rlhflab.data.prompts import load_prompts, step_prompts
from rlhflab.metrics import MetricsLogger
from rlhflab.models.checkpoint import prune_checkpoints, restore_trainer_state, save_checkpoint
from rlhflab.rewards import build_reward
from rlhflab.trainers.common import (Timer, check_resume_dir, finish_run, format_metrics, last_eval,
                                     log_step, make_doctor, make_optimization, prepare_output_dir,
                                     print_before_after, seed_everything, set_threads, write_train_result)


# --------------------------------------------------------------------------------------
# Config shared by GRPO and RLOO
# --------------------------------------------------------------------------------------
@dataclass
class OptimizerFields:
    """AdamW and its schedule: the fields GRPO, RLOO and DPO sections share."""

    learning_rate: float = f(1e-6, "peak learning rate", gt=0)
    min_learning_rate: float = f(0.0, "floor of the cosine/linear decay", ge=0)
    warmup_steps: int = f(0, "optimizer steps of linear warmup", ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = f("constant", "learning-rate schedule after warmup")
    weight_decay: float = f(0.0, "AdamW weight decay", ge=0)
    adam_beta1: float = f(0.9, "AdamW beta1", ge=0, lt=1)
    adam_beta2: float = f(0.999, "AdamW beta2", ge=0, lt=1)
    adam_eps: float = f(1e-8, "AdamW epsilon", gt=0)
    use_8bit_adam: bool = f(False, "8-bit AdamW from bitsandbytes (CUDA only; falls back to AdamW)")
    max_grad_norm: Optional[float] = f(1.0, "clip the global gradient norm to this; null disables", gt=0)

    def check(self) -> list[str]:
        # a learning_rate <= 0 is already reported by its range; comparing would only echo it
        if self.min_learning_rate > self.learning_rate > 0:
            return [f"min_learning_rate: {self.min_learning_rate} exceeds learning_rate "
                    f"{self.learning_rate}; lower it"]
        return []


@dataclass
class PolicyGradientSection(OptimizerFields):
    """Rollout sizes and update settings common to GRPO and RLOO."""

    prompts_per_step: int = f(16, "prompts per step; each is answered several times (group_size / k)", gt=0)
    batch_size: int = f(64, "responses generated at once during the rollout", gt=0)
    mini_batch_size: int = f(16, "responses per minibatch in the update", gt=0)
    gradient_accumulation_steps: int = f(1, "minibatches accumulated per optimizer step", gt=0)
    epochs: int = f(1, "passes over the step's responses; 1 pass with one optimizer step is fully on-policy", gt=0)
    clip_eps: float = f(0.2, "ratio clip below: ratios under 1-clip_eps stop the gradient", gt=0, lt=1)
    clip_eps_high: Optional[float] = f(None, "ratio clip above (DAPO's clip-higher, e.g. 0.28); null uses clip_eps", gt=0)
    entropy_coeff: float = f(0.0, "weight of the entropy bonus (loss subtracts entropy_coeff * entropy)", ge=0)
    loss_aggregation: Literal["token_mean", "seq_mean"] = f(
        "token_mean", "token_mean: every token of the batch weighs the same; seq_mean: every response does")
    mask_truncated: bool = f(False, "leave out of the loss the responses that hit max_new_tokens without EOS")
    share_prompt: bool = f(True, "compute each prompt once for its group of responses (KV cache reused in sampling, "
                                 "the update and the reference pass); exact, off only to compare")

    @property
    def samples_per_prompt(self) -> int:  # overridden by GRPO (group_size) and RLOO (k)
        return 1

    @property
    def rollout_size(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def check(self) -> list[str]:
        errs = super().check()
        if self.mini_batch_size > self.rollout_size:
            errs.append(f"mini_batch_size: {self.mini_batch_size} is larger than a step's responses "
                        f"(prompts_per_step x {self.samples_per_prompt} = {self.rollout_size}); lower it")
        return errs

    def optimizer_steps_per_rollout(self) -> int:
        n_minibatches = math.ceil(self.rollout_size / self.mini_batch_size)
        return self.epochs * math.ceil(n_minibatches / self.gradient_accumulation_steps)


def check_reference(model_cfg, lora_cfg, kl_weight: float, kl_key: str) -> list[str]:
    """Cross-section rules on model.reference for a trainer whose KL weight is `kl_key`."""
    errs = []
    if model_cfg.reference == "lora_disabled" and not lora_cfg.enabled:
        errs.append("model.reference: lora_disabled needs lora.enabled=true; use reference: copy")
    if kl_weight > 0 and model_cfg.reference == "none":
        errs.append(f"model.reference: none leaves no policy to measure KL against; "
                    f"set {kl_key}=0 or reference: copy")
    return errs


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------
class PolicyOnly(nn.Module):
    """A causal LM with `ActorCritic`'s response interface and no critic."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        self.critic = None
        self.value_head = None

    def forward_response(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                         with_values: bool = False) -> ResponseOutput:
        """(B, T, V) logits predicting each response token; the LM head runs on those T only."""
        hidden = _response_hidden(self.policy, input_ids, attention_mask, prompt_len)  # (B, T, H)
        _, head = decoder_and_head(self.policy)
        return ResponseOutput(head(hidden), None)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def _checkpointing(model: nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on; it rules out reusing a KV cache."""
    base = unwrap(model)
    flag = getattr(type(base), "is_activation_checkpointing", None) or getattr(type(base), "is_gradient_checkpointing", None)
    return bool(flag.__get__(base)) if isinstance(flag, property) else False


def groups_share_prompt(prompt_ids: Tensor, prompt_mask: Tensor, k: int) -> bool:
    """True when rows [g·k, (g+1)·k) hold the same prompt for every g. (B, P) each."""
    b = prompt_ids.shape[0]
    if k < 2 or b % k:
        return False
    ids, mask = prompt_ids.view(b // k, k, -1), prompt_mask.view(b // k, k, -1)
    return bool((ids == ids[:, :1]).all() and (mask == mask[:, :1]).all())


def grouped_response_hidden(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                            response_mask: Tensor, k: int) -> Tensor:
    """Hidden states that predict each response token, each group's prompt run once.

    prompt_ids, prompt_mask: (G, P), one left-padded row per group; response_ids,
    response_mask: (B, T) with B = G·k, the k rows of group g at [g·k, (g+1)·k).
    Returns (B, T, H), equal (up to rounding) to `_response_hidden` on the repeated
    prompts; gradients reach the prompt's computation through `repeat_interleave`.
    """
    decoder, _ = decoder_and_head(model)
    pos = position_ids_from(prompt_mask)                                             # (G, P)
    out = decoder(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos, use_cache=True)
    cache = out.past_key_values
    cache.batch_repeat_interleave(k)                                                 # (B, heads, P, d)
    first = out.last_hidden_state[:, -1:].repeat_interleave(k, dim=0)                # (B, 1, H): predicts token 0
    t = response_ids.shape[1]
    if t == 1:
        return first
    # Response tokens 0..T-2 as inputs, attending to the cached prompt: they predict 1..T-1.
    mask = torch.cat([prompt_mask.repeat_interleave(k, dim=0), response_mask[:, :-1].to(prompt_mask.dtype)], 1)
    rpos = pos[:, -1:].repeat_interleave(k, dim=0) + 1 + torch.arange(t - 1, device=pos.device)  # (B, T-1)
    rest = decoder(input_ids=response_ids[:, :-1], attention_mask=mask, position_ids=rpos,
                   past_key_values=cache, use_cache=True).last_hidden_state              # (B, T-1, H)
    return torch.cat([first, rest], dim=1)                                           # (B, T, H)


def grouped_response_logits(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                            response_mask: Tensor, k: int) -> Tensor:
    """(B, T, V) logits predicting each response token; see `grouped_response_hidden`."""
    _, head = decoder_and_head(model)
    return head(grouped_response_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, k))


@contextmanager
def reference_model(reference: Reference) -> Iterator[nn.Module]:
    """The reference as a model: the frozen copy, or the policy with its adapter off."""
    if reference.model is not None:
        yield reference.model
    else:
        with reference.policy.disable_adapter():
            yield reference.policy


def response_outputs(logits: Tensor, response_ids: Tensor, temperature: float = 1.0,
                     with_entropy: bool = False, entropy_grad: bool = True) -> ForwardOutput:
    """Log-probs (and entropy) at the sampling temperature from (B, T, V) logits."""
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = ops.logprobs_from_logits(logits, response_ids)                        # (B, T)
    entropy = None
    if with_entropy:
        if entropy_grad:
            entropy = ops.entropy_from_logits(logits)
        else:
            with torch.no_grad():
                entropy = ops.entropy_from_logits(logits.detach())
    return ForwardOutput(logprobs, None, entropy)


@dataclass
class PolicyModels:
    actor: PolicyOnly
    reference: Reference | None  # None when no KL is used: then no reference is loaded at all
    tokenizer: object
    device: torch.device

    @property
    def policy(self) -> nn.Module:
        return self.actor.policy


def build_policy_models(model_cfg, lora_cfg, device: str, need_reference: bool,
                        resume_dir: Path | None = None) -> PolicyModels:
    """Policy (+LoRA) and, when `need_reference`, the frozen reference (the starting policy)."""
    dev = resolve_device(device)
    load_kw = dict(torch_dtype=model_cfg.torch_dtype, device=str(dev),
                   trust_remote_code=model_cfg.trust_remote_code, tokenizer=model_cfg.tokenizer)
    full_resume = resume_dir is not None and not lora_cfg.enabled
    policy, tok = load_model(str(resume_dir) if full_resume else model_cfg.name_or_path, **load_kw)
    reference = None
    if need_reference and not lora_cfg.enabled:
        # The reference is always the starting policy, also when resuming.
        src = load_model(model_cfg.name_or_path, **load_kw)[0] if full_resume else policy
        reference = Reference.frozen_copy(src)
        disable_dropout(reference.model)
        del src
    if lora_cfg.enabled:
        if resume_dir is not None:
            from peft import PeftModel
            policy = PeftModel.from_pretrained(policy, str(resume_dir / "adapter"), is_trainable=True)
        else:
            policy = add_lora(policy, lora_cfg.r, lora_cfg.alpha, lora_cfg.dropout, lora_cfg.target_modules)
        if need_reference:
            reference = Reference.lora_disabled(policy)
    disable_dropout(policy)
    if model_cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    actor = PolicyOnly(policy)
    actor.train()
    return PolicyModels(actor, reference, tok, dev)


# --------------------------------------------------------------------------------------
# Rollout, scoring, log-probs
# --------------------------------------------------------------------------------------
def sample_groups(models: PolicyModels, examples, k: int, gen_cfg, max_prompt_length: int,
                  batch_size: int, share_prompt: bool = True) -> Rollout:
    """`k` sampled responses per example; rows [i·k, (i+1)·k) answer example i. B = n·k.

    With `share_prompt`, each prompt is prefilled once (all but its last token) and its
    KV cache repeated k times before `generate` continues from it; the sampling itself
    is `generate`'s, with the same settings as `rlhflab.rollout.generate`.
    """
    if not share_prompt or k < 2 or _checkpointing(models.policy):
        prompts = [e.prompt for e in examples for _ in range(k)]
        rows = [e.row for e in examples for _ in range(k)]
        return generate(models.policy, models.tokenizer, prompts, max_new_tokens=gen_cfg.max_new_tokens,
                        min_new_tokens=gen_cfg.min_new_tokens, temperature=gen_cfg.temperature,
                        top_k=gen_cfg.top_k, top_p=gen_cfg.top_p, max_prompt_length=max_prompt_length,
                        batch_size=batch_size, examples=rows)
    model, tok = models.policy, models.tokenizer
    eos = eos_ids_of(model, tok)
    tok.padding_side, tok.truncation_side = "left", "left"
    was_training = model.training
    model.eval()
    parts = []
    per_call = max(1, batch_size // k)  # prompts per generate call: batch_size responses
    for start in range(0, len(examples), per_call):
        chunk = examples[start : start + per_call]
        enc = tok([e.prompt for e in chunk], return_tensors="pt", padding=True, add_special_tokens=False,
                  truncation=True, max_length=max_prompt_length)
        ids, am = enc["input_ids"].to(models.device), enc["attention_mask"].to(models.device)  # (G, P)
        kwargs = dict(max_new_tokens=gen_cfg.max_new_tokens, min_new_tokens=gen_cfg.min_new_tokens or None,
                      pad_token_id=tok.pad_token_id, eos_token_id=eos, use_cache=True, do_sample=True,
                      temperature=gen_cfg.temperature, top_k=gen_cfg.top_k or None,
                      top_p=gen_cfg.top_p if gen_cfg.top_p < 1.0 else None)
        with torch.no_grad():
            if ids.shape[1] > 1:  # prefill all but the last prompt token once per prompt, then copy the cache
                decoder, _ = decoder_and_head(model)
                cache = decoder(input_ids=ids[:, :-1], attention_mask=am[:, :-1],
                                position_ids=position_ids_from(am[:, :-1]), use_cache=True).past_key_values
                cache.batch_repeat_interleave(k)
                kwargs["past_key_values"] = cache
            ids_k, am_k = ids.repeat_interleave(k, dim=0), am.repeat_interleave(k, dim=0)  # (G·k, P)
            out = model.generate(input_ids=ids_k, attention_mask=am_k, **kwargs)
        parts.append(finish_rollout(out, ids_k, am_k, tok, eos, [e.prompt for e in chunk for _ in range(k)],
                                    [e.row for e in chunk for _ in range(k)]))
    if was_training:
        model.train()
    return collate(parts, tok.pad_token_id)


def score_responses(scorer, roll: Rollout, reward_cfg, device: torch.device) -> Tensor:
    """Sequence scores (B,): the reward sources, minus the missing-EOS penalty, clipped."""
    scores = scorer.score(roll.prompts, roll.responses, roll.examples).float().to(device)  # (B,)
    if reward_cfg.missing_eos_penalty:
        scores = scores - reward_cfg.missing_eos_penalty * roll.hit_limit.float().to(device)
    if reward_cfg.score_clip is not None:
        scores = scores.clamp(-reward_cfg.score_clip, reward_cfg.score_clip)
    return scores


def _grouped_rows(roll: Rollout, k: int) -> bool:
    return k > 1 and groups_share_prompt(roll.prompt_ids, roll.prompt_mask, k)


@torch.no_grad()
def _logprobs_pass(model: nn.Module, roll: Rollout, temperature: float, micro_batch: int, k: int) -> Tensor:
    """(B, T) log-probs of the response tokens under `model`, each group's prompt run once."""
    micro = max(k, micro_batch - micro_batch % k)  # whole groups per micro-batch
    parts = []
    for s in range(0, len(roll), micro):
        rows = torch.arange(s, min(s + micro, len(roll)), device=roll.prompt_ids.device)
        mb = _group_minibatch(rows, roll, k)
        logits = grouped_response_logits(model, mb["prompt_ids"], mb["prompt_mask"], mb["response_ids"],
                                         mb["response_mask"], k)
        lp = response_outputs(logits, mb["response_ids"], temperature).logprobs      # (b, T')
        parts.append(torch.nn.functional.pad(lp, (0, roll.response_ids.shape[1] - lp.shape[1])))
    return torch.cat(parts) * roll.response_mask.float()


@torch.no_grad()
def reference_logprobs(reference: Reference, roll: Rollout, temperature: float = 1.0,
                       micro_batch: int = 64, k: int = 1) -> Tensor:
    """(B, T) log-probs of the response tokens under the reference, 0 on padding."""
    if _grouped_rows(roll, k):
        with reference_model(reference) as model:
            return _logprobs_pass(model, roll, temperature, micro_batch, k)
    ids, am, p = roll.input_ids(), roll.attention_mask(), roll.prompt_len
    parts = []
    for s in range(0, len(roll), micro_batch):
        sl = slice(s, s + micro_batch)
        logits = reference.response_logits(ids[sl], am[sl], p)  # (b, T, V)
        if temperature != 1.0:
            logits = logits / temperature
        parts.append(ops.logprobs_from_logits(logits, roll.response_ids[sl]))
    return torch.cat(parts) * roll.response_mask.float()


def old_logprobs(models: PolicyModels, roll: Rollout, temperature: float = 1.0,
                 micro_batch: int = 64, k: int = 1) -> Tensor:
    """(B, T) log-probs under the policy as it is now (the sampling policy), no gradients."""
    if _grouped_rows(roll, k) and not _checkpointing(models.policy):
        was_training = models.actor.training
        models.actor.eval()
        roll.logprobs = _logprobs_pass(models.policy, roll, temperature, micro_batch, k)
        models.actor.train(was_training)
        return roll.logprobs
    score_rollout(models.actor, None, roll, temperature=temperature, micro_batch=micro_batch,
                  with_values=False)
    return roll.logprobs


def broadcast_advantages(seq_advantages: Tensor, response_mask: Tensor) -> Tensor:
    """The same advantage on every response token: (B,), (B, T) -> (B, T), 0 on padding."""
    if seq_advantages.dim() != 1 or seq_advantages.shape[0] != response_mask.shape[0]:
        raise ValueError(f"advantages must be (B,) = ({response_mask.shape[0]},), "
                         f"got {tuple(seq_advantages.shape)}")
    return seq_advantages.float().unsqueeze(1) * response_mask.float()  # (B, T)


def loss_mask_of(roll: Rollout, mask_truncated: bool) -> Tensor:
    """response_mask, with every token of a truncated (no EOS) response set to 0 when asked. (B, T)."""
    mask = roll.response_mask.long()
    if mask_truncated:
        mask = mask * (~roll.hit_limit).long().unsqueeze(1).to(mask.device)
    return mask


# --------------------------------------------------------------------------------------
# The update
# --------------------------------------------------------------------------------------
def _minibatch(rows: Tensor, roll: Rollout, loss_mask: Tensor) -> dict:
    """Rows of the rollout with all-padding columns dropped (prompt left, response right)."""
    pm, rm = roll.prompt_mask[rows], roll.response_mask[rows]
    p_keep = int(pm.sum(0).nonzero().min()) if pm.any() else pm.shape[1] - 1
    t_keep = int(rm.sum(0).nonzero().max()) + 1 if rm.any() else 1
    resp = slice(0, t_keep)
    prompt_ids, prompt_mask = roll.prompt_ids[rows, p_keep:], pm[:, p_keep:]

    def cut(x: Tensor | None) -> Tensor | None:
        return None if x is None else x[rows, resp]

    return {
        "input_ids": torch.cat([prompt_ids, roll.response_ids[rows, resp]], 1),           # (b, P'+T')
        "attention_mask": torch.cat([prompt_mask, rm[:, resp].to(prompt_mask.dtype)], 1),
        "prompt_len": prompt_ids.shape[1],
        "response_ids": roll.response_ids[rows, resp],                                    # (b, T')
        "response_mask": rm[:, resp].float(),                                             # (b, T')
        "loss_mask": loss_mask[rows, resp],
        "advantages": roll.advantages[rows, resp],
        "old_logprobs": cut(roll.logprobs),
        "ref_logprobs": cut(roll.ref_logprobs),
    }


def _group_minibatch(rows: Tensor, roll: Rollout, k: int, loss_mask: Tensor | None = None) -> dict:
    """Like `_minibatch` for rows made of whole groups: one prompt row per group."""
    first = rows[::k]
    pm = roll.prompt_mask[first]                                                      # (G, P)
    rm = roll.response_mask[rows]                                                     # (b, T)
    p_keep = int(pm.sum(0).nonzero().min()) if pm.any() else pm.shape[1] - 1
    t_keep = int(rm.sum(0).nonzero().max()) + 1 if rm.any() else 1
    resp = slice(0, t_keep)

    def cut(x: Tensor | None) -> Tensor | None:
        return None if x is None else x[rows, resp]

    return {
        "prompt_ids": roll.prompt_ids[first, p_keep:], "prompt_mask": pm[:, p_keep:],
        "response_ids": roll.response_ids[rows, resp], "response_mask": rm[:, resp].float(),
        "loss_mask": cut(loss_mask), "advantages": cut(roll.advantages),
        "old_logprobs": cut(roll.logprobs), "ref_logprobs": cut(roll.ref_logprobs),
    }


def clip_fractions(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                   clip_eps: float, clip_eps_high: float) -> tuple[float, float]:
    """Fractions of tokens clipped below (ratio < 1−ε_low, A < 0) and above (ratio > 1+ε_high, A > 0)."""
    with torch.no_grad():
        ratio = torch.exp(logprobs - old_logprobs)
        low = ((ratio < 1.0 - clip_eps) & (advantages < 0)).float()
        high = ((ratio > 1.0 + clip_eps_high) & (advantages > 0)).float()
        return float(ops.masked_mean(low, mask)), float(ops.masked_mean(high, mask))


class PolicyLossTerms(NamedTuple):
    total: Tensor      # scalar to minimise: policy + entropy_coeff·(−H) + kl_coeff·KL
    policy: Tensor     # the clipped-surrogate part (detached)
    kl: Tensor         # the aggregated KL estimate (detached; 0 when kl_coeff is 0)
    entropy: Tensor    # the aggregated entropy (detached; 0 when none was given)
    clip_frac: Tensor  # fraction of tokens where the clipped branch was taken
    approx_kl: Tensor  # mean ½(log π − log π_old)²


def policy_gradient_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, *,
                         clip_eps: float = 0.2, clip_eps_high: float | None = None,
                         aggregation: str = "token_mean", normalizer: float | Tensor | None = None,
                         entropy: Tensor | None = None, entropy_coeff: float = 0.0,
                         ref_logprobs: Tensor | None = None, kl_coeff: float = 0.0,
                         kl_estimator: str = "k3") -> PolicyLossTerms:
    """The loss GRPO and RLOO minimise on one (micro)batch; all tensors (B, T).

    `advantages` are per token (a sequence's advantage broadcast over its tokens);
    `loss_mask` is the response mask, possibly with truncated responses zeroed. Every
    term is aggregated the same way (`aggregation`, `normalizer`; see `ops.aggregate`).
    """
    agg = dict(aggregation=aggregation, normalizer=normalizer)
    pg = ops.ppo_policy_loss(logprobs, old_logprobs, advantages, loss_mask, clip_eps,
                             clip_eps_high=clip_eps_high, **agg)
    total = pg.loss
    zero = logprobs.new_zeros(())
    mean_entropy = zero
    if entropy is not None:
        ent = ops.entropy_loss(entropy, loss_mask, **agg)  # no graph when entropy has none
        mean_entropy = ent.entropy
        if entropy_coeff > 0:
            total = total + entropy_coeff * ent.loss
    kl_term = zero
    if kl_coeff > 0:
        if ref_logprobs is None:
            raise ValueError("policy_gradient_loss: kl_coeff > 0 needs ref_logprobs")
        # k3 by default: unbiased and never negative (Schulman, "Approximating KL divergence").
        kl = ops.aggregate(ops.kl_estimate(logprobs, ref_logprobs, kl_estimator), loss_mask, **agg)
        total = total + kl_coeff * kl
        kl_term = kl.detach()
    return PolicyLossTerms(total, pg.loss.detach(), kl_term, mean_entropy, pg.clip_frac, pg.approx_kl)


def policy_update(models: PolicyModels, optimizer, scheduler, roll: Rollout, sec, *,
                  temperature: float, step: int, seed: int, kl_coeff: float = 0.0,
                  kl_estimator: str = "k3") -> dict[str, float]:
    """`sec.epochs` passes of shuffled minibatches of the clipped surrogate.

    roll.advantages (B, T) must be set. roll.logprobs holds the sampling policy's
    log-probs, or is None when this update makes a single optimizer step (see the module
    docstring). With `kl_coeff` > 0, roll.ref_logprobs must be set and
    kl_coeff · KL(π‖π_ref) (estimator `kl_estimator`) joins the loss, aggregated like it.
    """
    actor = models.actor
    params = actor.trainable_parameters()
    n = len(roll)
    if roll.logprobs is None and sec.optimizer_steps_per_rollout() > 1:
        raise ValueError("policy_update: roll.logprobs (old log-probs) are needed when a step makes "
                         "more than one optimizer step")
    if kl_coeff > 0 and roll.ref_logprobs is None:
        raise ValueError("policy_update: kl_coeff > 0 needs roll.ref_logprobs")
    eps_high = sec.clip_eps if sec.clip_eps_high is None else sec.clip_eps_high
    loss_mask = loss_mask_of(roll, sec.mask_truncated).to(roll.response_ids.device)  # (B, T)
    g = torch.Generator().manual_seed(seed * 7_919 + step)
    sums: dict[str, float] = {}
    n_mb = n_opt = 0
    grad_norms: list[float] = []
    kl_seq = torch.zeros(n)  # Σ_t KL per response, under the sampling policy (first epoch)

    def add(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value

    k = sec.samples_per_prompt
    grouped = (sec.share_prompt and sec.mini_batch_size % k == 0 and _grouped_rows(roll, k)
               and not _checkpointing(models.policy))
    device = roll.prompt_ids.device
    for epoch in range(sec.epochs):
        if grouped:  # shuffle whole groups, so each minibatch runs its prompts once
            groups = torch.randperm(n // k, generator=g).to(device)
            order = (groups.unsqueeze(1) * k + torch.arange(k, device=device)).reshape(-1)
        else:
            order = torch.randperm(n, generator=g).to(device)
        minibatches = [order[i : i + sec.mini_batch_size] for i in range(0, n, sec.mini_batch_size)]
        for start in range(0, len(minibatches), sec.gradient_accumulation_steps):
            group = minibatches[start : start + sec.gradient_accumulation_steps]
            rows = torch.cat(group)
            # The whole accumulation group's token (or sequence) count, so 1x8 == 8x1 exactly.
            if sec.loss_aggregation == "token_mean":
                normalizer = float(loss_mask[rows].sum().clamp(min=1))
            else:
                normalizer = float((loss_mask[rows].sum(-1) > 0).sum().clamp(min=1))
            for mb_rows in group:
                if grouped:
                    mb = _group_minibatch(mb_rows, roll, k, loss_mask)
                    logits = grouped_response_logits(models.policy, mb["prompt_ids"], mb["prompt_mask"],
                                                     mb["response_ids"], mb["response_mask"], k)
                    out = response_outputs(logits, mb["response_ids"], temperature, with_entropy=True,
                                           entropy_grad=sec.entropy_coeff > 0)
                else:
                    mb = _minibatch(mb_rows, roll, loss_mask)
                    out = forward_response(actor, mb["input_ids"], mb["attention_mask"], mb["response_ids"],
                                           mb["prompt_len"], temperature, with_values=False,
                                           with_entropy=True, entropy_grad=sec.entropy_coeff > 0)
                mask = mb["loss_mask"]
                old = mb["old_logprobs"] if mb["old_logprobs"] is not None else out.logprobs.detach()
                terms = policy_gradient_loss(
                    out.logprobs, old, mb["advantages"], mask, clip_eps=sec.clip_eps,
                    clip_eps_high=sec.clip_eps_high, aggregation=sec.loss_aggregation, normalizer=normalizer,
                    entropy=out.entropy, entropy_coeff=sec.entropy_coeff, ref_logprobs=mb["ref_logprobs"],
                    kl_coeff=kl_coeff, kl_estimator=kl_estimator)
                if not torch.isfinite(terms.total):
                    raise FloatingPointError(f"loss/total is {float(terms.total)} at step {step}; "
                                             f"policy={float(terms.policy)} entropy={float(terms.entropy)}")
                terms.total.backward()
                if kl_coeff > 0:
                    add("loss/kl", float(terms.kl))
                    if epoch == 0:  # the logged KL: Σ over every real response token
                        kl_tok = ops.kl_estimate(out.logprobs.detach(), mb["ref_logprobs"], kl_estimator)
                        kl_seq[mb_rows.cpu()] = (kl_tok * mb["response_mask"]).sum(-1).cpu()
                low, high = clip_fractions(out.logprobs, old, mb["advantages"], mask,
                                           sec.clip_eps, eps_high)
                add("loss/policy", float(terms.policy))
                add("loss/total", float(terms.total.detach()))
                add("loss/entropy", float(terms.entropy))
                add("params/policy_clip_frac", float(terms.clip_frac))
                add("params/clip_frac_low", low)
                add("params/clip_frac_high", high)
                add("params/approx_kl", float(terms.approx_kl))
                n_mb += 1
            max_norm = sec.max_grad_norm if sec.max_grad_norm is not None else float("inf")
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))  # pre-clip norm
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            n_opt += 1
    # loss/* (entropy included) are summed over the micro-batches of a group, each carrying
    # its share of the group's normalizer, so a group's sum is its value: mean over groups.
    # The fractions are per minibatch: mean over minibatches.
    metrics = {k: v / (n_opt if k.startswith("loss/") else n_mb) for k, v in sums.items()}
    metrics["params/grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["lr"] = optimizer.param_groups[0]["lr"]
    if kl_coeff > 0:
        metrics["params/kl_to_ref"] = float(kl_seq.mean())
    return metrics


# --------------------------------------------------------------------------------------
# Metrics, evaluation, checkpoints
# --------------------------------------------------------------------------------------
def rollout_metrics(roll: Rollout, scores: Tensor, k: int) -> dict[str, float]:
    """Reward mean/std, the fraction of groups whose rewards are all equal, lengths."""
    lengths = roll.response_mask.float().sum(-1)  # (B,)
    groups = scores.float().view(-1, k)           # (n, k)
    zero_spread = (groups.max(1).values - groups.min(1).values) <= 1e-8
    return {
        "rollout/reward_mean": float(scores.mean()),
        "rollout/reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
        "rollout/zero_spread_frac": float(zero_spread.float().mean()),
        "rollout/response_length": float(lengths.mean()),
        "rollout/response_length_min": float(lengths.min()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/hit_limit_frac": float(roll.hit_limit.float().mean()),
    }


PLOT_GROUPS: dict[str, list[str]] = {
    "reward": ["rollout/reward_mean", "eval/reward_mean", "eval/accuracy"],
    "zero_spread": ["rollout/zero_spread_frac"],
    "losses": ["loss/policy", "loss/kl", "loss/total"],
    "entropy": ["loss/entropy"],
    "kl": ["params/approx_kl", "params/kl_to_ref"],
    "clipping": ["params/policy_clip_frac", "params/clip_frac_low", "params/clip_frac_high"],
    "grad_norm": ["params/grad_norm"],
    "length": ["rollout/response_length"],
    "time": ["time/generate", "time/score", "time/forward", "time/update"],
    "lr": ["lr"],
}


def evaluate(models: PolicyModels, examples, scorer, cfg, out_dir: Path, step: int) -> dict[str, float]:
    """Greedy held-out accuracy and mean reward; the responses go to eval/step_N.jsonl."""
    res = evaluate_policy(models.policy, models.tokenizer, examples, scorer,
                          max_new_tokens=cfg.generation.max_new_tokens,
                          max_prompt_length=cfg.dataset.max_prompt_length,
                          batch_size=cfg.training.eval_batch_size)
    save_samples(res, out_dir / "eval" / f"step_{step}.jsonl")
    return res.metrics()


# --------------------------------------------------------------------------------------
# Step 6 and the loop around a trainer's step function
# --------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path
    history: list[dict] = field(default_factory=list)
    eval_before: dict | None = None
    eval_after: dict | None = None
    completions_per_s: float = 0.0
    models: PolicyModels | None = None


StepFn = Callable[..., dict]  # (models, examples, cfg, scorer, optimizer, scheduler, step, timer) -> metrics


def run_training(cfg, sec: PolicyGradientSection, step_fn: StepFn, name: str, *, need_reference: bool,
                 resume: str | Path | None = None, effective=None, quiet: bool = False) -> TrainResult:
    """Set up, then per step: fresh prompts, `step_fn` (phases 1-5), then 6. log, evaluate, save.

    `cfg` is a GRPO or RLOO run config (model, lora, dataset, generation, reward,
    training, logging sections); `sec` its method section.
    """
    t = cfg.training
    set_threads(t.num_threads)
    resume_dir = check_resume_dir(resume)
    out_dir = prepare_output_dir(t.output_dir, resume=resume_dir is not None)
    save_effective_config(effective if effective is not None else cfg, out_dir)
    seed_everything(t.seed)

    models = build_policy_models(cfg.model, cfg.lora, t.device, need_reference, resume_dir)
    train_examples = load_prompts(cfg.dataset, models.tokenizer, "train")
    eval_examples = load_prompts(cfg.dataset, models.tokenizer, "eval") if t.eval_interval else []
    scorer = build_reward(cfg.reward, models.device)
    optimizer, scheduler = make_optimization(models.actor.trainable_parameters(), sec,
                                             t.total_ppo_steps * sec.optimizer_steps_per_rollout())
    start_step = restore_trainer_state(resume_dir, optimizer, scheduler) if resume_dir is not None else 0

    doctor = make_doctor(cfg.logging.doctor, sec.max_grad_norm, sec.KL_KNOB)
    logger = MetricsLogger(out_dir, cfg.logging.report_to, cfg.logging.run_name, cfg.logging.wandb_project,
                           config=dataclasses.asdict(cfg), resume=resume_dir is not None)
    result = TrainResult(out_dir, out_dir / "final", models=models)
    if eval_examples and start_step == 0:
        result.eval_before = evaluate(models, eval_examples, scorer, cfg, out_dir, 0)
        logger.log(0, result.eval_before)
        if not quiet:
            print("step 0 (before training): " + format_metrics(result.eval_before))

    from tqdm import tqdm
    bar = tqdm(range(start_step, t.total_ppo_steps), initial=start_step, total=t.total_ppo_steps,
               disable=quiet or not cfg.logging.progress_bar, desc=name, dynamic_ncols=True)
    total_completions, total_seconds = 0, 0.0
    for step_idx in bar:
        step = step_idx + 1
        timer = Timer()
        t0 = time.perf_counter()
        # Fresh prompts every step; the draw depends only on (seed, step), so a resume matches.
        examples = step_prompts(train_examples, sec.prompts_per_step, t.seed, step)
        metrics = step_fn(models, examples, cfg, scorer, optimizer, scheduler, step, timer)
        seconds = time.perf_counter() - t0
        total_completions += sec.rollout_size
        total_seconds += seconds
        # 6. log, evaluate, save.
        metrics.update(timer.metrics())
        metrics["time/step"] = seconds
        metrics["perf/completions_per_s"] = sec.rollout_size / seconds
        if eval_examples and (step % t.eval_interval == 0 or step == t.total_ppo_steps):
            metrics.update(evaluate(models, eval_examples, scorer, cfg, out_dir, step))
        log_step(logger, result.history, doctor, step, metrics)
        bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}")
        if t.save_interval and step % t.save_interval == 0 and step < t.total_ppo_steps:
            save_checkpoint(out_dir / f"step_{step}", models.actor, models.tokenizer,
                            optimizer=optimizer, scheduler=scheduler, step=step)
            prune_checkpoints(out_dir, t.keep_last_checkpoints)
    bar.close()
    save_checkpoint(result.final_dir, models.actor, models.tokenizer, optimizer=optimizer,
                    scheduler=scheduler, step=t.total_ppo_steps)
    finish_run(logger, out_dir, models.device, cfg.logging.plots, PLOT_GROUPS)
    result.eval_after = last_eval(result.history)
    result.completions_per_s = total_completions / total_seconds if total_seconds else 0.0
    return result


def report(res: TrainResult) -> None:
    """Print the end-of-run summary and write train_result.json."""
    print(f"done: {res.output_dir} (final model in {res.final_dir}); "
          f"{res.completions_per_s:.2f} completions/s")
    print_before_after(res.eval_before, res.eval_after)
    write_train_result(res.output_dir, eval_before=res.eval_before, eval_after=res.eval_after,
                       completions_per_s=res.completions_per_s)


__all__ = [
    "OptimizerFields", "PolicyGradientSection", "groups_share_prompt", "grouped_response_hidden",
    "grouped_response_logits", "reference_model", "response_outputs", "check_reference", "PolicyOnly", "PolicyModels", "build_policy_models",
    "make_optimization", "sample_groups", "score_responses", "reference_logprobs", "old_logprobs",
    "broadcast_advantages", "loss_mask_of", "PolicyLossTerms", "policy_gradient_loss", "policy_update", "clip_fractions", "rollout_metrics",
    "PLOT_GROUPS", "evaluate", "Timer",
    "TrainResult", "run_training", "report",
]
