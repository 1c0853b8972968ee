"""Losses: hand-worked values and gradients, loop parity, padding and accumulation invariances."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlhflab.ops import (
    aggregate,
    dpo_loss,
    entropy_loss,
    ppo_policy_loss,
    reward_model_loss,
    value_loss,
)

LN15, LN05 = math.log(1.5), math.log(0.5)

# ---------------------------------------------------------------- aggregation


def test_aggregate_hand_worked():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # token_mean: (1 + 2 + 3 + 4) / 4 = 2.5; seq_mean: (mean(1,2,3) + 4) / 2 = (2 + 4) / 2 = 3
    assert aggregate(x, mask, "token_mean").item() == pytest.approx(2.5)
    assert aggregate(x, mask, "seq_mean").item() == pytest.approx(3.0)
    # normalizer replaces the denominator: 10 / 8 and (2 + 4) / 4
    assert aggregate(x, mask, "token_mean", normalizer=8).item() == pytest.approx(1.25)
    assert aggregate(x, mask, "seq_mean", normalizer=4).item() == pytest.approx(1.5)
    # an empty row does not count as a sequence: (2 + 4) / 2 still
    x3, m3 = torch.cat([x, torch.ones(1, 3)]), torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    assert aggregate(x3, m3, "seq_mean").item() == pytest.approx(3.0)
    assert aggregate(x, torch.zeros_like(mask)).item() == 0.0  # nothing to average: 0, not NaN
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(x, mask, "sum")
    with pytest.raises(ValueError):
        aggregate(x, mask[:, :1])

# ---------------------------------------------------------------- PPO policy loss


def _leaf(values):
    return torch.tensor(values, requires_grad=True)


def test_ppo_policy_loss_hand_worked_and_gradients():
    # four tokens, ε = 0.2 (clip range [0.8, 1.2]):
    #   t0: ratio 1.5, A = +1: unclipped -1.5, clipped -1.2 -> max = -1.2 (clipped: ratio past 1+ε with A > 0)
    #   t1: ratio 1.5, A = -1: unclipped  1.5, clipped  1.2 -> max =  1.5 (unclipped)
    #   t2: ratio 0.5, A = +1: unclipped -0.5, clipped -0.8 -> max = -0.5 (unclipped)
    #   t3: ratio 0.5, A = -1: unclipped  0.5, clipped  0.8 -> max =  0.8 (clipped: ratio below 1-ε with A < 0)
    # token_mean: (-1.2 + 1.5 - 0.5 + 0.8) / 4 = 0.6 / 4 = 0.15
    logprobs = _leaf([[LN15, LN15, LN05, LN05]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    out = ppo_policy_loss(logprobs, old, adv, torch.ones(1, 4), clip_eps=0.2)
    assert out.loss.item() == pytest.approx(0.15, abs=1e-6)
    assert out.clip_frac.item() == pytest.approx(0.5)  # t0 and t3
    # approx_kl = mean ½ log_ratio² = (2·½·0.405465² + 2·½·0.693147²) / 4 = 0.161214
    assert out.approx_kl.item() == pytest.approx(0.161214, abs=1e-5)
    # gradient: 0 on the clipped tokens; d(-A·ratio)/d logprob = -A·ratio on the others, / 4 tokens
    #   t1: -(-1)·1.5 / 4 = 0.375;  t2: -(1)·0.5 / 4 = -0.125
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.375, -0.125, 0.0]]))


def test_ppo_gradient_zero_exactly_where_clipped_in_advantage_direction():
    g = torch.Generator().manual_seed(0)
    log_ratio = (torch.rand(8, 16, generator=g) - 0.5) * 1.2                  # ratio in [0.55, 1.82]
    adv = torch.randn(8, 16, generator=g)
    logprobs = log_ratio.clone().requires_grad_(True)
    loss = ppo_policy_loss(logprobs, torch.zeros(8, 16), adv, torch.ones(8, 16), clip_eps=0.2).loss
    (grad,) = torch.autograd.grad(loss, logprobs)
    ratio = log_ratio.exp()
    clipped = ((ratio > 1.2) & (adv > 0)) | ((ratio < 0.8) & (adv < 0))
    assert clipped.any() and (~clipped).any()
    assert (grad[clipped] == 0).all()
    assert (grad[~clipped] != 0).all()
    torch.testing.assert_close(grad[~clipped], (-adv * ratio / adv.numel())[~clipped])


def test_ppo_dual_clip_bounds_negative_advantages():
    # ε = 0.2, c = 3:
    #   t0: ratio 5, A = -1: unclipped 5, clipped 1.2 -> max 5, bounded by -A·c = 3 -> 3 (no gradient)
    #   t1: ratio 2, A = -1: max(2, 1.2) = 2 < 3 -> 2 (gradient -A·ratio = 2)
    #   t2: ratio 5, A = +1: max(-5, -1.2) = -1.2 (no dual clip for A > 0)
    logprobs = _leaf([[math.log(5.0), math.log(2.0), math.log(5.0)]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    out = ppo_policy_loss(logprobs, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_eps=0.2, dual_clip=3.0)
    # (3 + 2 - 1.2) / 3 = 1.266667
    assert out.loss.item() == pytest.approx(3.8 / 3, abs=1e-6)
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 2.0 / 3, 0.0]]))
    # without the dual clip t0 costs 5: (5 + 2 - 1.2) / 3
    plain = ppo_policy_loss(logprobs, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_eps=0.2).loss
    assert plain.item() == pytest.approx(5.8 / 3, abs=1e-6)


def test_ppo_asymmetric_clip_eps_high():
    # ε_low = 0.2, ε_high = 0.28 (clip range [0.8, 1.28]):
    #   t0: ratio 1.25, A = +1: inside -> -1.25, gradient flows (symmetric 0.2 would clip to -1.2)
    #   t1: ratio 1.30, A = +1: clipped at 1.28 -> -1.28, no gradient
    #   t2: ratio 0.75, A = -1: below 0.8 -> clipped 0.8 (the low side is still 0.2)
    logprobs = _leaf([[math.log(1.25), math.log(1.3), math.log(0.75)]])
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    out = ppo_policy_loss(logprobs, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_eps=0.2, clip_eps_high=0.28)
    assert out.loss.item() == pytest.approx((-1.25 - 1.28 + 0.8) / 3, abs=1e-6)
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[-1.25 / 3, 0.0, 0.0]]))
    sym = ppo_policy_loss(logprobs, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_eps=0.2).loss
    assert sym.item() == pytest.approx((-1.2 - 1.2 + 0.8) / 3, abs=1e-6)


def _ppo_loop(logprobs, old, adv, mask, eps_low, eps_high, dual_clip, aggregation):
    per_seq, total, count = [], 0.0, 0
    for lp_row, old_row, a_row, m_row in zip(logprobs, old, adv, mask):
        row = []
        for lp, o, a, m in zip(lp_row, old_row, a_row, m_row):
            if not m:
                continue
            ratio = math.exp(lp - o)
            loss = max(-a * ratio, -a * min(max(ratio, 1 - eps_low), 1 + eps_high))
            if dual_clip is not None and a < 0:
                loss = min(loss, -a * dual_clip)
            row.append(loss)
        total, count = total + sum(row), count + len(row)
        if row:
            per_seq.append(sum(row) / len(row))
    return total / count if aggregation == "token_mean" else sum(per_seq) / len(per_seq)


def _random_batch(b, t, seed, min_len=1):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logprobs + (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 0.8
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(min_len, t + 1, (b,), generator=g)
    mask = (torch.arange(t) < lengths[:, None]).long()                         # (B, T) right-padded
    return logprobs, old, adv, mask


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("eps_high,dual_clip", [(None, None), (0.28, None), (None, 2.0), (0.3, 3.0)])
def test_ppo_policy_loss_matches_loop(aggregation, eps_high, dual_clip):
    lp, old, adv, mask = _random_batch(6, 10, seed=1)
    out = ppo_policy_loss(lp, old, adv, mask, clip_eps=0.2, clip_eps_high=eps_high, dual_clip=dual_clip,
                          aggregation=aggregation)
    expected = _ppo_loop(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2,
                         0.2 if eps_high is None else eps_high, dual_clip, aggregation)
    assert out.loss.item() == pytest.approx(expected, rel=1e-9)

# ---------------------------------------------------------------- value loss


def test_value_loss_hand_worked_and_gradients():
    # clip range 0.2:
    #   t0: V = 1.5, V_old = 1, R = 2: unclipped (1.5-2)² = 0.25;
    #       V_clip = 1 + clip(0.5) = 1.2, (1.2-2)² = 0.64 -> the clipped branch (larger) is used;
    #       V_clip does not move with V (clip saturated), so the gradient is 0
    #   t1: V = 2,   V_old = 1, R = 0: unclipped (2-0)² = 4; V_clip = 1.2, 1.44 -> unclipped
    #       gradient of ½·(V-R)²/2 tokens = (V - R)/2 = 1.0
    # loss = ½ · (0.64 + 4) / 2 = 1.16
    values = _leaf([[1.5, 2.0]])
    out = value_loss(values, torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 0.0]]), torch.ones(1, 2),
                     clip_range=0.2)
    assert out.loss.item() == pytest.approx(1.16, abs=1e-6)
    assert out.clip_frac.item() == pytest.approx(0.5)
    (grad,) = torch.autograd.grad(out.loss, values)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 1.0]]))
    # clip_range=None: ½ · (0.25 + 4) / 2 = 1.0625, gradient (V - R)/2 = [-0.25, 1.0]
    plain = value_loss(values, torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 0.0]]), torch.ones(1, 2),
                       clip_range=None)
    assert plain.loss.item() == pytest.approx(1.0625, abs=1e-6)
    (grad,) = torch.autograd.grad(plain.loss, values)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, 1.0]]))


def _value_loop(values, old, returns, mask, clip, aggregation):
    per_seq, total, count = [], 0.0, 0
    for v_row, o_row, r_row, m_row in zip(values, old, returns, mask):
        row = []
        for v, o, r, m in zip(v_row, o_row, r_row, m_row):
            if m:
                v_clip = o + min(max(v - o, -clip), clip)
                row.append(0.5 * max((v - r) ** 2, (v_clip - r) ** 2))
        total, count = total + sum(row), count + len(row)
        if row:
            per_seq.append(sum(row) / len(row))
    return total / count if aggregation == "token_mean" else sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_value_loss_matches_loop(aggregation):
    _, _, _, mask = _random_batch(6, 10, seed=2)
    g = torch.Generator().manual_seed(3)
    values, old, returns = (torch.randn(6, 10, generator=g, dtype=torch.float64) for _ in range(3))
    out = value_loss(values, old, returns, mask, clip_range=0.3, aggregation=aggregation)
    expected = _value_loop(values.tolist(), old.tolist(), returns.tolist(), mask.tolist(), 0.3, aggregation)
    assert out.loss.item() == pytest.approx(expected, rel=1e-9)

# ---------------------------------------------------------------- entropy loss


def test_entropy_loss_hand_worked():
    # mean over kept [1, 3, 4] = 8/3; the loss is its negative
    out = entropy_loss(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1, 0], [1, 1]]))
    assert out.loss.item() == pytest.approx(-8 / 3)
    assert out.entropy.item() == pytest.approx(8 / 3)

# ---------------------------------------------------------------- invariances


def _pad(x, n, fill):
    return torch.cat([x, torch.full((x.shape[0], n), fill, dtype=x.dtype)], dim=1)


def test_right_padding_changes_no_loss_or_gradient():
    lp, old, adv, mask = _random_batch(5, 7, seed=4)
    g = torch.Generator().manual_seed(5)
    values, returns = (torch.randn(5, 7, generator=g, dtype=torch.float64) for _ in range(2))
    for aggregation in ("token_mean", "seq_mean"):
        lp_a = lp.clone().requires_grad_(True)
        lp_b = _pad(lp, 3, -2.5).requires_grad_(True)        # finite garbage at the padding
        a = ppo_policy_loss(lp_a, old, adv, mask, dual_clip=3.0, aggregation=aggregation)
        b = ppo_policy_loss(lp_b, _pad(old, 3, -9.0), _pad(adv, 3, 4.0), _pad(mask, 3, 0),
                            dual_clip=3.0, aggregation=aggregation)
        assert b.loss.item() == pytest.approx(a.loss.item(), rel=1e-12)
        assert b.clip_frac.item() == pytest.approx(a.clip_frac.item())
        assert b.approx_kl.item() == pytest.approx(a.approx_kl.item())
        (ga,), (gb,) = torch.autograd.grad(a.loss, lp_a), torch.autograd.grad(b.loss, lp_b)
        torch.testing.assert_close(gb[:, :7], ga)
        assert (gb[:, 7:] == 0).all()
        va = value_loss(values, old, returns, mask, aggregation=aggregation)
        vb = value_loss(_pad(values, 3, 50.0), _pad(old, 3, -50.0), _pad(returns, 3, 8.0), _pad(mask, 3, 0),
                        aggregation=aggregation)
        assert vb.loss.item() == pytest.approx(va.loss.item(), rel=1e-12)
        ea = entropy_loss(values.abs(), mask, aggregation)
        eb = entropy_loss(_pad(values.abs(), 3, 7.0), _pad(mask, 3, 0), aggregation)
        assert eb.loss.item() == pytest.approx(ea.loss.item(), rel=1e-12)


def test_accumulation_8x1_equals_1x8():
    """The loss (and gradient) of a batch of 8 equals the sum over 8 micro-batches of 1
    when the micro-batches are given the whole batch's normalizer; for seq_mean the mean of
    the micro-batch losses equals it too (each sequence weighs the same)."""
    lp, old, adv, mask = _random_batch(8, 9, seed=6)
    assert len(set(mask.sum(1).tolist())) > 1   # lengths differ, so the normalizer matters
    g = torch.Generator().manual_seed(7)
    values, v_old, returns = (torch.randn(8, 9, generator=g, dtype=torch.float64) for _ in range(3))
    n_tokens = mask.sum()

    def run(aggregation, normalizer, micro):
        lp_leaf, v_leaf = lp.clone().requires_grad_(True), values.clone().requires_grad_(True)
        total = 0.0
        for rows in ([slice(0, 8)] if not micro else [slice(i, i + 1) for i in range(8)]):
            loss = (ppo_policy_loss(lp_leaf[rows], old[rows], adv[rows], mask[rows], dual_clip=3.0,
                                    aggregation=aggregation, normalizer=normalizer).loss
                    + value_loss(v_leaf[rows], v_old[rows], returns[rows], mask[rows],
                                 aggregation=aggregation, normalizer=normalizer).loss
                    + 0.01 * entropy_loss(v_leaf[rows].abs(), mask[rows], aggregation, normalizer).loss)
            if micro and normalizer is None:
                loss = loss / 8      # the usual "loss / accumulation_steps"
            loss.backward()          # gradients accumulate in .grad
            total += loss.item()
        return total, lp_leaf.grad, v_leaf.grad

    # token_mean: the whole batch, then 8 micro-batches each divided by the total token count
    full = run("token_mean", None, micro=False)
    acc = run("token_mean", n_tokens, micro=True)
    assert acc[0] == pytest.approx(full[0], rel=1e-12)
    torch.testing.assert_close(acc[1], full[1])
    torch.testing.assert_close(acc[2], full[2])
    # ... while "loss / accumulation_steps" with per-micro-batch token means is NOT the same
    naive = run("token_mean", None, micro=True)
    assert abs(naive[0] - full[0]) > 1e-3

    # seq_mean: directly (mean of the micro-batch losses) and with normalizer = 8 sequences
    full = run("seq_mean", None, micro=False)
    for normalizer in (None, 8):
        acc = run("seq_mean", normalizer, micro=True)
        assert acc[0] == pytest.approx(full[0], rel=1e-12)
        torch.testing.assert_close(acc[1], full[1])
        torch.testing.assert_close(acc[2], full[2])

# ---------------------------------------------------------------- DPO


def test_dpo_loss_hand_worked():
    # row 0: h = (-1 - -3) - (-2 - -2) = 2;  row 1: h = (-4 - -3) - (-2 - -2) = -1;  β = 0.5
    pc, pr = _leaf([-1.0, -4.0]), torch.tensor([-3.0, -3.0])
    rc, rr = torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0])
    # sigmoid: -log σ(βh): βh = 1 -> log(1 + e^-1) = 0.313262; βh = -0.5 -> log(1 + e^0.5) = 0.974077
    out = dpo_loss(pc, pr, rc, rr, beta=0.5, kind="sigmoid")
    assert out.loss.item() == pytest.approx((0.313262 + 0.974077) / 2, abs=1e-6)
    # rewards β(log π - log π_ref): chosen [0.5·1, 0.5·(-2)], rejected [0.5·(-1), 0.5·(-1)]
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(out.rejected_rewards, torch.tensor([-0.5, -0.5]))
    # gradient dL/dh = -β σ(-βh) / B: row 0 -0.5·σ(-1)/2 = -0.5·0.268941/2 = -0.067235
    (grad,) = torch.autograd.grad(out.loss, pc)
    assert grad[0].item() == pytest.approx(-0.5 * 0.268941 / 2, abs=1e-6)
    # label smoothing ε = 0.1: 0.9·(-log σ(βh)) + 0.1·(-log σ(-βh)), and -log σ(-x) = x - log σ(x)
    #   row 0: 0.9·0.313262 + 0.1·1.313262 = 0.413262
    #   row 1: 0.9·0.974077 + 0.1·0.474077 = 0.924077
    ls = dpo_loss(pc, pr, rc, rr, beta=0.5, kind="sigmoid", label_smoothing=0.1)
    assert ls.loss.item() == pytest.approx((0.413262 + 0.924077) / 2, abs=1e-6)
    # ipo: (h - 1/(2β))² = (2 - 1)² = 1 and (-1 - 1)² = 4 -> 2.5
    assert dpo_loss(pc, pr, rc, rr, beta=0.5, kind="ipo").loss.item() == pytest.approx(2.5)
    # hinge: max(0, 1 - βh) = max(0, 0) = 0 and max(0, 1.5) = 1.5 -> 0.75
    assert dpo_loss(pc, pr, rc, rr, beta=0.5, kind="hinge").loss.item() == pytest.approx(0.75)


def test_dpo_loss_errors():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="ref_chosen"):
        dpo_loss(x, x, torch.zeros(3, 1), x)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        dpo_loss(*(torch.zeros(3, 2) for _ in range(4)))
    with pytest.raises(ValueError, match="unknown DPO loss kind"):
        dpo_loss(x, x, x, x, kind="kto")

# ---------------------------------------------------------------- reward model


def test_reward_model_loss_hand_worked():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    # gaps [1, -1]: -log σ(1) = 0.313262, -log σ(-1) = 1.313262 -> mean 0.813262; accuracy 1/2
    out = reward_model_loss(chosen, rejected)
    assert out.loss.item() == pytest.approx(0.813262, abs=1e-6)
    assert out.accuracy.item() == pytest.approx(0.5)
    # margin 1: gaps [0, -2]: log 2 = 0.693147, -log σ(-2) = 2.126928 -> mean 1.410038
    assert reward_model_loss(chosen, rejected, margin=1.0).loss.item() == pytest.approx(1.410038, abs=1e-6)
    # per-pair margin [0, 1]: gaps [1, -2]: (0.313262 + 2.126928) / 2 = 1.220095
    per_pair = reward_model_loss(chosen, rejected, margin=torch.tensor([0.0, 1.0]))
    assert per_pair.loss.item() == pytest.approx(1.220095, abs=1e-6)
    # center_coeff 0.1: + 0.1·mean((2+1)², (0+1)²) = 0.1·5 = 0.5 -> 1.313262
    centred = reward_model_loss(chosen, rejected, center_coeff=0.1)
    assert centred.loss.item() == pytest.approx(0.813262 + 0.5, abs=1e-6)
    # margin and centring together: 1.410038 + 0.5
    both = reward_model_loss(chosen, rejected, margin=1.0, center_coeff=0.1)
    assert both.loss.item() == pytest.approx(1.910038, abs=1e-6)
    # equals -logsigmoid written out
    torch.testing.assert_close(out.loss, -F.logsigmoid(chosen - rejected).mean())


def test_reward_model_loss_shape_errors():
    with pytest.raises(ValueError, match=r"\(B,\)"):
        reward_model_loss(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match=r"\(B,\)"):
        reward_model_loss(torch.zeros(3, 1), torch.zeros(3, 1))
    with pytest.raises(ValueError, match="margin"):   # (B, 1) margin would broadcast to (B, B)
        reward_model_loss(torch.zeros(3), torch.zeros(3), margin=torch.ones(3, 1))

# ---------------------------------------------------------------- shapes


def test_policy_and_value_loss_shape_errors():
    a, b = torch.zeros(2, 3), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="equal"):
        ppo_policy_loss(a, a, b, torch.ones(2, 3))
    with pytest.raises(ValueError, match="equal"):
        ppo_policy_loss(a, a, a, torch.ones(2, 1))
    with pytest.raises(ValueError, match="equal"):
        value_loss(a, a, a, torch.ones(2, 1))
    with pytest.raises(ValueError):
        entropy_loss(a, torch.ones(2, 1))


# ---------------------------------------------------------------- engine additions


def test_token_sum_aggregation_is_a_constant_denominator():
    # Dr. GRPO: Σ loss·mask over the batch divided by a constant, not by the token count.
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # Σ = 1 + 2 + 3 + 4 = 10; default denominator B·T = 2·3 = 6
    assert aggregate(x, mask, "token_sum").item() == pytest.approx(10 / 6)
    # a constant of 2 sequences × 8 max tokens = 16, whatever the lengths
    assert aggregate(x, mask, "token_sum", normalizer=16).item() == pytest.approx(10 / 16)
    # a longer response weighs more per sequence: adding a real token raises the loss,
    # where token_mean would dilute it
    m2 = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert aggregate(x, m2, "token_sum", normalizer=16).item() == pytest.approx(19 / 16)


def test_clip_fractions_low_and_high_split_clip_frac():
    # The four tokens of the hand-worked case above: t0 clipped above (A > 0, ratio 1.5 > 1.2),
    # t3 clipped below (A < 0, ratio 0.5 < 0.8); t1 and t2 unclipped.
    logprobs = torch.tensor([[LN15, LN15, LN05, LN05]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    out = ppo_policy_loss(logprobs, torch.zeros(1, 4), adv, torch.ones(1, 4), clip_eps=0.2)
    assert out.clip_frac_high.item() == pytest.approx(0.25) and out.clip_frac_low.item() == pytest.approx(0.25)
    assert (out.clip_frac_low + out.clip_frac_high).item() == pytest.approx(out.clip_frac.item())


def test_token_weights_scale_each_tokens_loss():
    # Weights [2, 0.5] on two unclipped tokens (ratio 1, A = 1 and -1): (-1·2 + 1·0.5) / 2 = -0.75
    logprobs = _leaf([[0.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0]])
    w = torch.tensor([[2.0, 0.5]])
    out = ppo_policy_loss(logprobs, torch.zeros(1, 2), adv, torch.ones(1, 2), token_weights=w)
    assert out.loss.item() == pytest.approx(-0.75)
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    # d/dlogπ of −A·w·ratio at ratio 1 is −A·w / 2 tokens
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.25]]))
    with pytest.raises(ValueError, match="token_weights"):
        ppo_policy_loss(logprobs, torch.zeros(1, 2), adv, torch.ones(1, 2), token_weights=torch.ones(2))


def test_truncated_is_weights_hand_worked():
    from rlhflab.ops import logprob_gap, truncated_is_weights
    # old − sample = [ln 2, −ln 2, ln 4] -> ratios [2, 0.5, 4], capped at 3 -> [2, 0.5, 3]; padding 0
    old = torch.tensor([[math.log(0.4), math.log(0.1), math.log(0.8), -1.0]])
    sample = torch.tensor([[math.log(0.2), math.log(0.2), math.log(0.2), -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w = truncated_is_weights(old, sample, mask, cap=3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 3.0, 0.0]]))
    assert not w.requires_grad
    # mean |Δ| over real tokens: (ln 2 + ln 2 + ln 4) / 3 = 4 ln 2 / 3
    assert logprob_gap(old, sample, mask).item() == pytest.approx(4 * math.log(2) / 3, rel=1e-6)
    with pytest.raises(ValueError):
        truncated_is_weights(old, sample, mask, cap=0.0)
