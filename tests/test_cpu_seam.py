"""The CPU-only speed seam (`rlhflab.cpu`): on a CUDA-typed device nothing is swapped and no
thread is started; on a CPU the tricks apply as model.* asks. No GPU is needed: the seam
decides from the device it is given, and the models stay on the CPU."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from rlhflab import cpu
from rlhflab.engine import overlap
from rlhflab.models import cpu_matmul as cm
from rlhflab.models.actor_critic import ActorCritic, Critic, ValueHead, hidden_size_of

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def model_cfg(**kw):
    base = dict(cpu_matmul="onednn", lean_norm=True, lean_mlp=False, critic_overlap=True)
    return types.SimpleNamespace(**{**base, **kw})


@pytest.fixture(autouse=True)
def _model_dir(tiny_model_dir):
    global MODEL_DIR
    MODEL_DIR = tiny_model_dir


def tiny():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(MODEL_DIR))


def kinds(module: nn.Module) -> dict[str, int]:
    linear = sum(type(m) is nn.Linear for m in module.modules())
    fast = sum(type(m) is cm.FastLinear for m in module.modules())
    lean = sum("forward" in vars(m) for m in module.modules())  # the lean norm is an instance forward
    return {"linear": linear, "fast": fast, "lean": lean}


@pytest.fixture(autouse=True)
def _restore_mode():
    mode = cpu._matmul
    yield
    cpu._matmul = mode


def actor_critic():
    policy, base = tiny(), tiny()
    return ActorCritic(policy, critic=Critic(base, ValueHead(hidden_size_of(base))))


def test_a_cuda_device_swaps_no_module_and_starts_no_thread(monkeypatch):
    monkeypatch.setattr(overlap, "_worker", None)
    assert cpu.setup_process(CUDA, model_cfg()) == "torch"       # the plain library path
    model = tiny()
    before = kinds(model)
    assert cpu.apply(model, model_cfg(), CUDA) == cpu.NOTHING
    assert kinds(model) == before and before["fast"] == 0 and before["lean"] == 0
    actor = actor_critic()
    assert cpu.apply(actor, model_cfg(), CUDA) == cpu.NOTHING
    assert actor.critic_overlap is False                         # the critic's pass stays in this thread
    assert overlap._worker is None                               # no worker thread was made
    assert not cpu.map_large_allocations(CUDA)
    assert not cpu.reuse_freed_blocks(CUDA)


@pytest.mark.parametrize("allocator", ["release", "reuse"])
def test_the_allocator_setting_is_made_on_a_cpu_run_only(monkeypatch, allocator):
    calls = []
    monkeypatch.setattr(cpu, "map_large_allocations", lambda device: calls.append(("release", device.type)))
    monkeypatch.setattr(cpu, "reuse_freed_blocks", lambda device: calls.append(("reuse", device.type)))
    cpu.setup_process(CUDA, model_cfg(cpu_allocator=allocator))
    assert calls == []                                           # a GPU run leaves glibc as it is
    cpu.setup_process(CPU, model_cfg(cpu_allocator=allocator))
    assert calls == [(allocator, "cpu")]


def test_an_unknown_allocator_name_is_refused_by_name():
    with pytest.raises(ValueError, match="cpu_allocator 'keep': choose reuse or release"):
        cpu.set_allocator("keep", CPU)


def test_a_cpu_device_applies_the_tricks_as_configured():
    if not cm.ops_matmul.onednn_available():
        pytest.skip("this torch build has no oneDNN linear op")
    assert cpu.setup_process(CPU, model_cfg()) == "onednn"
    model = tiny()
    n_linear = kinds(model)["linear"]
    applied = cpu.apply(model, model_cfg(), CPU)
    after = kinds(model)
    assert applied.linears == n_linear == after["fast"] and after["linear"] == 0
    # A llama tiny model: two RMSNorms per layer and the final one.
    n_layers = model.config.num_hidden_layers
    assert applied.norms == after["lean"] == 2 * n_layers + 1
    # A separate critic: its pass goes to the worker thread; value heads keep nn.Linear.
    actor = actor_critic()
    got = cpu.apply(actor, model_cfg(), CPU)
    assert got.critic_overlap and actor.critic_overlap
    assert all(type(m) is nn.Linear for m in actor.critic.value_head.modules() if isinstance(m, nn.Linear))


def test_each_trick_follows_its_knob():
    cpu.setup_process(CPU, model_cfg(cpu_matmul="torch"))
    model = tiny()
    applied = cpu.apply(model, model_cfg(cpu_matmul="torch", lean_norm=False), CPU)
    assert applied == cpu.NOTHING and kinds(model)["fast"] == 0 and kinds(model)["lean"] == 0
    actor = actor_critic()
    assert not cpu.apply(actor, model_cfg(critic_overlap=False), CPU).critic_overlap
    frozen = tiny()
    assert cpu.apply(frozen, model_cfg(), CPU, trained=False).norms == 0   # a reference: linears only
