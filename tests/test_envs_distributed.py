"""Multi-turn episodes under 2 processes equal 1 (DDP on CPU, gloo): a PPO and a GRPO step
on episodes of different lengths (1 to 3 turns; a turn ends at one of many stop ids, so
some episodes close their turns and go on while others run out of tokens), from the same
seed and prompts, as tests/test_distributed.py checks single-turn runs; the GRPO step also
with `grpo.layout=packed` (each rank packs its own episodes). Both methods' 1-process
runs share one process and their 2-process runs one launch (tests/dist_jobs.py), as there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_jobs import run_jobs
from test_distributed import GRPO_STEP, PPO_STEP, ROOT, _assert_equal_and_moved, _common, _env, _weights

pytestmark = pytest.mark.slow

ENV = '''
from rlhflab.envs import StepResult


class Again:
    """'again' after each reply, a turn reward of the reply's length mod 3, done at turn 3."""

    def __init__(self):
        self.turn = 0

    def reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, messages, assistant_text):
        self.turn += 1
        r = float(len(assistant_text) % 3) / 2
        return StepResult(None if self.turn >= 3 else [{"role": "user", "content": "again"}], r, self.turn >= 3)
'''


@pytest.fixture(scope="module")
def stop_model(tmp_path_factory):
    """A tiny ChatML model whose generation_config lists 48 of its 512 ids as EOS, so about
    a tenth of the sampled tokens end a turn."""
    from rlhflab.models.tiny import make_tiny_model

    out = make_tiny_model(tmp_path_factory.mktemp("stop-model"), hidden_size=64, num_layers=2, num_heads=2,
                          chat_template="chatml")
    path = Path(out) / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    eos = cfg.get("eos_token_id", [])
    eos = [eos] if isinstance(eos, int) else list(eos)
    cfg["eos_token_id"] = eos + list(range(100, 148))
    path.write_text(json.dumps(cfg))
    return Path(out)


@pytest.fixture(scope="module")
def runs(stop_model, arith_dir, tmp_path_factory):
    """(the 1-process `Launch`, the 2-process one) of a PPO and a GRPO step, named by method."""
    jobs = {method: [method, "--config", str(ROOT / "configs" / f"{method}_debug.yaml"),
                     *_common(stop_model, arith_dir), "training.total_steps=1", 'dataset.prompt_template="{prompt}"',
                     "dataset.use_chat_template=true", "env.name=dist_env:Again", "env.max_turns=3", *settings]
            for method, settings in (("ppo", PPO_STEP), ("grpo", GRPO_STEP))}
    # GRPO's episodes packed (grpo.layout=packed): the rows of each rank packed on their own
    jobs["grpo_packed"] = [*jobs["grpo"], "grpo.layout=packed"]
    out = []
    for processes in (1, 2):
        base = tmp_path_factory.mktemp(f"multiturn-{processes}")
        env = _env(base)
        (base / "dist_env.py").write_text(ENV)
        out.append(run_jobs(base, jobs, env, processes, "ddp"))
    return tuple(out)


@pytest.mark.parametrize("method", ["ppo", "grpo", "grpo_packed"])
def test_multiturn_two_processes_equal_one(method, stop_model, runs):
    one_dir, two_dir = runs[0].ok(method), runs[1].ok(method)
    _assert_equal_and_moved(one_dir, two_dir, stop_model)
    one = [json.loads(x) for x in (one_dir / "metrics.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (two_dir / "metrics.jsonl").read_text().splitlines()]
    # Episodes of different lengths: some went on past their first turn, not all reached 3.
    assert 1.0 < one[0]["episode/turns_mean"] < 3.0, one[0]["episode/turns_mean"]
    for key in ("rollout/reward_mean", "rollout/reward_std", "rollout/response_length", "episode/turns_mean",
                "episode/context_tokens_mean", "episode/env_reward_mean"):
        assert one[0][key] == pytest.approx(two[0][key], abs=1e-6), key
    for key in ("loss/policy", "loss/total", "params/grad_norm"):
        assert one[0][key] == pytest.approx(two[0][key], rel=1e-3, abs=1e-6), key
    if method.endswith("_packed"):  # every pass packed (no batch fell back), and the update is the padded one's
        assert "runs padded" not in runs[0].text(method, "err") + runs[1].text(method, "err")
        padded, packed = (_weights(d / "final") for d in (runs[0].ok("grpo"), one_dir))
        assert max(float((padded[k] - packed[k]).abs().max()) for k in padded) <= 1e-5
