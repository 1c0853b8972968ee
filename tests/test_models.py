"""Model loading, the tiny model builder, the actor-critic, the reference, the value head."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhflab import cli
from rlhflab.errors import UserError
from rlhflab.models.actor_critic import (ActorCritic, Critic, Reference, ValueHead, hidden_size_of,
                                         load_value_head, position_ids_from, save_value_head)
from rlhflab.models.load import disable_dropout, load_model, load_tokenizer

PROMPTS = ["Question: Ada has 3 apples and gets 4 more. How many apples does Ada have now?\nAnswer:",
           "Question: 2 + 5?\nAnswer:"]


def _actor_critic(model_dir, dtype="float32", seed=0):
    torch.manual_seed(seed)
    model, tok = load_model(str(model_dir), torch_dtype=dtype)
    disable_dropout(model)
    return ActorCritic(model, value_head=ValueHead(hidden_size_of(model))), tok


def _batch(tok, prompts=PROMPTS, response=" 3 + 4 = 7\n#### 7"):
    """Left-padded prompts (B, P) followed by the same response (B, T); all mask 1 on it."""
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    resp = tok([response] * len(prompts), return_tensors="pt", add_special_tokens=False).input_ids
    ids = torch.cat([enc.input_ids, resp], 1)                          # (B, P+T)
    am = torch.cat([enc.attention_mask, torch.ones_like(resp)], 1)      # (B, P+T)
    return ids, am, resp, enc.input_ids.shape[1]


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, torch_dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_load_dtype_device(tiny_model_dir, dtype, torch_dtype):
    model, tok = load_model(str(tiny_model_dir), torch_dtype=dtype, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch_dtype}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert tok.padding_side == "left" and tok.pad_token == "<|pad|>"
    assert model.generation_config.pad_token_id == tok.pad_token_id


def test_unknown_dtype_is_a_user_error(tiny_model_dir):
    with pytest.raises(UserError, match="float64.*choose float32, bfloat16"):
        load_model(str(tiny_model_dir), torch_dtype="float64")


def test_left_padding(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    enc = tok(PROMPTS, padding=True, add_special_tokens=False, return_tensors="pt")
    short = enc.attention_mask[1]
    n_pad = int((short == 0).sum())
    assert n_pad > 0 and short[:n_pad].sum() == 0 and short[n_pad:].all()  # zeros first, then ones
    assert (enc.input_ids[1, :n_pad] == tok.pad_token_id).all()
    # Both prompts end at the last column, where generation continues.
    assert enc.input_ids[1, -1] == enc.input_ids[0, -1]


def test_pad_token_set_when_the_tokenizer_has_none(tiny_model_dir, tmp_path):
    # A copy of the tiny model whose tokenizer has no pad token.
    folder = tmp_path / "no-pad"
    shutil.copytree(tiny_model_dir, folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("pad_token", None)
    cfg_path.write_text(json.dumps(cfg))
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen.pop("pad_token_id", None)
    gen_path.write_text(json.dumps(gen))
    assert AutoTokenizer.from_pretrained(folder).pad_token is None  # the premise

    model, tok = load_model(str(folder))
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"
    assert tok.pad_token_id == tok.eos_token_id
    assert tok.padding_side == "left"
    assert model.generation_config.pad_token_id == tok.eos_token_id
    enc = tok(PROMPTS, padding=True, add_special_tokens=False)  # padding works now
    assert len(enc["input_ids"][0]) == len(enc["input_ids"][1])


def test_missing_model_path_is_a_user_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(UserError) as err:
        load_model(str(missing))
    msg = str(err.value)
    assert str(missing) in msg and "rlhflab fetch-model smollm2" in msg and "rlhflab import-gguf" in msg


def test_relative_missing_path_fails_fast_without_the_hub(tmp_path, monkeypatch):
    # `outputs/tiny-model` before `make-tiny` was run: a local path, so no hub requests
    # (which retry for about a minute offline) should be made before the error.
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("from_pretrained was called for a missing local path")

    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_hub)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_hub)
    for name in ("outputs/tiny-model", "./tiny-model"):
        with pytest.raises(UserError, match=f"'{name}'.*make-tiny"):
            load_model(name)
    with pytest.raises(UserError, match="'outputs/a/b'.*fetch-model"):  # no tiny model: a real one
        load_model("outputs/a/b")


def test_folder_without_config_is_a_user_error(tiny_model_dir, tmp_path):
    # A folder with the tokenizer but no model: the message names the path and the fix.
    folder = tmp_path / "tokenizer-only"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    with pytest.raises(UserError, match="no config.json.*fetch-model"):
        load_model(str(folder))
    # An empty folder: the same kind of message, not a traceback from transformers.
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=str(empty)):
        load_model(str(empty))


def test_make_tiny_cli_writes_a_loadable_folder(tmp_path, capsys):
    out = tmp_path / "tiny"
    rc = cli.main(["make-tiny", "--out", str(out), "--hidden-size", "32", "--layers", "1", "--heads", "2"])
    assert rc == 0 and str(out) in capsys.readouterr().out
    # Plain transformers, no rlhflab code.
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert model.config.vocab_size == len(tok)
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    # Digits are single tokens, so "1234" is four tokens.
    assert len(tok("1234", add_special_tokens=False).input_ids) == 4
    logits = model(**tok(["2 + 3 ="], return_tensors="pt")).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def test_make_tiny_cli_rejects_bad_sizes(tmp_path, capsys):
    rc = cli.main(["make-tiny", "--out", str(tmp_path / "x"), "--hidden-size", "30", "--heads", "4"])
    assert rc == 2
    assert "error: --hidden-size 30 is not divisible by --heads 4" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_disable_dropout():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    disable_dropout(net)
    x = torch.randn(3, 4)
    net.train()
    assert torch.equal(net(x), net(x))


# --------------------------------------------------------------------------------------
# Actor-critic
# --------------------------------------------------------------------------------------
def test_position_ids_skip_left_padding():
    am = torch.tensor([[0, 0, 1, 1, 1],
                       [1, 1, 1, 1, 1]])
    # row 0: cumsum 0,0,1,2,3 minus 1 -> -1,-1,0,1,2, clamped at 0
    assert position_ids_from(am).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_one_forward_gives_logits_and_values(tiny_model_dir):
    ac, tok = _actor_critic(tiny_model_dir)
    ids, am, resp, p = _batch(tok)
    calls = []
    decoder = ac.policy.model
    handle = decoder.register_forward_hook(lambda *a: calls.append(1))
    out = ac.forward_response(ids, am, p)
    handle.remove()
    b, t = resp.shape
    assert out.logits.shape == (b, t, len(tok)) and out.values.shape == (b, t)
    assert out.values.dtype == torch.float32
    assert len(calls) == 1  # one pass of the shared decoder for both
    no_values = ac.forward_response(ids, am, p, with_values=False)
    assert no_values.values is None and torch.equal(no_values.logits, out.logits)


def test_response_logits_equal_the_full_model_slice(tiny_model_dir):
    ac, tok = _actor_critic(tiny_model_dir)
    ids, am, resp, p = _batch(tok)
    t = resp.shape[1]
    out = ac.forward_response(ids, am, p)
    full = ac.policy(input_ids=ids, attention_mask=am, position_ids=position_ids_from(am)).logits
    # The logits that predict response token t sit at position P-1+t.
    torch.testing.assert_close(out.logits, full[:, p - 1 : p + t - 1], rtol=0, atol=1e-5)


def forward_response(ac, ids, am, resp, p):
    """The training forward on prompt+response ids (B, P+T): log-probs and values."""
    return ac(ids[:, :p], am[:, :p], resp, am[:, p:])


def test_left_padding_does_not_change_response_logprobs(tiny_model_dir):
    ac, tok = _actor_critic(tiny_model_dir)
    ids, am, resp, p = _batch(tok)                         # prompt 1 is left-padded here
    batched = forward_response(ac, ids, am, resp, p).logprobs[1]
    alone_ids, alone_am, alone_resp, alone_p = _batch(tok, PROMPTS[1:])  # no padding at all
    assert alone_p < p
    alone = forward_response(ac, alone_ids, alone_am, alone_resp, alone_p).logprobs[0]
    torch.testing.assert_close(batched, alone, rtol=0, atol=1e-5)
    # Extra left padding on top changes nothing either.
    pad = torch.full((ids.shape[0], 3), tok.pad_token_id)
    more = forward_response(ac, torch.cat([pad, ids], 1), torch.cat([torch.zeros_like(pad), am], 1),
                            resp, p + 3)
    torch.testing.assert_close(more.logprobs, forward_response(ac, ids, am, resp, p).logprobs,
                               rtol=0, atol=1e-5)


def test_value_head_computes_in_float32_for_a_bfloat16_model(tiny_model_dir):
    ac, tok = _actor_critic(tiny_model_dir, dtype="bfloat16")
    assert ac.policy.dtype == torch.bfloat16
    assert ac.value_head.summary.weight.dtype == torch.float32
    ids, am, resp, p = _batch(tok)
    out = ac.forward_response(ids, am, p)
    assert out.logits.dtype == torch.bfloat16 and out.values.dtype == torch.float32
    # The same as the head applied to the float32-cast hidden states.
    from rlhflab.models.actor_critic import response_hidden
    hidden = response_hidden(ac.policy, ids[:, :p], am[:, :p], ids[:, p:], am[:, p:])
    assert hidden.dtype == torch.bfloat16
    w, b = ac.value_head.summary.weight, ac.value_head.summary.bias
    expected = hidden.float() @ w[0] + b[0]
    torch.testing.assert_close(out.values, expected, rtol=1e-6, atol=1e-6)
    # A bfloat16 head would round the values to 8 bits of mantissa; float32 keeps them.
    assert not torch.equal(out.values, out.values.bfloat16().float())


def test_value_head_init_and_shape():
    torch.manual_seed(0)
    head = ValueHead(64, init_std=1e-2)
    assert head.summary.bias.abs().sum() == 0
    assert 0.005 < float(head.summary.weight.detach().std()) < 0.02
    assert head(torch.randn(2, 5, 64)).shape == (2, 5)


def test_value_head_saved_and_reloaded(tmp_path):
    torch.manual_seed(0)
    head = ValueHead(16)
    with torch.no_grad():
        head.summary.bias.fill_(0.25)
    path = save_value_head(head, tmp_path)
    assert path.name == "value_head.safetensors"
    fresh = ValueHead(16)
    assert not torch.equal(fresh.summary.weight, head.summary.weight)
    load_value_head(fresh, tmp_path)
    for (k, a), (_, b) in zip(head.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    x = torch.randn(3, 16)
    assert torch.equal(head(x), fresh(x))


def test_separate_critic(tiny_model_dir):
    torch.manual_seed(0)
    policy, tok = load_model(str(tiny_model_dir))
    critic_base, _ = load_model(str(tiny_model_dir))
    critic = Critic(critic_base)
    ac = ActorCritic(policy, critic=critic)
    assert ac.separate_critic and ac.value_head is None
    ids, am, resp, p = _batch(tok)
    out = ac.forward_response(ids, am, p)
    # The values are the critic's own.
    torch.testing.assert_close(out.values, critic(ids[:, :p], am[:, :p], ids[:, p:], am[:, p:]), rtol=0, atol=0)
    # Perturbing the policy changes the logits but not the values.
    with torch.no_grad():
        for prm in policy.parameters():
            prm.add_(0.01 * torch.randn_like(prm))
    out2 = ac.forward_response(ids, am, p)
    assert torch.equal(out2.values, out.values) and not torch.allclose(out2.logits, out.logits)
    # The value loss sends no gradient into the policy.
    out2.values.square().mean().backward()
    assert all(prm.grad is None for prm in policy.parameters())
    assert critic.value_head.summary.weight.grad is not None
    assert any(prm.grad is not None and prm.grad.abs().sum() > 0 for prm in critic.base.parameters())
    # And no parameter is shared between the two.
    policy_ptrs = {prm.data_ptr() for prm in policy.parameters()}
    assert policy_ptrs.isdisjoint(prm.data_ptr() for prm in critic.parameters())


def test_frozen_copy_reference_is_independent(tiny_model_dir):
    ac, tok = _actor_critic(tiny_model_dir)
    ref = Reference.frozen_copy(ac.policy)
    assert not ref.model.training
    assert all(not prm.requires_grad for prm in ref.model.parameters())
    policy_ptrs = {prm.data_ptr() for prm in ac.policy.parameters()}
    assert policy_ptrs.isdisjoint(prm.data_ptr() for prm in ref.model.parameters())
    ids, am, resp, p = _batch(tok)
    before = ref.response_logits(ids, am, p)
    torch.testing.assert_close(before, ac.forward_response(ids, am, p).logits.detach(), rtol=0, atol=0)
    with torch.no_grad():
        for prm in ac.policy.parameters():
            prm.add_(0.01)
    assert torch.equal(ref.response_logits(ids, am, p), before)  # the policy moved, the reference did not


def test_lora_disabled_reference_equals_the_base_model(tiny_model_dir):
    from rlhflab.models.load import add_lora

    torch.manual_seed(0)
    base, tok = load_model(str(tiny_model_dir))
    plain, _ = load_model(str(tiny_model_dir))  # an untouched copy to compare with
    policy = add_lora(base, r=4, alpha=8)
    ref = Reference.lora_disabled(policy)
    assert ref.model is None and ref.policy is policy  # no second copy of the weights
    ids, am, resp, p = _batch(tok)
    full = plain(input_ids=ids, attention_mask=am, position_ids=position_ids_from(am)).logits
    t = resp.shape[1]
    torch.testing.assert_close(ref.response_logits(ids, am, p), full[:, p - 1 : p + t - 1], rtol=0, atol=1e-5)
    # Move the adapter: the policy changes, the reference still equals the base model.
    with torch.no_grad():
        for name, prm in policy.named_parameters():
            if "lora_B" in name:
                prm.normal_(std=0.1)
    ac = ActorCritic(policy, value_head=ValueHead(hidden_size_of(policy)))
    pol_logits = ac.forward_response(ids, am, p).logits
    assert (pol_logits - full[:, p - 1 : p + t - 1]).abs().max() > 1e-3
    torch.testing.assert_close(ref.response_logits(ids, am, p), full[:, p - 1 : p + t - 1], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="peft"):
        Reference.lora_disabled(plain)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_device_is_a_user_error(tiny_model_dir):
    with pytest.raises(UserError, match="no CUDA device.*training.device=cpu"):
        load_model(str(tiny_model_dir), device="cuda")


def test_attn_implementation_reaches_every_model_and_computes_the_same(ppo_cfg):
    """model.attn_implementation=eager loads the policy, the separate critic and the frozen
    reference with eager attention, and they compute what transformers' default (sdpa)
    computes, left padding included."""
    from rlhflab.trainers import ppo

    torch.manual_seed(0)  # the same value head in both
    eager = ppo.build_models(ppo_cfg("model.attn_implementation=eager", "model.critic=separate"))
    torch.manual_seed(0)
    default = ppo.build_models(ppo_cfg("model.critic=separate"))
    ac = eager.actor
    assert {ac.policy.config._attn_implementation, ac.critic.base.config._attn_implementation,
            eager.reference.model.config._attn_implementation} == {"eager"}
    assert default.actor.policy.config._attn_implementation == "sdpa"
    ids, am, _, p = _batch(eager.tokenizer)
    assert (am[:, :p] == 0).any()  # some prompt is left-padded
    mine, theirs = ac.forward_response(ids, am, p), default.actor.forward_response(ids, am, p)
    torch.testing.assert_close(mine.logits, theirs.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=1e-5)


def test_bad_attn_implementation_is_refused_in_one_line(ppo_cfg, tiny_model_dir):
    from rlhflab.errors import ConfigError
    from rlhflab.trainers import ppo

    with pytest.raises((ConfigError, UserError), match=r"model\.attn_implementation: expected one of sdpa, eager"):
        ppo_cfg("model.attn_implementation=flash")
    # flash-attn is not installed here (and needs CUDA): transformers refuses, the message names the knob
    with pytest.raises(UserError, match=r"model\.attn_implementation=flash_attention_2 cannot load .*; set "
                                        r"model\.attn_implementation=sdpa or eager"):
        ppo.build_models(ppo_cfg("model.attn_implementation=flash_attention_2"))
    from rlhflab.config.schema import ModelConfig
    from rlhflab.trainers.rm import RMRunConfig, build_reward_model

    rm_cfg = RMRunConfig(model=ModelConfig(name_or_path=str(tiny_model_dir), attn_implementation="flash_attention_2"))
    with pytest.raises(UserError, match=r"model\.attn_implementation=flash_attention_2 cannot load"):
        build_reward_model(rm_cfg, torch.device("cpu"))
    rm_cfg.model.attn_implementation = "eager"  # and the reward model takes it
    assert build_reward_model(rm_cfg, torch.device("cpu"))[0].config._attn_implementation == "eager"
