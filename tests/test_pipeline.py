"""The pipeline of issue 4 on a tiny model: SFT -> reward model -> PPO on the reward model,
and the documented command sequence (scripts/pipeline_debug.sh) through the CLI.

Two SFT runs from the same tiny model, shared by the tests of this module:
- the policy imitates sloppy demonstrations (60% of answers off by one);
- the judge, the reward model's base, reads the worked solutions. A reward model based
  on the sloppy policy reached only 0.60 held-out accuracy on the same pairs (0.90 from
  the judge), and pairs whose wrong answers were mostly too large taught it "smaller is
  better", which PPO exploited at once (answers drifted to 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (the fixtures load models)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, Path]:
    from rlhflab.data import arith
    from rlhflab.data import preferences as prefdata

    out = tmp_path_factory.mktemp("task")
    paths = arith.write_task(out / "arith", n_train=600, n_test=100, seed=0)  # sft.jsonl: 60% off by one
    prefs = prefdata.write_arith_pairs(out / "prefs", n_train=1200, n_test=200, seed=0)
    return {**paths, "prefs_train": prefs["train"], "prefs_test": prefs["test"]}


def _sft(out: Path, base: Path, data: Path, task: dict) -> Path:
    from rlhflab.config import load_config
    from rlhflab.trainers.sft import SFTRunConfig, train_sft

    cfg, _ = load_config(CONFIGS / "sft_debug.yaml", SFTRunConfig, [
        f"model.name_or_path={base}", f"data.path={data}", f"data.eval_path={task['test']}",
        f"training.output_dir={out}", "training.num_threads=1", "logging.progress_bar=false", "logging.plots=false",
        "sft.epochs=10", "sft.batch_size=8", "sft.learning_rate=2e-3", "sft.eval_before=false",
        "sft.num_eval_generate=0"])
    return train_sft(cfg, quiet=True).final_dir


@pytest.fixture(scope="module")
def policy_run(tmp_path_factory, tiny_sft_rm_dir, task):
    """The policy's SFT, started in a process of its own (this module as a script, one
    thread), so that it runs beside the judge's SFT and the reward model on CI's other core
    (about 10 s against 30 s). `policy` waits for it."""
    out = tmp_path_factory.mktemp("policy")
    spec = out / "task.json"
    spec.write_text(json.dumps({k: str(v) for k, v in task.items()}))
    with (out / "log.txt").open("w") as log:
        proc = subprocess.Popen([sys.executable, __file__, str(out / "run"), str(tiny_sft_rm_dir), str(spec)],
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT)
    yield proc, out
    if proc.poll() is None:  # the tests that needed it did not run
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def policy(policy_run) -> Path:
    """SFT on the sloppy demonstrations (60% off by one): right about a third of the time."""
    proc, out = policy_run
    assert proc.wait(timeout=1200) == 0, (out / "log.txt").read_text()[-3000:]
    return Path((out / "final_dir.txt").read_text())


@pytest.fixture(scope="module")
def judge(tmp_path_factory, tiny_sft_rm_dir, task, policy_run) -> Path:
    """SFT on the worked solutions: the reward model's base (a judge that has seen arithmetic).
    The policy's SFT goes on beside it (`policy_run`)."""
    return _sft(tmp_path_factory.mktemp("judge"), tiny_sft_rm_dir, task["train"], task)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, task, judge):
    from rlhflab.config import load_config
    from rlhflab.trainers.rm import RMRunConfig, train_rm

    out = tmp_path_factory.mktemp("rm")
    cfg, _ = load_config(CONFIGS / "rm_debug.yaml", RMRunConfig, [
        f"model.name_or_path={judge}", f"data.path={task['prefs_train']}",
        f"data.eval_path={task['prefs_test']}", f"training.output_dir={out}", "training.num_threads=1",
        "logging.progress_bar=false", "logging.plots=false", "rm.epochs=8", "rm.learning_rate=3e-4",
        "training.eval_interval=0"])
    return train_rm(cfg, quiet=True)


def test_reward_model_reaches_heldout_accuracy_well_above_chance(reward_model):
    before, after = reward_model.eval_before, reward_model.eval_after
    print(f"reward model held-out accuracy {before['eval/accuracy']:.3f} -> {after['eval/accuracy']:.3f}, "
          f"gap {after['eval/score_gap']:.3f}")
    # Chance is 0.5. Measured on a 2-core AMD EPYC without AVX-512 (about 55 s), this
    # suite's judge: 0.80-0.835 over seeds 0-3 with torch's matmul, 0.85 with oneDNN's
    # (seed 0). At learning rate 6e-4 the same runs spread over 0.69-0.855 (seed 0: 0.69
    # here, 0.78 on an AVX-512 EPYC, 0.895 on an Intel Xeon): eight epochs of a tiny model
    # carry float32 rounding into the trajectory, and the larger step made it swing.
    assert before["eval/accuracy"] < 0.65
    assert after["eval/accuracy"] >= 0.75 and after["eval/score_gap"] > 0.5
    meta = json.loads((reward_model.final_dir / "rlhflab_rm.json").read_text())
    assert meta["score_std"] > 0 and meta["append_eos"] is True


def test_saved_reward_model_is_a_reward_source(task, reward_model):
    from rlhflab.config.schema import RewardSource
    from rlhflab.rewards import build_source

    scorer = build_source(RewardSource(type="model", path=str(reward_model.final_dir)))
    rows = [json.loads(line) for line in task["prefs_test"].read_text().splitlines()][:64]
    # The file holds raw questions; PPO hands the reward model its rendered prompts (rm_debug's template).
    from rlhflab.data.preferences import ARITH_TEMPLATE

    prompts = [ARITH_TEMPLATE.replace("{prompt}", r["prompt"]) for r in rows]
    chosen = scorer.score(prompts, [r["chosen"] for r in rows], [{}] * 64)
    rejected = scorer.score(prompts, [r["rejected"] for r in rows], [{}] * 64)
    assert chosen.dtype == torch.float32 and chosen.shape == (64,)
    assert (chosen > rejected).float().mean() >= 0.7
    # normalize: shifted and scaled by the held-out stats saved at the end of training.
    meta = json.loads((reward_model.final_dir / "rlhflab_rm.json").read_text())
    norm = build_source(RewardSource(type="model", path=str(reward_model.final_dir), normalize=True))
    assert torch.allclose(norm.score(prompts, [r["chosen"] for r in rows], [{}] * 64),
                          (chosen - meta["score_mean"]) / meta["score_std"], atol=1e-5)


def test_ppo_on_the_reward_model_raises_its_score_and_keeps_the_accuracy(tmp_path, task, policy, reward_model):
    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPORunConfig
    from rlhflab.trainers.ppo import train

    cfg, _ = load_config(CONFIGS / "ppo_rm_debug.yaml", PPORunConfig, [
        f"model.name_or_path={policy}", f"dataset.path={task['train']}", f"dataset.eval_path={task['test']}",
        f"reward.sources=[{{type: model, path: {reward_model.final_dir}, normalize: true}}]",
        f"training.output_dir={tmp_path / 'ppo'}", "training.num_threads=1", "logging.progress_bar=false",
        "logging.plots=false", "dataset.num_eval_samples=100", "training.total_steps=30", "training.eval_interval=30"])
    res = train(cfg, quiet=True)
    before, after = res.eval_before, res.eval_after
    print(f"PPO on the reward model: RM score {before['eval/reward_mean']:.3f} -> {after['eval/reward_mean']:.3f}; "
          f"true accuracy {before['eval/accuracy']:.3f} -> {after['eval/accuracy']:.3f}")
    # Measured on a 2-core AMD EPYC (30 steps, about 40 s, this suite's policy and reward
    # model): RM score +0.23 to +0.39 over the config's seed and seeds 0-2. The checker's
    # accuracy, which PPO never sees, moved -4 to +7 points on those seeds (100 prompts):
    # 30 steps do not lift it reliably, so the test asks only that it does not collapse (on
    # the 0.69 reward model that learning rate 6e-4 gave, it fell 6-12 points).
    assert after["eval/reward_mean"] > before["eval/reward_mean"] + 0.15
    assert after["eval/accuracy"] >= before["eval/accuracy"] - 0.08
    assert (res.final_dir / "config.json").is_file()


def test_documented_sequence_runs_offline_through_the_cli(tmp_path):
    """scripts/pipeline_debug.sh's commands, each shortened with overrides."""
    from rlhflab.cli import main

    out = tmp_path
    fast = ["training.num_threads=1", "logging.progress_bar=false", "logging.plots=false"]
    assert main(["make-tiny", "--out", str(out / "tiny-model"), "--hidden-size", "32", "--layers", "1",
                 "--heads", "2"]) == 0
    assert main(["make-data", "--out", str(out / "arith"), "--n-train", "64", "--n-test", "16"]) == 0
    assert main(["sft", "--config", str(CONFIGS / "sft_debug.yaml"), f"model.name_or_path={out / 'tiny-model'}",
                 f"data.path={out / 'arith/sft.jsonl'}", f"data.eval_path={out / 'arith/test.jsonl'}",
                 f"training.output_dir={out / 'sft_debug'}", "sft.max_steps=2", "sft.num_eval_generate=4", *fast]) == 0
    subprocess.run([sys.executable, "-m", "rlhflab.label.make_prefs", "--out", str(out / "prefs"),
                    "--n-train", "64", "--n-test", "16"], check=True, cwd=ROOT)
    assert main(["rm", "--config", str(CONFIGS / "rm_debug.yaml"), f"model.name_or_path={out / 'sft_debug/final'}",
                 f"data.path={out / 'prefs/train.jsonl'}", f"data.eval_path={out / 'prefs/test.jsonl'}",
                 f"training.output_dir={out / 'rm_debug'}", "rm.max_steps=2", *fast]) == 0
    assert main(["ppo", "--config", str(CONFIGS / "ppo_rm_debug.yaml"), f"model.name_or_path={out / 'sft_debug/final'}",
                 f"dataset.path={out / 'arith/train.jsonl'}", f"dataset.eval_path={out / 'arith/test.jsonl'}",
                 f"reward.sources=[{{type: model, path: {out / 'rm_debug/final'}, normalize: true}}]",
                 f"training.output_dir={out / 'ppo_rm_debug'}", "training.total_steps=1", "training.eval_interval=1",
                 "dataset.num_eval_samples=8", "ppo.rollout_samples=8", "ppo.batch_size=8", "ppo.mini_batch_size=8",
                 *fast]) == 0
    assert main(["generate", "--model", str(out / "sft_debug/final"), "--model", str(out / "ppo_rm_debug/final"),
                 "--prompts", str(out / "arith/test.jsonl"), "--template", "Question: {prompt}\\nAnswer:",
                 "--limit", "2", "--max-new-tokens", "8", "--device", "cpu"]) == 0
    result = json.loads((out / "ppo_rm_debug" / "train_result.json").read_text())
    assert set(result["eval_after"]) >= {"eval/reward_mean", "eval/accuracy"}


def test_the_script_lists_the_same_stages():
    script = (ROOT / "scripts" / "pipeline_debug.sh").read_text()
    stages = ["make-tiny", "make-data", "sft --config configs/sft_debug.yaml", "arith/sft.jsonl",
              "sft --config configs/sft_debug.yaml", "arith/train.jsonl", "make-prefs",
              "rm --config configs/rm_debug.yaml", "sft_judge/final", "ppo --config configs/ppo_rm_debug.yaml",
              "generate"]
    at = 0
    for stage in stages:  # each stage after the one before
        at = script.index(stage, at) + len(stage)


if __name__ == "__main__":  # policy_run's process: python tests/test_pipeline.py OUT BASE TASK.json
    folder = Path(sys.argv[1])
    paths = {k: Path(v) for k, v in json.loads(Path(sys.argv[3]).read_text()).items()}
    final = _sft(folder, Path(sys.argv[2]), paths["sft"], paths)
    (folder.parent / "final_dir.txt").write_text(str(final))
