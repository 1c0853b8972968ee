"""REINFORCE++ and Dr. GRPO: their advantage and loss maths by hand, parity with plain
loops, and a short run of each through its command."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlhflab import ops
from rlhflab.engine.dist import Dist
from rlhflab.engine.update import loss_terms
from rlhflab.trainers.dr_grpo import DrGRPOSection
from rlhflab.trainers.reinforce_pp import ReinforcePPSection, reinforce_pp_advantages


# --------------------------------------------------------------------------------------
# Discounted returns
# --------------------------------------------------------------------------------------
def test_discounted_returns_by_hand():
    # γ = 0.5, r = [1, 0, 2]: G_2 = 2, G_1 = 0 + 0.5·2 = 1, G_0 = 1 + 0.5·1 = 1.5; padding 0.
    r = torch.tensor([[1.0, 0.0, 2.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    torch.testing.assert_close(ops.discounted_returns(r, mask, 0.5), torch.tensor([[1.5, 1.0, 2.0, 0.0]]))
    # γ = 1 is the reverse cumulative sum: [3, 2, 2]
    torch.testing.assert_close(ops.discounted_returns(r, mask, 1.0), torch.tensor([[3.0, 2.0, 2.0, 0.0]]))


def test_discounted_returns_match_a_loop_and_ignore_right_padding():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(5, 7, generator=g, dtype=torch.float64)
    lengths = [7, 1, 4, 3, 6]
    mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).long()
    out = ops.discounted_returns(r, mask, 0.9)
    for b, n in enumerate(lengths):
        for t in range(7):
            want = sum(0.9 ** (s - t) * float(r[b, s]) for s in range(t, n)) if t < n else 0.0
            assert float(out[b, t]) == pytest.approx(want, rel=1e-12, abs=1e-12)
    wider = torch.cat([r, torch.full((5, 3), 9.0, dtype=torch.float64)], 1)
    torch.testing.assert_close(ops.discounted_returns(wider, torch.cat([mask, torch.zeros(5, 3, dtype=torch.long)], 1),
                                                      0.9)[:, :7], out)


# --------------------------------------------------------------------------------------
# REINFORCE++ advantages
# --------------------------------------------------------------------------------------
def test_reinforce_pp_advantages_by_hand():
    # Two responses of 2 and 1 tokens, scores [1, 0]; log π − log π_ref = [0.2, 0.4] and [0.6],
    # k2 = ½·d²: KL = [0.02, 0.08] and [0.18]; kl_coeff 0.5 -> rewards [-0.01, 1 - 0.04] and [0 - 0.09]
    # (the score sits on the last real token). Returns (γ = 1): [0.95, 0.96] and [-0.09].
    # Whitened over the 3 real tokens: mean 1.82 / 3 = 0.606667; deviations 0.343333, 0.353333,
    # -0.696667; population var (0.117878 + 0.124844 + 0.485344) / 3 = 0.242689 (std 0.492635):
    # [0.343333, 0.353333, -0.696667] / 0.492635 = [0.696933, 0.717232, -1.414165].
    logprobs = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    ref = logprobs - torch.tensor([[0.2, 0.4], [0.6, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    sec = ReinforcePPSection(kl_coeff=0.5, kl_estimator="k2")
    adv, kl = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), logprobs, ref, mask, sec, Dist())
    torch.testing.assert_close(kl, torch.tensor([[0.02, 0.08], [0.18, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.696933, 0.717232], [-1.414165, 0.0]]), atol=1e-5, rtol=0)


def test_reinforce_pp_group_mean_baseline_centres_scores_within_prompts():
    # n_samples 2: scores [3, 1 | 5, 5] -> centred [1, -1 | 0, 0]; no KL (policy == reference),
    # one token each: the returns are the centred scores, whitened: mean 0, std sqrt(0.5).
    lp = torch.zeros(4, 1)
    sec = ReinforcePPSection(kl_coeff=0.1, n_samples=2, baseline="group_mean")
    adv, _ = reinforce_pp_advantages(torch.tensor([3.0, 1.0, 5.0, 5.0]), lp, lp, torch.ones(4, 1), sec, Dist())
    torch.testing.assert_close(adv.squeeze(1), torch.tensor([1.0, -1.0, 0.0, 0.0]) / math.sqrt(0.5), atol=1e-6,
                               rtol=0)
    assert "baseline: group_mean needs n_samples >= 2" in ReinforcePPSection(baseline="group_mean").check()[-1]


# --------------------------------------------------------------------------------------
# Dr. GRPO: the centred reward and the constant length normaliser
# --------------------------------------------------------------------------------------
def test_dr_grpo_defaults_and_loss_by_hand():
    sec = DrGRPOSection()
    assert (sec.advantage_scale, sec.loss_aggregation, sec.kl_coeff) == ("none", "token_sum", 0.0)
    # Group of 2 with scores [1, 0]: advantages [0.5, -0.5] (no std). Responses of 3 and 1
    # tokens, ratio 1: per-token loss −A: [-0.5]*3 and [0.5]. token_sum with the constant
    # 2 responses × 4 max tokens = 8: (−1.5 + 0.5) / 8 = −0.125, whatever the lengths.
    adv_seq = ops.group_advantages(torch.tensor([1.0, 0.0]), 2, sec.advantage_scale)
    torch.testing.assert_close(adv_seq, torch.tensor([0.5, -0.5]))
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    adv = adv_seq[:, None] * mask
    lp = torch.zeros(2, 4, requires_grad=True)
    terms = loss_terms(lp, lp.detach(), adv, mask, sec, normalizer=8.0)
    assert float(terms.total) == pytest.approx(-0.125)
    (grad,) = torch.autograd.grad(terms.total, lp)
    # every real token's gradient is −A/8, the same per token for both responses
    torch.testing.assert_close(grad, torch.tensor([[-0.0625, -0.0625, -0.0625, 0.0], [0.0625, 0, 0, 0]]))
    # GRPO's token_mean would divide by the 4 real tokens: (−1.5 + 0.5) / 4 = −0.25
    from rlhflab.trainers.grpo import GRPOSection
    grpo = GRPOSection(kl_coeff=0.0)
    assert float(loss_terms(lp, lp.detach(), adv, mask, grpo).total) == pytest.approx(-0.25)


def test_dr_grpo_engine_normaliser_is_responses_times_max_new_tokens():
    from rlhflab.engine.update import group_normalizer
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])  # the middle row is masked out (truncated)
    assert group_normalizer(mask, "token_sum", max_new_tokens=16) == 2 * 16
    assert group_normalizer(mask, "token_mean", max_new_tokens=16) == 3
    assert group_normalizer(mask, "seq_mean", max_new_tokens=16) == 2


# --------------------------------------------------------------------------------------
# Each runs through its command
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["reinforce-pp", "dr-grpo"])
def test_command_runs_and_changes_the_policy(command, tiny_model_dir, arith_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from rlhflab.cli import main
    from rlhflab.rewards import register

    register("test_methods_length")(lambda prompt, response, example: float(len(response) % 3))
    stem = command.replace("-", "_")
    out = tmp_path / "run"
    rc = main([command, "--config", f"configs/{stem}_debug.yaml", f"model.name_or_path={tiny_model_dir}",
               f"dataset.path={arith_dir / 'train.jsonl'}", f"dataset.eval_path={arith_dir / 'test.jsonl'}",
               f"training.output_dir={out}", "training.total_steps=2", "training.eval_interval=0",
               "training.save_interval=0", "generation.max_new_tokens=6", "logging.progress_bar=false",
               "logging.plots=false", "reward.sources=[{type: rule, name: test_methods_length}]"])
    assert rc == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss/policy"]) and r["params/grad_norm"] > 0 for r in rows)
    a, s = load_file(str(out / "final" / "model.safetensors")), load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(not torch.equal(a[k], s[k]) for k in s)
