"""Other tools' knob names (TRL, verl, OpenRLHF), each run through the loader: the hint
names rlhflab's key, or says why there is none; and the model-path hints point the right way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhflab.config import load_config
from rlhflab.errors import ConfigError, UserError

CASES = [
    # (override, the hint's words)
    ("grpo.scale_rewards=none", "did you mean grpo.advantage_scale?"),
    ("grpo.max_completion_length=64", "did you mean generation.max_new_tokens?"),
    ("grpo.num_iterations=2", "did you mean grpo.epochs?"),
    ("grpo.epsilon=0.2", "did you mean grpo.clip_eps?"),
    ("grpo.epsilon_high=0.28", "did you mean grpo.clip_eps_high?"),
    ("grpo.loss_type=dapo", "did you mean grpo.loss_aggregation?"),
    ("grpo.temperature=0.7", "did you mean generation.temperature?"),
    ("grpo.num_train_epochs=1", "did you mean training.total_steps?"),
    ("training.num_train_epochs=1", "did you mean training.total_steps?"),
    ("training.fp16=true", "did you mean training.mixed_precision?"),
    ("fp16=true", "did you mean training.mixed_precision?"),
    ("dataset.dataset_name=openai/gsm8k", "did you mean dataset.name?"),
    ("dataset_name=openai/gsm8k", "did you mean dataset.name?"),
    ("generation.do_sample=true", "do_sample (another tool's name) has no rlhflab key: rollouts always sample"),
    ("grpo.per_device_train_batch_size=4", "did you mean grpo.mini_batch_size?"),
    ("grpo.n_samples_per_prompt=4", "did you mean grpo.group_size?"),
    ("grpo.num_generations=4", "did you mean grpo.group_size?"),
    ("grpo.kl_loss_coef=0.001", "did you mean grpo.kl_coeff?"),
    ("grpo.kl_loss_type=low_var_kl", "did you mean grpo.kl_estimator?"),
    ("grpo.use_kl_loss=true", "use_kl_loss (another tool's name) has no rlhflab key"),
    ("grpo.eps_clip=0.2", "did you mean grpo.clip_eps?"),
    ("grpo.train_batch_size=8", "did you mean grpo.prompts_per_step?"),
]


@pytest.mark.parametrize("override, hint", CASES)
def test_a_trl_verl_or_openrlhf_name_gets_the_right_hint(override, hint):
    from rlhflab.trainers.grpo import GRPORunConfig

    with pytest.raises(ConfigError) as info:
        load_config(None, GRPORunConfig, [override])
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and f"{override.split('=')[0]}: unknown key; {hint}" in msg, msg
    # never the near-spelling guesses they used to get
    assert "ptx_batch_size" not in msg and "share_prompt" not in msg


@pytest.mark.parametrize("module, cls, override, hint", [
    ("rlhflab.trainers.rloo", "RLOORunConfig", "rloo.n_samples_per_prompt=4", "did you mean rloo.k?"),
    ("rlhflab.trainers.rloo", "RLOORunConfig", "rloo.scale_rewards=false", "did you mean rloo.normalize_advantages?"),
    ("rlhflab.trainers.ppo", "PPORunConfig", "ppo.n_samples_per_prompt=4", "PPO samples one response per prompt"),
    ("rlhflab.trainers.dpo", "DPORunConfig", "dpo.loss_type=ipo", "did you mean dpo.loss_kind?"),
    ("rlhflab.trainers.dpo", "DPORunConfig", "dpo.num_train_epochs=1", "did you mean dpo.epochs?"),
    ("rlhflab.trainers.dpo", "DPORunConfig", "dpo.per_device_train_batch_size=4", "did you mean dpo.mini_batch_size?"),
    ("rlhflab.trainers.sft", "SFTRunConfig", "sft.per_device_train_batch_size=4", "did you mean sft.batch_size?"),
])
def test_the_hint_follows_the_section(module, cls, override, hint):
    import importlib

    with pytest.raises(ConfigError) as info:
        load_config(None, getattr(importlib.import_module(module), cls), [override])
    assert hint in str(info.value), str(info.value)


def test_a_run_folder_given_as_the_model_is_pointed_at_its_final(tiny_model_dir, tmp_path):
    import shutil

    from rlhflab.models.load import load_model

    run = tmp_path / "grpo"
    shutil.copytree(tiny_model_dir, run / "final")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(UserError) as info:
        load_model(str(run))
    assert f"did you mean {run / 'final'}?" in str(info.value) and "make-tiny" not in str(info.value)


def test_missing_paths_and_offline_hub_names_point_at_fetch_model(tmp_path, monkeypatch):
    from rlhflab.models import load as modelload

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(modelload, "hub_reachable", lambda *a, **k: False)
    monkeypatch.setattr(modelload, "_in_hub_cache", lambda name: False)
    with pytest.raises(UserError) as info:
        modelload.check_model_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    msg = str(info.value)
    assert "hub cannot be reached" in msg and "`rlhflab fetch-model smollm2`" in msg and "make-tiny" not in msg
    with pytest.raises(UserError) as info:
        modelload.check_model_source(str(tmp_path / "models" / "my-model"))
    msg = str(info.value)
    assert "`rlhflab fetch-model smollm2`" in msg and "`rlhflab import-gguf FILE.gguf --out DIR`" in msg
    assert "make-tiny" not in msg


def test_make_tiny_refuses_a_folder_that_holds_other_files(tmp_path, capsys):
    from rlhflab import cli

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    small = ["--hidden-size", "16", "--layers", "1", "--heads", "2"]
    assert cli.main(["make-tiny", "--out", str(run), *small]) == 2
    err = capsys.readouterr().err
    assert f"--out {run} is not empty (it holds metrics.jsonl)" in err and err.count("\n") == 1
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]  # nothing written
    # A folder holding only an earlier tiny model is rebuilt in place, as before.
    assert cli.main(["make-tiny", "--out", str(tmp_path / "tiny"), *small]) == 0
    assert cli.main(["make-tiny", "--out", str(tmp_path / "tiny"), *small]) == 0
