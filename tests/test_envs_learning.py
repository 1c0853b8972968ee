"""Learning on multi-turn episodes (slow): GRPO and PPO raise a reward that only the
environment gives, at the second turn. The task: reply to "again" with an empty turn (the
end-of-turn token at once). The first turn is free and unrewarded, so the gain needs the
turn reward to reach the second turn's tokens through the episode layout."""

from __future__ import annotations

import json

import pytest

from test_envs_distributed import stop_model  # noqa: F401  (the fixture: many stop ids, so turns close)
from test_grpo_helpers import ROOT, debug_config, easy_task

pytestmark = pytest.mark.slow

ENV = '''
from rlhflab.envs import StepResult


class QuietSecond:
    def __init__(self):
        self.turn = 0

    def reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, messages, assistant_text):
        self.turn += 1
        if self.turn == 1:
            return StepResult([{"role": "user", "content": "again"}], 0.0, False)
        return StepResult(None, 1.0 if not assistant_text.strip() else 0.0, True)
'''


@pytest.mark.parametrize("method", ["grpo", "ppo"])
def test_a_second_turn_reward_is_learned(method, stop_model, tmp_path_factory, tmp_path, monkeypatch):  # noqa: F811
    from rlhflab.trainers import grpo, ppo

    task = easy_task(tmp_path_factory)
    (tmp_path / "quiet_env.py").write_text(ENV)
    monkeypatch.chdir(tmp_path)
    mod, schema = {"grpo": (grpo, grpo.GRPORunConfig), "ppo": (ppo, ppo.PPORunConfig)}[method]
    sizes = {"grpo": ["grpo.prompts_per_step=8", "grpo.group_size=4", "grpo.batch_size=32", "grpo.mini_batch_size=32",
                      "grpo.learning_rate=1e-2", "grpo.kl_coeff=0"],
             "ppo": ["ppo.rollout_samples=32", "ppo.batch_size=32", "ppo.mini_batch_size=16", "ppo.epochs=2",
                     "ppo.learning_rate=1e-2", "ppo.kl_coeff=0"]}[method]
    cfg = debug_config(schema, f"{method}_debug.yaml", stop_model, task, tmp_path / "run",
                       'dataset.prompt_template="{prompt}"', "dataset.use_chat_template=true",
                       "generation.max_new_tokens=6", "generation.seeded_sampling=true", "env.name=quiet_env:QuietSecond",
                       "env.max_turns=2", "reward.sources=[{type: rule, name: 'quiet_env_zero:zero'}]",
                       "training.total_steps=30", "training.eval_interval=0", "training.save_interval=0", *sizes)
    (tmp_path / "quiet_env_zero.py").write_text("def zero(prompt, response, example):\n    return 0.0\n")
    mod.train(cfg, quiet=True)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    env_reward = [r["episode/env_reward_mean"] for r in rows if "episode/env_reward_mean" in r]
    first, last = sum(env_reward[:4]) / 4, sum(env_reward[-4:]) / 4
    print(f"{method}: the second turn's reward {first:.2f} over the first 4 steps -> {last:.2f} over the last 4")
    assert last >= first + 0.15, env_reward
