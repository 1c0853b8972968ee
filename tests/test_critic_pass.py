"""The separate critic's own pass in the update (`engine.update.critic_pass`): the same
step as the joint pass, with one model's activations alive at a time instead of two."""

from __future__ import annotations

import copy

import pytest
import torch
from memory_helpers import tensor_peak_bytes
from model_helpers import separate_critic_minibatch

from rlhflab.engine.update import PPOMath, minibatch_loss, update_group
from rlhflab.trainers.common import make_optimizer


@pytest.fixture
def critic_setup(ppo_cfg):
    """A separate-critic PPO run, its rollout (advantages, returns, old values) and one
    16-row minibatch of it. The passes run one after the other."""
    return separate_critic_minibatch(ppo_cfg("model.critic=separate", "ppo.mini_batch_size=16", "ppo.vf_coeff=0.5",
                                             "ppo.kl_coeff=0.1"))


def _one_step(actor, mb, cfg, normalizer, math_):
    """One optimizer step of `update_group` on a copy of `actor`: (the copy, its stats)."""
    actor = copy.deepcopy(actor)
    params = actor.trainable_parameters()
    opt = make_optimizer(params, 1e-3)
    _, stats = update_group(actor, [mb], opt, params, cfg.ppo, 1.0, math_, normalizer)
    return actor, stats[0]


def test_the_critic_apart_takes_the_same_step_as_the_joint_pass(critic_setup):
    cfg, actor, mb, n = critic_setup
    apart, st_apart = _one_step(actor, mb, cfg, n, PPOMath())
    # A minibatch_step of its own (learner mode's plug-in) runs the joint pass: here the
    # engine's own function, so only the path differs.
    joint, st_joint = _one_step(actor, mb, cfg, n, PPOMath(minibatch_step=minibatch_loss))
    moved = 0
    for (name, a), b in zip(apart.named_parameters(), joint.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
        moved += int(not torch.equal(a, dict(actor.named_parameters())[name]))
    assert moved > 10  # both the policy's and the critic's weights moved
    for key in ("policy", "value", "entropy", "total", "value_clip_frac", "approx_kl"):
        assert getattr(st_apart, key) == pytest.approx(getattr(st_joint, key), rel=1e-6, abs=1e-9), key
    # The total reports the weighted value part: policy + vf_coeff * value (entropy_coeff 0).
    assert st_apart.total == pytest.approx(st_apart.policy + 0.5 * st_apart.value, rel=1e-6)


def test_the_critic_apart_holds_one_models_activations_at_a_time(critic_setup):
    cfg, actor, mb, n = critic_setup
    peaks = {}
    for name, math_ in (("apart", PPOMath()), ("joint", PPOMath(minibatch_step=minibatch_loss))):
        model = copy.deepcopy(actor)
        params = model.trainable_parameters()
        opt = make_optimizer(params, 1e-3)
        update_group(model, [mb], opt, params, cfg.ppo, 1.0, math_, n)  # Adam state exists before measuring
        peaks[name] = tensor_peak_bytes(lambda: update_group(model, [mb], opt, params, cfg.ppo, 1.0, math_, n)) / 2**20
    # Both hold the gradients of both models at the end; the joint pass holds both graphs
    # at once on top. Profiled (the same in repeated runs): apart 8.41 MiB, joint 13.04 MiB
    # (with model.lean_mlp; without it 9.21 and 15.96).
    assert peaks["apart"] < 0.75 * peaks["joint"], peaks
