"""Statistics that must be exact, losses that must not overflow, and float64 kept float64
(issue 28): constant groups and constant tensors give exactly 0 at every size, scale and
magnitude; a log-ratio past exp's range gives a finite loss and a 0 gradient; every
public op returns float64 for float64 inputs."""

import math
import threading

import pytest
import torch

from rlhflab import ops
from rlhflab.ops import (group_advantages, kl_estimate, masked_var, masked_whiten, ppo_policy_loss,
                         rloo_advantages, truncated_is_weights)

SIZES = list(range(2, 17)) + [32, 64]
MAGNITUDES = [0.7, 42.1, 1000.3, -3e4, 1e-7, 1 / 3, -0.1]
DTYPES = [torch.float32, torch.float64]

# ---------------------------------------------------------------- group advantages


def test_issue_cases_give_exactly_zero():
    # The issue's cases: the plain s - mean(s) gave +5.96e-4 for eight 0.7s and -0.0367 for 42.1
    # (the float32 sum of eight 0.7s is 5.6000004, one ulp from 8 · 0.7; over std + 1e-4 ≈ 1e-4).
    for value in (0.7, 42.1):
        for scale in ("group", "batch"):
            out = group_advantages(torch.full((8,), value), 8, scale=scale)
            assert torch.equal(out, torch.zeros(8)), (value, scale, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_constant_groups_are_exactly_zero_at_every_size_and_magnitude(scale, dtype):
    g = torch.Generator().manual_seed(0)
    for k in SIZES:
        for value in MAGNITUDES:
            # a whole batch of equal scores, and a constant group beside a group that varies
            # (the batch std is then not 0, and the constant group must still give exactly 0)
            flat = torch.full((3 * k,), value, dtype=dtype)
            assert torch.equal(group_advantages(flat, k, scale=scale), torch.zeros(3 * k, dtype=dtype)), (k, value)
            mixed = torch.cat([torch.full((k,), value, dtype=dtype), torch.randn(k, generator=g, dtype=dtype)])
            out = group_advantages(mixed, k, scale=scale)
            assert torch.equal(out[:k], torch.zeros(k, dtype=dtype)), (k, value, out[:k])
            assert out[k:].abs().sum() > 0


def test_group_advantages_are_shift_invariant():
    # Shifting every score by a constant changes no advantage (the shift by a member is
    # only a re-centring): float64, so the comparison is to float64 rounding.
    g = torch.Generator().manual_seed(1)
    s = torch.randn(24, generator=g, dtype=torch.float64)
    for scale in ("group", "batch", "none"):
        torch.testing.assert_close(group_advantages(s + 1000.0, 6, scale=scale),
                                   group_advantages(s, 6, scale=scale), rtol=0, atol=1e-10)


# ---------------------------------------------------------------- RLOO


@pytest.mark.parametrize("dtype", DTYPES)
def test_rloo_constant_groups_are_exactly_zero(dtype):
    g = torch.Generator().manual_seed(2)
    for k in SIZES:
        for value in MAGNITUDES:
            s = torch.cat([torch.full((k,), value, dtype=dtype), torch.randn(k, generator=g, dtype=dtype)])
            out = rloo_advantages(s, k)
            assert torch.equal(out[:k], torch.zeros(k, dtype=dtype)), (k, value, out[:k])


# ---------------------------------------------------------------- whitening


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_whiten_of_a_constant_is_exactly_zero(dtype):
    for value in MAGNITUDES:
        for n in (3, 7, 10, 33):
            x = torch.full((2, n), value, dtype=dtype)
            x[1, -2:] = 123.0                                  # padding holding something else
            mask = torch.ones(2, n)
            mask[1, -2:] = 0
            assert torch.equal(masked_var(x, mask), torch.zeros((), dtype=dtype))
            assert torch.equal(masked_whiten(x, mask), torch.zeros_like(x)), (value, n)
            assert torch.equal(masked_whiten(x, mask, unbiased=True), torch.zeros_like(x))
            assert torch.equal(masked_whiten(x, mask, dim=-1), torch.zeros_like(x))
            # scale only: the constant comes back unchanged on real tokens, 0 on padding
            assert torch.equal(masked_whiten(x, mask, shift_mean=False), x * mask.to(dtype))


def test_masked_whiten_unbiased_hand_worked():
    # x = [1, 2, 3, 4]: mean 2.5, squares 2.25 + 0.25 + 0.25 + 2.25 = 5
    # population var 5/4 = 1.25; unbiased (n - 1) var 5/3
    x, m = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64), torch.ones(1, 4)
    centred = x - 2.5
    torch.testing.assert_close(masked_whiten(x, m, eps=0.0), centred / math.sqrt(1.25))
    torch.testing.assert_close(masked_whiten(x, m, eps=0.0, unbiased=True), centred / math.sqrt(5 / 3))


class _TwoRanks:
    """A stand-in for `engine.dist.Dist` on one of two threads: each reduction waits
    for the other rank and combines both values, as an all-reduce does."""

    distributed = True

    def __init__(self, rank: int, slots: list, barrier: threading.Barrier):
        self.rank, self.slots, self.barrier = rank, slots, barrier

    def _reduce(self, value, fn):
        self.slots[self.rank] = float(value)
        self.barrier.wait()
        out = fn(self.slots)
        self.barrier.wait()
        return out

    def sum(self, value):
        return self._reduce(value, sum)

    def max(self, value):
        return self._reduce(value, max)


def _on_two_ranks(fn, shards):
    slots, barrier, out, errors = [0.0, 0.0], threading.Barrier(2, timeout=60), [None, None], []

    def work(rank):
        try:
            out[rank] = fn(_TwoRanks(rank, slots, barrier), *shards[rank])
        except Exception as e:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return out


def test_two_rank_whitening_equals_one_process_and_is_exact_on_constants():
    from rlhflab.engine.dist import whiten as loop_whiten

    def whiten(d, x, m):
        return loop_whiten(x, m, d)

    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 5, generator=g) * 3 + 40
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    one = masked_whiten(x, mask)
    two = _on_two_ranks(whiten, [(x[:3], mask[:3]), (x[3:], mask[3:])])
    torch.testing.assert_close(torch.cat(two), one, rtol=0, atol=1e-5)
    # a constant batch: exactly 0 on both ranks, also when one rank has no real token
    c = torch.full((6, 5), 42.1)
    for m1 in (mask[3:], torch.zeros(3, 5)):
        two = _on_two_ranks(whiten, [(c[:3], mask[:3]), (c[3:], m1)])
        assert torch.equal(torch.cat(two), torch.zeros(6, 5))


def test_two_rank_batch_std_equals_one_process():
    from rlhflab.engine.dist import group_advantages as loop_group_advantages

    g = torch.Generator().manual_seed(5)
    s = torch.randn(16, generator=g) + 0.7
    one = group_advantages(s, 4, scale="batch")
    two = _on_two_ranks(lambda d, x: loop_group_advantages(x, 4, "batch", d), [(s[:8],), (s[8:],)])
    torch.testing.assert_close(torch.cat(two), one, rtol=0, atol=1e-6)
    c = torch.full((16,), 1000.3)
    two = _on_two_ranks(lambda d, x: loop_group_advantages(x, 4, "batch", d), [(c[:8],), (c[8:],)])
    assert torch.equal(torch.cat(two), torch.zeros(16))


# ---------------------------------------------------------------- log-ratio overflow


def _issue_case(advantage: float, dual_clip=None, dtype=torch.float32):
    logp = torch.tensor([[-1.0, -1.0]], dtype=dtype, requires_grad=True)
    old = torch.tensor([[-91.0, -1.1]], dtype=dtype)
    out = ppo_policy_loss(logp, old, torch.full((1, 2), advantage, dtype=dtype), torch.ones(1, 2),
                          clip_eps=0.2, dual_clip=dual_clip)
    out.loss.backward()
    return out.loss.detach(), logp.grad


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_ratio_past_exp_range_gives_zero_gradient_not_nan(dtype):
    # token 0: log-ratio 90 (exp overflows float32 at 88.7); A = 1, so the clipped branch
    #   is taken: loss -1.2, gradient 0.
    # token 1: log-ratio 0.1, ratio e^0.1 = 1.105171 inside [0.8, 1.2]: loss -1.105171,
    #   gradient d(-A·ratio)/dlogp = -ratio.
    # token mean: loss (-1.2 - 1.105171) / 2 = -1.152585; gradient [0, -1.105171 / 2 = -0.552585]
    loss, grad = _issue_case(1.0, dtype=dtype)
    r = math.exp(0.1)
    torch.testing.assert_close(loss, torch.tensor((-1.2 - r) / 2, dtype=dtype))
    assert grad[0, 0].item() == 0.0
    torch.testing.assert_close(grad, torch.tensor([[0.0, -r / 2]], dtype=dtype))
    assert round(loss.item(), 4) == -1.1526 and round(grad[0, 1].item(), 4) == -0.5526


def test_log_ratio_past_exp_range_with_dual_clip():
    # A = -1, dual clip c = 3: token 0's ratio is huge, the loss max(ratio, 1.2) is bounded by
    #   c·|A| = 3, gradient 0. token 1: loss = ratio = 1.105171 < 3, gradient +ratio.
    # loss (3 + 1.105171) / 2 = 2.052585; gradient [0, 0.552585]
    loss, grad = _issue_case(-1.0, dual_clip=3.0)
    r = math.exp(0.1)
    torch.testing.assert_close(loss, torch.tensor((3.0 + r) / 2))
    assert grad[0, 0].item() == 0.0
    torch.testing.assert_close(grad, torch.tensor([[0.0, r / 2]]))


def test_ordinary_ratios_are_unchanged_by_the_clamp():
    # |log-ratio| < 2: the loss and gradient equal the unclamped formula bit for bit.
    g = torch.Generator().manual_seed(6)
    lp = torch.randn(4, 7, generator=g) * 0.5
    old = lp + torch.randn(4, 7, generator=g) * 0.5
    adv = torch.randn(4, 7, generator=g)
    mask = (torch.rand(4, 7, generator=g) > 0.2).float()
    for dual in (None, 3.0):
        a = lp.clone().requires_grad_(True)
        ppo_policy_loss(a, old, adv, mask, clip_eps=0.2, dual_clip=dual).loss.backward()
        b = lp.clone().requires_grad_(True)
        ratio = torch.exp(b - old)
        per = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        if dual is not None:
            per = torch.where(adv < 0, torch.minimum(per, -adv * dual), per)
        ((per * mask).sum() / mask.sum()).backward()
        assert torch.equal(a.grad, b.grad)


def test_truncated_is_weights_of_a_wild_ratio_is_the_cap():
    w = truncated_is_weights(torch.tensor([[0.0, -1.0]]), torch.tensor([[-200.0, -1.0]]), torch.ones(1, 2), cap=2.0)
    assert torch.equal(w, torch.tensor([[2.0, 1.0]]))


def test_kl_clamp_bounds_the_estimate():
    # d = logπ - logπ_ref = [30, -30, 0.5]; k1 = d; clamp 10 -> [10, -10, 0.5]
    lp, ref = torch.tensor([[30.0, -30.0, 0.5]]), torch.zeros(1, 3)
    assert torch.equal(kl_estimate(lp, ref, "k1", clamp=10.0), torch.tensor([[10.0, -10.0, 0.5]]))
    # k3 at d = -30: log r = 30 clamped to 20 -> e^20 - 1 - 20 ≈ 4.85e8, then bounded to 10
    assert kl_estimate(lp, ref, "k3", clamp=10.0)[0, 1].item() == 10.0
    with pytest.raises(ValueError, match="clamp"):
        kl_estimate(lp, ref, "k1", clamp=0.0)


# ---------------------------------------------------------------- float64 in, float64 out


def _f64(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


B, T, V, H = 2, 3, 5, 4
M = torch.tensor([[1, 1, 0], [1, 1, 1]])
TOK = torch.tensor([[0, 1, 2], [3, 4, 0]])

# Every public function of rlhflab.ops, called on float64 inputs.
FLOAT64_CALLS = {
    "masked_sum": lambda: ops.masked_sum(_f64(B, T), M),
    "masked_mean": lambda: ops.masked_mean(_f64(B, T), M),
    "masked_var": lambda: ops.masked_var(_f64(B, T), M),
    "masked_whiten": lambda: ops.masked_whiten(_f64(B, T), M),
    "masked_pivot": lambda: ops.masked_pivot(_f64(B, T), M),
    "explained_variance": lambda: ops.explained_variance(_f64(B, T), _f64(B, T, seed=1), M),
    "logprobs_from_logits": lambda: ops.logprobs_from_logits(_f64(B, T, V), TOK),
    "entropy_from_logits": lambda: ops.entropy_from_logits(_f64(B, T, V)),
    "chunked_logprobs": lambda: [ops.chunked_logprobs(_f64(B, T, H), _f64(V, H, seed=1), None, TOK,
                                                      with_entropy=True, transform=tf)
                                 for tf in (None, ops.LogitTransform(scale=0.5, softcap=3.0))],
    "transform_logits": lambda: ops.transform_logits(_f64(B, T, V), ops.LogitTransform(scale=0.5, softcap=3.0)),
    "chunked_cross_entropy": lambda: ops.chunked_cross_entropy(_f64(B, T, H), _f64(V, H, seed=1), None, TOK),
    "kl_estimate": lambda: [ops.kl_estimate(_f64(B, T), _f64(B, T, seed=1), k) for k in ops.KL_KINDS],
    "kl_shaped_rewards": lambda: ops.kl_shaped_rewards(_f64(B), _f64(B, T), _f64(B, T, seed=1), M, 0.1),
    "last_token_index": None,  # returns indices
    "gae": lambda: ops.gae(_f64(B, T), _f64(B, T, seed=1), M),
    "group_advantages": lambda: [ops.group_advantages(_f64(8), 4, s) for s in ("group", "batch", "none")],
    "batch_std_of": lambda: ops.batch_std_of(_f64(8)),
    "rloo_advantages": lambda: ops.rloo_advantages(_f64(8), 4),
    "discounted_returns": lambda: ops.discounted_returns(_f64(B, T), M),
    "aggregate": lambda: [ops.aggregate(_f64(B, T), M, a) for a in ("token_mean", "seq_mean", "token_sum")],
    "ppo_policy_loss": lambda: ops.ppo_policy_loss(_f64(B, T), _f64(B, T, seed=1), _f64(B, T, seed=2), M,
                                                   dual_clip=3.0),
    "value_loss": lambda: ops.value_loss(_f64(B, T), _f64(B, T, seed=1), _f64(B, T, seed=2), M),
    "entropy_loss": lambda: ops.entropy_loss(_f64(B, T).abs(), M),
    "dpo_loss": lambda: [ops.dpo_loss(_f64(B), _f64(B, seed=1), _f64(B, seed=2), _f64(B, seed=3), kind=k)
                         for k in ("sigmoid", "ipo", "hinge")],
    "reward_model_loss": lambda: ops.reward_model_loss(_f64(B), _f64(B, seed=1), center_coeff=0.1),
    "truncated_is_weights": lambda: ops.truncated_is_weights(_f64(B, T), _f64(B, T, seed=1), M, 2.0),
    "logprob_gap": lambda: ops.logprob_gap(_f64(B, T), _f64(B, T, seed=1), M),
    "sequence_mask_weights": lambda: ops.sequence_mask_weights(_f64(B, T), _f64(B, T, seed=1), M, 3.0),
    "gspo_policy_loss": lambda: ops.gspo_policy_loss(_f64(B, T), _f64(B, T, seed=1), _f64(B, T, seed=2), M),
    "place_turn_rewards": lambda: ops.place_turn_rewards(_f64(B, 2), torch.tensor([[0, 1], [1, 2]]),
                                                         torch.ones(B, 2), T),
    "gae_over_actions": lambda: ops.gae_over_actions(_f64(B, T), _f64(B, T, seed=1), M),
    "discounted_returns_over_actions": lambda: ops.discounted_returns_over_actions(_f64(B, T), M),
    "episode_returns": lambda: ops.episode_returns(_f64(B, 2), torch.ones(B, 2)),
    "categorical_kl": lambda: ops.categorical_kl(torch.log_softmax(_f64(B, V), -1),
                                                 torch.log_softmax(_f64(B, V, seed=1), -1)),
    "conjugate_gradient": lambda: ops.conjugate_gradient(
        lambda v: torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64) @ v,
        torch.tensor([1.0, 2.0], dtype=torch.float64)),
    # counter-based sampling takes integer keys, not floats: uniform numbers are float64
    # always; the draw returns token ids (its running sum is float64 whatever the scores' dtype)
    "row_keys": None, "counter_uniform": None, "inverse_cdf_draw": None,
}


def _float_tensors(out):
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _float_tensors(o)]
    return []


def test_every_public_function_is_in_the_float64_table():
    public = {name for name in ops.__all__ if callable(getattr(ops, name))
              and not isinstance(getattr(ops, name), type)}
    assert public == set(FLOAT64_CALLS), public ^ set(FLOAT64_CALLS)


@pytest.mark.parametrize("name", sorted(k for k, v in FLOAT64_CALLS.items() if v is not None))
def test_float64_in_float64_out(name):
    tensors = _float_tensors(FLOAT64_CALLS[name]())
    assert tensors, name
    assert all(t.dtype == torch.float64 for t in tensors), [t.dtype for t in tensors]


def test_two_rank_explained_variance_equals_one_process():
    from rlhflab.engine.dist import explained_variance as dist_explained_variance

    def ev(d, v, r, m):
        return dist_explained_variance(v, r, m, d)

    g = torch.Generator().manual_seed(5)
    returns = torch.randn(6, 5, generator=g) + 3
    values = 0.6 * returns + 0.5 * torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    one = ops.explained_variance(values, returns, mask).item()
    two = _on_two_ranks(ev, [(values[:3], returns[:3], mask[:3]), (values[3:], returns[3:], mask[3:])])
    assert two[0] == two[1] == pytest.approx(one, abs=1e-6)
    # returns that vary on no rank: NaN on both
    flat = torch.full((6, 5), 2.0)
    two = _on_two_ranks(ev, [(values[:3], flat[:3], mask[:3]), (values[3:], flat[3:], mask[3:])])
    assert all(math.isnan(x) for x in two)


def test_batch_moments_hand_worked_one_convention():
    from rlhflab.engine.dist import Dist, batch_moments

    # real values 1, 2, 3 (the 4 is masked out): n 3, mean 2, population var (1 + 0 + 1) / 3
    x, m = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 1.0, 1.0, 0.0])
    got = batch_moments(x, m, Dist())
    assert (got.count, got.mean) == (3.0, 2.0) and got.var == pytest.approx(2 / 3, abs=1e-12)
    # the op's batch std is the same statistic: scores 1, 2, 3 -> sqrt(2/3)
    assert ops.batch_std_of(x[:3]).item() == pytest.approx((2 / 3) ** 0.5, abs=1e-12)
    # a constant batch: variance exactly 0, from the pivot shift
    assert batch_moments(torch.full((5,), 0.7), None, Dist()).var == 0.0
