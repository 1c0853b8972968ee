"""Reward model: `rlhflab rm --config configs/rm_debug.yaml [key=value ...]`.

One visible loop:

    1. data        preference rows (the labelling app's export as it is, or the
                   conversational form), held-out split, texts ``prompt + response``
    2. model       the base LM as a ``*ForSequenceClassification`` with one output: a
                   scalar head (N(0, 1/(hidden+1)), bias 0) read at the last real token;
                   LoRA (peft, the head fully trained) or every weight trainable
    3. update      chosen and rejected of each pair in one forward; Bradley-Terry loss
                   −log σ(r_chosen − r_rejected − margin_coeff·margin), plus
                   center_coeff·mean((r_chosen + r_rejected)²) to keep scores near 0
    4. evaluate    held-out pairwise accuracy, mean score gap, score mean and std
    5. log, save   metrics.jsonl, plots, final/ (a plain HF folder that
                   `reward.sources: [{type: model, path: .../final}]` loads;
                   under LoRA the adapter also goes to final/adapter/)

`train_rm(cfg)` is the Python entry point.

Where this departs from common recipes:
- Ties (rows with "tie": true or margin 0) are dropped by default; with
  ``data.ties: soft`` they count with target ½: −½[log σ(d) + log σ(−d)].
- Texts are truncated from the left: the score is read at the end.
- Under gradient accumulation each micro-batch's mean loss is weighted by its share of
  the group's pairs, so 1x8 equals 8x1.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhflab import ops
from rlhflab.config.schema import (CpuConfig, CHAT_TEMPLATE_HELP, ChatTemplateUse, LoggingConfig, LoRAConfig, ModelConfig,
                                   TrainingConfig, f)
from rlhflab.data import preferences as prefdata
from rlhflab.data.chat import resolve_use_chat_template
from rlhflab.data.loading import read_rows
from rlhflab.engine.dist import Forward, even_share
from rlhflab.errors import UserError
from rlhflab.models.load import default_lora_targets, disable_dropout, load_tokenizer, resolve_dtype
from rlhflab.models.lean import make_lean
from rlhflab.models.precision import autocast
from rlhflab.rewards.model import META_FILE, RMMeta, encode, score_head, sequence_scores, text_ids
from rlhflab.models.checkpoint import atomic_folder, state_part, untied
from rlhflab.run import TrainResult, entry_point, start_run
from rlhflab.trainers.common import (check_finite_model, check_finite_step, clip_and_step, config_entry_points,
                                     cut_rows_by_tokens, make_optimizer, make_probe_batch, make_scheduler,
                                     train_and_held_out, warmup_of)


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
@dataclass
class PreferenceDataConfig:
    """Preference pairs: where they come from and how they are read."""

    path: Optional[str] = f("outputs/prefs/train.jsonl", "local jsonl/json/parquet/csv of prompt/chosen/rejected rows; null to use `name`")
    name: Optional[str] = f(None, "a `datasets` hub name, e.g. trl-lib/ultrafeedback_binarized (used when path is null)")
    subset: Optional[str] = f(None, "the hub dataset's configuration name")
    split: str = f("train", "split of a hub dataset for training")
    eval_path: Optional[str] = f(None, "local held-out file; null to use eval_split or split off eval_fraction")
    eval_split: Optional[str] = f(None, "split of a hub dataset for evaluation; null splits off eval_fraction")
    eval_fraction: float = f(0.1, "share of the pairs held out when there is no eval file or split", ge=0, lt=1)
    num_samples: Optional[int] = f(None, "use only the first N training pairs; null uses all", gt=0)
    num_eval_samples: Optional[int] = f(500, "held-out pairs evaluated; null uses all", gt=0)
    prompt_template: str = f("{prompt}", "how a plain row's raw prompt is shown, as the policy's run shows it; {prompt} is replaced")
    max_length: int = f(512, "longest prompt+response in tokens; longer texts are cut from the left", gt=1)
    append_eos: bool = f(True, "end every text with EOS, the token whose state is scored")
    use_chat_template: ChatTemplateUse = f("auto", CHAT_TEMPLATE_HELP + " (around plain rows' templated prompts too)")
    ties: Literal["drop", "soft"] = f("drop", "rows marked as ties: drop them, or train them toward equal scores")
    max_bad_fraction: float = f(0.5, "stop when more than this share of rows are not preference pairs", ge=0, le=1)

    def check(self) -> list[str]:
        if self.path is None and self.name is None:
            return ["path: no path and no name; set data.path to a file or data.name to a hub dataset"]
        return []


@dataclass
class RMSection:
    """Optimisation, loss and evaluation settings of reward-model training."""

    epochs: float = f(1.0, "passes over the training pairs (fractions allowed); ignored when max_steps is set", gt=0)
    max_steps: Optional[int] = f(None, "optimizer steps in all; null derives them from epochs", gt=0)
    batch_size: int = f(8, "pairs per micro-batch (2x sequences per forward)", gt=0)
    gradient_accumulation_steps: int = f(1, "micro-batches per optimizer step", gt=0)
    learning_rate: float = f(1e-5, "peak learning rate", gt=0)
    min_learning_rate: float = f(0.0, "floor of the decay", ge=0)
    warmup_steps: int = f(0, "optimizer steps of linear warmup; when set (> 0) it wins over warmup_ratio", ge=0)
    warmup_ratio: float = f(0.03, "share of the optimizer steps spent in linear warmup; warmup_steps, when set, wins", ge=0, lt=1)
    lr_schedule: Literal["constant", "cosine", "linear"] = f("cosine", "learning-rate schedule after warmup")
    weight_decay: float = f(0.0, "AdamW weight decay", ge=0)
    adam_beta1: float = f(0.9, "AdamW beta1", ge=0, lt=1)
    adam_beta2: float = f(0.999, "AdamW beta2", ge=0, lt=1)
    adam_eps: float = f(1e-8, "AdamW epsilon", gt=0)
    max_grad_norm: Optional[float] = f(1.0, "clip the global gradient norm to this; null disables", gt=0)
    margin_coeff: float = f(0.0, "ask for a score gap of margin_coeff x the row's margin (Llama 2); 0 ignores margins", ge=0)
    center_coeff: float = f(0.0, "weight of mean((r_chosen + r_rejected)^2), keeping scores near 0", ge=0)
    head_init_std: Optional[float] = f(None, "std of the normal init of the scalar head (bias 0); null: 1/sqrt(hidden+1)", gt=0)
    logging_steps: int = f(10, "log the training loss every this many optimizer steps", gt=0)
    eval_before: bool = f(True, "evaluate the starting model too (step 0)")
    layout: Literal["padded", "packed"] = f("padded", "decoder passes of the training and held-out scores: padded "
                                                      "rows, or each text's real tokens packed into rows (chosen and "
                                                      "rejected together; the same numbers to rounding; SDPA, eager or FlashAttention)")
    mini_batch_tokens: Optional[int] = f(None, "cut each optimizer step's pairs into micro-batches of at most this "
                                               "many real tokens, both texts (a longer pair runs alone); null: "
                                               "batch_size pairs each", gt=0)

    def check(self) -> list[str]:
        if self.min_learning_rate > self.learning_rate:
            return [f"min_learning_rate: {self.min_learning_rate} exceeds learning_rate {self.learning_rate}; lower it"]
        return []


def _rm_training() -> TrainingConfig:
    return TrainingConfig(output_dir="outputs/rm", eval_interval=50, save_interval=0)


def _rm_model() -> ModelConfig:
    return ModelConfig(name_or_path="outputs/sft/final")


@dataclass
class RMRunConfig:
    """`rlhflab rm`: every section of a reward-model run (training.total_steps is not used)."""

    model: ModelConfig = field(default_factory=_rm_model)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    rm: RMSection = field(default_factory=RMSection)
    training: TrainingConfig = field(default_factory=_rm_training)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)


# --------------------------------------------------------------------------------------
# The loss (pure)
# --------------------------------------------------------------------------------------
class RMLoss(NamedTuple):
    loss: Tensor      # scalar
    accuracy: Tensor  # fraction of non-tie pairs with r_chosen > r_rejected


def pairwise_loss(chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, tie: Tensor | None = None,
                  center_coeff: float = 0.0) -> RMLoss:
    """Bradley-Terry over preferred pairs, ½/½ targets over ties, mean over all pairs.

    chosen, rejected, margin: (B,) float; tie: (B,) bool. With no ties this is exactly
    `rlhflab.ops.reward_model_loss`.
    """
    if tie is None or not bool(tie.any()):
        out = ops.reward_model_loss(chosen, rejected, margin, center_coeff)
        return RMLoss(out.loss, out.accuracy)
    if tie.shape != chosen.shape:
        raise ValueError(f"tie {tuple(tie.shape)} must be (B,) = {tuple(chosen.shape)}")
    pref = ~tie
    diff = chosen - rejected                                            # (B,)
    if margin is not None:
        diff = diff - torch.where(pref, margin, torch.zeros_like(margin))
    per_pair = torch.where(pref, -F.logsigmoid(diff), -0.5 * (F.logsigmoid(diff) + F.logsigmoid(-diff)))
    loss = per_pair.mean()
    if center_coeff:
        loss = loss + center_coeff * (chosen + rejected).square().mean()
    acc = (chosen[pref] > rejected[pref]).float().mean() if bool(pref.any()) else torch.tensor(float("nan"))
    return RMLoss(loss, acc.detach())


# --------------------------------------------------------------------------------------
# 1. data
# --------------------------------------------------------------------------------------
@dataclass
class JoinedPair:
    """A pair as the reward model scores it: each side's prompt and response joined."""

    chosen: str     # prompt + chosen response
    rejected: str   # prompt + rejected response
    margin: float   # 0.0 when the row has none
    tie: bool


def _load_pairs(source: str, split: str, subset: str | None, d: PreferenceDataConfig, warn) -> list[prefdata.PreferencePair]:
    rep = prefdata.parse_pairs(read_rows(source, split, subset), str(source), d.max_bad_fraction, warn)
    pairs = rep.pairs
    if rep.ties and d.ties == "drop":
        pairs = [p for p in pairs if not p.tie]
        warn(f"{source}: {rep.ties} tie rows dropped (data.ties=soft trains them toward equal scores)")
        if not pairs:
            raise UserError(f"{source}: every row is a tie; set data.ties=soft or give rows with a preference")
    return pairs


def to_texts(pairs: Sequence[prefdata.PreferencePair], tokenizer, d: PreferenceDataConfig,
             source: str = "data.path") -> list[JoinedPair]:
    """Each pair's two texts, prompt + response, the prompt rendered as the policy's run
    renders it (`data.prompt_template`, then the chat template by the one rule)."""
    use_chat = resolve_use_chat_template(d.use_chat_template, tokenizer, "data.use_chat_template")
    texts = prefdata.render_pairs(pairs, tokenizer, d.prompt_template, use_chat, source, "data.prompt_template")
    return [JoinedPair(t.prompt + t.chosen, t.prompt + t.rejected, p.margin or 0.0, p.tie)
            for p, t in zip(pairs, texts)]


@dataclass
class RMData:
    train: list[JoinedPair]
    eval: list[JoinedPair]


def load_rm_data(d: PreferenceDataConfig, tokenizer, seed: int = 0, warn=print) -> RMData:
    train, held = train_and_held_out(d, lambda src, split, subset: _load_pairs(src, split, subset, d, warn),
                                     seed, unit="pairs")
    prefdata.check_sources(d.path, d.eval_path, len(train), ("data.path", "data.eval_path"), warn)
    source = str(d.path or d.name)
    return RMData(to_texts(train, tokenizer, d, source), to_texts(held, tokenizer, d, str(d.eval_path or source)))


def count_truncated(tokenizer, texts: Sequence[JoinedPair], meta: RMMeta) -> int:
    """Texts longer than `meta.max_length` tokens, as the scorer tokenises them (`text_ids`)."""
    ids = text_ids(tokenizer, [t for p in texts for t in (p.chosen, p.rejected)], meta)
    return sum(len(r) > meta.max_length for r in ids)


# --------------------------------------------------------------------------------------
# 2. model
# --------------------------------------------------------------------------------------
def build_reward_model(cfg: RMRunConfig, device: torch.device):
    """(model, tokenizer): the base LM with a fresh scalar head, LoRA-wrapped if asked."""
    from transformers import AutoModelForSequenceClassification

    from rlhflab.models.load import _load_error, reject_adapter, reject_gguf_quantized, resolve_model_path
    from rlhflab.models.quant import refuse_quantization

    m = cfg.model
    refuse_quantization(m, "rlhflab rm")
    reject_adapter(m.name_or_path, "model")  # a reward model needs a full base model
    reject_gguf_quantized(resolve_model_path(m.name_or_path))  # it could not be saved at the end
    tok = load_tokenizer(m.tokenizer or m.name_or_path, m.trust_remote_code, padding_side="right",
                         kind="model" if m.tokenizer is None else "tokenizer")
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            resolve_model_path(m.name_or_path), num_labels=1, dtype=resolve_dtype(m.torch_dtype, device), trust_remote_code=m.trust_remote_code,
            output_loading_info=True, **({"attn_implementation": m.attn_implementation} if m.attn_implementation else {}))
    except Exception as exc:
        raise _load_error("model", m.name_or_path, exc, m.attn_implementation) from None
    model.config.pad_token_id = tok.pad_token_id
    head = score_head(model)
    head_name = "score" if hasattr(model, "score") else "classifier"
    if any(k.startswith(head_name) for k in info.get("missing_keys", [])):
        # A fresh head (a causal LM as the base; an existing reward model keeps its own).
        # N(0, 1/(hidden+1)) as in OpenAI's lm-human-preferences reward head: initial scores of
        # order one, so the base gets a useful gradient from the first step (0.01 learned far slower).
        std = cfg.rm.head_init_std or 1.0 / math.sqrt(head.weight.shape[-1] + 1)
        torch.nn.init.normal_(head.weight, std=std)
        if getattr(head, "bias", None) is not None:
            torch.nn.init.zeros_(head.bias)
    disable_dropout(model)
    if cfg.lora.enabled:
        from peft import LoraConfig, get_peft_model
        targets = cfg.lora.target_modules or default_lora_targets(model)
        lcfg = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                          target_modules=targets, task_type="SEQ_CLS", modules_to_save=[head_name], bias="none")
        model = get_peft_model(model, lcfg)
    make_lean(model, m)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if cfg.lora.enabled:
            model.enable_input_require_grads()
    model.to(device).train()
    return model, tok


# --------------------------------------------------------------------------------------
# 3. update, 4. evaluate
# --------------------------------------------------------------------------------------
def pair_scores(model, tokenizer, pairs: Sequence[JoinedPair], meta: RMMeta, device, layout: str = "padded",
                budget: int | None = None) -> tuple[Tensor, Tensor]:
    """(chosen, rejected) scores, each (B,), from one forward over the 2B texts (`layout`:
    padded rows, or chosen and rejected packed together into rows of at most `budget` tokens)."""
    b = encode(tokenizer, [p.chosen for p in pairs] + [p.rejected for p in pairs], meta, device)
    scores = sequence_scores(model, b["input_ids"], b["attention_mask"], layout, budget)   # (2B,)
    return scores[: len(pairs)], scores[len(pairs):]


def pair_tokens(tokenizer, pairs: Sequence[JoinedPair], meta: RMMeta) -> list[int]:
    """Each pair's real tokens, chosen and rejected together, as `encode` cuts them."""
    n = [min(len(ids), meta.max_length) for ids in text_ids(tokenizer, [t for p in pairs for t in (p.chosen, p.rejected)],
                                                            meta)]
    return [n[2 * i] + n[2 * i + 1] for i in range(len(pairs))]


def step_pairs(micro: Sequence[list[JoinedPair]], tokens: int | None, tokenizer, meta: RMMeta,
               dist=None) -> list[list[JoinedPair]]:
    """One optimizer step's micro-batches of pairs: each of `micro` (this rank's share), or
    with `tokens` (rm.mini_batch_tokens) this rank's pairs of the step cut into micro-batches
    of at most that many real tokens (both texts; `cut_rows_by_tokens`: as many on every rank)."""
    world, rank = (dist.world_size, dist.rank) if dist is not None else (1, 0)
    if tokens is None:
        return [even_share(b, world, rank) for b in micro]
    pairs = [p for b in micro for p in even_share(b, world, rank)]
    return [[pairs[i] for i in c] for c in cut_rows_by_tokens(pair_tokens(tokenizer, pairs, meta), tokens, dist)]


def _batch_loss(model, tokenizer, pairs: Sequence[JoinedPair], meta: RMMeta, cfg: RMRunConfig, device) -> RMLoss:
    chosen, rejected = pair_scores(model, tokenizer, pairs, meta, device, cfg.rm.layout, cfg.rm.mini_batch_tokens)
    margin = None
    if cfg.rm.margin_coeff:
        margin = cfg.rm.margin_coeff * torch.tensor([p.margin for p in pairs], dtype=torch.float32, device=chosen.device)
    tie = torch.tensor([p.tie for p in pairs], dtype=torch.bool, device=chosen.device)
    return pairwise_loss(chosen, rejected, margin, tie, cfg.rm.center_coeff)


@torch.no_grad()
def evaluate_rm(model, tokenizer, pairs: Sequence[JoinedPair], meta: RMMeta, batch_size: int,
                device, layout: str = "padded") -> dict[str, float]:
    """Held-out accuracy (non-tie pairs), mean gap r_chosen − r_rejected, score mean/std."""
    was_training = model.training
    model.eval()
    cs, rs = [], []
    for s in range(0, len(pairs), batch_size):
        c, r = pair_scores(model, tokenizer, pairs[s : s + batch_size], meta, device, layout)
        cs.append(c.cpu())
        rs.append(r.cpu())
    if was_training:
        model.train()
    chosen, rejected = torch.cat(cs), torch.cat(rs)
    tie = torch.tensor([p.tie for p in pairs], dtype=torch.bool)
    pref = ~tie
    both = torch.cat([chosen, rejected])
    loss = pairwise_loss(chosen, rejected, None, tie)
    return {"eval/accuracy": float((chosen[pref] > rejected[pref]).float().mean()) if pref.any() else float("nan"),
            "eval/loss": float(loss.loss),
            "eval/score_gap": float((chosen[pref] - rejected[pref]).mean()) if pref.any() else float("nan"),
            "eval/score_mean": float(both.mean()), "eval/score_std": float(both.std()) if len(both) > 1 else 0.0}


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------
PLOT_GROUPS = {
    "loss": ["train/loss", "eval/loss"],
    "accuracy": ["train/accuracy", "eval/accuracy"],
    "scores": ["eval/score_gap", "eval/score_mean", "eval/score_std"],
    "grad_norm": ["params/grad_norm", "params/grad_norm_max"],
    "lr": ["lr"],
}


@dataclass
class RMResult(TrainResult):
    train_pairs: int = 0


def save_reward_model(model, tokenizer, meta: RMMeta, folder: Path, state: dict | None = None) -> None:
    """A plain HF sequence-classification folder (LoRA merged; adapter in adapter/), written
    then renamed; a failed save leaves the previous folder as it was. `state`: the model's
    full state dict when the module holds shards (FSDP)."""
    import copy
    with atomic_folder(folder, "save the reward model to") as tmp:
        if state is not None:
            model.save_pretrained(tmp, state_dict=untied(model, state))
        elif hasattr(model, "peft_config"):
            model.save_pretrained(tmp / "adapter")
            copy.deepcopy(model).merge_and_unload().save_pretrained(tmp)
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / META_FILE).write_text(meta.to_json())


@entry_point
def train_rm(cfg: RMRunConfig, effective=None, quiet: bool = False) -> RMResult:
    """Train a reward model as configured; returns where it went and the before/after metrics."""
    t, r = cfg.training, cfg.rm
    run = start_run(cfg, "rm", effective=effective, quiet=quiet, local={"rm.batch_size": r.batch_size})
    dist, device, say = run.dist, run.device, run.print

    # 1-2. data and model
    model, tok = build_reward_model(cfg, device)
    run.adopt(model)  # the CPU-only speed tricks, on a CPU
    meta = RMMeta(append_eos=cfg.data.append_eos, add_special_tokens=False, max_length=cfg.data.max_length)
    data = load_rm_data(cfg.data, tok, t.seed, warn=say)
    probe = make_probe_batch(tok, [p.chosen for p in data.train[:4]], device)  # for check_finite_model
    cut = count_truncated(tok, data.train, meta)
    if cut:
        say(f"warning: {cut} training texts are longer than data.max_length={cfg.data.max_length} "
            "and are cut from the left (the response end is kept)")
    groups_per_epoch = math.ceil(math.ceil(len(data.train) / r.batch_size) / r.gradient_accumulation_steps)
    total_steps = r.max_steps or max(1, math.ceil(groups_per_epoch * r.epochs))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, r.learning_rate, r.weight_decay, (r.adam_beta1, r.adam_beta2), r.adam_eps)
    # The pairwise loss as a module's forward, wrapped for the launcher's strategy; each
    # rank takes its share of every micro-batch of the one shuffle.
    loss_model, optimizer = dist.prepare(
        Forward(model, lambda m, pairs: _batch_loss(m, tok, pairs, meta, cfg, device)), optimizer, r.max_grad_norm)
    scheduler = make_scheduler(optimizer, total_steps, warmup_of(r, total_steps), r.lr_schedule,
                               r.min_learning_rate)
    say(f"rm: {len(data.train)} training pairs, {len(data.eval)} held out; {total_steps} optimizer steps; "
        f"{sum(p.numel() for p in params):,} trainable parameters")

    # The doctor reads each logged row (accuracy stuck at chance, a growing score gap,
    # overfitting, gradient spikes) and stops the run on a non-finite loss.
    out_dir = run.open(r.max_grad_norm)
    result = run.result(RMResult, adapter_dir=out_dir / "final" / "adapter" if cfg.lora.enabled else None,
                        train_pairs=len(data.train))
    evaluate = lambda: evaluate_rm(model, tok, data.eval, meta, t.eval_batch_size, device, r.layout)  # noqa: E731
    if r.eval_before and data.eval:  # on the main process, which alone writes (whole weights held: FSDP)
        result.eval_before = run.on_main(evaluate, loss_model)
        run.log_start(result.eval_before)

    bar = run.progress(total_steps)
    step, epoch = 0, 0
    win_loss, win_acc, win_n, win_norms = 0.0, 0.0, 0, []
    last_eval: dict[str, float] = {}
    while step < total_steps:
        order = list(range(len(data.train)))
        random.Random(t.seed * 1_000_003 + epoch).shuffle(order)  # a fresh shuffle per epoch
        micro = [[data.train[i] for i in order[s : s + r.batch_size]] for s in range(0, len(order), r.batch_size)]
        epoch += 1
        for g in range(0, len(micro), r.gradient_accumulation_steps):
            if step >= total_steps:
                break
            group = step_pairs(micro[g : g + r.gradient_accumulation_steps], r.mini_batch_tokens, tok, meta, dist)
            n_group = sum(len(b) for b in group) * dist.world_size
            # 3. update: each micro-batch's mean loss weighted by its share of the group.
            lr = optimizer.param_groups[0]["lr"]
            for i, b in enumerate(group):
                with dist.accumulating(loss_model, last=i == len(group) - 1):
                    with autocast(t.mixed_precision, device):  # the score head stays float32 (sequence_scores)
                        out = loss_model(b)
                    bad = dist.sum(float(not torch.isfinite(out.loss)))
                    check_finite_step(step + 1, loss=float("nan") if bad else float(out.loss.detach()),
                                      knob="rm.learning_rate", lr=lr)
                    dist.backward(out.loss * (len(b) / n_group) * dist.scale)
                win_loss += float(out.loss.detach()) * len(b)
                win_acc += float(out.accuracy) * len(b) if math.isfinite(float(out.accuracy)) else 0.0
                win_n += len(b)
            win_norms.append(clip_and_step(params, optimizer, scheduler, r.max_grad_norm, step=step + 1,
                                           knob="rm.learning_rate", dist=dist))
            step += 1
            bar.update(1)
            # 5. log, evaluate
            metrics: dict[str, float] = {}
            if step % r.logging_steps == 0 or step == total_steps:
                win_loss, win_acc, win_n = dist.sum(win_loss), dist.sum(win_acc), int(dist.sum(float(win_n)))
                metrics.update({"train/loss": win_loss / max(win_n, 1), "train/accuracy": win_acc / max(win_n, 1),
                                "params/grad_norm": sum(win_norms) / len(win_norms),
                                "params/grad_norm_max": max(win_norms),
                                "lr": optimizer.param_groups[0]["lr"], "epoch": step / groups_per_epoch})
                win_loss, win_acc, win_n, win_norms = 0.0, 0.0, 0, []
            if data.eval and ((t.eval_interval and step % t.eval_interval == 0) or step == total_steps):
                last_eval = run.on_main(evaluate, loss_model, default={})
                metrics.update(last_eval)
            if metrics:
                run.log(step, metrics)
                if "train/loss" in metrics:
                    bar.set_postfix(loss=f"{metrics['train/loss']:.3f}")
    bar.close()
    # The held-out score distribution: what `normalize: true` uses when no reference file is given.
    if last_eval:
        meta.score_mean, meta.score_std = last_eval["eval/score_mean"], max(last_eval["eval/score_std"], 1e-6)
        meta.extra = {"eval_accuracy": last_eval["eval/accuracy"]}
    model.eval()

    state, _ = dist.full_state(loss_model)  # FSDP: the full weights, gathered to rank 0

    def save() -> None:  # rank 0, once the forward pass is checked finite
        check_finite_model(model, probe, step=step, knob="rm.learning_rate", lr=r.learning_rate)
        save_reward_model(model, tok, meta, result.final_dir, state_part(state, "model."))

    run.save(save, loss_model)
    return run.end(result, PLOT_GROUPS, last_eval, step, train_pairs=result.train_pairs)


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def _done_line(res) -> str:
    """The last line `rlhflab rm` prints."""
    return (f"done in {res.seconds:.0f}s: reward model in {res.final_dir}"
            + (f" (adapter in {res.adapter_dir})" if res.adapter_dir else ""))


add_parser, run = config_entry_points(RMRunConfig, train_rm, stem="rm",
                                      example="rm.learning_rate=1e-4", headline=_done_line)
