"""docs/conventions.md, recomputed: every worked number on the page comes from
`rlhflab.ops` here (rlhflab's side with the library's defaults, the other tools' side
with the library's own keywords or, where rlhflab has none, the other convention written
out in a line of arithmetic), and every sentence that carries a number must still be on
the page. The defaults the page quotes are read from the config sections."""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import pytest
import torch

from rlhflab import ops
from rlhflab.ops.losses import LOG_RATIO_CLAMP

PAGE = Path(__file__).resolve().parents[1] / "docs" / "conventions.md"
F64 = torch.float64


def body() -> str:
    # one line per paragraph, typographic minus as ASCII: a sentence may wrap anywhere
    return re.sub(r"\s*\n\s*", " ", PAGE.read_text(encoding="utf-8")).replace("\u2212", "-")


def quoted(text: str, *values) -> None:
    """`text` is on the page, and each number in it equals the matching value to the
    number of decimals printed (numbers written as 1e-4 or 3.0e-8 to their digits)."""
    page = body()
    text = text.replace("\u2212", "-")
    assert text in page, f"conventions.md no longer says {text!r}"
    numbers = re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?", text)
    flat = [float(v) for vs in values for v in (vs.flatten().tolist() if torch.is_tensor(vs) else [vs])]
    assert len(numbers) == len(flat), (text, numbers, flat)
    for shown, value in zip(numbers, flat):
        mantissa, _, exp = shown.partition("e")
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        tol = 0.5 * 10 ** (-decimals + (int(exp) if exp else 0))
        assert abs(value - float(shown)) <= tol * (1 + 1e-9), f"{text!r}: {shown} vs {value}"


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# ---------------------------------------------------------------- 1. whitening


def test_whitening_n_versus_n_minus_1():
    a, m = t([1.0, 2.0, 3.0, 4.0]), torch.ones(1, 4)
    quoted("A = [1, 2, 3, 4]; the mean is 2.5 and Σ(A - mean)² = 5.", 1, 2, 3, 4, a.mean(), ((a - 2.5) ** 2).sum())
    ours = ops.masked_whiten(a, m)                       # var = 5/4
    theirs = ops.masked_whiten(a, m, unbiased=True)      # var = 5/3
    # OpenRLHF: population variance, max(var, 1e-8) instead of var + 1e-8
    openrlhf = (a - 2.5) * torch.rsqrt(torch.clamp(((a - 2.5) ** 2).mean(), min=1e-8))
    torch.testing.assert_close(openrlhf, ours, rtol=1e-7, atol=1e-7)
    quoted("rlhflab and OpenRLHF, var = 5/4: whitened [-1.342, -0.447, 0.447, 1.342]", 5, 4, ours)
    quoted("verl and TRL, var = 5/3: whitened [-1.162, -0.387, 0.387, 1.162]", 5, 3, theirs)
    quoted("sqrt((n - 1)/n), which is 0.866 at n = 4 and 0.998 at n = 256", 1, math.sqrt(3 / 4), 4,
           math.sqrt(255 / 256), 256)
    assert "var + 1e-8" in body() and inspect.signature(ops.masked_whiten).parameters["eps"].default == 1e-8


# ---------------------------------------------------------------- 2. group epsilon


def test_group_advantage_epsilon():
    assert inspect.signature(ops.group_advantages).parameters["eps"].default == 1e-4
    quoted("rlhflab's ε is 1e-4 (as TRL's); verl's is 1e-6, OpenRLHF's 1e-9", 1e-4, 1e-6, 1e-9)
    s = t(1.0, 0.0, 0.0, 0.0)
    first = [ops.group_advantages(s, 4, eps=e)[0] for e in (1e-4, 1e-6, 1e-9)]
    quoted("scores [1, 0, 0, 0]: mean 0.25, std 0.5. The first response gets 1.4997 with ε = 1e-4, "
           "1.499997 with ε = 1e-6 and 1.5 with ε = 1e-9", 1, 0, 0, 0, s.mean(), s.std(),
           first[0], 1e-4, first[1], 1e-6, first[2], 1e-9)
    s = t(0.0, 0.0, 0.0, 0.0001)
    last = [ops.group_advantages(s, 4, eps=e)[3] for e in (1e-4, 1e-6, 1e-9)]
    quoted("scores [0, 0, 0, 0.0001]: mean 0.000025, std 0.00005. The last response gets 0.5 with "
           "ε = 1e-4 (rlhflab, TRL), 1.4706 with ε = 1e-6 (verl) and 1.49997 with ε = 1e-9",
           0, 0, 0, 0.0001, s.mean(), s.std(), last[0], 1e-4, last[1], 1e-6, last[2], 1e-9)
    # "scores such as 0.7 or 42.1": exactly 0 (tests/test_ops_exact.py sweeps sizes and magnitudes)
    for v in (0.7, 42.1):
        assert torch.equal(ops.group_advantages(torch.full((8,), v), 8), torch.zeros(8))


# ---------------------------------------------------------------- 3. KL bound


def test_kl_estimate_bound():
    d = t([-3.0, 15.0, 0.5])
    zero = torch.zeros_like(d)
    k3, k1 = ops.kl_estimate(d, zero, "k3"), ops.kl_estimate(d, zero, "k1")
    k3_10, k1_10 = ops.kl_estimate(d, zero, "k3", clamp=10), ops.kl_estimate(d, zero, "k1", clamp=10)
    quoted("d = -3: k3 = e^3 - 1 - 3 = 16.0855 in rlhflab and TRL, 10 in verl and OpenRLHF.",
           -3, 3, 1, 3, k3[0, 0], k3_10[0, 0])
    quoted("d = 15: k1 = 15 in rlhflab, TRL and verl, 10 in OpenRLHF.", 15, k1[0, 1], k1_10[0, 1])
    quoted("d = 0.5: k3 = 0.1065 everywhere", 0.5, k3_10[0, 2])
    assert k3[0, 2] == k3_10[0, 2]
    # the shaped rewards take the same bound
    _, kl = ops.kl_shaped_rewards(t(0.0), d, zero, torch.ones(1, 3), 0.1, "k1", kl_clamp=10)
    torch.testing.assert_close(kl, k1_10)


# ---------------------------------------------------------------- 4. log-ratio clamp


def test_log_ratio_clamp_example():
    assert LOG_RATIO_CLAMP == 20.0
    quoted("exp(clamp(log π - log π_old, -20, 20))", -20, 20)
    assert math.log(torch.finfo(torch.float32).max) == pytest.approx(88.72, abs=0.01)
    quoted("a log-ratio above about 88.7 overflows float32's exp", math.log(torch.finfo(torch.float32).max))
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-91.0, -1.1]])
    out = ops.ppo_policy_loss(lp, old, torch.ones(1, 2), torch.ones(1, 2), clip_eps=0.2)
    out.loss.backward()
    quoted("log π = [-1, -1], log π_old = [-91, -1.1], A = 1, clip 0.2, token mean. Token 0's log-ratio is 90 "
           "and its loss the clipped -1.2; token 1's ratio is e^0.1. The loss is -1.1526 and the gradient "
           "[0, -0.5526]; unclamped in float32 the gradient is [NaN, -0.5526]",
           lp.detach(), old, 1, 0.2, 0, (lp - old)[0, 0], -1.2, 1, 0.1, out.loss, lp.grad, -0.5526)
    assert lp.grad[0, 0].item() == 0.0
    # the unclamped form, written out: NaN where the log-ratio is 90
    lp2 = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    ratio = torch.exp(lp2 - old)
    per = torch.maximum(-ratio, -ratio.clamp(0.8, 1.2))
    per.mean().backward()
    assert math.isnan(lp2.grad[0, 0].item()) and lp2.grad[0, 1].item() == pytest.approx(-0.5526, abs=1e-4)


# ---------------------------------------------------------------- 5. dual clip


def test_dual_clip_example():
    lp = t([math.log(5.0)])
    args = (torch.zeros_like(lp), -torch.ones_like(lp), torch.ones(1, 1))
    plain = ops.ppo_policy_loss(lp, *args).loss
    lp_d = lp.clone().requires_grad_(True)
    dual = ops.ppo_policy_loss(lp_d, *args, dual_clip=3.0).loss
    dual.backward()
    quoted("every run with c = 3", 3)
    quoted("A = -1, ratio 5 (the policy made a bad token five times likelier). rlhflab's token loss is 5; "
           "verl's is 3", -1, 5, plain, dual)
    assert lp_d.grad.item() == 0.0   # "the token pushes no gradient"
    from rlhflab.config.schema import PolicySection
    assert PolicySection().dual_clip is None


# ---------------------------------------------------------------- 6 and 7. aggregation


LOSSES = t([1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0])   # (B, T) = (2, 4), padded to width 4
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


def test_aggregation_example():
    quoted("two responses with per-token losses [1, 1, 1] and [2, 2]", 1, 1, 1, 2, 2)
    quoted("token mean: (1 + 1 + 1 + 2 + 2) / 5 = 1.4", 1, 1, 1, 2, 2, MASK.sum(),
           ops.aggregate(LOSSES, MASK, "token_mean"))
    quoted("mean of per-response means: (1 + 2) / 2 = 1.5", 1, 2, 2, ops.aggregate(LOSSES, MASK, "seq_mean"))
    from rlhflab.config.schema import PolicySection
    assert PolicySection().loss_aggregation == "token_mean"


def test_dr_grpo_normaliser_example():
    from rlhflab.trainers.dr_grpo import DrGRPOSection
    assert DrGRPOSection().loss_aggregation == "token_sum"
    max_new_tokens, b, width = 8, 2, LOSSES.shape[-1]
    ours = ops.aggregate(LOSSES, MASK, "token_sum", normalizer=b * max_new_tokens)
    verl = (LOSSES * MASK).sum() / width      # summed token losses over the padded width, no 1/B
    quoted("(token sum 7) in a tensor padded to width 4, with `max_new_tokens` 8. rlhflab: 7 / (2 × 8) = 0.4375. "
           "verl: 7 / 4 = 1.75.", (LOSSES * MASK).sum(), width, max_new_tokens, (LOSSES * MASK).sum(), b,
           max_new_tokens, ours, (LOSSES * MASK).sum(), width, verl)


# ---------------------------------------------------------------- 8. RLOO


def test_rloo_baseline_example():
    from rlhflab.trainers.rloo import RLOOSection
    assert RLOOSection().kl_coeff == 0.05 and RLOOSection().kl_estimator == "k1"
    beta = 0.1
    scores = t(1.0, 0.0)
    lp, ref = t([1.0, 1.0], [0.0, 0.0]), torch.zeros(2, 2, dtype=F64)   # k1 per token [1, 1] and [0, 0]
    mask = torch.ones(2, 2)
    kl_sum = ops.kl_estimate(lp, ref, "k1").sum(-1)
    shaped = scores - beta * kl_sum                                   # rlhflab: KL inside the baseline
    ours = ops.rloo_advantages(shaped, 2)
    loo = ops.rloo_advantages(scores, 2)                               # OpenRLHF: scores only ...
    rewards, _ = ops.kl_shaped_rewards(loo, lp, ref, mask, beta, "k1")  # ... then -β·KL per token
    first_token_return = ops.discounted_returns(rewards, mask)[:, 0]
    quoted("k = 2, scores [1, 0], summed KL [2, 0] (per token [1, 1] and [0, 0]), β = 0.1.",
           2, scores, kl_sum, lp, beta)
    quoted("rlhflab: shaped [0.8, 0]; advantages [0.8, -0.8] on every token.", shaped, ours)
    quoted("OpenRLHF: leave-one-out scores [1, -1]; the return at the first token, with the per-token KL "
           "added back, is [0.8, -1.0].", loo, first_token_return)


# ---------------------------------------------------------------- 9. entropy


def test_entropy_cancellation_example():
    z64 = t([100.0, 92.0, 92.0, 92.0, 92.0])
    z32 = z64.float()
    exact = ops.entropy_from_logits(z64[None]).item()             # float64
    ours = ops.entropy_from_logits(z32[None]).item()               # float32, -Σ p log p
    p = torch.softmax(z32, -1)
    difference_form = (torch.logsumexp(z32, -1) - (p * z32).sum(-1)).item()   # verl's form, float32
    spacing = torch.finfo(torch.float32).eps * 64                  # float32 spacing in [64, 128)
    quoted("logits [100, 92, 92, 92, 92] in float32. The entropy (computed in float64) is 0.0120614. "
           "rlhflab's float32 value is 0.0120613, off by 3.0e-8; the difference form gives 0.0120544, off by "
           "6.9e-6 (a relative error of 5.7e-4), because the spacing of float32 numbers near 100 is 7.6e-6.",
           z64, exact, ours, abs(ours - exact), difference_form, abs(difference_form - exact),
           abs(difference_form - exact) / exact, 100, spacing)


# ---------------------------------------------------------------- 10. KL placement


def test_kl_placement_defaults_and_example():
    from rlhflab.trainers.grpo import GRPOSection
    from rlhflab.trainers.ppo import PPOSection
    from rlhflab.trainers.rloo import RLOOSection
    ppo, grpo, rloo = PPOSection(), GRPOSection(), RLOOSection()
    assert (ppo.kl_in, ppo.kl_estimator, ppo.kl_coeff) == ("reward", "k1", 0.05)
    assert (grpo.kl_estimator, grpo.kl_coeff) == ("k3", 0.04)
    quoted("(`ppo.kl_in: reward`, k1, `ppo.kl_coeff` 0.05), its RLOO in the sequence reward (k1, 0.05), and its "
           "GRPO in the loss (k3, `grpo.kl_coeff` 0.04", ppo.kl_coeff, rloo.kl_coeff, grpo.kl_coeff)
    k3 = ops.kl_estimate(t([0.5]), t([0.0]), "k3").item()
    quoted("a token with d = 0.5 has k3 = 0.1065. Its penalty is 0.04 × 0.1065 = 0.00426 with rlhflab's GRPO "
           "default and 0.001 × 0.1065 = 0.000107 with verl's example: forty times weaker.",
           0.5, k3, grpo.kl_coeff, k3, grpo.kl_coeff * k3, 0.001, k3, 0.001 * k3)


# ---------------------------------------------------------------- 11. value clip


def test_value_clip_example():
    from rlhflab.trainers.ppo import PPOSection
    assert PPOSection().value_clip == 0.2
    v, old, ret, m = t([1.6]), t([1.0]), t([2.0]), torch.ones(1, 1)
    quoted("old value 1, new value 1.6, return 2. Unclipped error (1.6 - 2)² = 0.16.", 1, 1.6, 2, 1.6, 2,
           (v - ret).square())
    for clip, text in ((0.2, "clip 0.2: the clipped value is 1.2, error 0.64; the loss ½ · max(0.16, 0.64) = 0.32."),
                       (0.5, "clip 0.5: the clipped value is 1.5, error 0.25; the loss ½ · max(0.16, 0.25) = 0.125.")):
        vc = old + (v - old).clamp(-clip, clip)
        loss = ops.value_loss(v, old, ret, m, clip_range=clip).loss
        quoted(text, clip, vc, (vc - ret).square(), (v - ret).square(), (vc - ret).square(), loss)


def test_page_is_linked_from_the_guide():
    readme = (PAGE.parent / "README.md").read_text(encoding="utf-8")
    assert "(conventions.md)" in readme


# ---------------------------------------------------------------- 12-20. TRL 1.16
# TRL's side is its convention written out in a line or two (what TRL 1.16's GRPO, RLOO and
# DPO trainers compute, read from their source and checked on these inputs); rlhflab's side
# is rlhflab's own functions.


def test_trl_bias_corrected_kl_gradient():
    from rlhflab.trainers.grpo import GRPOSection
    assert GRPOSection().kl_estimator == "k3"
    quoted("TRL 1.16's default `use_bias_correction_kl=True`", 1.16)
    values, ours, trl = [], [], []
    for d in (0.5, -0.5):
        lp = t([d]).requires_grad_(True)          # log π; log π_ref = 0, log π_old = log π (on-policy)
        ref = torch.zeros(1, 1, dtype=F64)
        k3 = ops.kl_estimate(lp, ref, "k3")
        (g_ours,) = torch.autograd.grad(k3.sum(), lp)
        # TRL: k3 · r with r = exp(log π − log π_old), differentiable, 1 in value
        k3_trl = ops.kl_estimate(lp, ref, "k3") * torch.exp(lp - lp.detach())
        (g_trl,) = torch.autograd.grad(k3_trl.sum(), lp)
        assert k3_trl.item() == k3.item()          # the same value on-policy
        values.append(k3.item()), ours.append(g_ours.item()), trl.append(g_trl.item())
        assert g_trl.item() == pytest.approx(d, abs=1e-12)   # (1 - e^-d) + k3 = d
    quoted("d = 0.5: k3 = 0.1065 in both. The gradient of the KL term with respect to log π is 0.3935 in "
           "rlhflab and 0.5 in TRL.", 0.5, values[0], ours[0], trl[0])
    quoted("d = -0.5: k3 = 0.1487 in both; the gradient is -0.6487 in rlhflab and -0.5 in TRL.",
           -0.5, values[1], ours[1], trl[1])


def test_trl_entropy_bonus_is_a_token_mean():
    from rlhflab.engine.update import group_normalizer, loss_terms
    from rlhflab.trainers.grpo import GRPOSection
    ent = t([1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0])
    trl = (ent * MASK).sum() / MASK.sum()          # TRL: the micro-batch token mean, any loss_type
    lp = torch.zeros(2, 4, dtype=F64)

    def ours(agg):
        sec = GRPOSection(loss_aggregation=agg, kl_coeff=0.0, entropy_coeff=0.01)
        norm = group_normalizer(MASK, agg, 8)
        return loss_terms(lp, lp, torch.zeros_like(lp), MASK, sec, normalizer=norm, entropy=ent).entropy

    quoted("TRL, any `loss_type`: (1 + 1 + 1 + 2 + 2) / 5 = 1.4.", 1, 1, 1, 2, 2, MASK.sum(), trl)
    quoted("rlhflab `token_mean`: 1.4 as well; `seq_mean`: (1 + 2) / 2 = 1.5; `token_sum` (Dr. GRPO) with "
           "`max_new_tokens` 8: 7 / (2 × 8) = 0.4375, so the same bonus needs an `entropy_coeff` 3.2 times",
           ours("token_mean"), 1, 2, 2, ours("seq_mean"), 8, (ent * MASK).sum(), 2, 8, ours("token_sum"),
           trl / ours("token_sum"))


def test_trl_counts_masked_truncated_responses():
    from rlhflab.engine.minibatch import loss_mask_of
    from rlhflab.engine.update import group_normalizer
    from rlhflab.rollout import Rollout
    losses = t([1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0])
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    roll = Rollout(torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.long),
                   torch.ones(3, 4, dtype=torch.long), response_mask, torch.tensor([False, False, True]))
    mask = loss_mask_of(roll, mask_truncated=True)                        # the third row is all 0
    max_new = 4

    def ours(agg):
        return ops.aggregate(losses, mask, agg, normalizer=group_normalizer(mask, agg, max_new))

    m = mask.to(F64)
    trl_grpo = ((losses * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()       # TRL grpo: mean over all B
    trl_dr = (losses * m).sum() / (losses.shape[0] * max_new)               # TRL dr_grpo: B × max length
    trl_tok = (losses * m).sum() / m.sum()                                  # TRL dapo / bnpo
    quoted("a third response truncated at `max_new_tokens` 4, masked.", max_new)
    quoted("`seq_mean`: rlhflab (1 + 2) / 2 = 1.5; TRL's `grpo` (1 + 2 + 0) / 3 = 1.",
           1, 2, 2, ours("seq_mean"), 1, 2, 0, 3, trl_grpo)
    quoted("`token_sum`: rlhflab 7 / (2 × 4) = 0.875; TRL's `dr_grpo` 7 / (3 × 4) = 0.5833.",
           (losses * m).sum(), 2, 4, ours("token_sum"), (losses * m).sum(), 3, 4, trl_dr)
    quoted("token mean: 7 / 5 = 1.4 in both", (losses * m).sum(), m.sum(), ours("token_mean"))
    assert ours("token_mean") == trl_tok


def test_trl_bnpo_averages_micro_batch_means():
    from rlhflab.engine.update import group_normalizer
    mbs = [(t([1.0, 1.0, 1.0], [2.0, 2.0, 0.0]), torch.tensor([[1, 1, 1], [1, 1, 0]])),
           (t([3.0, 0.0, 0.0], [4.0, 4.0, 4.0]), torch.tensor([[1, 0, 0], [1, 1, 1]]))]
    group = group_normalizer(torch.cat([m for _, m in mbs]), "token_mean", 3)   # 9 tokens
    ours = sum(ops.aggregate(x, m, "token_mean", normalizer=group) for x, m in mbs)   # what the engine sums
    means = [ops.aggregate(x, m, "token_mean") for x, m in mbs]                 # each micro-batch's own mean
    bnpo = sum(means) / len(mbs)                                                # TRL bnpo: / accumulation steps
    quoted("(token mean 7 / 5 = 1.4), the second [3] and [4, 4, 4] (15 / 4 = 3.75).", 7, 5, means[0], 3, 4, 4, 4,
           15, 4, means[1])
    quoted("rlhflab `token_mean` and TRL `dapo`: (7 + 15) / 9 = 2.4444.", 7, 15, group, ours)
    quoted("TRL `bnpo`: (1.4 + 3.75) / 2 = 2.575.", means[0], means[1], 2, bnpo)


def test_trl_sequence_mask_versus_tis():
    from rlhflab.config.schema import PolicySection
    assert PolicySection().tis_cap is None and PolicySection().sequence_mask_cap is None
    delta = t([0.5, 0.5, 0.2], [0.1, -0.3, 0.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    old, sample = delta, torch.zeros_like(delta)                  # Δ = old − sample
    seq = ops.sequence_mask_weights(old, sample, mask, cap=3.0)
    tis = ops.truncated_is_weights(old, sample, mask, cap=3.0)
    # TRL's sequence_mask written out: ρ = exp(Σ Δ), kept if ρ <= 3
    rho = torch.exp((delta * mask).sum(-1))
    trl = torch.where(rho > 3, torch.zeros_like(rho), rho).unsqueeze(1) * mask
    torch.testing.assert_close(seq.weights, trl)
    quoted("(`vllm_importance_sampling_mode: sequence_mask`, C = 3)", 3)
    quoted("response A has Δ = [0.5, 0.5, 0.2], response B Δ = [0.1, -0.3].", delta[0], delta[1, :2])
    quoted("ρ_A = e^1.2 = 3.3201 > 3, so A is masked; ρ_B = e^-0.2 = 0.8187 weighs both of B's tokens.",
           1.2, seq.ratio[0], 3, -0.2, seq.ratio[1])
    assert seq.masked.tolist() == [True, False] and torch.equal(seq.weights[0], torch.zeros(3, dtype=F64))
    assert seq.weights[1, 0] == seq.weights[1, 1] == seq.ratio[1]
    quoted("`tis_cap=3`: A's tokens get [1.6487, 1.6487, 1.2214] and B's [1.1052, 0.7408].", 3, tis[0],
           tis[1, :2])
    long = ops.sequence_mask_weights(torch.full((1, 300), 0.004, dtype=F64), torch.zeros(1, 300, dtype=F64),
                                     torch.ones(1, 300), cap=3.0)
    quoted("a 300-token response whose tokens are each 0.004 nats off has ρ = e^1.2", 300, 0.004, 300 * 0.004)
    assert long.masked.item()


def test_trl_rloo_sequence_ratio_and_normalisation():
    from rlhflab.engine.dist import Dist, whiten
    lp = t([0.1, 0.1]).requires_grad_(True)          # log π; log π_old = 0: token log-ratios 0.1
    old, adv, m = torch.zeros(1, 2, dtype=F64), torch.ones(1, 2, dtype=F64), torch.ones(1, 2)
    out = ops.ppo_policy_loss(lp, old, adv, m, clip_eps=0.2)
    (g_ours,) = torch.autograd.grad(out.loss, lp)
    # TRL: one ratio per response, exp(Σ log π − Σ log π_old), clipped, mean over responses
    lp2 = lp.detach().clone().requires_grad_(True)
    ratio = torch.exp(lp2.sum(-1) - old.sum(-1))
    trl = -torch.minimum(ratio * 1.0, ratio.clamp(0.8, 1.2) * 1.0).mean()
    (g_trl,) = torch.autograd.grad(trl, lp2)
    quoted("each token's ratio is e^0.1 = 1.1052, inside the clip: the loss is -1.1052 and each token's log-prob "
           "gets the gradient -0.5526.", 0.1, math.exp(0.1), out.loss, g_ours[0, 0])
    assert g_ours[0, 0] == g_ours[0, 1]
    quoted("the response's ratio is e^0.2 = 1.2214, above 1.2: the loss is -1.2 and the gradient 0.",
           0.2, ratio, 1.2, trl, g_trl.abs().max())
    a = torch.tensor([1.0, 0.0, 0.0, -1.0], dtype=F64)
    ours = whiten(a, torch.ones_like(a), Dist())                         # what rloo.normalize_advantages runs
    trl_norm = (a - a.mean()) / (a.std(unbiased=True) + 1e-4)            # TRL: std with n − 1, plus 1e-4
    quoted("Normalising advantages [1, 0, 0, -1]: rlhflab gives [1.4142, 0, 0, -1.4142], TRL [1.2246, 0, 0, -1.2246].",
           a, ours, trl_norm)


def test_trl_ipo_divides_by_length():
    beta = 0.1
    # chosen: log-ratio 2 over 4 tokens; rejected: -1 over 2 tokens (policy sums, reference 0)
    pc, pr, zero = t(2.0), t(-1.0), torch.zeros(1, dtype=F64)
    ours = ops.dpo_loss(pc, pr, zero, zero, beta, "ipo").loss
    h_trl = pc / 4 - pr / 2                                               # TRL: per-token means
    trl = (h_trl - 1 / (2 * beta)).square().mean()
    quoted("β = 0.1 (1/(2β) = 5)", beta, 1, 2, 1 / (2 * beta))
    quoted("rlhflab: h = 2 - (-1) = 3, loss (3 - 5)² = 4.", pc, pr, pc - pr, pc - pr, 5, ours)
    quoted("TRL: h = 2/4 - (-1/2) = 1, loss (1 - 5)² = 16.", 2, 4, -1, 2, h_trl, h_trl, 5, trl)


def test_trl_sigmoid_ignores_label_smoothing():
    import torch.nn.functional as F
    beta, eps = 0.1, 0.1
    pc, zero = t(2.0), torch.zeros(1, dtype=F64)                      # h = 2
    ours = ops.dpo_loss(pc, zero, zero, zero, beta, "sigmoid", label_smoothing=eps).loss
    trl = -F.logsigmoid(beta * pc).mean()                                 # TRL sigmoid: ε unused
    robust = ((-(1 - eps) * F.logsigmoid(beta * pc) + eps * F.logsigmoid(-beta * pc)) / (1 - 2 * eps)).mean()
    assert trl == ops.dpo_loss(pc, zero, zero, zero, beta, "sigmoid").loss
    quoted("β = 0.1, h = 2, ε = 0.1: rlhflab's loss is 0.6181, TRL's sigmoid 0.5981 (plain DPO).",
           beta, pc, eps, ours, trl)
    quoted("TRL's `robust` loss with the same ε is a third value, 0.5731.", robust)


def test_rpo_nll_term_and_its_trl_name(monkeypatch):
    from rlhflab.trainers import dpo
    help_ = dpo.DPOSection.__dataclass_fields__["sft_coeff"].metadata.get("help", "")
    assert "rpo_alpha" not in help_ and "loss_weights [1, sft_coeff]" in help_ and len(help_) <= 200
    # two pairs: chosen token log-probs [-1, -2, -3] and [-2] (sums -6, -2); rejected sums -5, -4
    seq = t(-6.0, -2.0, -5.0, -4.0)
    monkeypatch.setattr(dpo, "policy_sequence_logprobs", lambda actor, batch: seq)
    pairs = [dpo.TokenizedPair([1], [5, 6, 7], [8, 9]), dpo.TokenizedPair([1], [5], [8, 9, 10])]
    ref = torch.zeros(2, dtype=F64)
    plain, st = dpo.dpo_micro_batch_loss(object(), pairs, ref, ref, dpo.DPOSection(sft_coeff=0.0), 0, "cpu")
    rpo, _ = dpo.dpo_micro_batch_loss(object(), pairs, ref, ref, dpo.DPOSection(sft_coeff=0.5), 0, "cpu")
    quoted("chosen token log-probs [-1, -2, -3] and [-2] give a mean NLL of 8 / 4 = 2; with α = 0.5 the loss is "
           "the DPO loss + 1.", -1, -2, -3, -2, 8, 4, st.nll, 0.5, rpo - plain)
