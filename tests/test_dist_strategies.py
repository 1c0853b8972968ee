"""What the sharded strategies refuse, and the checkpoint pieces they use, in one process.

The strategies themselves run in tests/test_distributed.py (2 processes each); these are
the one-line errors and the state-dict helpers, checked without launching anything.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from rlhflab.engine.dist import Dist, _fully_shard, check_fsdp_on_cpu, check_strategy
from rlhflab.errors import UserError
from rlhflab.models.checkpoint import STATE_FILE, check_resume, state_part, untied


def _dist(kind: str, zero_stage: int = 0, fsdp_here: bool = False) -> Dist:
    """A 2-process Dist whose accelerator only says its strategy (nothing is launched)."""
    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage))
    acc = SimpleNamespace(distributed_type=f"DistributedType.{kind}", state=state)
    return Dist(rank=0, world_size=2, local_world_size=2, accelerator=acc, fsdp_here=fsdp_here)


def test_fsdp_on_a_cpu_needs_fsdp2_and_no_offload(monkeypatch):
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(UserError, match="fsdp_config.fsdp_version: .*set fsdp_version: 2"):
        check_fsdp_on_cpu()
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    with pytest.raises(UserError, match="fsdp_offload_params: .*set it to false"):
        check_fsdp_on_cpu()
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "false")
    check_fsdp_on_cpu()  # FSDP2 without offload: accepted


def test_fsdp_refuses_a_module_without_decoder_layers_before_sharding_anything():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(UserError, match="no transformers model whose decoder layers.*cpu_2proc.yaml"):
        _fully_shard(module, world_size=2, reshard_after_forward=True)
    assert type(module[0].weight) is torch.nn.Parameter  # untouched: no process group was needed


def test_each_strategy_refuses_what_it_cannot_run():
    fsdp, zero2, zero3 = _dist("MULTI_CPU", fsdp_here=True), _dist("DEEPSPEED", 2), _dist("DEEPSPEED", 3)
    assert (fsdp.strategy, zero2.strategy, zero3.strategy) == ("fsdp", "deepspeed", "deepspeed")
    assert (fsdp.lockstep, zero2.lockstep, zero3.lockstep) == (True, False, True)
    with pytest.raises(UserError, match="generation.backend=vllm under FSDP"):
        check_strategy(fsdp, lora=False, method="grpo", backend="vllm")
    with pytest.raises(UserError, match=r"dpo \(its evaluation runs on rank 0 alone\) under ZeRO-3"):
        check_strategy(zero3, lora=False, method="dpo", rl=False)
    with pytest.raises(UserError, match="lora.enabled under ZeRO-3"):
        check_strategy(zero3, lora=True, method="ppo")
    with pytest.raises(UserError, match="trpo: the teaching TRPO runs in one process"):
        check_strategy(_dist("MULTI_CPU"), lora=False, method="trpo")
    # What each does run passes: LoRA under FSDP, SFT under ZeRO-2, anything in one process.
    check_strategy(fsdp, lora=True, method="sft", rl=False)
    check_strategy(zero2, lora=True, method="dpo", rl=False)
    check_strategy(zero3, lora=False, method="ppo")
    check_strategy(Dist(), lora=True, method="trpo", backend="vllm", rl=False)


def test_a_gathered_state_dict_is_split_by_prefix_and_loses_its_tied_copy():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    # A gathered state dict holds a tensor under each name, the tied head included.
    full = {f"policy.{k}": v.clone() for k, v in model.named_parameters(remove_duplicate=False)}
    full["value_head.summary.weight"] = torch.zeros(1, 16)
    policy = state_part(full, "policy.")
    assert "value_head.summary.weight" not in policy and "lm_head.weight" in policy
    kept = untied(model, policy)
    assert "lm_head.weight" not in kept and "model.embed_tokens.weight" in kept
    assert len(kept) == len(policy) - 1
    assert state_part(full, "value_head.") == {"summary.weight": full["value_head.summary.weight"]}
    assert state_part(None, "policy.") is None


@pytest.mark.parametrize("saved, now, message", [
    ({"fsdp": True}, {"fsdp": False, "deepspeed": False}, "saved under an FSDP accelerate config and this run is not"),
    ({"deepspeed": True}, {"fsdp": False, "deepspeed": False}, "saved under a DeepSpeed accelerate config"),
    ({}, {"fsdp": True, "deepspeed": False}, "saved without an FSDP accelerate config and this run is under"),
    ({"fsdp": False}, {"fsdp": False, "deepspeed": True}, "saved without a DeepSpeed accelerate config"),
])
def test_a_checkpoint_resumes_only_under_the_strategy_that_saved_it(tiny_model_dir, tmp_path, saved, now, message):
    folder = tmp_path / "step_2"
    shutil.copytree(tiny_model_dir, folder)
    layout = {"method": "ppo", "lora": False, "critic": "none", "world_size": 2, **saved}
    torch.save({"step": 2, "optimizer": {}, "rng": {}, "layout": layout}, folder / STATE_FILE)
    with pytest.raises(UserError, match=message):
        check_resume(folder, method="ppo", lora=False, critic="none", world_size=2, **now)
    check_resume(folder, method="ppo", lora=False, critic="none", world_size=2,
                 fsdp=bool(saved.get("fsdp")), deepspeed=bool(saved.get("deepspeed")))  # the same: accepted


def test_a_deepspeed_config_without_deepspeed_is_one_line_before_anything_starts(monkeypatch):
    import importlib.util

    from rlhflab.engine import dist as dist_module

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    import accelerate

    def started(*args, **kwargs):
        raise AssertionError("accelerate was started before the DeepSpeed check")

    monkeypatch.setattr(accelerate, "Accelerator", started)  # refused before accelerate sets anything up
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(UserError, match=r"DeepSpeed is not installed; pip install -e '\.\[deepspeed\]'"):
        dist_module.init_dist("cpu")


def test_the_merged_weights_of_a_gathered_lora_state_are_what_peft_merges():
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhflab.models.checkpoint import merged_lora_state

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
    policy = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # B starts at zero: give the adapter something to merge
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_()
    merged = merged_lora_state(policy, dict(policy.state_dict()))
    reference = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    assert max(float((merged[k] - reference[k]).abs().max()) for k in reference) < 1e-6
    q = "model.layers.0.self_attn.q_proj.weight"
    assert float((merged[q] - policy.get_base_model().state_dict()[q.replace(".weight", ".base_layer.weight")])
                 .abs().max()) > 1e-3  # the adapter did change the weight


# A process that writes a line without a newline (block-buffered on a pipe), registers an
# exit handler, keeps a module-level object whose __del__ speaks at the interpreter's
# teardown, and ends through `leave(3)`; as a rank (a real one-process gloo group) or not.
_LEAVE = """
import atexit, os, sys, torch, torch.distributed as td
from rlhflab.engine import dist
class Teardown:
    def __del__(self, write=os.write):  # module globals are gone by then
        write(2, b"teardown\\n")
keep = Teardown()
atexit.register(lambda: print("handler, group alive:", td.is_initialized(), file=sys.stderr))
if sys.argv[1] == "rank":  # WORLD_SIZE=2 in its environment says so (nothing waits on a rank 1)
    td.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    atexit.register(dist._close_process_group)  # as init_dist does
    atexit.register(lambda: td.all_reduce(torch.ones(1)))  # runs first (LIFO): the group still works
sys.stdout.write("unflushed")
dist.leave(3)
"""


@pytest.mark.parametrize("as_rank", [False, True])
def test_leave_exits_with_the_code_after_the_exit_handlers_and_a_rank_skips_the_teardown(tmp_path, as_rank):
    import os
    import subprocess
    import sys

    env = {**os.environ, "WORLD_SIZE": "2" if as_rank else "1"}
    out = subprocess.run([sys.executable, "-c", _LEAVE, "rank" if as_rank else "alone", str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 3, out.stderr
    assert out.stdout == "unflushed"  # buffered output reaches the pipe either way
    # The exit handlers run either way; a rank's process group is destroyed by then (the
    # handler registered before the group sees it gone), and only the plain exit reaches
    # the interpreter's teardown.
    assert "handler, group alive: False" in out.stderr
    assert ("teardown" in out.stderr) is (not as_rank), out.stderr
