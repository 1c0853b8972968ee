"""Issue 14's "done when", end to end through the `rlhflab` command: from a folder holding
my_rewards.py, with no PYTHONPATH, PPO and GRPO train with `my_rewards:score` and
`eval.correct: my_rewards:exact`, and eval/accuracy in metrics.jsonl is that function's.
Also: configs/ppo_sentiment.yaml runs with a classifier reward and the lexicon checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RLHFLAB = Path(sys.executable).with_name("rlhflab")

MY_REWARDS = '''
def score(prompt, response, example):
    return 1.0 if response.strip() == example["answer"] else 0.0

def exact(prompt, response, example):
    # deliberately not the reward: right when the response has an even number of characters,
    # so eval/accuracy can only be this function's
    return len(response.strip()) % 2 == 0
'''


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    cmd = [str(RLHFLAB) if RLHFLAB.exists() else shutil.which("rlhflab"), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def task_folder(tmp_path, tiny_model_dir) -> Path:
    folder = tmp_path / "my_task"
    (folder / "data").mkdir(parents=True)
    words = ["cat", "dog", "bird", "fish", "frog", "mole", "wolf", "lark", "newt", "crab", "yak", "owl"]
    for split, ws in (("train", words), ("test", words[:8])):
        (folder / "data" / f"{split}.jsonl").write_text(
            "".join(json.dumps({"word": w, "reversed": w[::-1]}) + "\n" for w in ws))
    (folder / "my_rewards.py").write_text(MY_REWARDS)
    common = (f"model: {{name_or_path: {tiny_model_dir}, reference: copy}}\n"
              "dataset:\n  path: data/train.jsonl\n  eval_path: data/test.jsonl\n  prompt_field: word\n"
              "  answer_field: reversed\n  prompt_template: \"Reverse: {prompt}\\nAnswer:\"\n  max_prompt_length: 32\n"
              "generation: {max_new_tokens: 6}\n"
              "reward:\n  sources: [{type: rule, name: my_rewards:score}]\n"
              "eval:\n  correct: my_rewards:exact\n"
              "training: {device: cpu, total_steps: 2, eval_interval: 1, save_interval: 0, num_threads: 1}\n"
              "logging: {progress_bar: false, plots: false}\n")
    (folder / "ppo.yaml").write_text(common + "ppo: {rollout_samples: 8, batch_size: 8, mini_batch_size: 4, "
                                              "epochs: 1, learning_rate: 1.0e-4}\n")
    (folder / "grpo.yaml").write_text(common + "grpo: {group_size: 2, prompts_per_step: 4, batch_size: 8, "
                                               "mini_batch_size: 4, learning_rate: 1.0e-4}\n")
    return folder


def _assert_accuracy_is_exacts(run_dir: Path) -> None:
    rows = [r for r in _rows(run_dir / "metrics.jsonl") if "eval/reward_mean" in r]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        samples = _rows(run_dir / "eval" / f"step_{row['step']}.jsonl")
        even = [len(s["response"].strip()) % 2 == 0 for s in samples]
        assert row["eval/accuracy"] == pytest.approx(sum(even) / len(even))


@pytest.mark.slow
def test_ppo_from_the_task_folder_without_pythonpath(task_folder, monkeypatch):
    done = _run(["ppo", "--config", "ppo.yaml", "training.output_dir=out_ppo"], task_folder)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "preflight: reward.sources[0] my_rewards:score on row 0 of data/train.jsonl" in done.stdout
    _assert_accuracy_is_exacts(task_folder / "out_ppo")
    # From another directory (in this process: my_rewards was never imported here), the
    # config still finds my_rewards.py next to itself.
    from rlhflab.cli import main

    elsewhere = task_folder.parent / "elsewhere"
    shutil.copytree(task_folder / "data", elsewhere / "data")  # data paths are relative to the cwd
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["ppo", "--config", str(task_folder / "ppo.yaml"), "training.output_dir=out_ppo",
                 "training.total_steps=1"]) == 0
    assert sys.modules["my_rewards"].__file__ == str(task_folder / "my_rewards.py")
    monkeypatch.delitem(sys.modules, "my_rewards")


@pytest.mark.slow
def test_grpo_from_the_task_folder_without_pythonpath(task_folder):
    done = _run(["grpo", "--config", "grpo.yaml", "training.output_dir=out_grpo"], task_folder)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "preflight: eval.correct my_rewards:exact" in done.stdout
    rows = _rows(task_folder / "out_grpo" / "metrics.jsonl")
    assert any("rollout/reward_mean" in r for r in rows)  # trained on the plug-in's reward
    _assert_accuracy_is_exacts(task_folder / "out_grpo")


@pytest.mark.slow
def test_the_sentiment_config_runs(tiny_model_dir, tmp_path):
    """configs/ppo_sentiment.yaml as shipped, pointed at tiny stand-ins: a classifier trained for
    a few steps, the untrained tiny model as the policy, one PPO step."""
    from rlhflab.data.reviews import write_reviews

    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPORunConfig
    from rlhflab.trainers.classifier import ClassifierRunConfig, train_classifier
    from rlhflab.trainers.ppo import train

    reviews = write_reviews(tmp_path / "reviews", n_prompts=64, n_test=8, n_labelled=64)
    clf_cfg, _ = load_config(ROOT / "configs" / "classifier_debug.yaml", ClassifierRunConfig, [
        f"model.name_or_path={tiny_model_dir}", f"data.path={reviews / 'labelled_train.jsonl'}",
        f"data.eval_path={reviews / 'labelled_test.jsonl'}", "classifier.max_steps=2",
        f"training.output_dir={tmp_path / 'clf'}"])
    clf = train_classifier(clf_cfg, quiet=True)
    cfg, _ = load_config(ROOT / "configs" / "ppo_sentiment.yaml", PPORunConfig, [
        f"model.name_or_path={tiny_model_dir}", f"dataset.path={reviews / 'prompts_train.jsonl'}",
        f"dataset.eval_path={reviews / 'prompts_test.jsonl'}",
        f"reward.sources=[{{type: classifier, path: {clf.final_dir}, label: POSITIVE, text: response}}]",
        "ppo.rollout_samples=8", "ppo.batch_size=8", "ppo.mini_batch_size=4", "generation.max_new_tokens=6",
        "training.total_steps=1", "training.eval_interval=1", f"training.output_dir={tmp_path / 'ppo'}",
        "logging.progress_bar=false", "logging.plots=false", "training.num_threads=1"])
    train(cfg, quiet=True)
    from rlhflab.data.reviews import is_positive, lexicon_score
    for row in [r for r in _rows(tmp_path / "ppo" / "metrics.jsonl") if "eval/reward_mean" in r]:
        samples = _rows(tmp_path / "ppo" / "eval" / f"step_{row['step']}.jsonl")
        assert row["eval/accuracy"] == pytest.approx(sum(is_positive("", s["response"], {}) for s in samples) / 8)
        assert row["eval/lexicon"] == pytest.approx(sum(lexicon_score("", s["response"], {}) for s in samples) / 8)
        assert 0 <= row["eval/reward_mean"] <= 1  # a probability


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_loads_with_its_commands_schema(config):
    """configs/<command>[_variant].yaml validates against `rlhflab <command>`'s schema."""
    import importlib

    from rlhflab.config import load_config
    from rlhflab.config.cli import SCHEMAS

    # the longest command whose name (with _ for -) starts the file name: dr_grpo_debug -> dr-grpo
    command = max((c for c in SCHEMAS if config.removesuffix(".yaml").startswith(c.replace("-", "_"))), key=len)
    module, _, attr = SCHEMAS[command].partition(":")
    load_config(ROOT / "configs" / config, getattr(importlib.import_module(module), attr))
