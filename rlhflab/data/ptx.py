"""Rows for PPO-ptx: a language-modelling loss mixed into the policy update.

InstructGPT (Ouyang et al., 2022) mixes gradients of the pretraining objective into
PPO so that the policy keeps what it could do before RL ("PPO-ptx"). Here `ptx_data`
is a file of rows: SFT-style rows (any layout of `rlhflab.data.sft`; the loss covers
the response, the prompt is context) or plain text rows {"text": ...} (the loss covers
every token). Each update minibatch takes the next `ptx_batch_size` rows of a shuffle
that depends only on (seed, step), so a resumed run sees the same rows.
"""

from __future__ import annotations

import random
from typing import Iterator

import torch

from rlhflab.data import sft as sftdata
from rlhflab.data.chat import resolve_use_chat_template
from rlhflab.data.loading import read_rows
from rlhflab.errors import UserError


class PtxData:
    """Tokenized ptx rows and a per-step stream of batches."""

    def __init__(self, examples: list[sftdata.TokenizedExample], pad_token_id: int, batch_size: int,
                 seed: int, device):
        self.examples, self.pad, self.batch_size, self.seed, self.device = (
            examples, pad_token_id, batch_size, seed, device)

    @classmethod
    def load(cls, path: str, tokenizer, *, prompt_template: str, use_chat_template: bool | str, batch_size: int,
             max_seq_length: int, seed: int, device) -> "PtxData":
        rows = read_rows(path)
        text_rows = [r for r in rows if isinstance(r.get("text"), str) and sftdata.detect_layout(r) is None]
        examples: list[sftdata.TokenizedExample] = []
        for r in text_rows:  # plain text: every token is a target
            ids = tokenizer(r["text"], add_special_tokens=False)["input_ids"][:max_seq_length]
            if len(ids) > 1:
                examples.append(sftdata.TokenizedExample(ids, list(ids), 0, False))
        rest = [r for r in rows if not (isinstance(r.get("text"), str) and sftdata.detect_layout(r) is None)]
        if rest:
            try:
                parsed = sftdata.parse_rows(rest, path)
            except UserError as exc:
                raise UserError(f"ptx_data: {exc}; plain {{\"text\": ...}} rows work too") from None
            tpl = sftdata.Template(prompt_template, " {response}",
                                   resolve_use_chat_template(use_chat_template, tokenizer))
            examples += sftdata.tokenize_examples(parsed, tokenizer, tpl, max_seq_length).examples
        if not examples:
            raise UserError(f"ptx_data {path}: no usable rows (give {{\"text\": ...}} rows or SFT rows "
                            f"such as question/answer or prompt/completion)")
        return cls(examples, tokenizer.pad_token_id, batch_size, seed, device)

    def batches(self, step: int) -> Iterator[dict[str, torch.Tensor]]:
        """An endless stream of batches for one step, the same for the same (seed, step)."""
        rng = random.Random(self.seed * 1_000_003 + step)
        while True:
            order = list(range(len(self.examples)))
            rng.shuffle(order)
            for s in range(0, max(1, len(order) - self.batch_size + 1), self.batch_size):
                batch = [self.examples[i] for i in order[s : s + self.batch_size]]
                yield {k: v.to(self.device) for k, v in sftdata.collate(batch, self.pad).items()}
