"""Sequence classifier: `rlhflab classifier --config configs/classifier_debug.yaml [key=value ...]`.

Trains the model that a ``type: classifier`` reward source reads (the TRL sentiment
notebook's reward is such a classifier's POSITIVE probability). One visible loop:

    1. data       labelled rows ``{"text": ..., "label": ...}`` (field names configurable;
                  labels are names such as POSITIVE or integers), a held-out split
    2. model      the base as ``AutoModelForSequenceClassification`` with one output per
                  label and ``id2label`` from the data (names sorted, so the ids do not
                  depend on row order); the head is fresh, every weight trains
    3. update     cross-entropy on shuffled batches, AdamW, warmup then cosine decay
    4. evaluate   held-out accuracy and loss
    5. save       final/: a plain HF folder (model + tokenizer) that
                  ``reward.sources: [{type: classifier, path: .../final, label: POSITIVE}]`` loads

`train_classifier(cfg)` is the Python entry point. The text is encoded exactly as the
reward source encodes it (`rlhflab.rewards.classifier.ClassifierScorer`): no special
tokens added, cut from the left to `data.max_length`, so training and scoring agree.
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

from rlhflab.config.schema import CpuConfig, LoggingConfig, ModelConfig, TrainingConfig, f
from rlhflab.data.loading import read_rows, require_fields
from rlhflab.errors import UserError
from rlhflab.models.load import disable_dropout, load_tokenizer, resolve_dtype
from rlhflab.run import TrainResult, entry_point, start_run
from rlhflab.trainers.common import (check_finite_model, check_finite_step, clip_and_step, config_entry_points,
                                     make_optimizer, make_probe_batch, make_scheduler, warmup_of)


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
@dataclass
class ClassifierDataConfig:
    """Labelled texts: where they come from and how they are read."""

    path: str = f("outputs/classifier_data/train.jsonl", "local jsonl/json/parquet/csv of labelled rows")
    eval_path: Optional[str] = f(None, "local held-out file; null splits off eval_fraction of `path`")
    eval_fraction: float = f(0.1, "share of the rows held out when there is no eval_path", gt=0, lt=1)
    text_field: str = f("text", "field holding the text")
    label_field: str = f("label", "field holding the label: a name (POSITIVE) or an integer")
    num_samples: Optional[int] = f(None, "use only the first N training rows; null uses all", gt=0)
    num_eval_samples: Optional[int] = f(None, "held-out rows evaluated; null uses all", gt=0)
    max_length: int = f(128, "longest text in tokens; longer texts are cut from the left (as the reward does)", gt=1)


@dataclass
class ClassifierSection:
    """Optimisation settings of classifier training."""

    epochs: float = f(3.0, "passes over the training rows (fractions allowed); ignored when max_steps is set", gt=0)
    max_steps: Optional[int] = f(None, "optimizer steps in all; null derives them from epochs", gt=0)
    batch_size: int = f(32, "rows per optimizer step", gt=0)
    learning_rate: float = f(1e-3, "peak learning rate", gt=0)
    min_learning_rate: float = f(0.0, "floor of the decay", ge=0)
    warmup_steps: int = f(0, "optimizer steps of linear warmup; when set (> 0) it wins over warmup_ratio", ge=0)
    warmup_ratio: float = f(0.05, "share of the optimizer steps spent in linear warmup; warmup_steps, when set, wins", ge=0, lt=1)
    lr_schedule: Literal["constant", "cosine", "linear"] = f("cosine", "learning-rate schedule after warmup")
    weight_decay: float = f(0.0, "AdamW weight decay", ge=0)
    max_grad_norm: Optional[float] = f(1.0, "clip the global gradient norm to this; null disables", gt=0)
    logging_steps: int = f(10, "log the training loss every this many optimizer steps", gt=0)
    eval_before: bool = f(True, "evaluate the untrained head too (step 0): chance level")

    def check(self) -> list[str]:
        if self.min_learning_rate > self.learning_rate:
            return [f"min_learning_rate: {self.min_learning_rate} exceeds learning_rate {self.learning_rate}; lower it"]
        return []


def _classifier_training() -> TrainingConfig:
    return TrainingConfig(output_dir="outputs/classifier", eval_interval=50, save_interval=0)


@dataclass
class ClassifierRunConfig:
    """`rlhflab classifier`: every section of a classifier run (training.total_steps is not used)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: ClassifierDataConfig = field(default_factory=ClassifierDataConfig)
    classifier: ClassifierSection = field(default_factory=ClassifierSection)
    training: TrainingConfig = field(default_factory=_classifier_training)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)


# --------------------------------------------------------------------------------------
# 1. data
# --------------------------------------------------------------------------------------
class LabelledText(NamedTuple):
    text: str
    label: int  # index into the run's sorted label names


@dataclass
class ClassifierData:
    train: list[LabelledText]
    eval: list[LabelledText]
    labels: list[str]  # id -> name


def _label_names(rows: Sequence[dict], field_name: str, source: str) -> list[str]:
    bad = [r[field_name] for r in rows if not isinstance(r[field_name], (str, int)) or isinstance(r[field_name], bool)]
    if bad:
        raise UserError(f"{source}: label {bad[0]!r} is a {type(bad[0]).__name__}; labels must be names "
                        f"(strings) or integers in data.label_field ({field_name!r})")
    raw = {r[field_name] for r in rows}
    if all(isinstance(v, int) for v in raw):
        return [str(i) for i in range(max(raw) + 1)]  # 0..max, so the integer is the id
    return sorted(str(v) for v in raw)


def load_classifier_data(d: ClassifierDataConfig, seed: int = 0) -> ClassifierData:
    """Training and held-out rows as (text, label id), with the label names."""
    rows = read_rows(d.path)
    require_fields(rows, [d.text_field, d.label_field], d.path)
    if d.eval_path:
        eval_rows = read_rows(d.eval_path)
        require_fields(eval_rows, [d.text_field, d.label_field], d.eval_path)
    else:
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        n_eval = max(1, int(round(len(rows) * d.eval_fraction)))
        eval_rows, rows = [rows[i] for i in order[:n_eval]], [rows[i] for i in order[n_eval:]]
    rows = rows[: d.num_samples] if d.num_samples else rows
    eval_rows = eval_rows[: d.num_eval_samples] if d.num_eval_samples else eval_rows
    labels = _label_names(rows + eval_rows, d.label_field, d.path)
    if len(labels) < 2:
        raise UserError(f"{d.path}: every row has label {labels[0]!r}; a classifier needs at least two labels")
    index = {name: i for i, name in enumerate(labels)}

    def convert(rs: list[dict]) -> list[LabelledText]:
        return [LabelledText(str(r[d.text_field]), index[str(r[d.label_field])]) for r in rs]

    return ClassifierData(convert(rows), convert(eval_rows), labels)


# --------------------------------------------------------------------------------------
# 2. model
# --------------------------------------------------------------------------------------
def build_classifier(cfg: ClassifierRunConfig, labels: list[str], device: torch.device):
    """(model, tokenizer): the base with a fresh `len(labels)`-way head."""
    from transformers import AutoModelForSequenceClassification

    from rlhflab.models.load import _load_error, reject_gguf_quantized, resolve_model_path
    from rlhflab.models.quant import refuse_quantization

    m = cfg.model
    refuse_quantization(m, "rlhflab classifier")
    reject_gguf_quantized(resolve_model_path(m.name_or_path))  # it could not be saved at the end
    tok = load_tokenizer(m.tokenizer or m.name_or_path, m.trust_remote_code, padding_side="right")
    tok.truncation_side = "left"
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            resolve_model_path(m.name_or_path), num_labels=len(labels), id2label=dict(enumerate(labels)),
            label2id={n: i for i, n in enumerate(labels)}, dtype=resolve_dtype(m.torch_dtype),
            trust_remote_code=m.trust_remote_code)
    except Exception as exc:
        raise _load_error("model", m.name_or_path, exc) from None
    model.config.pad_token_id = tok.pad_token_id  # the head reads the last non-pad token
    disable_dropout(model)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.to(device).train()
    return model, tok


def logits_of(model, tokenizer, texts: Sequence[str], max_length: int, device) -> Tensor:
    """(B, num_labels) logits, the texts encoded as the classifier reward encodes them."""
    enc = tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True,
                    max_length=max_length).to(device)
    return model(**enc).logits.float()


# --------------------------------------------------------------------------------------
# 4. evaluate
# --------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_classifier(model, tokenizer, rows: Sequence[LabelledText], max_length: int, batch_size: int,
                        device) -> dict[str, float]:
    """Held-out accuracy (argmax) and mean cross-entropy."""
    was_training = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    for s in range(0, len(rows), batch_size):
        batch = rows[s : s + batch_size]
        logits = logits_of(model, tokenizer, [r.text for r in batch], max_length, device)
        target = torch.tensor([r.label for r in batch], device=logits.device)
        loss_sum += float(F.cross_entropy(logits, target, reduction="sum"))
        correct += int((logits.argmax(-1) == target).sum())
    if was_training:
        model.train()
    n = max(len(rows), 1)
    return {"eval/accuracy": correct / n, "eval/loss": loss_sum / n}


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------
PLOT_GROUPS = {"loss": ["train/loss", "eval/loss"], "accuracy": ["train/accuracy", "eval/accuracy"],
               "grad_norm": ["params/grad_norm"], "lr": ["lr"]}


@dataclass
class ClassifierResult(TrainResult):
    labels: list[str] = field(default_factory=list)


def save_classifier(model, tokenizer, folder: Path) -> None:
    """A plain HF sequence-classification folder, written to a temporary name first (a
    full disk or a read-only folder: one line naming it, an earlier save left intact)."""
    from rlhflab.models.checkpoint import atomic_folder

    with atomic_folder(folder, "save the classifier to") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


@entry_point
def train_classifier(cfg: ClassifierRunConfig, effective=None, quiet: bool = False) -> ClassifierResult:
    """Train a sequence classifier as configured; returns where it went and its held-out metrics."""
    t, c, d = cfg.training, cfg.classifier, cfg.data
    run = start_run(cfg, "classifier", effective=effective, quiet=quiet)
    data = load_classifier_data(d, t.seed)  # 1. data first: a bad file fails before the model loads
    model, tok = build_classifier(cfg, data.labels, run.device)  # 2. model
    run.adopt(model)  # the CPU-only speed tricks, on a CPU
    device, say = run.device, run.print
    probe = make_probe_batch(tok, [r.text for r in data.train[:4]], device)  # for check_finite_model
    steps_per_epoch = math.ceil(len(data.train) / c.batch_size)
    total_steps = c.max_steps or max(1, math.ceil(steps_per_epoch * c.epochs))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, c.learning_rate, c.weight_decay)
    scheduler = make_scheduler(optimizer, total_steps, warmup_of(c, total_steps), c.lr_schedule,
                               c.min_learning_rate)
    counts = [sum(r.label == i for r in data.train) for i in range(len(data.labels))]
    say(f"classifier: {len(data.train)} training rows ({', '.join(f'{n} {name}' for n, name in zip(counts, data.labels))}), "
        f"{len(data.eval)} held out; {total_steps} optimizer steps")

    run.open(doctor=False)
    result = run.result(ClassifierResult, labels=data.labels)
    evaluate = lambda: evaluate_classifier(model, tok, data.eval, d.max_length, t.eval_batch_size, device)  # noqa: E731
    if c.eval_before:
        result.eval_before = evaluate()
        run.log_start(result.eval_before)

    bar = run.progress(total_steps)
    step, epoch, last_eval = 0, 0, {}
    win_loss, win_correct, win_n, win_norms = 0.0, 0, 0, []
    while step < total_steps:
        order = list(range(len(data.train)))
        random.Random(t.seed * 1_000_003 + epoch).shuffle(order)  # a fresh shuffle per epoch
        epoch += 1
        for s in range(0, len(order), c.batch_size):
            if step >= total_steps:
                break
            # 3. update: cross-entropy on one batch.
            batch = [data.train[i] for i in order[s : s + c.batch_size]]
            logits = logits_of(model, tok, [r.text for r in batch], d.max_length, device)  # (B, num_labels)
            target = torch.tensor([r.label for r in batch], device=logits.device)       # (B,)
            loss = F.cross_entropy(logits, target)
            lr = optimizer.param_groups[0]["lr"]
            check_finite_step(step + 1, loss=float(loss.detach()), knob="classifier.learning_rate", lr=lr)
            loss.backward()
            win_norms.append(clip_and_step(params, optimizer, scheduler, c.max_grad_norm, step=step + 1,
                                           knob="classifier.learning_rate"))
            step += 1
            bar.update(1)
            win_loss += float(loss.detach()) * len(batch)
            win_correct += int((logits.detach().argmax(-1) == target).sum())
            win_n += len(batch)
            # 4-5. log, evaluate
            metrics: dict[str, float] = {}
            if step % c.logging_steps == 0 or step == total_steps:
                metrics.update({"train/loss": win_loss / win_n, "train/accuracy": win_correct / win_n,
                                "params/grad_norm": sum(win_norms) / len(win_norms),
                                "lr": optimizer.param_groups[0]["lr"], "epoch": step / steps_per_epoch})
                win_loss, win_correct, win_n, win_norms = 0.0, 0, 0, []
            if (t.eval_interval and step % t.eval_interval == 0) or step == total_steps:
                last_eval = evaluate()
                metrics.update(last_eval)
            if metrics:
                run.log(step, metrics)
                if "train/loss" in metrics:
                    bar.set_postfix(loss=f"{metrics['train/loss']:.3f}")
    bar.close()
    check_finite_model(model, probe, step=step, knob="classifier.learning_rate", lr=c.learning_rate)
    model.eval()
    run.save(lambda: save_classifier(model, tok, result.final_dir))
    return run.end(result, PLOT_GROUPS, last_eval, step, labels=data.labels)


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def _done_line(res) -> str:
    """The last line `rlhflab classifier` prints."""
    return (f"done in {res.seconds:.0f}s: classifier in {res.final_dir} (labels {', '.join(res.labels)}); "
            f"use it as reward.sources: [{{type: classifier, path: {res.final_dir}, label: {res.labels[-1]}}}]")


add_parser, run = config_entry_points(ClassifierRunConfig, train_classifier, stem="classifier",
                                      example="classifier.learning_rate=1e-4", headline=_done_line)
