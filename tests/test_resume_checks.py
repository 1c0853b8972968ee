"""Resume checks the checkpoint before touching anything: the trainer state loads, the
files the config needs are there, and the recorded method / LoRA / critic layout / world
size match the config; each mismatch names the setting and how to proceed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlhflab import cli
from rlhflab.errors import UserError
from rlhflab.models.actor_critic import PolicyOnly
from rlhflab.models.checkpoint import (STATE_FILE, check_resume, latest_checkpoint, recorded_layout,
                                       save_checkpoint)
from rlhflab.trainers import ppo
from rlhflab.trainers.common import make_optimizer


@pytest.fixture
def ppo_run(ppo_cfg, tmp_path):
    """A run folder with two PPO checkpoints (value head, no LoRA), step_1/ and step_2/."""
    models = ppo.build_models(ppo_cfg())
    opt = make_optimizer(models.actor.trainable_parameters(), 1e-3)
    run = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(run / f"step_{step}", models.actor, models.tokenizer, optimizer=opt, step=step,
                        method="ppo")
    return run


def test_a_matching_checkpoint_passes(ppo_run):
    check_resume(ppo_run / "step_2", method="ppo", lora=False, critic="value_head", world_size=1)
    assert latest_checkpoint(ppo_run) == ppo_run / "step_2"


def test_truncated_trainer_state_names_the_file_and_an_earlier_checkpoint(ppo_run):
    state = ppo_run / "step_2" / STATE_FILE
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a save cut in half
    with pytest.raises(UserError) as err:
        check_resume(ppo_run / "step_2", method="ppo", lora=False, critic="value_head")
    msg = str(err.value)
    assert f"{STATE_FILE} cannot be read" in msg and "truncated or corrupt" in msg
    assert f"--resume {ppo_run / 'step_1'}" in msg and "\n" not in msg


def test_missing_value_head_is_named(ppo_run):
    (ppo_run / "step_2" / "value_head.safetensors").unlink()
    with pytest.raises(UserError, match=r"value_head.safetensors \(the value head\) missing"):
        check_resume(ppo_run / "step_2", method="ppo", lora=False, critic="value_head")


def test_lora_switched_on_at_resume_names_the_setting(ppo_run):
    with pytest.raises(UserError) as err:
        check_resume(ppo_run / "step_2", method="ppo", lora=True, critic="value_head")
    msg = str(err.value)
    assert "lora.enabled=false but the config says lora.enabled=true" in msg
    assert "set lora.enabled=false to resume" in msg and "model.name_or_path=" in msg


def test_ppo_checkpoint_resumed_by_grpo(ppo_run):
    with pytest.raises(UserError) as err:
        check_resume(ppo_run / "step_2", method="grpo", lora=False, critic="none")
    msg = str(err.value)
    assert "this is a ppo checkpoint and `rlhflab grpo` cannot continue it" in msg
    assert f"rlhflab ppo --resume {ppo_run / 'step_2'}" in msg


def test_old_checkpoint_without_a_recorded_layout_is_read_off_its_files(ppo_run):
    # A checkpoint saved before the layout was recorded: no method, LoRA or critic in it.
    folder = ppo_run / "step_2"
    state = torch.load(folder / STATE_FILE, weights_only=False)
    del state["layout"]
    torch.save(state, folder / STATE_FILE)
    (folder / "rlhflab.json").write_text(json.dumps({"step": 2}))
    assert recorded_layout(folder, state) == {"lora": False, "critic": "value_head"}
    check_resume(folder, method="ppo", lora=False, critic="value_head", world_size=2)  # nothing to compare
    with pytest.raises(UserError, match="holds a value head on the shared base.*needs no critic"):
        check_resume(folder, method="grpo", lora=False, critic="none")
    with pytest.raises(UserError, match="set model.critic=value_head to resume"):
        check_resume(folder, method="ppo", lora=False, critic="separate")


def test_world_size_and_separate_critic_files(ppo_run, ppo_cfg, tmp_path):
    with pytest.raises(UserError, match="saved by a run of 1 processes and this run has 4"):
        check_resume(ppo_run / "step_2", method="ppo", lora=False, critic="value_head", world_size=4)
    models = ppo.build_models(ppo_cfg("model.critic=separate"))
    opt = make_optimizer(models.actor.trainable_parameters(), 1e-3)
    folder = save_checkpoint(tmp_path / "sep" / "step_1", models.actor, models.tokenizer, optimizer=opt,
                             step=1, method="ppo")
    check_resume(folder, method="ppo", lora=False, critic="separate")
    shutil.rmtree(folder / "critic")
    with pytest.raises(UserError, match=r"critic/ \(the separate critic model\).*missing"):
        check_resume(folder, method="ppo", lora=False, critic="separate")


def test_critic_free_checkpoint_records_none(ppo_cfg, tmp_path):
    models = ppo.build_models(ppo_cfg())
    actor = PolicyOnly(models.actor.policy)
    opt = make_optimizer(actor.trainable_parameters(), 1e-3)
    folder = save_checkpoint(tmp_path / "step_1", actor, models.tokenizer, optimizer=opt, step=1, method="grpo")
    assert json.loads((folder / "rlhflab.json").read_text())["critic"] == "none"
    check_resume(folder, method="grpo", lora=False, critic="none")
    with pytest.raises(UserError, match="this is a grpo checkpoint and `rlhflab rloo` cannot"):
        check_resume(folder, method="rloo", lora=False, critic="none")


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_dpo_resume_checks_before_touching_the_run(tiny_model_dir, arith_dir, tmp_path, capsys):
    from rlhflab.data.preferences import write_off_by_one_pairs

    task = tmp_path / "task"
    shutil.copytree(arith_dir, task)
    write_off_by_one_pairs(task)
    out = tmp_path / "dpo"
    args = ["dpo", "--config", "configs/dpo_debug.yaml", f"model.name_or_path={tiny_model_dir}",
            f"dataset.path={task / 'pairs_train.jsonl'}", f"dataset.eval_path={task / 'pairs_test.jsonl'}",
            f"training.output_dir={out}", "dataset.num_samples=8", "dataset.num_eval_samples=4",
            "dpo.batch_size=4", "dpo.mini_batch_size=4", "dpo.max_steps=2", "training.save_interval=1",
            "training.eval_interval=0", "logging.progress_bar=false", "logging.plots=false",
            "training.num_threads=1"]
    assert cli.main(args) == 0, capsys.readouterr().err
    capsys.readouterr()
    before = _tree(out)
    # LoRA switched on at resume: refused, naming the setting, before anything is written.
    rc = cli.main(["dpo", "--resume", str(out / "step_1"), *args[1:], "lora.enabled=true",
                   "model.reference=lora_disabled"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and "lora.enabled=false but the config says lora.enabled=true" in err
    assert _tree(out) == before
    # A truncated trainer state: refused, naming it, before anything is written.
    state = out / "step_1" / STATE_FILE
    state.write_bytes(state.read_bytes()[:100])
    before = _tree(out)
    rc = cli.main(["dpo", "--resume", str(out / "step_1"), *args[1:]])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and "truncated or corrupt" in err and "Traceback" not in err
    assert _tree(out) == before


@pytest.mark.slow
def test_mismatched_resumes_from_the_command_line_touch_nothing(tiny_model_dir, arith_dir, tmp_path, capsys):
    """A PPO checkpoint resumed by grpo, or with LoRA switched on: one line each, exit 2,
    and the run folder is byte-identical afterwards."""
    from rlhflab import cli

    out = tmp_path / "run"
    common = [f"model.name_or_path={tiny_model_dir}", f"dataset.path={arith_dir / 'train.jsonl'}",
              f"dataset.eval_path={arith_dir / 'test.jsonl'}", f"training.output_dir={out}",
              "generation.max_new_tokens=6", "training.eval_interval=0", "logging.progress_bar=false",
              "logging.plots=false", "training.num_threads=1"]
    assert cli.main(["ppo", "--config", "configs/ppo_debug.yaml", *common, "training.total_steps=2",
                     "training.save_interval=1", "ppo.rollout_samples=8", "ppo.batch_size=8",
                     "ppo.mini_batch_size=4"]) == 0
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    capsys.readouterr()
    for argv, says in (
            (["grpo", "--config", "configs/grpo_debug.yaml", *common], "this is a ppo checkpoint"),
            (["ppo", "--config", "configs/ppo_debug.yaml", *common, "lora.enabled=true",
              "model.reference=lora_disabled"], "lora.enabled=false")):
        assert cli.main([*argv, "--resume", str(out / "step_1")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err
    after = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert after == before
