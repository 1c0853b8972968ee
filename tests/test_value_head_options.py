"""The value head's options (the tutorial seed's TRL kwargs): model.value_head_init,
value_head_init_std and value_head_dropout; the defaults compute what the head always did."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rlhflab.config.schema import ModelConfig
from rlhflab.errors import ConfigError
from rlhflab.models.actor_critic import ValueHead, load_value_head, save_value_head
from rlhflab.trainers import ppo


def test_normal_init_has_the_asked_std():
    # 8192 weights: the sample std of N(0, 0.05²) lies within 0.05 * (1 ± 3/sqrt(2*8192)),
    # i.e. ±2.3%, at three standard errors; 5% leaves room and still fails for the old 0.01.
    torch.manual_seed(0)
    head = ValueHead(8192, init_std=0.05, init="normal")
    std = float(head.summary.weight.detach().std())
    assert abs(std - 0.05) < 0.05 * 0.05, std
    assert abs(float(head.summary.weight.detach().mean())) < 0.05 * 4 / math.sqrt(8192)
    assert torch.count_nonzero(head.summary.bias) == 0


def test_zero_init_gives_zero_values():
    head = ValueHead(64, init="zero")
    values = head(torch.randn(3, 7, 64) * 100)  # (B, T): w·h + b = 0·h + 0
    assert values.shape == (3, 7)
    assert torch.equal(values, torch.zeros(3, 7))


def test_uniform_init_is_pytorchs_linear_init():
    # nn.Linear's default: weight and bias ~ U(-1/sqrt(H), 1/sqrt(H)); std 1/sqrt(3H).
    torch.manual_seed(0)
    H = 4096
    head = ValueHead(H, init="uniform")
    bound = 1 / math.sqrt(H)  # 1/64 = 0.015625
    assert float(head.summary.weight.detach().abs().max()) <= bound
    assert abs(float(head.summary.weight.detach().std()) - bound / math.sqrt(3)) < 0.05 * bound / math.sqrt(3)
    assert 0 < abs(float(head.summary.bias.detach())) <= bound
    torch.manual_seed(0)
    assert torch.equal(head.summary.weight, nn.Linear(H, 1).weight)


def test_defaults_are_the_old_head_bit_for_bit():
    # Before these options: nn.Linear(H, 1) (PyTorch's init draws first), then weight ~
    # N(0, 0.01²) and bias 0. The same seed must give the same weights, and the config's
    # defaults the same head as the bare constructor.
    torch.manual_seed(3)
    old = nn.Linear(32, 1)
    nn.init.normal_(old.weight, std=1e-2)
    nn.init.zeros_(old.bias)
    torch.manual_seed(3)
    head = ValueHead.from_config(32, ModelConfig())
    assert head.dropout is None
    assert torch.equal(head.summary.weight, old.weight) and torch.equal(head.summary.bias, old.bias)
    torch.manual_seed(3)
    assert torch.equal(ValueHead(32).summary.weight, old.weight)
    h = torch.randn(2, 5, 32)
    assert torch.equal(head(h), old(h).squeeze(-1))


def test_dropout_only_in_passes_that_train_the_head():
    torch.manual_seed(0)
    plain = ValueHead(64)
    dropped = ValueHead(64, dropout=0.5)
    dropped.load_state_dict(plain.state_dict())  # the same weights; dropout has no parameters
    assert set(dropped.state_dict()) == {"summary.weight", "summary.bias"}  # checkpoints unchanged
    h = torch.randn(4, 6, 64)
    # Train mode with gradients: features are dropped (and the rest scaled by 1/(1-p) = 2),
    # so two passes differ from each other and from the plain head.
    a, b = dropped(h), dropped(h)
    assert not torch.allclose(a, b) and not torch.allclose(a, plain(h))
    # The no-grad scoring of a rollout (still train mode) and eval mode: the full head.
    with torch.no_grad():
        assert torch.equal(dropped(h), plain(h))
    dropped.eval()
    assert torch.equal(dropped(h), plain(h))


def test_dropout_averages_to_the_plain_head():
    # Inverted dropout keeps the expectation: the mean of many dropped passes nears w·h.
    torch.manual_seed(0)
    head = ValueHead(16, init_std=1.0, dropout=0.25)
    h = torch.randn(16)
    full = float(head.summary(h).detach())
    mean = torch.stack([head(h) for _ in range(4000)]).mean().detach()
    # per pass std <= |w|·|h|·sqrt(p/(1-p)) ~ 4·4·0.58 ~ 9; over 4000 passes ~0.15; 0.6 is 4 of them
    assert abs(float(mean) - full) < 0.6


def test_saved_head_with_dropout_reloads_into_a_plain_one(tmp_path):
    torch.manual_seed(0)
    head = ValueHead(16, dropout=0.3)
    save_value_head(head, tmp_path)
    fresh = ValueHead(16, init="zero")
    load_value_head(fresh, tmp_path)
    assert torch.equal(fresh.summary.weight, head.summary.weight)


@pytest.mark.parametrize("bad", [{"init": "xavier"}, {"dropout": 1.0}, {"dropout": -0.1}])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(ValueError):
        ValueHead(8, **bad)


def test_config_reaches_the_built_heads(ppo_cfg):
    models = ppo.build_models(ppo_cfg("model.value_head_init=zero", "model.value_head_dropout=0.2"))
    head = models.actor.value_head
    assert head.dropout is not None and head.dropout.p == 0.2
    assert torch.count_nonzero(head.summary.weight) == 0
    tok = models.tokenizer
    enc = tok(["Question: 1 + 2?\nAnswer:"], return_tensors="pt", add_special_tokens=False)
    resp = tok([" 3"], return_tensors="pt", add_special_tokens=False).input_ids
    ids = torch.cat([enc.input_ids, resp], 1)
    out = models.actor.forward_response(ids, torch.ones_like(ids), enc.input_ids.shape[1])
    assert torch.equal(out.values, torch.zeros_like(out.values))
    # The separate critic's head follows the same keys.
    sep = ppo.build_models(ppo_cfg("model.critic=separate", "model.value_head_init_std=0.5"))
    assert 0.2 < float(sep.actor.critic.value_head.summary.weight.detach().std()) < 1.0


def test_config_ranges_and_the_tutorial_names(ppo_cfg):
    with pytest.raises(ConfigError, match="value_head_dropout"):
        ppo_cfg("model.value_head_dropout=1.0")
    with pytest.raises(ConfigError, match="value_head_init"):
        ppo_cfg("model.value_head_init=xavier")
    for seed_name, ours in [("summary_dropout_prob", "model.value_head_dropout"),
                            ("v_head_initializer_range", "model.value_head_init_std"),
                            ("v_head_init_strategy", "model.value_head_init")]:
        with pytest.raises(ConfigError, match=f"did you mean {ours}"):
            ppo_cfg(f"model.{seed_name}=0.1")


@pytest.mark.parametrize("critic", ["value_head", "separate"])
def test_critic_learning_rate_is_the_critics_own_group(ppo_cfg, critic):
    """ppo.critic_learning_rate: the value head (or separate critic) in a group of its own.
    Adam's first step moves every parameter with a nonzero gradient by its group's lr
    (m/sqrt(v) = g/|g| = +-1 after one step, bias-corrected), so one step with policy lr
    1e-6 and critic lr 1e-3 moves the head's weights by 1e-3 and the policy's by 1e-6."""
    from rlhflab.trainers.loop import build_run

    cfg = ppo_cfg(f"model.critic={critic}", "ppo.learning_rate=1e-6", "ppo.critic_learning_rate=1e-3")
    run = build_run(cfg, ppo.method(cfg))
    groups = run.optimizer.param_groups
    head = run.models.actor.value_head if critic == "value_head" else run.models.actor.critic
    assert [g["lr"] for g in groups] == [1e-6, 1e-3]
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in head.parameters() if p.requires_grad}
    assert sum(len(g["params"]) for g in groups) == len(run.models.actor.trainable_parameters())
    before = [p.detach().clone() for g in groups for p in g["params"]]
    for g in groups:
        for p in g["params"]:
            p.grad = torch.ones_like(p)
    run.optimizer.step()
    moved = [(p.detach() - b).abs().max().item() for p, b in zip([p for g in groups for p in g["params"]], before)]
    n_policy = len(groups[0]["params"])
    assert max(moved[:n_policy]) == pytest.approx(1e-6, rel=0.05)  # float32 rounding of a 1e-6 step
    assert min(moved[n_policy:]) == pytest.approx(1e-3, rel=1e-3)
    # unset: one group at the policy's learning rate, as before
    plain = build_run(ppo_cfg(f"model.critic={critic}"), ppo.method(ppo_cfg(f"model.critic={critic}")))
    assert len(plain.optimizer.param_groups) == 1
