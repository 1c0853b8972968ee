"""RLOO trainer: config, the KL folded into the reward, leave-one-out by a plain loop,
no reference at kl_coeff 0, and a short run that changes the weights."""

from __future__ import annotations

import math

import pytest
import torch

from rlhflab.config import load_config
from rlhflab.data.prompts import load_prompts
from rlhflab.errors import ConfigError
from rlhflab.models.actor_critic import Reference
from rlhflab.trainers import rloo
from rlhflab.trainers.common import Timer
from rlhflab.trainers.loop import build_run
from rlhflab.trainers.rloo import RLOORunConfig, rloo_step

from test_grpo_helpers import ROOT, debug_config, easy_task, keep_rollouts, small_model


class VariedScorer:
    def score(self, prompts, responses, examples):
        return torch.tensor([float(len(r) % 3) for r in responses])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return small_model(tmp_path_factory), easy_task(tmp_path_factory)


def test_shipped_configs_validate():
    main, _ = load_config(ROOT / "configs" / "rloo_gsm8k.yaml", RLOORunConfig)
    debug, _ = load_config(ROOT / "configs" / "rloo_debug.yaml", RLOORunConfig)
    assert main.rloo.k == 4 and main.rloo.kl_coeff > 0 and main.model.reference == "lora_disabled"
    assert debug.training.device == "cpu"
    with pytest.raises(ConfigError, match="rloo.k: must be > 1"):
        load_config(ROOT / "configs" / "rloo_debug.yaml", RLOORunConfig, ["rloo.k=1"])
    with pytest.raises(ConfigError, match="set rloo.kl_coeff=0 or reference: copy"):
        load_config(ROOT / "configs" / "rloo_debug.yaml", RLOORunConfig, ["model.reference=none"])


def test_kl_is_folded_into_the_reward_before_leave_one_out(dirs, tmp_path, monkeypatch):
    model_dir, task_dir = dirs
    cfg = debug_config(RLOORunConfig, "rloo_debug.yaml", model_dir, task_dir, tmp_path / "run",
                       "generation.max_new_tokens=6", "rloo.k=4", "rloo.prompts_per_step=3",
                       "rloo.mini_batch_size=12", "rloo.kl_coeff=0.5", "rloo.kl_estimator=k1")
    torch.manual_seed(0)
    run = build_run(cfg, rloo.method(cfg))
    run.scorer = VariedScorer()
    with torch.no_grad():  # move the policy away from the reference so the KL is not 0
        for p in run.models.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    examples = load_prompts(cfg.dataset, run.models.tokenizer, "train")[:3]
    seen = keep_rollouts(monkeypatch, rloo)
    metrics = rloo_step(run, examples, 1, Timer())
    (roll,) = seen
    assert run.sec.kl_loss_coeff == 0.0 and "loss/kl" not in metrics  # the KL is in the reward, not in the loss
    mask = roll.response_mask.float()
    # R_i = score_i − 0.5 · Σ_t (log π − log π_ref), then A_i = R_i − mean of the other 3: a plain loop.
    rewards = [float(roll.scores[i]) - 0.5 * float(((roll.logprobs[i] - roll.ref_logprobs[i]) * mask[i]).sum())
               for i in range(len(roll))]
    for i in range(len(roll)):
        g = i // 4
        others = [rewards[j] for j in range(4 * g, 4 * g + 4) if j != i]
        expected = rewards[i] - sum(others) / 3
        real = roll.advantages[i][mask[i].bool()]
        assert torch.allclose(real, torch.full_like(real, expected), atol=1e-5)
    assert abs(metrics["params/kl_to_ref"]) > 0 and math.isfinite(metrics["rollout/shaped_reward_mean"])


def test_kl_coeff_zero_loads_no_reference_and_trains(dirs, tmp_path, monkeypatch):
    model_dir, task_dir = dirs

    def forbidden(*args, **kwargs):
        raise AssertionError("a reference was built although kl_coeff = 0")

    monkeypatch.setattr(Reference, "frozen_copy", classmethod(forbidden))
    cfg = debug_config(RLOORunConfig, "rloo_debug.yaml", model_dir, task_dir, tmp_path / "run",
                       "rloo.kl_coeff=0", "rloo.learning_rate=1e-2", "training.total_steps=2",
                       "training.eval_interval=0", "training.save_interval=0", "generation.max_new_tokens=4",
                       "reward.sources=[{type: rule, name: test_rloo_length}]")
    from rlhflab.rewards import register
    register("test_rloo_length")(lambda p, r, e: float(len(r) % 3))
    from transformers import AutoModelForCausalLM
    res = rloo.train(cfg, quiet=True)
    assert res.models.reference is None
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    end = AutoModelForCausalLM.from_pretrained(res.final_dir).state_dict()
    assert any(not torch.allclose(start[k], end[k]) for k in start)
    assert all(math.isfinite(v) for h in res.history for v in h.values())
