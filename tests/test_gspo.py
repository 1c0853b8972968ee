"""GSPO (Zheng et al., 2025): the sequence-level ratio and its clipped loss by hand, its
gradient, padding invariance, the config's refusals, and a short run through
`rlhflab gspo` that changes the weights."""

from __future__ import annotations

import math

import pytest
import torch

from rlhflab import cli, ops
from rlhflab.config import load_config
from rlhflab.errors import ConfigError
from rlhflab.metrics import read_metrics
from rlhflab.trainers.gspo import GSPORunConfig

from test_grpo_helpers import ROOT, easy_task, small_model

# Two responses. Row 0: 2 real tokens, log π − log π_old = (0.2, −0.1), A = +1.
# Row 1: 3 real tokens, log-ratios (0.5, 0.5, 0.5), A = +2.
LOGPROBS = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
OLD = torch.tensor([[-1.2, -1.9, 0.0], [-1.0, -1.0, -1.0]])
ADV = torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_sequence_ratio_and_loss_by_hand():
    # s_0 = exp((0.2 − 0.1)/2) = exp(0.05) = 1.051271; s_1 = exp(0.5) = 1.648721.
    # clip range [0.8, 1.2]: row 0 is inside, ℓ_0 = −1·1.051271 = −1.051271;
    # row 1 is above with A > 0, ℓ_1 = max(−2·1.648721, −2·1.2) = −2.4.
    # seq_mean: (−1.051271 − 2.4) / 2 = −1.7256355.
    out = ops.gspo_policy_loss(LOGPROBS, OLD, ADV, MASK, clip_eps=0.2, clip_eps_high=0.2)
    assert out.loss.item() == pytest.approx((-math.exp(0.05) - 2.4) / 2, abs=1e-6)
    assert out.clip_frac.item() == pytest.approx(0.5)          # one response of two is clipped
    assert out.clip_frac_high.item() == pytest.approx(0.5) and out.clip_frac_low.item() == 0.0
    # approx_kl over the 5 real tokens: ½(0.04 + 0.01 + 3·0.25)/5 = 0.08.
    assert out.approx_kl.item() == pytest.approx(0.08, abs=1e-6)


def test_the_papers_small_clip_range():
    # ε_low = 3e-4, ε_high = 4e-4: both ratios are above 1.0004 with A > 0, both clipped:
    # ℓ_0 = −1·1.0004, ℓ_1 = −2·1.0004; mean −1.5006.
    out = ops.gspo_policy_loss(LOGPROBS, OLD, ADV, MASK)
    assert out.loss.item() == pytest.approx(-1.5006, abs=1e-6)
    assert out.clip_frac.item() == 1.0
    # token_mean weighs each response by its tokens: (2·−1.0004 + 3·−2.0008) / 5 = −1.60064.
    tm = ops.gspo_policy_loss(LOGPROBS, OLD, ADV, MASK, aggregation="token_mean")
    assert tm.loss.item() == pytest.approx(-1.60064, abs=1e-6)


def test_gradient_is_the_sequence_ratio_spread_over_the_tokens():
    # Unclipped row 0: ∂ℓ_0/∂logπ_t = −A·s_0·(1/n_0) = −1.051271/2 on each real token, and
    # seq_mean divides by 2 responses: −0.26281775. Row 1 is clipped: no gradient.
    lp = LOGPROBS.clone().requires_grad_(True)
    ops.gspo_policy_loss(lp, OLD, ADV, MASK, clip_eps=0.2, clip_eps_high=0.2).loss.backward()
    g = -math.exp(0.05) / 2 / 2
    assert torch.allclose(lp.grad, torch.tensor([[g, g, 0.0], [0.0, 0.0, 0.0]]), atol=1e-6)


def test_one_ratio_per_response_differs_from_token_ratios():
    # Token-level PPO clips row 0's first token (exp(0.2) = 1.2214 > 1.2) and not its
    # second; GSPO sees one ratio, 1.0513, inside the range: the two losses differ.
    ppo = ops.ppo_policy_loss(LOGPROBS[:1], OLD[:1], ADV[:1], MASK[:1], clip_eps=0.2, aggregation="seq_mean")
    gspo = ops.gspo_policy_loss(LOGPROBS[:1], OLD[:1], ADV[:1], MASK[:1], clip_eps=0.2, clip_eps_high=0.2)
    assert ppo.loss.item() == pytest.approx(-(1.2 + math.exp(-0.1)) / 2, abs=1e-6)
    assert gspo.loss.item() == pytest.approx(-math.exp(0.05), abs=1e-6)


def test_extra_padding_changes_nothing_and_a_ratio_of_one_is_grpo():
    pad = lambda x: torch.cat([x, torch.full((2, 2), 7.0)], 1)  # noqa: E731  (garbage past the mask)
    a = ops.gspo_policy_loss(LOGPROBS, OLD, ADV, MASK)
    b = ops.gspo_policy_loss(pad(LOGPROBS), pad(OLD), pad(ADV), torch.cat([MASK, torch.zeros(2, 2)], 1))
    assert torch.equal(a.loss, b.loss)
    # π = π_old (one optimizer step per rollout): every ratio is 1, and the loss is PPO's
    # seq_mean loss, −mean(A) = −(1 + 2)/2.
    same = ops.gspo_policy_loss(LOGPROBS, LOGPROBS, ADV, MASK)
    ppo = ops.ppo_policy_loss(LOGPROBS, LOGPROBS, ADV, MASK, aggregation="seq_mean")
    assert same.loss.item() == pytest.approx(-1.5) == ppo.loss.item()


def test_token_level_options_are_refused():
    with pytest.raises(ValueError, match="token-level"):
        ops.gspo_policy_loss(LOGPROBS, OLD, ADV, MASK, dual_clip=3.0)
    cfg, _ = load_config(ROOT / "configs" / "gspo_debug.yaml", GSPORunConfig)
    assert (cfg.gspo.clip_eps, cfg.gspo.clip_eps_high, cfg.gspo.loss_aggregation) == (3e-4, 4e-4, "seq_mean")
    with pytest.raises(ConfigError, match="dual_clip: a token-level option"):
        load_config(ROOT / "configs" / "gspo_debug.yaml", GSPORunConfig, ["gspo.dual_clip=3"])


def test_gspo_run_moves_the_weights(tmp_path_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhflab.rewards import register

    register("test_gspo_length")(lambda p, r, e: float(len(r) % 3))  # rewards that differ within a group
    model_dir, task_dir = small_model(tmp_path_factory), easy_task(tmp_path_factory)
    out = tmp_path / "gspo"
    assert cli.main(["gspo", "--config", str(ROOT / "configs" / "gspo_debug.yaml"), f"model.name_or_path={model_dir}",
                     f"dataset.path={task_dir / 'train.jsonl'}", f"dataset.eval_path={task_dir / 'test.jsonl'}",
                     f"training.output_dir={out}", "training.total_steps=2", "training.eval_interval=0",
                     "training.save_interval=0", "training.num_threads=1", "gspo.learning_rate=1e-2",
                     "generation.max_new_tokens=6", "reward.sources=[{type: rule, name: test_gspo_length}]",
                     "logging.progress_bar=false", "logging.plots=false"]) == 0
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    end = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    assert any(not torch.allclose(start[k], end[k]) for k in start)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss/policy"]) for r in rows)
    # Two minibatch steps per rollout: the second sees a sequence ratio that left 1.
    assert any(r["params/approx_kl"] > 0 for r in rows)
