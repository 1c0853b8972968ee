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


def _real(ids, mask):
    return [[t for t, m in zip(r, k) if m] for r, k in zip(ids.tolist(), mask.tolist())]


@pytest.mark.parametrize("bos", [True, False])
def test_sft_dpo_and_reward_model_read_a_prompt_as_the_rollouts_do(bos):
    """The one rule (`data.tokens.leading_ids`): SFT's prompt ids, DPO's and a reward
    model's text start equal the ids `encode_prompts` gives the policy at rollout time."""
    from rlhflab.data.sft import tokenize_example
    from rlhflab.rewards.model import RMMeta, encode
    from rlhflab.trainers.dpo import tokenize_pairs
    from rlhflab.data.preferences import PairText

    tok = _word_tokenizer(bos=bos)
    prompts = ["a b c", "<s> d"]  # raw; and one that starts with a template's own <s>
    rollout = _real(*encode_prompts(tok, prompts))
    # with a BOS: <s> a b c (3, 4, 5 after 1) and <s> d, the template's <s> not doubled
    assert rollout == ([[1, 3, 4, 5], [1, 6]] if bos else [[3, 4, 5], [1, 6]])
    for prompt, want in zip(prompts, rollout):
        ex = tokenize_example(prompt, "d", append_eos=True, tokenizer=tok, max_seq_length=16)
        assert ex.input_ids[:ex.prompt_len] == want and ex.input_ids[ex.prompt_len:] == [6, 2]  # "d" </s>
    pairs = tokenize_pairs([PairText(p, "d", "c") for p in prompts], tok, max_prompt_length=3, max_response_length=4)
    # max 3 prompt tokens, cut from the left as the rollouts cut: <s> a b c -> <s> b c (the BOS
    # kept); a b c fits as it is
    assert [p.prompt_ids for p in pairs] == _real(*encode_prompts(tok, prompts, max_length=3))
    assert pairs[0].prompt_ids == ([1, 4, 5] if bos else [3, 4, 5])
    meta = RMMeta(append_eos=True, add_special_tokens=False, max_length=4)
    enc = encode(tok, [p + " d" for p in prompts], meta)
    # "a b c d" + </s> is 6 ids with the BOS: <s> kept, then the last 3 (c d </s>); 5 without
    # it: the last 4 (b c d </s>). "<s> d d" + </s> fits either way
    assert _real(enc["input_ids"], enc["attention_mask"]) == (
        [[1, 5, 6, 2], [1, 6, 6, 2]] if bos else [[4, 5, 6, 2], [1, 6, 6, 2]])
