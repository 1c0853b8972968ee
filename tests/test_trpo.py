"""TRPO: conjugate gradient and the exact KL by hand, the natural-gradient step against an
explicitly formed Fisher matrix on a toy policy, the trust region on the tiny model, and
a run through `rlhflab trpo`."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from rlhflab import ops
from rlhflab.models.actor_critic import ResponseOutput
from rlhflab.rollout import Rollout
from rlhflab.trainers.trpo import TRPOSection, natural_gradient_step


def test_conjugate_gradient_by_hand_and_against_a_solve():
    # A = [[4, 1], [1, 3]], b = [1, 2]: x = A⁻¹b = [3·1 − 1·2, −1·1 + 4·2] / 11 = [1/11, 7/11], in 2 steps.
    a = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    res = ops.conjugate_gradient(lambda v: a @ v, torch.tensor([1.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(res.x, torch.tensor([1 / 11, 7 / 11], dtype=torch.float64))
    assert res.iterations == 2 and res.residual_norm < 1e-12
    g = torch.Generator().manual_seed(0)
    m = torch.randn(6, 6, generator=g, dtype=torch.float64)
    spd = m @ m.T + 0.5 * torch.eye(6, dtype=torch.float64)
    b = torch.randn(6, generator=g, dtype=torch.float64)
    torch.testing.assert_close(ops.conjugate_gradient(lambda v: spd @ v, b, iterations=6).x,
                               torch.linalg.solve(spd, b), rtol=1e-8, atol=1e-10)


def test_categorical_kl_by_hand():
    # KL([0.5, 0.5] ‖ [0.25, 0.75]) = 0.5·ln(0.5/0.25) + 0.5·ln(0.5/0.75) = 0.5·0.693147 − 0.5·0.405465 = 0.143841
    old = torch.tensor([[0.5, 0.5]]).log()
    new = torch.tensor([[0.25, 0.75]]).log()
    assert float(ops.categorical_kl(old, new)) == pytest.approx(0.143841, abs=1e-6)
    assert float(ops.categorical_kl(old, old)) == 0.0


class TablePolicy(nn.Module):
    """A toy 'LM' whose logits at response position t are a table row W[t] (T, V)."""

    def __init__(self, t: int, v: int, seed: int = 0):
        super().__init__()
        self.policy = nn.Module()
        self.policy.w = nn.Parameter(0.5 * torch.randn(t, v, generator=torch.Generator().manual_seed(seed),
                                                       dtype=torch.float64))

    def forward_response(self, input_ids, attention_mask, prompt_len, with_values=False):
        b, t = input_ids.shape[0], input_ids.shape[1] - prompt_len
        return ResponseOutput(self.policy.w[:t].unsqueeze(0).expand(b, t, -1), None)


def _toy_rollout(b=6, t=3, v=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    resp = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 2] = mask[3, 1:] = 0
    roll = Rollout(torch.zeros(b, 1, dtype=torch.long), torch.ones(b, 1, dtype=torch.long), resp, mask,
                   hit_limit=torch.zeros(b, dtype=torch.bool))
    roll.advantages = torch.randn(b, t, generator=g, dtype=torch.float64) * mask
    return roll


def test_step_is_the_damped_natural_gradient_scaled_to_the_trust_region():
    actor, roll = TablePolicy(3, 4), _toy_rollout()
    w0 = actor.policy.w.detach().clone()
    mask = roll.response_mask.double()
    n = mask.sum()

    def surrogate(w):  # mean ratio·A at θ_old: its gradient is g
        lp = w.log_softmax(-1).unsqueeze(0).expand(6, -1, -1).gather(-1, roll.response_ids.unsqueeze(-1)).squeeze(-1)
        old = w0.log_softmax(-1).unsqueeze(0).expand(6, -1, -1).gather(-1, roll.response_ids.unsqueeze(-1)).squeeze(-1)
        return ((lp - old).exp() * roll.advantages * mask).sum() / n

    def mean_kl(w):
        old = w0.log_softmax(-1).unsqueeze(0).expand(6, -1, -1)
        return (ops.categorical_kl(old, w.log_softmax(-1).unsqueeze(0).expand(6, -1, -1)) * mask).sum() / n

    # F formed explicitly (the Hessian of the mean KL at θ_old, 12 x 12) and the damped solve.
    g = torch.autograd.functional.jacobian(surrogate, w0).reshape(-1)
    fisher = torch.autograd.functional.hessian(mean_kl, w0).reshape(12, 12)
    sec = TRPOSection(max_kl=1e-4, cg_iterations=12, cg_damping=0.1, line_search_steps=10, backtrack=0.5)
    damped = fisher + 0.1 * torch.eye(12, dtype=torch.float64)
    x = torch.linalg.solve(damped, g)
    expected = math.sqrt(2 * 1e-4 / float(x @ damped @ x)) * x
    stats = natural_gradient_step(actor, roll, sec)
    step = (actor.policy.w.detach() - w0).reshape(-1)
    # The accepted step is a backtracking fraction of the full step √(2δ/xᵀFx)·x (the step
    # computes in float32, hence 1e-3 relative).
    want = stats["trpo/step_fraction"] * expected
    assert float((step - want).norm() / want.norm()) < 1e-3
    assert stats["trpo/step_fraction"] > 0
    assert float(mean_kl(actor.policy.w.detach())) == pytest.approx(stats["trpo/kl"], rel=1e-2)  # float32 inside
    assert stats["trpo/kl"] <= 1e-4 and stats["trpo/surrogate_improvement"] > 0


def test_no_improvement_possible_leaves_the_policy_unchanged():
    actor, roll = TablePolicy(3, 4), _toy_rollout()
    roll.advantages = torch.zeros_like(roll.advantages)   # g = 0: nothing to gain
    w0 = actor.policy.w.detach().clone()
    stats = natural_gradient_step(actor, roll, TRPOSection(max_kl=0.01))
    assert torch.equal(actor.policy.w.detach(), w0) and stats["trpo/step_fraction"] == 0.0


@pytest.mark.slow
def test_trpo_command_keeps_every_step_in_the_trust_region(tiny_model_dir, arith_dir, tmp_path):
    from rlhflab.cli import main
    from rlhflab.rewards import register

    register("test_trpo_length")(lambda prompt, response, example: float(len(response) % 3))
    out = tmp_path / "run"
    assert main(["trpo", "--config", "configs/trpo_debug.yaml", f"model.name_or_path={tiny_model_dir}",
                 f"dataset.path={arith_dir / 'train.jsonl'}", f"dataset.eval_path={arith_dir / 'test.jsonl'}",
                 f"training.output_dir={out}", "training.total_steps=2", "training.eval_interval=0",
                 "training.save_interval=0", "generation.max_new_tokens=6", "trpo.max_kl=0.005",
                 "logging.progress_bar=false", "reward.sources=[{type: rule, name: test_trpo_length}]"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["trpo/kl"] <= 0.005 and r["trpo/surrogate_improvement"] > 0
        assert math.isfinite(r["loss/value"])
    assert (out / "final" / "value_head.safetensors").exists()
