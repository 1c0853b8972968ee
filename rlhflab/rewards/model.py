"""A trained reward model as a reward source: a base LM with a scalar head.

The model is a Hugging Face ``*ForSequenceClassification`` with one output (what
`rlhflab rm` saves; other reward models in that format load too). Its score is read at
the last real token of each sequence, found from the attention mask, so left and right
padding give the same score (Hugging Face's own forward finds that token by the pad id,
which fails when pad and EOS are the same token).

Texts are ``prompt + response`` (+ EOS when the model was trained so), encoded with
the reward model's own tokenizer: a policy with another tokenizer works, since PPO
hands over decoded text. Sequences longer than `max_length` are cut from the left, so
the response end, where the score is read, is kept.

``normalize: true`` shifts and scales scores to mean 0, std 1 measured on reference
samples: the rows of ``reference_path`` when given (prompt/response rows, or preference
rows whose both sides count), else the held-out responses `rlhflab rm` scored at the
end of training (saved in ``rlhflab_rm.json``). A reference row's prompt is raw, as a
dataset's is: the run shows it through its own template (``dataset.prompt_template``,
then the chat template by the one rule), so the mean and std are measured on the texts
the run scores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from rlhflab.data.tokens import adds_bos, keep_end, leading_ids
from rlhflab.errors import UserError

META_FILE = "rlhflab_rm.json"


@dataclass
class RMMeta:
    """What a scorer must know to read texts as the reward model was trained to."""

    append_eos: bool = True
    add_special_tokens: bool = False
    max_length: int = 512
    score_mean: float | None = None  # on held-out responses, for normalisation
    score_std: float | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"kind": "reward_model", "append_eos": self.append_eos,
                           "add_special_tokens": self.add_special_tokens, "max_length": self.max_length,
                           "score_mean": self.score_mean, "score_std": self.score_std, **self.extra}, indent=2)

    @classmethod
    def read(cls, folder: str | Path) -> "RMMeta":
        path = Path(folder) / META_FILE
        if not path.is_file():  # a reward model not made by rlhflab: Hugging Face conventions
            return cls(append_eos=False, add_special_tokens=True)
        from rlhflab.files import read_json
        d = read_json(path)
        return cls(d.get("append_eos", True), d.get("add_special_tokens", False), d.get("max_length", 512),
                   d.get("score_mean"), d.get("score_std"),
                   {k: v for k, v in d.items() if k not in ("kind", "append_eos", "add_special_tokens",
                                                            "max_length", "score_mean", "score_std")})


def score_head(model: torch.nn.Module) -> torch.nn.Module:
    """The scalar head of a *ForSequenceClassification model (score or classifier)."""
    from rlhflab.models.actor_critic import unwrap
    base = unwrap(model)
    for name in ("score", "classifier"):
        head = getattr(base, name, None)
        if head is not None:
            return head
    raise UserError(f"{type(base).__name__} has no score/classifier head; save the reward model with `rlhflab rm`")


def sequence_scores(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                    layout: str = "padded", budget: int | None = None) -> Tensor:
    """(B,) float32 scalar scores, read at each row's last real token (any padding side).

    `layout: packed` (right-padded rows) runs the decoder on the rows' real tokens packed
    into rows of at most `budget` tokens (`models.layout.plan_sequences`) and reads each
    sequence's last state from the packed rows: the same scores to float rounding."""
    from rlhflab.models import layout as layouts
    from rlhflab.models.actor_critic import position_ids_from, unwrap
    from rlhflab.ops import last_token_index

    base = unwrap(model)
    decoder = getattr(base, base.base_model_prefix)
    last = last_token_index(attention_mask)                                   # (B,)
    if layout != "padded":
        layout = layouts.choose_sequences(decoder.config, layout, attention_mask)
    if layout == "packed":
        packing = layouts.plan_sequences(input_ids, attention_mask, budget)
        flat = layouts.flat_states(layouts.packed_states(decoder, packing))  # (R·W + 1, H)
        h = flat[packing.gather[torch.arange(len(last), device=last.device), last]]   # (B, H)
    else:
        out = decoder(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids_from(attention_mask), use_cache=False)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state  # (B, L, H)
        h = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, H)
    head = score_head(model)
    with torch.autocast(h.device.type, enabled=False):  # the head in its own dtype also under autocast
        return head(h.to(next(head.parameters()).dtype)).float()[:, 0]       # (B,)


def text_ids(tokenizer, texts: Sequence[str], meta: RMMeta) -> list[list[int]]:
    """Each text's ids before truncation, EOS appended if trained so. rlhflab's reward
    models (`add_special_tokens: false`) read a text as the rollouts read a prompt
    (`data.tokens.leading_ids`: the tokenizer's BOS in front when it adds one); other
    reward models as their tokenizer's own call does."""
    if meta.add_special_tokens:
        ids = tokenizer(list(texts), add_special_tokens=True)["input_ids"]
    else:
        ids = leading_ids(tokenizer, texts)
    eos = tokenizer.eos_token_id
    if not meta.append_eos or eos is None:
        return [list(r) for r in ids]
    return [list(r) if r and r[-1] == eos else [*r, eos] for r in ids]


def encode(tokenizer, texts: Sequence[str], meta: RMMeta, device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """Tokenize for scoring: EOS appended if trained so, cut from the left (a BOS kept),
    padded right."""
    bos = adds_bos(tokenizer) if not meta.add_special_tokens else None
    rows = [keep_end(r, meta.max_length, bos is not None) for r in text_ids(tokenizer, texts, meta)]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)   # (B, L)
    mask = torch.zeros((len(rows), width), dtype=torch.long)            # (B, L)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}


def load_reward_model(path: str, device: torch.device | str = "cpu", torch_dtype: str = "float32"):
    """(model, tokenizer, meta) of a reward model folder or hub name."""
    from transformers import AutoModelForSequenceClassification

    from rlhflab.models.load import _load_error, load_tokenizer, reject_adapter, resolve_dtype

    reject_adapter(path, "reward model")
    tok = load_tokenizer(path, padding_side="right", kind="reward model")
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=resolve_dtype(torch_dtype))
    except Exception as exc:
        raise _load_error("reward model", path, exc) from None
    if model.config.num_labels != 1:
        raise UserError(f"reward model {path!r} has {model.config.num_labels} outputs, not 1; "
                        "for a classifier use type: classifier with a label")
    model.to(device).eval()
    return model, tok, RMMeta.read(path)


@torch.no_grad()
def score_texts(model, tokenizer, texts: Sequence[str], meta: RMMeta, batch_size: int = 32) -> Tensor:
    """(N,) float32 CPU scores of full texts, in batches."""
    device = next(model.parameters()).device
    out = []
    for s in range(0, len(texts), batch_size):
        b = encode(tokenizer, texts[s : s + batch_size], meta, device)
        out.append(sequence_scores(model, b["input_ids"], b["attention_mask"]).cpu())
    return torch.cat(out) if out else torch.zeros(0)


def scored_texts(prompts: Sequence[str], responses: Sequence[str], text: str = "prompt_response") -> list[str]:
    """What a model or classifier source reads: prompt + response, or (`text: response`)
    the response alone."""
    return list(responses) if text == "response" else [p + r for p, r in zip(prompts, responses)]


def reference_texts(path: str, text: str = "prompt_response", fmt=None, tokenizer=None) -> list[str]:
    """The texts of a reference file (prompt/response rows, or preference rows whose both
    sides count) as the source reads them in a run: each raw prompt through the run's
    prompt format `fmt` (a `data.prompts.PromptFormat` resolved on the policy's `tokenizer`;
    None: as it is), then `scored_texts`. A prompt that already begins with what the
    format adds is a `UserError` (files hold raw prompts, the run applies the template)."""
    from rlhflab.data.loading import read_rows
    from rlhflab.data.prompts import refuse_templated, template_heads

    rows = read_rows(path)
    heads = template_heads(fmt.template, tokenizer, fmt.use_chat) if fmt is not None else []
    prompts, responses = [], []
    for i, row in enumerate(rows):
        if isinstance(row.get("response"), str):
            sides = [row["response"]]
        elif isinstance(row.get("chosen"), str) and isinstance(row.get("rejected"), str):
            sides = [row["chosen"], row["rejected"]]
        else:
            raise UserError(f"{path}: row {i} has neither response nor chosen/rejected strings "
                            f"(it has {sorted(row)}); give prompt/response rows for reference_path")
        prompt = str(row.get("prompt", ""))
        if fmt is not None:
            refuse_templated(prompt, heads, path, i, "prompt")
            prompt = fmt.render(prompt, tokenizer)
        prompts += [prompt] * len(sides)
        responses += sides
    if len(responses) < 2:
        raise UserError(f"{path}: at least 2 reference samples are needed to measure a std")
    return scored_texts(prompts, responses, text)


class RewardModelScorer:
    """score(prompts, responses, examples) -> (B,) float32 CPU, optionally normalised."""

    def __init__(self, model, tokenizer, meta: RMMeta, batch_size: int = 32,
                 shift: float = 0.0, scale: float = 1.0, text: str = "prompt_response"):
        self.model, self.tokenizer, self.meta = model, tokenizer, meta
        self.batch_size, self.text = batch_size, text
        self.shift, self.scale = shift, scale

    @classmethod
    def from_config(cls, source, device: torch.device | str = "cpu", fmt=None, tokenizer=None) -> "RewardModelScorer":
        """`fmt`, `tokenizer`: how the run shows its raw prompts (`reference_texts`)."""
        if not source.path:
            raise UserError("reward source type model needs path: the folder `rlhflab rm` saved (its final/)")
        model, tok, meta = load_reward_model(source.path, device)
        scorer = cls(model, tok, meta, source.batch_size, text=getattr(source, "text", "prompt_response"))
        if source.normalize:
            ref = getattr(source, "reference_path", None)
            if ref:
                scorer.calibrate(reference_texts(ref, scorer.text, fmt, tokenizer))
            elif meta.score_mean is not None and meta.score_std:
                scorer.shift, scorer.scale = meta.score_mean, meta.score_std
            else:
                raise UserError(f"reward model {source.path}: normalize needs reference samples; set "
                                "reference_path to a jsonl of prompt/response rows")
        return scorer

    def calibrate(self, texts: Sequence[str]) -> None:
        """Set shift and scale to the mean and std of the raw scores of `texts`."""
        raw = score_texts(self.model, self.tokenizer, texts, self.meta, self.batch_size)
        self.shift, self.scale = float(raw.mean()), float(raw.std().clamp(min=1e-6))

    def score(self, prompts: Sequence[str], responses: Sequence[str], examples: Sequence[dict] | None = None) -> Tensor:
        raw = score_texts(self.model, self.tokenizer, scored_texts(prompts, responses, self.text), self.meta,
                          self.batch_size)
        return ((raw - self.shift) / self.scale).float()
