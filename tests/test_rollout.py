"""Rollouts: response masks around EOS, pad replacement, hit_limit, collate, logprobs at T."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from rlhflab.models.actor_critic import ActorCritic, Reference, ValueHead, hidden_size_of, position_ids_from
from rlhflab.models.load import disable_dropout, load_model
from rlhflab.engine import scoring
from rlhflab.rollout import Rollout, collate, generate, response_mask_from


def score_rollout(actor, reference, roll, **kwargs):
    """The rollout scored as PPO scores it: log-probs, values and (with a reference) its log-probs."""
    return scoring.score_rollout(actor, reference, roll, with_values=True, **kwargs)

EOS, PAD = 0, 1  # the tiny tokenizer's ids of <|endoftext|> and <|pad|>


# --------------------------------------------------------------------------------------
# response_mask_from
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("ids, expected", [
    ([5, 6, EOS, 7, 8], [1, 1, 1, 0, 0]),       # EOS mid-sequence: kept, what follows is not
    ([EOS, 7, 8, 9, 9], [1, 0, 0, 0, 0]),       # EOS at t=0: a one-token response
    ([5, 6, 7, 8, 9], [1, 1, 1, 1, 1]),         # no EOS: every token counts
    ([5, 6, 7, 8, EOS], [1, 1, 1, 1, 1]),       # EOS at the last position
    ([5, EOS, EOS, EOS, EOS], [1, 1, 0, 0, 0]),  # pad == eos: only the first EOS is real
])
def test_response_mask_around_eos(ids, expected):
    mask = response_mask_from(torch.tensor([ids]), EOS)
    assert mask.tolist() == [expected] and mask.dtype == torch.long


def test_response_mask_batched_and_several_eos_ids():
    ids = torch.tensor([[5, 6, EOS, 7],
                        [5, 42, 6, EOS],
                        [5, 6, 7, 8]])
    # 42 is a second end token (e.g. <|im_end|>): row 1 ends at it.
    assert response_mask_from(ids, [EOS, 42]).tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


# --------------------------------------------------------------------------------------
# generate: a scripted model, so the responses are exactly the ones we crafted
# --------------------------------------------------------------------------------------
class ScriptedLM(torch.nn.Module):
    """Stands in for a causal LM: `generate` appends fixed response rows to the prompts."""

    def __init__(self, responses: list[list[int]], eos_token_id: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.responses = torch.tensor(responses)
        self.generation_config = SimpleNamespace(eos_token_id=eos_token_id, pad_token_id=None)
        self.calls: list[dict] = []

    def generate(self, input_ids, attention_mask, **kwargs):
        self.calls.append(kwargs)
        return torch.cat([input_ids, self.responses[: input_ids.shape[0]]], 1)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_model(str(tiny_model_dir))[1]


@pytest.fixture(scope="module")
def pad_is_eos_tok(tiny_model_dir, tmp_path_factory):
    """The tiny tokenizer without its pad token: the loader reuses EOS as pad."""
    folder = tmp_path_factory.mktemp("pad-is-eos")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("pad_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    from rlhflab.models.load import load_tokenizer
    t = load_tokenizer(str(folder))
    assert t.pad_token_id == t.eos_token_id == EOS
    return t


def test_generate_masks_pads_and_flags_limit(tok):
    seven = tok.convert_tokens_to_ids("7")
    responses = [[seven, EOS, seven, seven, seven],   # EOS mid-sequence, junk after it
                 [EOS, seven, seven, seven, seven],   # EOS first: an empty answer
                 [seven, seven, seven, seven, seven]]  # no EOS: cut off at the limit
    model = ScriptedLM(responses, EOS)
    roll = generate(model, tok, ["a", "b c d", "e f"], max_new_tokens=5, temperature=0.7, top_k=3)
    assert roll.response_mask.tolist() == [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    # Tokens after the first EOS are replaced by pad; the EOS itself stays.
    assert roll.response_ids.tolist() == [[seven, EOS, PAD, PAD, PAD], [EOS, PAD, PAD, PAD, PAD],
                                          [seven] * 5]
    assert roll.hit_limit.tolist() == [False, False, True]
    assert roll.responses == ["7", "", "77777"]
    # The prompts were left-padded; the sampling settings reached generate.
    assert roll.prompt_mask[0].tolist()[-1] == 1 and roll.prompt_mask[0, 0] == 0
    kw = model.calls[0]
    assert kw["do_sample"] and kw["temperature"] == 0.7 and kw["top_k"] == 3 and kw["eos_token_id"] == [EOS]
    assert kw["max_new_tokens"] == 5 and kw["pad_token_id"] == PAD
    # The attention mask over prompt+response ignores padding on both sides.
    assert roll.attention_mask()[0].tolist()[-5:] == [1, 1, 0, 0, 0]


def test_generate_with_pad_equal_to_eos(pad_is_eos_tok):
    t = pad_is_eos_tok
    seven = t.convert_tokens_to_ids("7")
    # What generate returns when pad == eos: the EOS, then more EOS as padding.
    responses = [[seven, EOS, EOS, EOS], [seven, seven, seven, seven]]
    roll = generate(ScriptedLM(responses, EOS), t, ["a", "b"], max_new_tokens=4, greedy=True)
    assert roll.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert roll.hit_limit.tolist() == [False, True]
    assert roll.responses == ["7", "7777"]


def test_generate_in_batches_collates(tok):
    seven = tok.convert_tokens_to_ids("7")
    model = ScriptedLM([[seven, EOS, seven]] * 2, EOS)
    roll = generate(model, tok, ["a", "b c d e f", "g h"], max_new_tokens=3, batch_size=2)
    assert len(model.calls) == 2 and len(roll) == 3
    # The batches had different prompt widths; all rows now end at the same column.
    assert roll.prompt_ids.shape[1] == max(len(tok(p, add_special_tokens=False).input_ids)
                                           for p in ["a", "b c d e f", "g h"])
    assert (roll.prompt_mask[:, -1] == 1).all()
    assert roll.prompts == ["a", "b c d e f", "g h"]


# --------------------------------------------------------------------------------------
# collate
# --------------------------------------------------------------------------------------
def _roll(prompt_rows, response_rows, pad=PAD):
    """A Rollout from lists of token ids (prompts left-padded, responses right-padded)."""
    p = max(map(len, prompt_rows))
    t = max(map(len, response_rows))
    prompt_ids = torch.tensor([[pad] * (p - len(r)) + r for r in prompt_rows])
    prompt_mask = torch.tensor([[0] * (p - len(r)) + [1] * len(r) for r in prompt_rows])
    response_ids = torch.tensor([r + [pad] * (t - len(r)) for r in response_rows])
    response_mask = torch.tensor([[1] * len(r) + [0] * (t - len(r)) for r in response_rows])
    return Rollout(prompt_ids, prompt_mask, response_ids, response_mask,
                   hit_limit=torch.tensor([r[-1] != EOS for r in response_rows]),
                   prompts=[f"p{i}" for i in range(len(prompt_rows))])


def test_collate_pads_prompts_left_and_responses_right():
    a = _roll([[11, 12], [13]], [[21, EOS], [22, 23]])  # P=2, T=2
    b = _roll([[14, 15, 16, 17]], [[24, 25, 26, EOS]])  # P=4, T=4
    c = collate([a, b], PAD)
    assert c.prompt_ids.tolist() == [[PAD, PAD, 11, 12], [PAD, PAD, PAD, 13], [14, 15, 16, 17]]
    assert c.prompt_mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]]
    assert c.response_ids.tolist() == [[21, EOS, PAD, PAD], [22, 23, PAD, PAD], [24, 25, 26, EOS]]
    assert c.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert c.hit_limit.tolist() == [False, True, False]
    assert c.prompts == ["p0", "p1", "p0"] and c.prompt_len == 4
    assert c.input_ids().shape == (3, 8) and c.attention_mask()[1].tolist() == [0, 0, 0, 1, 1, 1, 0, 0]
    assert collate([a], PAD) is a


def test_collated_rollout_scores_like_its_parts(tiny_model_dir):
    torch.manual_seed(0)
    model, tok = load_model(str(tiny_model_dir))
    disable_dropout(model)
    ac = ActorCritic(model, value_head=ValueHead(hidden_size_of(model)))
    a = _roll([[11, 12], [13]], [[21, EOS], [22, 23]])
    b = _roll([[14, 15, 16, 17]], [[24, 25, 26, EOS]])
    parts = [score_rollout(ac, None, _roll([[11, 12], [13]], [[21, EOS], [22, 23]])),
             score_rollout(ac, None, _roll([[14, 15, 16, 17]], [[24, 25, 26, EOS]]))]
    whole = score_rollout(ac, None, collate([a, b], PAD))
    torch.testing.assert_close(whole.logprobs[:2, :2], parts[0].logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(whole.logprobs[2:], parts[1].logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(whole.values[:2, :2], parts[0].values, rtol=0, atol=1e-5)
    assert (whole.logprobs[:2, 2:] == 0).all() and (whole.values[:2, 2:] == 0).all()  # padding


# --------------------------------------------------------------------------------------
# Scoring at the sampling temperature
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_at_the_sampling_temperature(tiny_model_dir, temperature):
    torch.manual_seed(0)
    model, tok = load_model(str(tiny_model_dir))
    disable_dropout(model)
    ac = ActorCritic(model, value_head=ValueHead(hidden_size_of(model)))
    prompts = ["Question: Ada has 3 pens and gets 4 more. How many pens?\nAnswer:", "Question: 1 + 2?\nAnswer:"]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    # Sample with transformers directly, keeping the processed scores (logits / T).
    torch.manual_seed(1)
    out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=None, top_p=None,
                         max_new_tokens=6, pad_token_id=tok.pad_token_id,
                         output_scores=True, return_dict_in_generate=True)
    p = enc.input_ids.shape[1]
    response = out.sequences[:, p:]                                        # (B, T)
    sampled = torch.stack(out.scores, 1).log_softmax(-1)                  # (B, T, V)
    sampled_lp = sampled.gather(-1, response.unsqueeze(-1)).squeeze(-1)  # (B, T)
    mask = response_mask_from(response, tok.eos_token_id)
    roll = Rollout(enc.input_ids, enc.attention_mask, response, mask, hit_limit=torch.zeros(2, dtype=torch.bool))
    score_rollout(ac, None, roll, temperature=temperature)
    # The "old" policy is the one that sampled: the same logprobs, token by token.
    torch.testing.assert_close(roll.logprobs, sampled_lp * mask, rtol=0, atol=1e-4)
    # And exactly log_softmax(logits / T) of the full model.
    ids, am = roll.input_ids(), roll.attention_mask()
    full = model(input_ids=ids, attention_mask=am, position_ids=position_ids_from(am)).logits
    t = response.shape[1]
    expected = (full[:, p - 1 : p + t - 1] / temperature).log_softmax(-1)
    expected = expected.gather(-1, response.unsqueeze(-1)).squeeze(-1) * mask
    torch.testing.assert_close(roll.logprobs, expected, rtol=0, atol=1e-5)


def _scorers(tiny_model_dir):
    """The tiny model with a value head (seeded), a frozen copy as the reference, and the id of "7"."""
    torch.manual_seed(0)
    model, tok = load_model(str(tiny_model_dir))
    disable_dropout(model)
    return (ActorCritic(model, value_head=ValueHead(hidden_size_of(model))), Reference.frozen_copy(model),
            tok.convert_tokens_to_ids("7"))


def test_score_rollout_with_reference_and_micro_batches(tiny_model_dir):
    ac, ref, seven = _scorers(tiny_model_dir)
    roll = _roll([[11, 12], [13], [14, 15, 16]], [[seven, EOS], [seven, seven, seven], [EOS]])
    whole = score_rollout(ac, ref, roll, micro_batch=64)
    lp, val, ref_lp = whole.logprobs.clone(), whole.values.clone(), whole.ref_logprobs.clone()
    # A reference equal to the policy gives the same logprobs; padding gives 0.
    torch.testing.assert_close(ref_lp, lp, rtol=0, atol=1e-6)
    assert (lp[roll.response_mask == 0] == 0).all() and (lp[roll.response_mask == 1] < 0).all()
    # Micro-batches of one row give the same numbers.
    again = score_rollout(ac, ref, roll, micro_batch=1)
    torch.testing.assert_close(again.logprobs, lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(again.values, val, rtol=0, atol=1e-5)
    assert score_rollout(ac, None, roll).ref_logprobs is None


def test_micro_batches_by_length_pad_less_and_keep_the_rollout_order(tiny_model_dir):
    ac, ref, seven = _scorers(tiny_model_dir)
    # Long and short rows alternate: real lengths 9, 2, 8, 3 (prompt + response).
    roll = _roll([[11, 12, 13, 14], [15], [16, 17, 18, 19], [20]],
                 [[seven] * 4 + [EOS], [EOS], [seven] * 3 + [EOS], [seven, EOS]])
    order = scoring.row_order(roll, 1, by_length=True)
    assert order.tolist() == [1, 3, 2, 0]                      # shortest first
    # Padded cells (rows x (P' + T')) of micro-batches of 2: in order, both pairs mix a long
    # and a short row: 2 x (4 + 5) + 2 x (4 + 4) = 34; by length, {1, 3}: 2 x (1 + 2) = 6
    # and {2, 0}: 2 x (4 + 5) = 18, together 24.
    def cells(mbs):
        return sum(len(mb) * (mb.prompt_ids.shape[1] + mb.response_ids.shape[1]) for mb in mbs)
    assert cells(scoring.micro_batches(roll, 2, 1)) == 34
    assert cells(scoring.micro_batches(roll, 2, 1, order)) == 24
    # The numbers come back in the rollout's order, equal to one pass over every row.
    whole = score_rollout(ac, ref, roll, micro_batch=64)
    lp, val, ref_lp = whole.logprobs.clone(), whole.values.clone(), whole.ref_logprobs.clone()
    sorted_ = score_rollout(ac, ref, roll, micro_batch=2)
    torch.testing.assert_close(sorted_.logprobs, lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(sorted_.values, val, rtol=0, atol=1e-5)
    torch.testing.assert_close(sorted_.ref_logprobs, ref_lp, rtol=0, atol=1e-5)
    # Groups move whole: rows (0, 1) and (2, 3) as groups of 2, the second one shorter.
    grouped = scoring.row_order(_roll([[11, 12]] * 2 + [[13]] * 2,
                                      [[seven, EOS], [seven] * 3, [EOS], [seven, EOS]]), 2, by_length=True)
    assert grouped.tolist() == [2, 3, 0, 1]


def test_generate_invariants_on_the_tiny_model(tiny_model_dir):
    torch.manual_seed(0)
    model, tok = load_model(str(tiny_model_dir))
    # Raise the EOS logit by 4 (p(EOS) about 0.1 per token for the untrained model), so
    # some responses end early and some hit the limit.
    def more_eos(module, args, logits):
        logits[..., EOS] += 4.0
        return logits

    model.lm_head.register_forward_hook(more_eos)
    prompts = [f"Question: {a} + {b}?\nAnswer:" for a in range(4) for b in range(4)]
    roll = generate(model, tok, prompts, max_new_tokens=8, temperature=1.0, batch_size=8)
    assert 0 < int(roll.hit_limit.sum()) < 16
    assert roll.response_ids.shape == (16, roll.response_mask.shape[1]) and roll.response_ids.shape[1] <= 8
    for ids, mask, limit in zip(roll.response_ids.tolist(), roll.response_mask.tolist(), roll.hit_limit.tolist()):
        n = sum(mask)
        assert mask == [1] * n + [0] * (len(mask) - n)             # ones, then zeros
        assert all(i == PAD for i in ids[n:])                       # padding after the end
        assert limit == (EOS not in ids[:n])                        # cut off iff no EOS kept
        if not limit:
            assert ids[n - 1] == EOS and EOS not in ids[: n - 1]    # the first EOS ends it


def test_long_prompts_are_cut_from_the_left(tok):
    seven = tok.convert_tokens_to_ids("7")
    model = ScriptedLM([[seven, EOS]], EOS)
    prompt = "Question: 1 + 2 + 3 + 4?\nAnswer:"
    full = tok(prompt, add_special_tokens=False).input_ids
    roll = generate(model, tok, [prompt], max_new_tokens=2, max_prompt_length=4)
    assert roll.prompt_ids.tolist() == [full[-4:]]  # the end, where the question is, is kept


def test_evaluate_policy_accuracy_and_reward(tok):
    from rlhflab.data.prompts import PromptExample
    from rlhflab.evaluate import evaluate_policy
    from rlhflab.rewards import REGISTRY, RuleScorer

    ids = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    answers = [" #### 7", " #### 8", " 7"]  # right, wrong number, no '####'
    width = max(len(ids(a)) for a in answers) + 1
    rows = [ids(a) + [EOS] + [PAD] * (width - len(ids(a)) - 1) for a in answers]
    model = ScriptedLM(rows, EOS)
    examples = [PromptExample(f"Q{i}: 3 + 4?", {"answer": "3 + 4 = 7\n#### 7"}) for i in range(3)]
    res = evaluate_policy(model, tok, examples, RuleScorer(REGISTRY["gsm8k"]), max_new_tokens=width)
    assert model.calls[0]["do_sample"] is False  # greedy
    assert [s["score"] for s in res.samples] == pytest.approx([1.0, 0.1, 0.0])
    assert [s["correct"] for s in res.samples] == [True, False, False]
    assert res.accuracy == pytest.approx(1 / 3) and res.reward_mean == pytest.approx(1.1 / 3)
    assert res.metrics() == {"eval/reward_mean": res.reward_mean, "eval/accuracy": res.accuracy}
    # Rows without answers: no accuracy, the reward still counts.
    plain = [PromptExample("hi", {})]
    res = evaluate_policy(ScriptedLM(rows[:1], EOS), tok, plain, RuleScorer(lambda p, r, e: len(r)),
                          max_new_tokens=width)
    assert res.accuracy is None and "eval/accuracy" not in res.metrics()


# --------------------------------------------------------------------------------------
# the inverse-CDF draw in place of generate's multinomial (the sampler's log-probs, seeded sampling)
# --------------------------------------------------------------------------------------
def _first_token_counts(model, tok, prompt, n, **kw):
    roll = generate(model, tok, [prompt], n=n, max_new_tokens=1, batch_size=n, **kw)
    return torch.bincount(roll.response_ids[:, 0], minlength=model.config.vocab_size)


@pytest.mark.parametrize("draw", [dict(sample_logprobs=True), dict(seed=11, step=3)])
def test_our_draw_samples_the_models_own_distribution(tiny_model_dir, draw):
    """20,000 first tokens of one prompt, drawn by `InverseCDFDraw` inside `generate`
    (recording the sampler's log-probs: torch's random numbers; seeded: one counter-based number per row key):
    each token's count within 4.5 standard deviations of 20,000 x softmax(logits / T),
    worked from the model's own forward pass; with top-k 3 only the 3 likeliest tokens
    appear, in their renormalised shares. The same counts every run."""
    model, tok = load_model(str(tiny_model_dir))
    prompt, n, temperature = "Question: 2 + 3?\nAnswer:", 20_000, 0.7
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1] / temperature
    for top_k in (0, 3):
        p = logits.softmax(-1)
        if top_k:
            keep = logits.topk(top_k).indices
            p = torch.zeros_like(p).index_fill_(0, keep, 1.0) * p
            p = p / p.sum()
        torch.manual_seed(0)
        counts = _first_token_counts(model, tok, prompt, n, temperature=temperature, top_k=top_k, **draw)
        sd = (n * p * (1 - p)).sqrt()
        assert ((counts - n * p).abs() <= 4.5 * sd + 1e-6).all(), top_k
        if top_k:
            assert set(counts.nonzero().squeeze(1).tolist()) <= set(keep.tolist())


def test_our_draw_keeps_generates_own_rules_and_the_seed(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))

    def more_eos(module, args, logits):  # EOS likely at every position (p about 0.9)
        logits[..., EOS] += 8.0
        return logits

    hook = model.lm_head.register_forward_hook(more_eos)
    prompts = [f"Question: {a} + 5?\nAnswer:" for a in range(8)]
    kw = dict(n=2, max_new_tokens=6, batch_size=16, sample_logprobs=True)
    free = generate(model, tok, prompts, **kw)
    held = generate(model, tok, prompts, min_new_tokens=4, **kw)  # generate's own processor, before the draw
    assert int(free.response_mask.sum(1).min()) < 4 and int(held.response_mask.sum(1).min()) >= 4
    hook.remove()
    torch.manual_seed(3)
    first = generate(model, tok, prompts, **kw)
    torch.manual_seed(3)
    again = generate(model, tok, prompts, **kw)
    assert torch.equal(first.response_ids, again.response_ids)  # torch.manual_seed fixes the samples
    greedy = generate(model, tok, prompts, n=2, max_new_tokens=6, batch_size=16, greedy=True)
    top1 = generate(model, tok, prompts, top_k=1, **kw)
    assert torch.equal(top1.response_ids, greedy.response_ids)  # one token left: the draw is the argmax


def test_draw_kwargs_hand_generate_our_draw_only_when_asked():
    from rlhflab.rollout.hf import draw_kwargs

    # what generate is handed: greedy over (temperature, top-k, top-p, the draw); nothing when greedy
    kw = draw_kwargs(greedy=False, temperature=0.7, top_k=5, top_p=0.9, record=True)
    assert kw["do_sample"] is False and kw["temperature"] is None
    assert [type(p).__name__ for p in kw["logits_processor"]] == [
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "InverseCDFDraw"]
    assert draw_kwargs(greedy=True, temperature=0.7, top_k=0, top_p=1.0, record=True) == {}
    assert draw_kwargs(greedy=False, temperature=0.7, top_k=0, top_p=1.0) == {}   # generate's own draw


def test_static_cache_decodes_what_the_dynamic_cache_does(tiny_model_dir):
    """`generation.hf.cache: static`: generate's KV cache preallocated at max_prompt_length +
    max_new_tokens (compiled around on a GPU; eager here). The tokens are the dynamic cache's:
    greedy, and seeded samples of groups that the dynamic path prefills once and shares, over
    calls whose prompts differ in width (the cache keeps one size)."""
    from rlhflab.config.schema import GenerationConfig, HFGenerationConfig
    from rlhflab.rollout import HFBackend

    model, tok = load_model(str(tiny_model_dir))
    short = [f"Question: {a} + 5?\nAnswer:" for a in range(4)]
    long_ = [f"Question: {a} + {a} + {a} + 123 + 45?\nAnswer:" for a in range(4)]
    for prompts in (short, long_):
        kw = dict(max_new_tokens=6, max_prompt_length=32, batch_size=8)
        dyn = generate(model, tok, prompts, greedy=True, **kw)
        sta = generate(model, tok, prompts, greedy=True, static_cache=True, **kw)
        assert torch.equal(sta.response_ids, dyn.response_ids) and torch.equal(sta.response_mask, dyn.response_mask)
        seeded = dict(n=2, temperature=1.0, seed=7, step=1, **kw)
        shared = generate(model, tok, prompts, **seeded)
        static = generate(model, tok, prompts, static_cache=True, **seeded)
        assert torch.equal(static.response_ids, shared.response_ids)
    assert getattr(model, "_previous_max_cache_length", None) == 32 + 6  # one size for every call
    assert HFBackend(model, tok, GenerationConfig(hf=HFGenerationConfig(cache="static")), max_prompt_length=32, batch_size=8).static_cache
    assert not HFBackend(model, tok, GenerationConfig(), max_prompt_length=32, batch_size=8).static_cache  # auto, CPU
    errs = GenerationConfig(hf=HFGenerationConfig(cache="static"), backend="vllm").check()
    assert any(e.startswith("hf.cache: static applies only to backend=hf") for e in errs)
    assert not GenerationConfig(backend="vllm").check()  # the default, auto, is no conflict


def test_hf_cache_auto_is_static_on_one_cuda_gpu_only(monkeypatch):
    """`generation.hf.cache: auto` (the default): the static cache where transformers compiles
    around it, one CUDA GPU in a single process with a compilable base; dynamic on a CPU, under
    several processes, with a quantization transformers will not compile, and on a
    transformers that cannot size it (no error: the user asked for nothing in particular)."""
    import transformers

    from rlhflab.errors import UserError
    from rlhflab.rollout.hf import static_cache_for

    class on(torch.nn.Module):  # a model on `device` (no memory there), quantized or not
        def __init__(self, device, quantizer=None):
            super().__init__()
            self.where, self.hf_quantizer = torch.device(device), quantizer

        def parameters(self, recurse=True):
            yield SimpleNamespace(device=self.where)

    assert static_cache_for("auto", on("cuda")) and not static_cache_for("auto", on("cuda"), world_size=2)
    assert not static_cache_for("auto", on("cpu")) and not static_cache_for("auto", on("meta"))
    assert not static_cache_for("auto", on("cuda", SimpleNamespace(is_compileable=False)))
    assert static_cache_for("auto", on("cuda", SimpleNamespace(is_compileable=True)))
    assert static_cache_for("static", on("cpu")) and not static_cache_for("dynamic", on("cuda"))
    monkeypatch.setattr(transformers, "GenerationConfig", lambda: SimpleNamespace(max_length=20))  # an old one
    assert not static_cache_for("auto", on("cuda"))
    with pytest.raises(UserError, match="hf.cache: static needs transformers 5.16"):
        static_cache_for("static", on("cuda"))


def test_static_cache_on_a_transformers_without_max_cache_len_is_refused_when_the_backend_is_built(
        tiny_model_dir, monkeypatch):
    import transformers

    from rlhflab.config.schema import GenerationConfig, HFGenerationConfig
    from rlhflab.errors import UserError
    from rlhflab.rollout import HFBackend

    model, tok = load_model(str(tiny_model_dir))
    monkeypatch.setattr(transformers, "GenerationConfig", lambda: SimpleNamespace(max_length=20))  # an old one
    with pytest.raises(UserError, match=r"hf\.cache: static needs transformers 5.16 or newer .* "
                                        r"generation.hf.cache: dynamic"):
        HFBackend(model, tok, GenerationConfig(hf=HFGenerationConfig(cache="static")), max_prompt_length=32, batch_size=8)
    assert not HFBackend(model, tok, GenerationConfig(), max_prompt_length=32, batch_size=8).static_cache
