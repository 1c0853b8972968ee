"""The last decoder layer's MLP runs on the response rows only (models.actor_critic.last_layer_rows).

Every caller of `response_hidden` reads the last hidden state at positions >= P-1 alone;
the last layer's output at earlier positions feeds nothing. These tests hold the shortcut
to the plain pass (the same decoder with the hooks switched off): the hidden states and
every parameter's gradient agree, on each architecture `make-tiny` builds, with the lean
MLP and without, through a LoRA adapter, on grouped prompts, and the shortcut
steps aside under activation checkpointing.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhflab.models import actor_critic as ac
from rlhflab.models.lean import lean_mlp
from rlhflab.models.load import add_lora
from rlhflab.models.tiny import ARCHS, make_tiny_model

B, P, T = 6, 9, 5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows")
    return {arch: make_tiny_model(root / arch, hidden_size=64, num_layers=2, num_heads=4, vocab_size=300,
                                  arch=arch, kv_heads=2 if arch == "qwen2" else None)
            for arch in ARCHS}


def _batch(group_size: int = 1):
    g = torch.Generator().manual_seed(0)
    n_prompts = B // group_size
    prompt_ids = torch.randint(3, 250, (n_prompts, P), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :3] = 0  # left padding
    response_ids = torch.randint(3, 250, (B, T), generator=g)
    response_mask = torch.ones_like(response_ids)
    response_mask[1, 3:] = 0  # right padding
    return prompt_ids, prompt_mask, response_ids, response_mask


@contextmanager
def _off(*args, **kwargs):
    yield


def _pass(model, batch, group_size: int = 1, plain: bool = False, monkeypatch=None):
    """Hidden states and parameter gradients of a weighted sum of `response_hidden`."""
    if plain:
        monkeypatch.setattr(ac, "last_layer_rows", _off)
    try:
        model.zero_grad(set_to_none=True)
        hidden = ac.response_hidden(model, *batch, group_size=group_size)
        weights = torch.linspace(-1, 1, hidden.numel()).view_as(hidden)
        (hidden * weights).sum().backward()
    finally:
        if plain:
            monkeypatch.undo()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return hidden.detach(), grads


def _mlp_rows(model) -> list[int]:
    """Records the number of positions each layer's MLP computes (its forward's input) during a pass."""
    decoder, _ = ac.decoder_and_head(model)
    seen: list[int] = []
    for layer in decoder.layers:
        layer.mlp.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    return seen


def _assert_same(a, b):
    (ha, ga), (hb, gb) = a, b
    torch.testing.assert_close(ha, hb, rtol=1e-6, atol=1e-6)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        # Float32 sums over other row orders: each gradient within 1e-5 of its tensor's
        # largest entry (an element-wise rtol fails on entries that cancel to near 0: seen
        # 3e-7 of the max on an Intel CPU, where lora_A's small entries missed rtol 1e-5).
        scale = float(gb[name].abs().max())
        torch.testing.assert_close(ga[name], gb[name], rtol=0, atol=max(1e-6, 1e-5 * scale), msg=name)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("lean", [False, True])
def test_equal_to_the_plain_pass(arch, lean, folders, monkeypatch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(folders[arch]))
    if lean:
        assert lean_mlp(model) == 2
    batch = _batch()
    seen = _mlp_rows(model)
    short = _pass(model, batch)
    # The first layer's MLP saw every position of prompt + response (less the last token);
    # the last layer's only the T positions that predict response tokens.
    assert seen == [P + T - 1, T]
    _assert_same(short, _pass(model, batch, plain=True, monkeypatch=monkeypatch))
    assert seen[2:] == [P + T - 1, P + T - 1]  # the plain pass: every position in both layers


def test_grouped_prompts_and_lora(folders, monkeypatch):
    torch.manual_seed(0)
    model = add_lora(AutoModelForCausalLM.from_pretrained(str(folders["llama"])), r=4)
    for name, p in model.named_parameters():  # B away from zero, so the adapter matters
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    batch = _batch(group_size=3)
    seen = _mlp_rows(model)
    short = _pass(model, batch, group_size=3)
    # The padded layout gives each of the 6 rows its group's prompt: one pass of P+T-1
    # positions, the last layer's MLP on the T that predict response tokens.
    assert seen == [P + T - 1, T]
    assert any("lora_B" in n for n in short[1])
    _assert_same(short, _pass(model, batch, group_size=3, plain=True, monkeypatch=monkeypatch))


def test_steps_aside_under_activation_checkpointing(folders, monkeypatch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(folders["llama"]))
    plain = _pass(model, _batch(), plain=True, monkeypatch=monkeypatch)
    model.gradient_checkpointing_enable()
    model.train()
    seen = _mlp_rows(model)
    checkpointed = _pass(model, _batch())
    # Recomputation in the backward pass runs outside the context: the MLP keeps every row.
    assert seen[:2] == [P + T - 1, P + T - 1]
    _assert_same(checkpointed, plain)


def test_no_op_where_the_mlp_is_not_a_dense_gated_block():
    class Router(torch.nn.Module):  # a mixture-of-experts block: routing looks at every token
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(4, 2)

    class Layer(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

    class Decoder(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(mlp)])

    assert ac._last_mlp(Decoder(Router())) is None
    assert ac._last_mlp(torch.nn.Linear(2, 2)) is None  # no `layers`


def test_an_mlp_called_with_a_keyword_input_is_left_whole(folders):
    model = AutoModelForCausalLM.from_pretrained(str(folders["llama"]))
    decoder, _ = ac.decoder_and_head(model)
    mlp = decoder.layers[-1].mlp
    x = torch.randn(2, P, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ac.last_layer_rows(model, decoder, 4):
        by_keyword = mlp(x=x)
        by_position = mlp(x)
    assert by_keyword.shape == x.shape
    torch.testing.assert_close(by_keyword, mlp(x).detach(), rtol=0, atol=0)
    # Positional: rows [4:] computed, the first 4 zeros.
    assert by_position.shape == x.shape and by_position[:, :4].abs().sum() == 0
    torch.testing.assert_close(by_position[:, 4:], by_keyword[:, 4:], rtol=1e-6, atol=1e-6)
