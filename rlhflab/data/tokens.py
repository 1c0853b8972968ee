"""How a text that starts a sequence becomes token ids: one rule for every place a model
reads a prompt (training rollouts, evaluation and the sampler through
`rollout.encode_prompts`; SFT and DPO prompts; reward-model texts).

The text is tokenised as it is (no special tokens added), then the tokenizer's BOS is put
in front when the tokenizer is configured to add one (`adds_bos`) and the text does not
already start with it: a chat template writes its own ``<bos>``, a raw prompt to a base
model such as Gemma 3 needs it (without it that model degenerates). A tokenizer without a
BOS gets exactly the ids of ``tokenizer(text, add_special_tokens=False)``. A model trained
on the ids of this rule (SFT, DPO, a reward model) sees at training time what the rollouts
give it.
"""

from __future__ import annotations

from typing import Sequence


def adds_bos(tokenizer) -> int | None:
    """The tokenizer's BOS id when it is configured to put one before a text (its
    post-processor adds it under ``add_special_tokens=True``: Llama 2, Gemma), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bos if with_special[:1] == [bos] and plain[:1] != [bos] else None


def leading_ids(tokenizer, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
    """Each text's ids as the start of a sequence: the BOS once in front when the tokenizer
    adds one (not doubled after a template's own), else the text's plain ids. With
    `max_length`, a longer row keeps its end (where a prompt's question is) and its BOS."""
    bos = adds_bos(tokenizer)
    rows = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if len(texts) else []
    if bos is not None:
        rows = [[bos, *(r[1:] if r[:1] == [bos] else r)] for r in rows]
    return [keep_end(list(r), max_length, bos is not None) for r in rows]


def keep_end(ids: list[int], max_length: int | None, keep_first: bool = False) -> list[int]:
    """The last `max_length` ids of `ids` (all when None or short enough); with `keep_first`
    the first id (a BOS) stays in front of the last `max_length - 1`."""
    if max_length is None or len(ids) <= max_length:
        return ids
    head = ids[:1] if keep_first else []
    return head + ids[len(ids) - max(0, max_length - len(head)):]
