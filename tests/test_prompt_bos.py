"""Prompt tokens (`rollout.encode_prompts`): the tokenizer's BOS in front of a raw prompt when
the tokenizer is configured to add one, once; unchanged ids for a tokenizer without one."""

from __future__ import annotations

import pytest
import torch

from rlhflab.models.load import load_tokenizer
from rlhflab.rollout import adds_bos, encode_prompts, generate


def _word_tokenizer(bos: bool):
    """Seven words; with `bos` its post-processor puts <s> (id 1) before a text, as Gemma's and
    Llama 2's tokenizers do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "c": 5, "d": 6}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def test_bos_added_once_and_kept_by_truncation():
    tok = _word_tokenizer(bos=True)
    assert adds_bos(tok) == 1
    ids, mask = encode_prompts(tok, ["a b", "<s> c", "d"])
    # "a b" -> <s> a b; "<s> c" already starts with it (a chat template's <bos>) -> <s> c, not <s> <s> c
    assert ids.tolist() == [[1, 3, 4], [0, 1, 5], [0, 1, 6]]
    assert mask.tolist() == [[1, 1, 1], [0, 1, 1], [0, 1, 1]]
    # max_length 3 keeps the BOS and the last two words: <s> b c (the question sits at the end)
    ids, mask = encode_prompts(tok, ["a b c", "<s> d"], max_length=3)
    assert ids.tolist() == [[1, 4, 5], [0, 1, 6]] and mask.tolist() == [[1, 1, 1], [0, 1, 1]]


def test_without_bos_the_ids_are_the_tokenizers_own(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    assert adds_bos(tok) is None and adds_bos(_word_tokenizer(bos=False)) is None
    prompts = ["Question: 12 + 7?\nAnswer:", "1 + 2 =", ""]
    for max_length in (None, 4):
        tok.truncation_side = "left"
        ref = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False,
                  truncation=max_length is not None, max_length=max_length)
        ids, mask = encode_prompts(tok, prompts, max_length)
        assert torch.equal(ids, ref["input_ids"]) and torch.equal(mask, ref["attention_mask"])


@pytest.fixture
def bos_tokenizer(tiny_model_dir):
    """The tiny model's tokenizer, told to put its <|endoftext|> (id 0) before every text."""
    from tokenizers import processors

    tok = load_tokenizer(str(tiny_model_dir))
    tok.bos_token = "<|endoftext|>"
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.bos_token_id)])
    assert adds_bos(tok) == tok.bos_token_id == 0
    return tok


def test_generate_sends_the_bos_to_the_model(tiny_model_dir, bos_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    prompts = ["1 + 2 =", "<|endoftext|>3 + 4 ="]
    roll = generate(model, bos_tokenizer, prompts, max_new_tokens=2, greedy=True)
    plain = bos_tokenizer(prompts[0], add_special_tokens=False)["input_ids"]
    for row, mask in zip(roll.prompt_ids.tolist(), roll.prompt_mask.tolist()):
        real = [t for t, m in zip(row, mask) if m]
        assert real[0] == 0 and real[1] != 0  # one BOS, first
    first = [t for t, m in zip(roll.prompt_ids[0].tolist(), roll.prompt_mask[0].tolist()) if m]
    assert first == [0, *plain]
