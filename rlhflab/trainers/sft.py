"""Supervised fine-tuning: `rlhflab sft --config configs/sft_debug.yaml [key=value ...]`.

One visible loop:

    1. data        read rows (local file or `datasets` name), recognise the layout,
                   format (chat template or prompt/response templates), tokenize,
                   mask the prompt (labels -100; kept with sft.train_on_prompt),
                   truncate to max_seq_length
    2. model       the causal LM, with a LoRA adapter (peft) or all weights trainable
    3. update      shuffled micro-batches, gradient accumulation, token-weighted loss
                   over response tokens, grad-norm clipping, warmup then decay
    4. evaluate    held-out loss and perplexity (token-weighted), greedy generations
                   scored by ROUGE-L and exact match (and, when every reference is a
                   number, `#### N` or plain, by `rlhflab eval`'s numeric rule)
    5. log, save   metrics.jsonl, plots, step_N/ and final/ (a plain HF folder; under
                   LoRA the adapter goes to final/adapter/ and a merged copy to final/)

`train_sft(cfg)` is the Python entry point (the quickstart uses it for the warm start).

Where this departs from common recipes:
- Under gradient accumulation the summed response-token NLL is divided by the token
  count of the whole accumulated group, so 1x8 equals 8x1 and every response token
  weighs the same (the usual per-micro-batch mean over-weights short batches).
- Prompt and response are tokenized separately (see `rlhflab.data.sft`), matching how
  a prompt is encoded before generation.
- `sft.train_on_prompt: true` puts the prompt's tokens in the training loss too (the
  notebook seed's ``labels = input_ids``); the held-out ``eval/loss`` stays the response
  tokens' NLL either way, so runs with and without it compare on the same number.
- The loss never materialises the (B, L, V) logits: the LM head runs on the response
  positions only, a chunk of rows at a time (`batch_nll`, `ops.chunked_cross_entropy`).
"""

from __future__ import annotations

import json
import math
import random
import time
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch
import torch.nn.functional as F

from rlhflab import ops
from rlhflab.config.schema import (CpuConfig, CHAT_TEMPLATE_HELP, ChatTemplateUse, LoggingConfig, LoRAConfig, ModelConfig,
                                   TrainingConfig, check_quantization, f)
from rlhflab.data import sft as sftdata
from rlhflab.data.chat import resolve_use_chat_template
from rlhflab.data.loading import read_rows
from rlhflab.engine.dist import Dist, Forward, even_share
from rlhflab.engine.update import inner
from rlhflab.errors import UserError
from rlhflab.models import layout as layouts
from rlhflab.models.actor_critic import decoder_and_head, packed_label_nll
from rlhflab.models.checkpoint import atomic_folder, save_policy, state_part
from rlhflab.models.head import linear_lm_head
from rlhflab.models.load import add_lora, load_model
from rlhflab.models.lean import make_lean
from rlhflab.models.precision import autocast
from rlhflab.models.quant import prepare_quantized, quantization_kwargs
from rlhflab.run import TrainResult, entry_point, start_run
from rlhflab.trainers.common import (check_finite_model, check_finite_step, clip_and_step, config_entry_points,
                                     cut_rows_by_tokens, make_optimizer, make_scheduler,
                                     train_and_held_out, warmup_of)


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
@dataclass
class SFTDataConfig:
    """Demonstrations: where they come from and how they become tokens."""

    path: Optional[str] = f("outputs/arith/sft.jsonl", "local jsonl/json/parquet/csv file of demonstrations; null to use `name`")
    name: Optional[str] = f(None, "a `datasets` hub name, e.g. databricks/databricks-dolly-15k (used when path is null)")
    subset: Optional[str] = f(None, "the hub dataset's configuration name")
    split: str = f("train", "split of a hub dataset for training")
    eval_path: Optional[str] = f(None, "local held-out file; null to use eval_split or split off eval_fraction")
    eval_split: Optional[str] = f(None, "split of a hub dataset for evaluation; null splits off eval_fraction")
    eval_fraction: float = f(0.05, "share of the training rows held out when there is no eval file or split", ge=0, lt=1)
    num_samples: Optional[int] = f(None, "use only the first N training rows; null uses all", gt=0)
    num_eval_samples: Optional[int] = f(200, "held-out rows for loss/perplexity; null uses all", gt=0)
    prompt_template: str = f("User: {prompt}\n\nAssistant:", "prompt text without a chat template; {prompt} is replaced")
    response_template: str = f(" {response}", "response text without a chat template; {response} is replaced, EOS follows")
    use_chat_template: ChatTemplateUse = f("auto", CHAT_TEMPLATE_HELP)
    max_seq_length: int = f(512, "longest prompt+response in tokens; longer rows are cut from the right", gt=1)
    max_bad_fraction: float = f(0.5, "stop when more than this share of rows fit no layout", ge=0, le=1)

    def check(self) -> list[str]:
        errs = []
        if self.path is None and self.name is None:
            errs.append("path: no path and no name; set data.path to a file or data.name to a hub dataset")
        if "{prompt}" not in self.prompt_template:
            errs.append("prompt_template: must contain {prompt}")
        if "{response}" not in self.response_template:
            errs.append("response_template: must contain {response}")
        return errs


@dataclass
class SFTSection:
    """Optimisation and evaluation settings of SFT."""

    epochs: float = f(1.0, "passes over the training rows (fractions allowed); ignored when max_steps is set", gt=0)
    max_steps: Optional[int] = f(None, "optimizer steps in all; null derives them from epochs", gt=0)
    batch_size: int = f(16, "rows per micro-batch", gt=0)
    gradient_accumulation_steps: int = f(1, "micro-batches per optimizer step", gt=0)
    learning_rate: float = f(2e-4, "peak learning rate", gt=0)
    min_learning_rate: float = f(0.0, "floor of the decay", ge=0)
    warmup_steps: int = f(0, "optimizer steps of linear warmup; when set (> 0) it wins over warmup_ratio", ge=0)
    warmup_ratio: float = f(0.03, "share of the optimizer steps spent in linear warmup; warmup_steps, when set, wins", ge=0, lt=1)
    lr_schedule: Literal["constant", "cosine", "linear"] = f("cosine", "learning-rate schedule after warmup")
    weight_decay: float = f(0.0, "AdamW weight decay", ge=0)
    adam_beta1: float = f(0.9, "AdamW beta1", ge=0, lt=1)
    adam_beta2: float = f(0.999, "AdamW beta2", ge=0, lt=1)
    adam_eps: float = f(1e-8, "AdamW epsilon", gt=0)
    max_grad_norm: Optional[float] = f(1.0, "clip the global gradient norm to this; null disables", gt=0)
    logging_steps: int = f(10, "log the training loss every this many optimizer steps", gt=0)
    eval_before: bool = f(True, "evaluate the starting model too (step 0), for a before/after table")
    num_eval_generate: int = f(64, "held-out prompts answered greedily for ROUGE-L and exact match; 0 skips", ge=0)
    eval_max_new_tokens: int = f(64, "largest generated response during evaluation", gt=0)
    save_merged: bool = f(True, "under LoRA, also save the adapter merged into a plain model in final/")
    train_on_prompt: bool = f(False, "put the prompt's tokens in the training loss too (labels = input_ids, as in "
                                     "the notebook seed); false trains on the response only. eval/loss is always "
                                     "the response's")
    layout: Literal["padded", "packed"] = f("padded", "decoder passes of the training and held-out loss: padded rows, "
                                                      "or each sequence's real tokens packed into rows (the same "
                                                      "numbers to rounding; SDPA, eager or FlashAttention)")
    mini_batch_tokens: Optional[int] = f(None, "cut each optimizer step's rows into micro-batches of at most this "
                                               "many real tokens (a longer row runs alone); null: "
                                               "batch_size rows each", gt=0)

    def check(self) -> list[str]:
        if self.min_learning_rate > self.learning_rate:
            return [f"min_learning_rate: {self.min_learning_rate} exceeds learning_rate {self.learning_rate}; lower it"]
        return []


def _sft_training() -> TrainingConfig:
    return TrainingConfig(output_dir="outputs/sft", eval_interval=50, save_interval=0)


@dataclass
class SFTRunConfig:
    """`rlhflab sft`: every section of an SFT run (training.total_steps is not used)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    sft: SFTSection = field(default_factory=SFTSection)
    training: TrainingConfig = field(default_factory=_sft_training)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)

    def check(self) -> list[str]:
        return check_quantization(self.model, self.lora)


# --------------------------------------------------------------------------------------
# The loss (pure)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponseNLL:
    total: torch.Tensor  # scalar: summed NLL over response tokens
    tokens: int          # number of response tokens


def response_nll(logits: torch.Tensor, labels: torch.Tensor) -> ResponseNLL:
    """Summed next-token NLL over positions whose label is not -100.

    logits (B, L, V) from input_ids (B, L); labels (B, L) with -100 on prompt and padding.
    Position i predicts token i+1, so logits[:, :-1] meet labels[:, 1:].
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on (B, L)")
    pred = logits[:, :-1].float()                                   # (B, L-1, V)
    target = labels[:, 1:]                                          # (B, L-1)
    total = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1),
                            ignore_index=sftdata.IGNORE_INDEX, reduction="sum")
    return ResponseNLL(total, int((target != sftdata.IGNORE_INDEX).sum()))


def batch_nll(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
              layout: str = "padded", budget: int | None = None) -> ResponseNLL:
    """`response_nll` of the model on one micro-batch, never holding the (B, L, V) logits.

    When the LM head is a plain linear map (`linear_lm_head`), the decoder's hidden states
    and the head's weight go to `ops.chunked_cross_entropy`, which computes logits only
    for the response positions (label not -100), one chunk of rows at a time, in the
    forward and the backward pass. Otherwise the model's own logits go to `response_nll`.
    Both give the same sum (tests/test_sft.py). `layout: packed` runs the decoder on the
    rows' real tokens packed into rows of at most `budget` tokens (`models.layout`), the
    LM head on the read positions only: the same sum to float rounding.
    """
    if layout != "padded":
        decoder, _ = decoder_and_head(model)
        layout = layouts.choose_sequences(decoder.config, layout, attention_mask)
    if layout == "packed":
        total = packed_label_nll(model, input_ids, attention_mask, labels, budget)
        return ResponseNLL(total, int((labels[:, 1:] != sftdata.IGNORE_INDEX).sum()))
    head = linear_lm_head(model)
    if head is None:
        return response_nll(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels)
    decoder, _ = decoder_and_head(model)
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state    # (B, L, H)
    target = labels[:, 1:]                                                  # (B, L-1)
    total = ops.chunked_cross_entropy(hidden[:, :-1], head.weight, head.bias, target,
                                      ignore_index=sftdata.IGNORE_INDEX, onednn=head.onednn,
                                      transform=head.transform)
    return ResponseNLL(total, int((target != sftdata.IGNORE_INDEX).sum()))


def accumulate_group(model, group: Sequence[dict[str, torch.Tensor]], device: torch.device,
                     dist: Dist | None = None, mixed_precision: str = "no") -> "GroupNLL":
    """Backward over a group of micro-batches whose loss is the group's token-mean NLL.

    Each micro-batch's summed NLL is divided by the response-token count of the whole
    group (over every process), so the accumulated gradient equals that of one batch
    holding every row. `model` is a causal LM, or `Forward(lm, batch_nll)` as the
    data-parallel wrapper sees it. The forward runs under `mixed_precision`'s autocast
    (the chunked cross-entropy stays float32). Returns the group's totals over every process.
    """
    dist = dist or Dist()
    nll_of = model if isinstance(inner(model), Forward) else Forward(model, batch_nll)
    n_tokens = int(dist.sum(float(sum(int((b["labels"][:, 1:] != sftdata.IGNORE_INDEX).sum()) for b in group))))
    total = 0.0
    for i, b in enumerate(group):
        b = {k: v.to(device) for k, v in b.items()}
        with dist.accumulating(nll_of, last=i == len(group) - 1):
            with autocast(mixed_precision, device):
                nll = nll_of(b["input_ids"], b["attention_mask"], b["labels"])
            dist.backward(nll.total / max(n_tokens, 1) * dist.scale)
        total += float(nll.total.detach())
    return GroupNLL(dist.sum(total), n_tokens)


@dataclass(frozen=True)
class GroupNLL:
    total: float  # summed NLL over the group's response tokens
    tokens: int


# --------------------------------------------------------------------------------------
# 1. data
# --------------------------------------------------------------------------------------
@dataclass
class SFTData:
    train: list[sftdata.TokenizedExample]
    eval: list[sftdata.TokenizedExample]
    eval_examples: list[sftdata.SFTExample]  # for generation (prompt, reference)
    template: sftdata.Template


def _read(source: str, split: str, subset: str | None, d: SFTDataConfig, warn) -> list[sftdata.SFTExample]:
    rows = read_rows(source, split, subset)
    return sftdata.parse_rows(rows, str(source), d.max_bad_fraction, warn)


def load_sft_data(d: SFTDataConfig, tokenizer, seed: int = 0, warn=print, train_on_prompt: bool = False) -> SFTData:
    """Train and held-out examples, tokenized; truncation reported through `warn`.
    `train_on_prompt` labels the training rows' prompts with their ids; the held-out rows
    keep the prompt masked (eval/loss is the response's NLL)."""
    source = d.path or d.name
    train, held = train_and_held_out(d, lambda src, split, subset: _read(src, split, subset, d, warn), seed)
    use_chat = resolve_use_chat_template(d.use_chat_template, tokenizer, "data.use_chat_template")
    tpl = sftdata.Template(d.prompt_template, d.response_template, use_chat)
    tr = sftdata.tokenize_examples(train, tokenizer, tpl, d.max_seq_length, train_on_prompt)
    ev = sftdata.tokenize_examples(held, tokenizer, tpl, d.max_seq_length)
    for rep, name in ((tr, str(source)), (ev, str(d.eval_path or source) + " (held out)")):
        msg = rep.message(name, d.max_seq_length)
        if msg:
            warn(f"warning: {msg}")
    if not tr.examples:
        raise UserError(f"{source}: no training row has a response token within max_seq_length="
                        f"{d.max_seq_length}; raise data.max_seq_length")
    return SFTData(tr.examples, ev.examples, held, tpl)


def batches(examples: Sequence[sftdata.TokenizedExample], batch_size: int, seed: int,
            epoch: int) -> list[list[sftdata.TokenizedExample]]:
    """A fresh shuffle per epoch (seeded by seed and epoch), cut into micro-batches."""
    order = list(range(len(examples)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return [[examples[i] for i in order[s : s + batch_size]] for s in range(0, len(order), batch_size)]


def step_micro_batches(micro: Sequence[list[sftdata.TokenizedExample]], tokens: int | None, pad_token_id: int,
                       dist: Dist | None = None) -> list[dict[str, torch.Tensor]]:
    """One optimizer step's micro-batches, collated: each of `micro` (this rank's share), or
    with `tokens` (sft.mini_batch_tokens) this rank's rows of the step cut into micro-batches
    of at most that many real tokens (`cut_rows_by_tokens`: as many on every rank)."""
    dist = dist or Dist()
    if tokens is None:
        return [sftdata.collate(even_share(b, dist.world_size, dist.rank), pad_token_id) for b in micro]
    rows = [ex for b in micro for ex in even_share(b, dist.world_size, dist.rank)]
    chunks = cut_rows_by_tokens([len(ex.input_ids) for ex in rows], tokens, dist)
    return [sftdata.collate([rows[i] for i in c], pad_token_id) for c in chunks]


# --------------------------------------------------------------------------------------
# 4. evaluation
# --------------------------------------------------------------------------------------
@torch.no_grad()
def heldout_loss(model, examples: Sequence[sftdata.TokenizedExample], pad_token_id: int,
                 batch_size: int, device: torch.device, layout: str = "padded") -> dict[str, float]:
    """Token-weighted mean NLL over every held-out response token, and its perplexity."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for s in range(0, len(examples), batch_size):
        b = {k: v.to(device) for k, v in sftdata.collate(examples[s : s + batch_size], pad_token_id).items()}
        out = batch_nll(model, b["input_ids"], b["attention_mask"], b["labels"], layout)
        total += float(out.total)
        tokens += out.tokens
    if was_training:
        model.train()
    loss = total / max(tokens, 1)
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}


def generation_metrics(model, tokenizer, examples: Sequence[sftdata.SFTExample], tpl: sftdata.Template,
                       max_new_tokens: int, batch_size: int) -> tuple[dict[str, float], list[dict]]:
    """Greedy responses to held-out prompts: ROUGE-L F1, exact match and, when every
    reference is a number (``#### N`` or plain), accuracy by the eval's numeric rule
    (`rlhflab.rewards.checks.judge`: the response's ``#### N``, or for a plain-number
    reference its last number)."""
    from rouge_score import rouge_scorer

    from rlhflab.rewards.checks import judge
    from rlhflab.rollout import generate

    prompts = [sftdata.format_example(ex, tokenizer, tpl)[0] for ex in examples]
    roll = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, greedy=True, batch_size=batch_size)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    refs = [ex.response.strip() for ex in examples]
    outs = [r.strip() for r in roll.responses]
    rouge = [scorer.score(ref, out)["rougeL"].fmeasure for ref, out in zip(refs, outs)]
    exact = [float(ref == out) for ref, out in zip(refs, outs)]
    metrics = {"eval/rougeL": sum(rouge) / len(rouge), "eval/exact_match": sum(exact) / len(exact)}
    samples = [{"prompt": p, "reference": ref, "response": out, "rougeL": r, "exact": bool(e)}
               for p, ref, out, r, e in zip(prompts, refs, outs, rouge, exact)]
    correct = judge(None, prompts, outs, [{"answer": ref} for ref in refs])
    if correct is not None:
        metrics["eval/accuracy"] = sum(correct) / len(correct)
        for s, c in zip(samples, correct):
            s["correct"] = c
    return metrics, samples


def evaluate_sft(model, tokenizer, data: SFTData, cfg: SFTRunConfig, device: torch.device,
                 out_dir: Path | None = None, step: int = 0) -> dict[str, float]:
    metrics: dict[str, float] = {}
    if data.eval:
        metrics.update(heldout_loss(model, data.eval, tokenizer.pad_token_id, cfg.training.eval_batch_size, device,
                                    cfg.sft.layout))
    n_gen = min(cfg.sft.num_eval_generate, len(data.eval_examples))
    if n_gen:
        gm, samples = generation_metrics(model, tokenizer, data.eval_examples[:n_gen], data.template,
                                         cfg.sft.eval_max_new_tokens, cfg.training.eval_batch_size)
        metrics.update(gm)
        if out_dir is not None:
            path = out_dir / "eval" / f"step_{step}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return metrics


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------
PLOT_GROUPS = {
    "loss": ["train/loss", "eval/loss"],
    "perplexity": ["eval/perplexity"],
    "generation": ["eval/rougeL", "eval/exact_match", "eval/accuracy"],
    "grad_norm": ["params/grad_norm", "params/grad_norm_max"],
    "lr": ["lr"],
}


@dataclass
class SFTResult(TrainResult):
    train_rows: int = 0


def build_model(cfg: SFTRunConfig, device: torch.device):
    m = cfg.model
    quant = quantization_kwargs(m, cfg.lora, device)  # {} unless model.load_in_4bit/8bit (QLoRA)
    model, tok = load_model(m.name_or_path, torch_dtype=m.torch_dtype, device=str(device),
                            trust_remote_code=m.trust_remote_code, tokenizer=m.tokenizer,
                            attn_implementation=m.attn_implementation, **quant)
    if cfg.lora.enabled:
        model = prepare_quantized(model, m.gradient_checkpointing)
        model = add_lora(model, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules)
    make_lean(model, m)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if cfg.lora.enabled:
            model.enable_input_require_grads()
    model.config.use_cache = False
    model.train()
    return model, tok


def _save(model, tokenizer, folder: Path, merged: bool, state: dict | None = None) -> None:
    """A plain HF folder (merged under LoRA, adapter in adapter/), written then renamed;
    a failed save leaves the previous folder as it was. `state`: the model's full state
    dict when the module holds shards (FSDP)."""
    model.config.use_cache = True
    try:
        with atomic_folder(folder, "save the model to") as tmp:
            if hasattr(model, "peft_config") and not merged:
                model.save_pretrained(tmp / "adapter")
                tokenizer.save_pretrained(tmp)
            else:
                save_policy(model, tokenizer, tmp, state)
    finally:
        model.config.use_cache = False


@entry_point
def train_sft(cfg: SFTRunConfig, effective=None, quiet: bool = False) -> SFTResult:
    """Run SFT as configured; returns where the model went and the before/after metrics."""
    t, s = cfg.training, cfg.sft
    run = start_run(cfg, "sft", effective=effective, quiet=quiet, local={"sft.batch_size": s.batch_size})
    dist, device = run.dist, run.device

    # 1-2. data and model
    model, tok = build_model(cfg, device)
    run.adopt(model)  # the CPU-only speed tricks, on a CPU
    data = load_sft_data(cfg.data, tok, t.seed, warn=run.print, train_on_prompt=s.train_on_prompt)
    # A few training rows, run through the model before each save: a checkpoint whose
    # forward pass is not finite is never written.
    probe = {k: v.to(device) for k, v in sftdata.collate(data.train[:4], tok.pad_token_id).items() if k != "labels"}
    groups_per_epoch = math.ceil(math.ceil(len(data.train) / s.batch_size) / s.gradient_accumulation_steps)
    total_steps = s.max_steps or max(1, math.ceil(groups_per_epoch * s.epochs))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, s.learning_rate, s.weight_decay, (s.adam_beta1, s.adam_beta2), s.adam_eps)
    # Under several processes the loss module is wrapped for the launcher's strategy, and
    # each rank takes its share of every micro-batch (the same rows one process would use).
    nll_model, optimizer = dist.prepare(Forward(model, partial(batch_nll, layout=s.layout, budget=s.mini_batch_tokens)),
                                        optimizer, s.max_grad_norm)
    scheduler = make_scheduler(optimizer, total_steps, warmup_of(s, total_steps), s.lr_schedule,
                               s.min_learning_rate)
    run.print(f"sft: {len(data.train)} training rows, {len(data.eval)} held out; {total_steps} optimizer steps; "
              f"{sum(p.numel() for p in params):,} trainable parameters")
    # The doctor reads each logged row (loss not falling, overfitting, gradient spikes) and
    # stops the run on a non-finite loss, as check_finite_step does before each update.
    out_dir = run.open(s.max_grad_norm)
    result = run.result(SFTResult, adapter_dir=out_dir / "final" / "adapter" if cfg.lora.enabled else None,
                        train_rows=len(data.train))
    evaluate = lambda at: evaluate_sft(model, tok, data, cfg, device, out_dir, at)  # noqa: E731
    if s.eval_before:  # on the main process, which alone writes (whole weights held: FSDP)
        result.eval_before = run.on_main(lambda: evaluate(0), nll_model)
        run.log_start(result.eval_before)

    def save(folder: Path, at: int) -> None:
        """The model, once its forward pass is checked finite (a failure stops every rank)."""
        state, _ = dist.full_state(nll_model)  # FSDP: the full weights, gathered to rank 0

        def write() -> None:
            check_finite_model(model, probe, step=at, knob="sft.learning_rate", lr=s.learning_rate)
            _save(model, tok, folder, merged=s.save_merged, state=state_part(state, "model."))

        run.save(write, nll_model, folder)

    bar = run.progress(total_steps)
    step, epoch = 0, 0
    window_nll, window_tokens, window_norms, window_start = 0.0, 0, [], time.perf_counter()
    last_eval: dict[str, float] = {}
    while step < total_steps:
        micro = batches(data.train, s.batch_size, t.seed, epoch)
        epoch += 1
        for g in range(0, len(micro), s.gradient_accumulation_steps):
            if step >= total_steps:
                break
            group = step_micro_batches(micro[g : g + s.gradient_accumulation_steps], s.mini_batch_tokens,
                                       tok.pad_token_id, dist)
            # 3. update: backward over the group, then clip and step.
            nll = accumulate_group(nll_model, group, device, dist, t.mixed_precision)
            check_finite_step(step + 1, loss=nll.total, knob="sft.learning_rate",
                              lr=optimizer.param_groups[0]["lr"])
            window_nll += nll.total
            window_tokens += nll.tokens
            window_norms.append(clip_and_step(params, optimizer, scheduler, s.max_grad_norm, step=step + 1,
                                              knob="sft.learning_rate", dist=dist))
            step += 1
            bar.update(1)
            # 5. log, evaluate, save
            metrics: dict[str, float] = {}
            if step % s.logging_steps == 0 or step == total_steps:
                elapsed = time.perf_counter() - window_start
                metrics.update({"train/loss": window_nll / max(window_tokens, 1),
                                "params/grad_norm": sum(window_norms) / len(window_norms),
                                "params/grad_norm_max": max(window_norms),
                                "lr": optimizer.param_groups[0]["lr"], "epoch": step / groups_per_epoch,
                                "perf/tokens_per_s": window_tokens / max(elapsed, 1e-9)})
                window_nll, window_tokens, window_norms, window_start = 0.0, 0, [], time.perf_counter()
            if (t.eval_interval and step % t.eval_interval == 0) or step == total_steps:
                last_eval = run.on_main(lambda: evaluate(step), nll_model, default={})
                metrics.update(last_eval)
            if metrics:
                run.log(step, metrics)
                if "train/loss" in metrics:
                    bar.set_postfix(loss=f"{metrics['train/loss']:.3f}")
            if t.save_interval and step % t.save_interval == 0 and step < total_steps:
                save(out_dir / f"step_{step}", step)
    bar.close()
    save(result.final_dir, step)
    return run.end(result, PLOT_GROUPS, last_eval, step, train_rows=result.train_rows)


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def _done_line(res) -> str:
    """The last line `rlhflab sft` prints."""
    return (f"done in {res.seconds:.0f}s: {res.output_dir} (model in {res.final_dir}"
            + (f", adapter in {res.adapter_dir})" if res.adapter_dir else ")"))


add_parser, run = config_entry_points(SFTRunConfig, train_sft, stem="sft",
                                      example="sft.learning_rate=1e-4", headline=_done_line)
