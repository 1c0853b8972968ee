"""A sequence classifier as a reward source: the probability of a named label.

As in the TRL sentiment notebook (a sentiment model's POSITIVE score as the reward):
``reward.sources: [{type: classifier, path: lvwerra/distilbert-imdb, label: POSITIVE}]``.

- The text is ``prompt + response`` (the notebook scores query + response) or, with
  ``text: response``, the response alone. It is encoded with the classifier's own
  tokenizer, truncated to the classifier's length limit from the left (keeping the
  response end).
- The reward is softmax(logits)[label]; a one-output classifier gives sigmoid(logit).
- The label is matched against the model's ``id2label`` (case-insensitively); an
  unknown name is a `UserError` listing the labels there are.
- ``normalize: true`` shifts and scales by the mean and std of the probabilities on
  ``reference_path`` rows, read as the run reads its texts (`model.reference_texts`: the
  raw prompts through the run's template).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from rlhflab.errors import UserError


def label_index(config, label: str | None, where: str) -> int | None:
    """Index of `label` among the classifier's labels; None for a one-output model."""
    if config.num_labels == 1:
        return None
    labels = {int(i): str(name) for i, name in (config.id2label or {}).items()}
    if label is None:
        raise UserError(f"classifier {where}: set label to the class whose probability is the reward; "
                        f"its labels are {sorted(labels.values())}")
    for i, name in labels.items():
        if name == label:
            return i
    matches = [i for i, name in labels.items() if name.lower() == label.lower()]
    if len(matches) == 1:
        return matches[0]
    raise UserError(f"classifier {where}: no label {label!r}; its labels are {[labels[i] for i in sorted(labels)]}")


class ClassifierScorer:
    """score(prompts, responses, examples) -> (B,) float32 CPU probabilities (or normalised)."""

    def __init__(self, model, tokenizer, index: int | None, batch_size: int = 32,
                 text: str = "prompt_response", shift: float = 0.0, scale: float = 1.0):
        self.model, self.tokenizer, self.index = model, tokenizer, index
        self.batch_size, self.text = batch_size, text
        self.shift, self.scale = shift, scale
        limit = getattr(model.config, "max_position_embeddings", None) or 512
        tok_limit = getattr(tokenizer, "model_max_length", None)
        self.max_length = min(limit, tok_limit) if isinstance(tok_limit, int) and tok_limit < 10**6 else limit

    @classmethod
    def from_config(cls, source, device: torch.device | str = "cpu", fmt=None, tokenizer=None) -> "ClassifierScorer":
        """`fmt`, `tokenizer`: how the run shows its raw prompts (`model.reference_texts`)."""
        from transformers import AutoModelForSequenceClassification

        from rlhflab.models.load import _load_error, load_tokenizer, reject_adapter

        if not source.path:
            raise UserError("reward source type classifier needs path: a sequence-classification model folder or hub name")
        reject_adapter(source.path, "classifier")
        tok = load_tokenizer(source.path, padding_side="right", kind="classifier")
        try:
            model = AutoModelForSequenceClassification.from_pretrained(source.path)
        except Exception as exc:
            raise _load_error("classifier", source.path, exc) from None
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tok.pad_token_id
        model.to(device).eval()
        scorer = cls(model, tok, label_index(model.config, source.label, repr(source.path)), source.batch_size,
                     getattr(source, "text", "prompt_response"))
        if source.normalize:
            ref = getattr(source, "reference_path", None)
            if not ref:
                raise UserError(f"classifier {source.path}: normalize needs reference_path, a jsonl of "
                                "prompt/response rows to measure the mean and std on")
            from rlhflab.rewards.model import reference_texts
            raw = scorer.probabilities(reference_texts(ref, scorer.text, fmt, tokenizer))
            scorer.shift, scorer.scale = float(raw.mean()), float(raw.std().clamp(min=1e-6))
        return scorer

    @torch.no_grad()
    def probabilities(self, texts: Sequence[str]) -> Tensor:
        """(N,) float32 CPU probability of the label for each text."""
        device = next(self.model.parameters()).device
        self.tokenizer.truncation_side = "left"
        out = []
        for s in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(list(texts[s : s + self.batch_size]), return_tensors="pt", padding=True,
                                 truncation=True, max_length=self.max_length).to(device)
            logits = self.model(**enc).logits.float()                     # (b, num_labels)
            if self.index is None:
                out.append(torch.sigmoid(logits[:, 0]).cpu())
            else:
                out.append(torch.softmax(logits, dim=-1)[:, self.index].cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def score(self, prompts: Sequence[str], responses: Sequence[str], examples: Sequence[dict] | None = None) -> Tensor:
        from rlhflab.rewards.model import scored_texts
        return ((self.probabilities(scored_texts(prompts, responses, self.text)) - self.shift) / self.scale).float()
