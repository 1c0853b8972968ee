"""The CPU-only settings (`rlhflab.cpu`, the `cpu:` section): on a CUDA-typed device nothing is
swapped and a CPU setting other than the default is refused; on a CPU they apply as `cpu.*`
asks. No GPU is needed: the seam decides from the device it is given, and the models stay on
the CPU."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from rlhflab import cpu
from rlhflab.config.loader import load_config
from rlhflab.cpu import matmul as cm
from rlhflab.errors import UserError
from rlhflab.models.actor_critic import ActorCritic, Critic, ValueHead, hidden_size_of

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def cpu_cfg(**kw):
    return types.SimpleNamespace(**{"matmul": "onednn", **kw})


@pytest.fixture(autouse=True)
def _model_dir(tiny_model_dir):
    global MODEL_DIR
    MODEL_DIR = tiny_model_dir


def tiny():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(MODEL_DIR))


def kinds(module: nn.Module) -> dict[str, int]:
    return {"linear": sum(type(m) is nn.Linear for m in module.modules()),
            "fast": sum(type(m) is cm.FastLinear for m in module.modules())}


@pytest.fixture(autouse=True)
def _restore_mode():
    mode = cpu._matmul
    yield
    cpu._matmul = mode


def actor_critic():
    policy, base = tiny(), tiny()
    return ActorCritic(policy, critic=Critic(base, ValueHead(hidden_size_of(base))))


def test_a_cuda_device_swaps_no_module_and_refuses_a_cpu_setting(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu, "map_large_allocations", lambda device: calls.append(device.type))
    assert cpu.setup_process(CUDA, cpu_cfg(matmul="auto")) == "torch"       # the plain library path
    with pytest.raises(UserError, match=r"^cpu\.matmul: onednn is a CPU setting and this run trains on cuda; "
                                        r"remove cpu\.matmul"):
        cpu.setup_process(CUDA, cpu_cfg())
    assert calls == []                                                       # glibc left as it is
    model = tiny()
    before = kinds(model)
    assert cpu.apply(model, None, CUDA) == cpu.NOTHING
    assert kinds(model) == before and before["fast"] == 0


def test_a_gpu_run_leaves_glibc_alone_and_a_cpu_run_releases_large_blocks(monkeypatch):
    assert not cpu.map_large_allocations(CUDA)            # a device other than the CPU: nothing
    calls = []
    monkeypatch.setattr(cpu, "map_large_allocations", lambda device: calls.append(device.type))
    cpu.setup_process(CPU, cpu_cfg(matmul="torch"))
    assert calls == ["cpu"]


def test_a_cpu_device_switches_the_linears_where_onednn_was_chosen():
    if not cm.ops_matmul.onednn_available():
        pytest.skip("this torch build has no oneDNN linear op")
    assert cpu.setup_process(CPU, cpu_cfg()) == "onednn"
    model = tiny()
    n_linear = kinds(model)["linear"]
    applied = cpu.apply(model, None, CPU)
    after = kinds(model)
    assert applied.linears == n_linear == after["fast"] and after["linear"] == 0
    actor = actor_critic()                                  # value heads keep nn.Linear
    cpu.apply(actor, None, CPU)
    assert all(type(m) is nn.Linear for m in actor.critic.value_head.modules() if isinstance(m, nn.Linear))


def test_torch_matmul_switches_nothing():
    cpu.setup_process(CPU, cpu_cfg(matmul="torch"))
    model = tiny()
    assert cpu.apply(model, None, CPU) == cpu.NOTHING and kinds(model)["fast"] == 0


def test_the_old_key_is_read_as_cpu_matmul_and_the_removed_ones_are_named(capsys):
    from rlhflab.trainers.ppo import PPORunConfig

    cfg, _ = load_config(None, PPORunConfig, ["model.cpu_matmul=torch"])
    assert cfg.cpu.matmul == "torch"
    assert "model.cpu_matmul is read as cpu.matmul" in capsys.readouterr().err
    for key in ("model.lean_norm", "model.cpu_allocator", "model.critic_overlap", "generation.fast_draw"):
        with pytest.raises(UserError, match=rf"{key}: removed \(it saved under 10% of a step"):
            load_config(None, PPORunConfig, [f"{key}=true"])
