"""DPO on offline preference pairs: `rlhflab dpo --config configs/dpo_debug.yaml [key=value ...]`.

Direct Preference Optimisation (Rafailov et al., 2023) and two relatives (IPO, hinge)
on pairs in the labelling app's export format, read as they are:

    {"prompt": str, "chosen": str, "rejected": str, "margin": float, "pair_id": ..., "n_labels": int}

The loop, in order:

    1. data         read and tokenize the pairs (prompt left-truncated, responses
                    right-truncated, EOS appended); tie rows are left out
    2. reference    sequence log-probs of every pair under the reference, computed once
                    and cached (up front, or on a pair's first use)
    3. update       per batch of pairs: policy sequence log-probs of chosen and rejected
                    in one forward pass, `ops.dpo_loss`, gradient accumulation over
                    micro-batches, grad-norm clipping
    4. log, evaluate (held-out implicit-reward accuracy; greedy task accuracy), save

A sequence log-prob is the sum of the log-probs of the response tokens only (EOS
included, prompt and padding excluded). The LM head runs only on the real response
positions, a chunk of rows at a time (`ops.chunked_logprobs`), so the policy's
(B, T, V) logits are never held, in the forward or the backward pass.

Where we depart from common practice:
- With `precompute_ref_logprobs` and a frozen-copy reference, the copy is freed once
  every pair's reference log-probs are cached, so training holds one model. Under LoRA
  the reference is the adapter-disabled policy and costs no memory; its log-probs are
  cached all the same, so each pair's reference pass runs once.
- Besides the implicit-reward accuracy (β·log π/π_ref of chosen > of rejected, which is
  0 before training because both rewards are 0), `eval/logp_accuracy` reports how often
  the policy itself gives the chosen response the higher log-probability.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch
from torch import Tensor

from rlhflab import ops
from rlhflab.config import load_config
from rlhflab.config.schema import (CpuConfig, DatasetConfig, GenerationConfig, LoggingConfig, LoRAConfig, ModelConfig,
                                   OptimizerFields, TrainingConfig, check_reference, f)
from rlhflab.data.chat import resolve_use_chat_template, response_end_id
from rlhflab.data.loading import read_rows
from rlhflab.data.preferences import PairText, check_sources, parse_pairs, render_pairs, write_off_by_one_pairs
from rlhflab.data.prompts import load_prompts
from rlhflab.data.tokens import leading_ids
from rlhflab.errors import UserError
from rlhflab.engine.dist import Forward, even_share
from rlhflab.engine.update import inner
from rlhflab.evaluate import evaluate_policy, save_samples
from rlhflab.models.actor_critic import PolicyOnly, Reference, response_hidden
from rlhflab.models.head import linear_lm_head
from rlhflab.rewards import RuleScorer, resolve_rule
from rlhflab.models.setup import PolicyModels, build_models
from rlhflab.run import TrainResult, entry_point, start_run
from rlhflab.trainers.common import (Timer, check_finite_model, check_finite_step, clip_and_step, cut_rows_by_tokens,
                                     last_eval, make_optimization, make_probe_batch)


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
@dataclass
class DPOSection(OptimizerFields):
    """DPO settings (the optimizer fields are shared with GRPO and RLOO)."""

    beta: float = f(0.1, "strength of the implicit KL to the reference: the reward is beta * log(pi/pi_ref)", gt=0)
    loss_kind: Literal["sigmoid", "ipo", "hinge"] = f(
        "sigmoid", "sigmoid: DPO; ipo: squared loss to 1/(2 beta); hinge: SLiC's max(0, 1 - beta h)")
    label_smoothing: float = f(0.0, "assumed fraction of flipped labels (conservative DPO; sigmoid only)", ge=0, lt=0.5)
    batch_size: int = f(16, "pairs per optimizer step", gt=0)
    mini_batch_size: int = f(8, "pairs per forward pass; batch_size / mini_batch_size micro-batches are accumulated", gt=0)
    epochs: int = f(1, "passes over the training pairs", gt=0)
    max_steps: Optional[int] = f(None, "stop after this many optimizer steps; null runs every epoch", gt=0)
    max_response_length: int = f(256, "chosen/rejected responses longer than this (in tokens, EOS included) are cut", gt=0)
    append_eos: bool = f(True, "end every response with the EOS token (the export holds text without it)")
    precompute_ref_logprobs: bool = f(True, "compute every pair's reference log-probs before training; false: on first use (cached either way)")
    eval_fraction: float = f(0.1, "held-out fraction of the pairs when dataset.eval_path is null", ge=0, lt=1)
    sft_coeff: float = f(0.0, "weight of an NLL term on the chosen responses (RPO, Pang et al. 2024; in TRL 1.x "
                                  "loss_type [sigmoid, sft] with loss_weights [1, sft_coeff]); 0 is plain DPO", ge=0)
    task_eval_path: Optional[str] = f(None, "GSM8K-format file (question/answer) for greedy held-out accuracy; null skips it")
    task_reward: str = f("gsm8k", "rule reward used to score the greedy task answers")
    layout: Literal["padded", "packed"] = f("padded", "decoder passes of the policy and reference: padded rows, or "
                                                      "each sequence's real tokens packed into rows (the same numbers "
                                                      "to rounding; SDPA, eager or FlashAttention)")
    mini_batch_tokens: Optional[int] = f(None, "cut each optimizer step's pairs into micro-batches of at most this many "
                                               "real tokens, both sequences (a longer pair runs alone); null: "
                                               "mini_batch_size pairs each", gt=0)

    def check(self) -> list[str]:
        errs = super().check()
        if self.mini_batch_size > self.batch_size:
            errs.append(f"mini_batch_size: {self.mini_batch_size} exceeds batch_size {self.batch_size}; lower it")
        if self.label_smoothing and self.loss_kind != "sigmoid":
            errs.append(f"label_smoothing: only the sigmoid loss uses it, loss_kind is {self.loss_kind!r}; set it to 0")
        return errs


def _dpo_dataset() -> DatasetConfig:
    return DatasetConfig(path="outputs/arith/pairs_train.jsonl", eval_path="outputs/arith/pairs_test.jsonl",
                         prompt_field="prompt", answer_field="answer")


@dataclass
class DPORunConfig:
    """`rlhflab dpo`: every section of a DPO run. Its length is `dpo.epochs` (and `dpo.max_steps`), not `training.total_steps`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    dataset: DatasetConfig = field(default_factory=_dpo_dataset)
    generation: GenerationConfig = field(default_factory=GenerationConfig)  # greedy task evaluation only
    dpo: DPOSection = field(default_factory=DPOSection)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)

    def check(self) -> list[str]:
        if self.model.reference == "none":
            return ["model.reference: none leaves DPO nothing to compare against; use copy "
                    "(or lora_disabled with lora.enabled=true)"]
        return check_reference(self.model, self.lora, 0.0, "dpo.beta")


# --------------------------------------------------------------------------------------
# 1. Data
# --------------------------------------------------------------------------------------
def read_preference_pairs(source: str, dataset_cfg: DatasetConfig, tokenizer=None,
                          limit: int | None = None, warn=print) -> list[PairText]:
    """The export's rows as text pairs (`rlhflab.data.preferences` parses them: TRL's
    standard and conversational forms, explicit or implicit prompt); ties carry no
    preference and are left out.

    Prompts are raw (docs/reference/data_formats.md): a plain prompt goes through
    `dataset.prompt_template` and the chat template by the one rule, as the policy's run
    renders its prompts, and one that already holds that template is refused;
    conversational rows are rendered with the chat template by `pair_texts`.
    """
    d = dataset_cfg
    rows = read_rows(source, d.split, d.subset)
    if d.prompt_field != "prompt":  # the export names it "prompt"; a file may call it otherwise
        rows = [{**r, "prompt": r[d.prompt_field]} if isinstance(r, dict) and d.prompt_field in r else r
                for r in rows]
    use_chat = resolve_use_chat_template(d.use_chat_template, tokenizer) if tokenizer is not None else False
    report = parse_pairs(rows, source, warn=warn)
    kept = [p for p in report.pairs if not p.tie]
    pairs = render_pairs(kept, tokenizer, d.prompt_template, use_chat, str(source), "dataset.prompt_template")
    if report.ties:
        warn(f"{source}: {report.ties} tie rows left out (no preference to learn)")
    if not pairs:
        raise UserError(f"{source}: every row is a tie; DPO needs pairs with a preference")
    return pairs[:limit] if limit is not None else pairs


@dataclass
class TokenizedPair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


def tokenize_pairs(pairs: Sequence[PairText], tokenizer, max_prompt_length: int,
                   max_response_length: int, append_eos: bool = True,
                   end_token_id: int | None = None) -> list[TokenizedPair]:
    """Prompt and responses tokenized separately (as at generation time) and truncated.

    With `append_eos`, a response that does not already end with it gets `end_token_id`
    (default the tokenizer's EOS; under a chat template the end-of-turn token, which is
    where the policy's own responses end).
    """
    eos = end_token_id if end_token_id is not None else tokenizer.eos_token_id

    def response(text: str) -> list[int]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if append_eos and eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]
        return ids[:max_response_length]

    prompts = leading_ids(tokenizer, [p.prompt for p in pairs], max_prompt_length)  # as the rollouts do
    return [TokenizedPair(prompt, response(p.chosen), response(p.rejected)) for p, prompt in zip(pairs, prompts)]


@dataclass
class ResponseBatch:
    input_ids: Tensor      # (B, P+T) prompt left-padded, response right-padded
    attention_mask: Tensor  # (B, P+T)
    response_ids: Tensor   # (B, T)
    response_mask: Tensor  # (B, T) 1 on real response tokens
    prompt_len: int        # P


def collate_responses(prompts: Sequence[list[int]], responses: Sequence[list[int]], pad_token_id: int,
                      device: torch.device | str = "cpu") -> ResponseBatch:
    """Prompt+response rows in the rollout layout, so response token t sits at P + t."""
    b = len(prompts)
    p = max(len(x) for x in prompts)
    t = max(max(len(x) for x in responses), 1)
    prompt_ids = torch.full((b, p), pad_token_id, dtype=torch.long)      # (B, P)
    prompt_mask = torch.zeros((b, p), dtype=torch.long)
    response_ids = torch.full((b, t), pad_token_id, dtype=torch.long)    # (B, T)
    response_mask = torch.zeros((b, t), dtype=torch.long)
    for i, (pr, rs) in enumerate(zip(prompts, responses)):
        if pr:
            prompt_ids[i, p - len(pr):] = torch.tensor(pr)
            prompt_mask[i, p - len(pr):] = 1
        if rs:
            response_ids[i, :len(rs)] = torch.tensor(rs)
            response_mask[i, :len(rs)] = 1
    return ResponseBatch(torch.cat([prompt_ids, response_ids], 1).to(device),
                         torch.cat([prompt_mask, response_mask], 1).to(device),
                         response_ids.to(device), response_mask.to(device), p)


def pair_batch(pairs: Sequence[TokenizedPair], pad_token_id: int, device) -> ResponseBatch:
    """2b rows: the b chosen responses, then the b rejected ones, each after its prompt."""
    prompts = [x.prompt_ids for x in pairs] * 2
    responses = [x.chosen_ids for x in pairs] + [x.rejected_ids for x in pairs]
    return collate_responses(prompts, responses, pad_token_id, device)


def sequence_logprobs(logits: Tensor, batch: ResponseBatch) -> Tensor:
    """Σ_t log p(response token t), response tokens only: logits (B, T, V) -> (B,)."""
    logprobs = ops.logprobs_from_logits(logits, batch.response_ids)  # (B, T)
    return ops.masked_sum(logprobs, batch.response_mask, dim=-1)      # (B,)


def policy_sequence_logprobs(actor: PolicyOnly, batch: ResponseBatch, layout: str = "padded") -> Tensor:
    """Σ_t log p(response token t) under the policy, (B,), never holding (B, T, V) logits.

    When the LM head is a plain linear map, the hidden states of the real response tokens
    (padding left out) and the head's weight go to `ops.chunked_logprobs`, one chunk of
    rows at a time in forward and backward; otherwise the policy's own logits are used.
    `layout` as in `response_hidden` (packed: the same numbers to float rounding).
    """
    head = linear_lm_head(getattr(actor, "policy", None))
    if head is None:
        out = actor.forward_response(batch.input_ids, batch.attention_mask, batch.prompt_len,
                                     **({} if layout == "padded" else {"layout": layout}))
        return sequence_logprobs(out.logits, batch)
    p = batch.prompt_len
    with actor.autocast(batch.input_ids.device):  # training.mixed_precision; the head below is float32
        hidden = response_hidden(actor.policy, batch.input_ids[:, :p], batch.attention_mask[:, :p],
                                 batch.response_ids, batch.response_mask, layout=layout)         # (B, T, H)
    real = batch.response_mask.bool()                                                            # (B, T)
    logprobs = torch.zeros(real.shape, dtype=torch.float32, device=hidden.device)                # (B, T)
    logprobs[real] = ops.chunked_logprobs(hidden[real], head.weight, head.bias, batch.response_ids[real],
                                          onednn=head.onednn, transform=head.transform).logprobs.float()
    return logprobs.sum(-1)


# --------------------------------------------------------------------------------------
# 2. The reference log-probs, computed once per pair
# --------------------------------------------------------------------------------------
class ReferenceCache:
    """Sequence log-probs of chosen and rejected under the reference, per pair index.

    `get(indices)` computes the pairs it has not seen yet (one batched pass) and returns
    the cached values; `fill(batch_size)` computes them all up front. `n_computed` counts
    the pairs sent through the reference, so a test can check each goes through once.
    """

    def __init__(self, reference: Reference | None, pairs: Sequence[TokenizedPair], pad_token_id: int,
                 device: torch.device, batch_size: int = 16, layout: str = "padded"):
        self.reference = reference
        self.layout = layout  # of the reference's pass (`response_hidden`)
        self.pairs = pairs
        self.pad_token_id = pad_token_id
        self.device = device
        self.batch_size = batch_size
        self.chosen = torch.zeros(len(pairs))    # (N,)
        self.rejected = torch.zeros(len(pairs))  # (N,)
        self.done = torch.zeros(len(pairs), dtype=torch.bool)
        self.n_computed = 0

    @torch.no_grad()
    def _compute(self, indices: list[int]) -> None:
        if self.reference is None:
            raise RuntimeError("ReferenceCache: the reference was released before every pair was cached")
        for s in range(0, len(indices), self.batch_size):
            idx = indices[s : s + self.batch_size]
            batch = pair_batch([self.pairs[i] for i in idx], self.pad_token_id, self.device)
            p = batch.prompt_len
            # The reference's token log-probs from its hidden states (`Reference.logprobs`,
            # the engine's path), summed over the real response tokens.
            token_lp = self.reference.logprobs(batch.input_ids[:, :p], batch.attention_mask[:, :p],
                                               batch.response_ids, batch.response_mask,
                                               layout=self.layout)                            # (2b, T)
            lp = ops.masked_sum(token_lp, batch.response_mask, dim=-1).cpu()               # (2b,)
            b = len(idx)
            self.chosen[idx], self.rejected[idx] = lp[:b], lp[b:]
            self.done[idx] = True
            self.n_computed += b

    def get(self, indices: Sequence[int]) -> tuple[Tensor, Tensor]:
        """(ref_chosen, ref_rejected), each (b,), on the training device."""
        indices = [int(i) for i in indices]
        missing = [i for i in indices if not self.done[i]]
        if missing:
            self._compute(missing)
        return self.chosen[indices].to(self.device), self.rejected[indices].to(self.device)

    def fill(self) -> None:
        self._compute([i for i in range(len(self.pairs)) if not self.done[i]])

    @property
    def complete(self) -> bool:
        return bool(self.done.all())


# --------------------------------------------------------------------------------------
# 3. The loss of a batch
# --------------------------------------------------------------------------------------
@dataclass
class DPOBatchStats:
    loss: float               # the preference loss (without the NLL term)
    nll: float                # mean NLL per chosen response token
    chosen_rewards: Tensor    # (b,) β·(log π − log π_ref), chosen
    rejected_rewards: Tensor  # (b,)
    policy_chosen: Tensor     # (b,) sequence log-probs under the policy
    policy_rejected: Tensor   # (b,)


def dpo_micro_batch_loss(actor: PolicyOnly, pairs: Sequence[TokenizedPair], ref_chosen: Tensor,
                         ref_rejected: Tensor, sec: DPOSection, pad_token_id: int,
                         device, nll_denominator: float | None = None) -> tuple[Tensor, DPOBatchStats]:
    """The DPO loss of b pairs (mean over them) from one forward pass over 2b rows,
    plus `sft_coeff` times the chosen responses' NLL per token: their summed NLL over
    `nll_denominator` (default: their own token count; token-budget micro-batches give
    the step's, scaled by the micro-batch's share of the pairs, see `pair_micro_batches`)."""
    batch = pair_batch(pairs, pad_token_id, device)
    # (2b,); through the data-parallel wrapper when the actor comes as Forward(actor, ...)
    layout = getattr(sec, "layout", "padded")
    lp = (actor(batch) if isinstance(inner(actor), Forward)
          else policy_sequence_logprobs(actor, batch, **({} if layout == "padded" else {"layout": layout})))
    b = len(pairs)
    out = ops.dpo_loss(lp[:b], lp[b:], ref_chosen, ref_rejected, sec.beta, sec.loss_kind, sec.label_smoothing)
    nll = -lp[:b].sum() / (batch.response_mask[:b].sum().clamp(min=1) if nll_denominator is None else nll_denominator)
    loss = out.loss + sec.sft_coeff * nll if sec.sft_coeff > 0 else out.loss
    return loss, DPOBatchStats(float(out.loss.detach()), float(nll.detach()), out.chosen_rewards.cpu(),
                               out.rejected_rewards.cpu(), lp[:b].detach().cpu(), lp[b:].detach().cpu())


def pair_micro_batches(pairs: Sequence[TokenizedPair], sec: DPOSection,
                       dist=None) -> tuple[list, int | None]:
    """One step's micro-batches as positions into `pairs` (this rank's share of the step):
    slices of `mini_batch_size` pairs, or with `mini_batch_tokens` lists of positions holding
    at most that many real tokens each (both sequences of a pair: 2 x prompt + chosen +
    rejected; `cut_rows_by_tokens`: as many on every rank). The second item is None for
    slices, else the step's chosen-response token count over every rank, the NLL term's
    normaliser."""
    if sec.mini_batch_tokens is None:
        size = dist.local(sec.mini_batch_size, "dpo.mini_batch_size") if dist is not None else sec.mini_batch_size
        return [slice(m, m + size) for m in range(0, len(pairs), size)], None
    lengths = [2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs]
    chosen = sum(len(p.chosen_ids) for p in pairs)
    return (cut_rows_by_tokens(lengths, sec.mini_batch_tokens, dist),
            int(dist.sum(float(chosen))) if dist is not None else chosen)


def reward_metrics(chosen: Tensor, rejected: Tensor, prefix: str = "") -> dict[str, float]:
    """TRL's names: rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies."""
    return {f"{prefix}rewards/chosen": float(chosen.mean()),
            f"{prefix}rewards/rejected": float(rejected.mean()),
            f"{prefix}rewards/margins": float((chosen - rejected).mean()),
            f"{prefix}rewards/accuracies": float((chosen > rejected).float().mean())}


@torch.no_grad()
def evaluate_pairs(actor: PolicyOnly, pairs: Sequence[TokenizedPair], cache: ReferenceCache,
                   sec: DPOSection, pad_token_id: int, device) -> dict[str, float]:
    """Held-out loss, implicit-reward metrics and the policy's own log-prob preference."""
    was_training = actor.training
    actor.eval()
    losses, ch, rj, pc, pr = [], [], [], [], []
    for s in range(0, len(pairs), sec.mini_batch_size):
        idx = list(range(s, min(s + sec.mini_batch_size, len(pairs))))
        ref_c, ref_r = cache.get(idx)
        loss, st = dpo_micro_batch_loss(actor, [pairs[i] for i in idx], ref_c, ref_r, sec, pad_token_id, device)
        losses.append(st.loss * len(idx))
        ch.append(st.chosen_rewards), rj.append(st.rejected_rewards)
        pc.append(st.policy_chosen), pr.append(st.policy_rejected)
    if was_training:
        actor.train()
    chosen, rejected = torch.cat(ch), torch.cat(rj)
    return {"eval/loss": sum(losses) / len(pairs), **reward_metrics(chosen, rejected, "eval/"),
            "eval/logp_accuracy": float((torch.cat(pc) > torch.cat(pr)).float().mean())}


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------
def _split(pairs: list[PairText], fraction: float, seed: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(pairs), generator=g).tolist()
    n_eval = int(round(len(pairs) * fraction))
    return [pairs[i] for i in order[n_eval:]], [pairs[i] for i in order[:n_eval]]


def _evaluate(models: PolicyModels, eval_tok, eval_cache, task_examples, task_scorer, cfg: DPORunConfig,
              out_dir: Path, step: int) -> dict[str, float]:
    metrics = {}
    if eval_tok:
        metrics.update(evaluate_pairs(models.actor, eval_tok, eval_cache, cfg.dpo,
                                      models.tokenizer.pad_token_id, models.device))
    if task_examples:
        res = evaluate_policy(models.policy, models.tokenizer, task_examples, task_scorer,
                              max_new_tokens=cfg.generation.max_new_tokens,
                              max_prompt_length=cfg.dataset.max_prompt_length,
                              batch_size=cfg.training.eval_batch_size)
        save_samples(res, out_dir / "eval" / f"step_{step}.jsonl")
        metrics.update(res.metrics())
    return metrics


@entry_point
def train(cfg: DPORunConfig, resume: str | Path | None = None, effective=None, quiet: bool = False) -> TrainResult:
    """Run DPO as configured; returns where the outputs went and the metric history."""
    t, sec, d = cfg.training, cfg.dpo, cfg.dataset
    run = start_run(cfg, "dpo", effective=effective, resume=resume, quiet=quiet, resumable=True,
                    local={"dpo.batch_size": sec.batch_size})
    dist, say = run.dist, run.print
    models = build_models(cfg.model, cfg.lora, t.device, need_reference=True, resume_dir=run.resume_dir,
                          mixed_precision=t.mixed_precision, world_size=dist.world_size)
    run.adopt_models(models)  # the CPU-only speed tricks, on a CPU
    tok, pad = models.tokenizer, models.tokenizer.pad_token_id

    # 1. data: the export rows as they are; held-out pairs from eval_path or a split.
    if not d.path:
        raise UserError("dataset.path: DPO needs a preference file (prompt/chosen/rejected jsonl)")
    train_pairs = read_preference_pairs(d.path, d, tok, d.num_samples, warn=say)
    if d.eval_path:
        eval_pairs = read_preference_pairs(d.eval_path, d, tok, d.num_eval_samples, warn=say)
    else:
        train_pairs, eval_pairs = _split(train_pairs, sec.eval_fraction, t.seed)
        eval_pairs = eval_pairs[: d.num_eval_samples] if d.num_eval_samples else eval_pairs
    check_sources(d.path, d.eval_path, len(train_pairs), ("dataset.path", "dataset.eval_path"), say)
    probe = make_probe_batch(tok, [p.prompt + p.chosen for p in train_pairs[:4]], models.device)
    tok_args = (tok, d.max_prompt_length, sec.max_response_length, sec.append_eos,
                response_end_id(tok, resolve_use_chat_template(d.use_chat_template, tok)))
    train_tok, eval_tok = tokenize_pairs(train_pairs, *tok_args), tokenize_pairs(eval_pairs, *tok_args)
    task_examples, task_scorer = [], None
    if sec.task_eval_path and t.eval_interval:
        task_cfg = dataclasses.replace(d, eval_path=sec.task_eval_path, prompt_field="question",
                                       answer_field="answer")
        task_examples = load_prompts(task_cfg, tok, "eval")
        task_scorer = RuleScorer(resolve_rule(sec.task_reward))

    # 2. reference log-probs: cached per pair; with a frozen copy, the copy is freed after.
    train_cache = ReferenceCache(models.reference, train_tok, pad, models.device, sec.mini_batch_size, sec.layout)
    eval_cache = ReferenceCache(models.reference, eval_tok, pad, models.device, sec.mini_batch_size, sec.layout)
    timer = Timer()
    if sec.precompute_ref_logprobs:
        with timer("reference"):
            train_cache.fill()
            eval_cache.fill()
        if models.reference is not None and models.reference.model is not None:
            models.reference = train_cache.reference = eval_cache.reference = None  # free the copy

    steps_per_epoch = math.ceil(len(train_tok) / sec.batch_size)
    total_steps = steps_per_epoch * sec.epochs
    if sec.max_steps is not None:
        total_steps = min(total_steps, sec.max_steps)
    optimizer, scheduler = make_optimization(models.actor.trainable_parameters(), sec, total_steps)
    # The sequence log-probs as a module's forward, wrapped for the launcher's strategy.
    logprob_model, optimizer = dist.prepare(Forward(models.actor, partial(policy_sequence_logprobs, layout=sec.layout)),
                                            optimizer, sec.max_grad_norm)
    start_step = run.restore(optimizer, scheduler, logprob_model)
    # The doctor reads each step's row (implicit-reward accuracy at chance, a growing margin,
    # chosen and rejected log-probs falling together, overfitting, gradient spikes) and
    # stops the run on a non-finite loss.
    out_dir = run.open(sec.max_grad_norm)
    result = run.result(unit="pairs", models=models, state={"ref_cache": train_cache})
    evaluate = lambda at: _evaluate(models, eval_tok, eval_cache, task_examples, task_scorer, cfg,  # noqa: E731
                                    out_dir, at)
    if t.eval_interval and start_step == 0:  # on the main process (whole weights held: FSDP)
        result.eval_before = run.on_main(lambda: evaluate(0), logprob_model)
        run.log_start(result.eval_before and {**result.eval_before, **timer.metrics()})

    def save(folder: Path, at: int) -> None:
        """The checkpoint, once its forward pass is checked finite."""
        run.save_checkpoint(folder, at, module=logprob_model, actor=models.actor, tokenizer=tok, optimizer=optimizer,
                            scheduler=scheduler, state_prefix="model.",
                            check=lambda: check_finite_model(models.policy, probe, step=at, knob="dpo.learning_rate",
                                                             lr=sec.learning_rate))

    bar = run.progress(total_steps, initial=start_step)
    params = models.actor.trainable_parameters()
    step, total_pairs, total_seconds = 0, 0, 0.0
    for epoch in range(sec.epochs):
        # The order depends only on (seed, epoch), so a resumed run sees the same batches.
        order = torch.randperm(len(train_tok), generator=torch.Generator().manual_seed(t.seed * 1_009 + epoch))
        for start in range(0, len(order), sec.batch_size):
            if step >= total_steps:
                break
            step += 1
            if step <= start_step:
                continue
            timer = Timer()
            t0 = time.perf_counter()
            # This rank's share of the batch (the whole batch in one process).
            global_idx = order[start : start + sec.batch_size].tolist()
            idx = even_share(global_idx, dist.world_size, dist.rank)
            n_batch = len(idx) * dist.world_size
            with timer("reference"):
                ref_c, ref_r = train_cache.get(idx)
            # 3. update: micro-batches of pairs, their losses weighted to the batch mean.
            stats = []
            with timer("update"):
                cuts, chosen_tokens = pair_micro_batches([train_tok[i] for i in idx], sec, dist)
                for j, sl in enumerate(cuts):
                    mb = idx[sl] if isinstance(sl, slice) else [idx[i] for i in sl]
                    denom = None if chosen_tokens is None else chosen_tokens * len(mb) / n_batch
                    with dist.accumulating(logprob_model, last=j == len(cuts) - 1):
                        loss, st = dpo_micro_batch_loss(logprob_model, [train_tok[i] for i in mb], ref_c[sl],
                                                        ref_r[sl], sec, pad, models.device, denom)
                        bad = dist.sum(float(not torch.isfinite(loss)))
                        check_finite_step(step, loss=float("nan") if bad else float(loss.detach()),
                                          knob="dpo.learning_rate", lr=optimizer.param_groups[0]["lr"])
                        dist.backward(loss * len(mb) / n_batch * dist.scale)
                    stats.append((len(mb), st))
                grad_norm = clip_and_step(params, optimizer, scheduler, sec.max_grad_norm, step=step,
                                          knob="dpo.learning_rate", dist=dist)
            seconds = time.perf_counter() - t0
            total_pairs += n_batch
            total_seconds += seconds
            # 4. log, evaluate, save (the batch's numbers, over every process).
            parts = dist.gather([(n, s.loss, s.nll, s.chosen_rewards, s.rejected_rewards, s.policy_chosen,
                                  s.policy_rejected) for n, s in stats])
            rows = [r for part in parts for r in part]
            cat = lambda i: torch.cat([r[i] for r in rows])  # noqa: E731
            metrics = {"loss": sum(r[0] * r[1] for r in rows) / n_batch, **reward_metrics(cat(3), cat(4)),
                       "nll/chosen": sum(r[0] * r[2] for r in rows) / n_batch,
                       "logps/chosen": float(cat(5).mean()), "logps/rejected": float(cat(6).mean()),
                       "params/grad_norm": grad_norm, "lr": optimizer.param_groups[0]["lr"], "epoch": epoch,
                       **timer.metrics(), "perf/pairs_per_s": n_batch / seconds}
            if t.eval_interval and (step % t.eval_interval == 0 or step == total_steps):
                metrics.update(run.on_main(lambda: evaluate(step), logprob_model, default={}))
            run.log(step, metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['rewards/accuracies']:.2f}")
            if t.save_interval and step % t.save_interval == 0 and step < total_steps:
                save(out_dir / f"step_{step}", step)
    bar.close()
    save(result.final_dir, total_steps)
    result.eval_after = last_eval(result.history)
    result.samples_per_s = total_pairs / total_seconds if total_seconds else 0.0
    run.finish(PLOT_GROUPS, eval_before=result.eval_before, eval_after=result.eval_after,
               pairs_per_s=result.samples_per_s)
    return result


PLOT_GROUPS: dict[str, list[str]] = {
    "loss": ["loss", "eval/loss"],
    "rewards": ["rewards/chosen", "rewards/rejected", "rewards/margins"],
    "accuracy": ["rewards/accuracies", "eval/rewards/accuracies", "eval/logp_accuracy", "eval/accuracy"],
    "logps": ["logps/chosen", "logps/rejected"],
    "grad_norm": ["params/grad_norm"],
    "lr": ["lr"],
}


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config, e.g. configs/dpo_debug.yaml")
    parser.add_argument("--resume", default=None, help="continue from a step_N/ checkpoint folder")
    parser.add_argument("--make-arith-pairs", metavar="TASK_DIR", default=None,
                        help="write demo pairs (right vs off-by-one answers) from TASK_DIR/{train,test}.jsonl "
                             "to TASK_DIR/pairs_{train,test}.jsonl and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. dpo.beta=0.2")


def run(args: argparse.Namespace) -> int:
    if args.make_arith_pairs:
        for split, path in write_off_by_one_pairs(args.make_arith_pairs).items():
            print(f"{split:>5}: {path}")
        return 0
    if not args.config:
        raise UserError("give --config (e.g. configs/dpo_debug.yaml) or --make-arith-pairs TASK_DIR")
    cfg, effective = load_config(args.config, DPORunConfig, args.overrides)
    train(cfg, resume=args.resume, effective=effective).report(skip_missing=True)
    return 0
