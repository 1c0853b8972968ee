"""GAE, group (GRPO) and leave-one-out (RLOO) advantages: hand-worked, loop parity, padding."""

import statistics

import pytest
import torch

from rlhflab.ops import gae, group_advantages, rloo_advantages

# ---------------------------------------------------------------- GAE


def test_gae_worked_example():
    # γ = 0.9, λ = 0.95, r = [1, 0, 2], V = [2, 2.5, 3]; the episode ends after step 2 (V_3 = 0)
    # δ2 = 2 + 0.9·0   - 3   = -1.0
    # δ1 = 0 + 0.9·3   - 2.5 =  0.2
    # δ0 = 1 + 0.9·2.5 - 2   =  1.25
    # γλ = 0.855
    # A2 = -1.0
    # A1 = 0.2  + 0.855·(-1.0)   = -0.655
    # A0 = 1.25 + 0.855·(-0.655) = 1.25 - 0.560025 = 0.689975
    # returns = A + V = [2.689975, 1.845, 2.0]
    out = gae(torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[2.0, 2.5, 3.0]]),
              torch.ones(1, 3), gamma=0.9, lam=0.95)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.689975, -0.655, -1.0]]))
    torch.testing.assert_close(out.returns, torch.tensor([[2.689975, 1.845, 2.0]]))


def test_gae_right_padding_changes_nothing():
    rewards = torch.tensor([[1.0, 0.0, 2.0]])
    values = torch.tensor([[2.0, 2.5, 3.0]])
    ref = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.95)
    # two padding steps whose rewards and values are garbage: they must not leak in
    padded = gae(torch.tensor([[1.0, 0.0, 2.0, 7.0, -5.0]]), torch.tensor([[2.0, 2.5, 3.0, 40.0, 9.0]]),
                 torch.tensor([[1, 1, 1, 0, 0]]), gamma=0.9, lam=0.95)
    torch.testing.assert_close(padded.advantages[:, :3], ref.advantages)
    torch.testing.assert_close(padded.returns[:, :3], ref.returns)
    assert (padded.advantages[:, 3:] == 0).all() and (padded.returns[:, 3:] == 0).all()


def test_gae_special_cases():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(3, 6, generator=g, dtype=torch.float64)
    v = torch.randn(3, 6, generator=g, dtype=torch.float64)
    m = torch.ones(3, 6)
    # λ = 0: A_t = δ_t = r_t + γ V_{t+1} - V_t
    next_v = torch.cat([v[:, 1:], torch.zeros(3, 1, dtype=v.dtype)], 1)
    torch.testing.assert_close(gae(r, v, m, gamma=0.9, lam=0.0).advantages, r + 0.9 * next_v - v)
    # γ = λ = 1: A_t = (sum of rewards from t on) - V_t, so returns are the reward-to-go
    to_go = r.flip(1).cumsum(1).flip(1)
    out = gae(r, v, m, gamma=1.0, lam=1.0)
    torch.testing.assert_close(out.advantages, to_go - v)
    torch.testing.assert_close(out.returns, to_go)


def _gae_loop(rewards, values, mask, gamma, lam):
    adv = [[0.0] * len(row) for row in rewards]
    for b in range(len(rewards)):
        n = int(sum(mask[b]))                    # right-padded: the first n steps are real
        running = 0.0
        for t in reversed(range(n)):
            v_next = values[b][t + 1] if t + 1 < n else 0.0
            delta = rewards[b][t] + gamma * v_next - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
    ret = [[(a + v) if m else 0.0 for a, v, m in zip(ar, vr, mr)] for ar, vr, mr in zip(adv, values, mask)]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


@pytest.mark.parametrize("gamma,lam", [(0.9, 0.95), (1.0, 0.95), (0.99, 0.5)])
def test_gae_matches_loop(gamma, lam):
    g = torch.Generator().manual_seed(1)
    r = torch.randn(6, 9, generator=g, dtype=torch.float64)
    v = torch.randn(6, 9, generator=g, dtype=torch.float64)
    lengths = torch.tensor([9, 1, 4, 0, 7, 2])
    m = (torch.arange(9) < lengths[:, None]).long()                           # (B, T)
    out = gae(r, v, m, gamma=gamma, lam=lam)
    adv, ret = _gae_loop(r.tolist(), v.tolist(), m.tolist(), gamma, lam)
    torch.testing.assert_close(out.advantages, adv)
    torch.testing.assert_close(out.returns, ret)


def test_gae_shape_errors():
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 1))
    with pytest.raises(ValueError):
        gae(torch.zeros(3), torch.zeros(3), torch.ones(3))

# ---------------------------------------------------------------- GRPO group advantages


def test_group_advantages_group_scale_hand_worked():
    # groups of 3: [0, 2, 4] and [5, 5, 5]
    # group 0: mean 2, centred [-2, 0, 2], unbiased var (4 + 0 + 4) / 2 = 4, std 2 -> [-1, 0, 1]
    # group 1: all equal: centred 0 -> 0 (not 0/0 = NaN)
    eps = 1e-4
    out = group_advantages(torch.tensor([0.0, 2.0, 4.0, 5.0, 5.0, 5.0]), 3, scale="group", eps=eps)
    torch.testing.assert_close(out, torch.tensor([-2 / (2 + eps), 0.0, 2 / (2 + eps), 0.0, 0.0, 0.0]))
    # exactly [-1, 0, 1] without eps
    out0 = group_advantages(torch.tensor([0.0, 2.0, 4.0]), 3, scale="group", eps=0.0)
    torch.testing.assert_close(out0, torch.tensor([-1.0, 0.0, 1.0]))


def test_group_advantages_batch_and_none_hand_worked():
    scores = torch.tensor([-3.0, 1.0, 1.0, 1.0])  # groups of 2: [-3, 1] and [1, 1]
    # group means -1 and 1 -> centred [-2, 2, 0, 0]
    # "none": the centred scores
    torch.testing.assert_close(group_advantages(scores, 2, scale="none"), torch.tensor([-2.0, 2.0, 0.0, 0.0]))
    # "batch": batch mean 0; squares 9 + 1 + 1 + 1 = 12; population var 12 / 4 = 3 (every
    #   whole-batch statistic divides by n), std sqrt(3) -> [-2, 2, 0, 0] / sqrt(3)
    torch.testing.assert_close(group_advantages(scores, 2, scale="batch", eps=0.0),
                               torch.tensor([-2.0, 2.0, 0.0, 0.0]) / 3 ** 0.5)
    # "group": group 0 unbiased std sqrt((4 + 4) / 1) = 2·sqrt(2) -> ±1/sqrt(2); group 1 -> 0
    torch.testing.assert_close(group_advantages(scores, 2, scale="group", eps=0.0)[:2],
                               torch.tensor([-2 ** -0.5, 2 ** -0.5]))


def test_group_advantages_constant_groups_no_nan():
    for scale in ("group", "batch", "none"):
        out = group_advantages(torch.full((8,), 3.0), 4, scale=scale)
        assert torch.equal(out, torch.zeros(8)), scale
    # group size 1: nothing to compare with, advantage 0
    assert torch.equal(group_advantages(torch.tensor([1.0, 2.0]), 1), torch.zeros(2))


def _group_loop(scores, k, scale, eps):
    out, all_std = [], statistics.pstdev(scores)  # the batch: population std (n), a group: n - 1
    for i in range(0, len(scores), k):
        grp = scores[i:i + k]
        mean = sum(grp) / k
        std = {"group": statistics.stdev(grp), "batch": all_std, "none": None}[scale]
        out += [(s - mean) / (std + eps) if std is not None else s - mean for s in grp]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_loop(scale):
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(24, generator=g, dtype=torch.float64)
    for k in (2, 4, 6):
        out = group_advantages(scores, k, scale=scale)   # float64 in, float64 out, to float64 precision
        torch.testing.assert_close(out, _group_loop(scores.tolist(), k, scale, 1e-4), rtol=1e-12, atol=1e-12)


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        group_advantages(torch.zeros(6, 1), 2)
    with pytest.raises(ValueError, match="unknown scale"):
        group_advantages(torch.zeros(6), 2, scale="token")

# ---------------------------------------------------------------- RLOO


def test_rloo_hand_worked():
    # k = 3, scores [1, 2, 6]: baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5
    # advantages [1-4, 2-3.5, 6-1.5] = [-3, -1.5, 4.5]
    # second prompt [0, 0, 3]: baselines 1.5, 1.5, 0 -> [-1.5, -1.5, 3]
    out = rloo_advantages(torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0]), 3)
    torch.testing.assert_close(out, torch.tensor([-3.0, -1.5, 4.5, -1.5, -1.5, 3.0]))


def _rloo_loop(scores, k):
    out = []
    for i in range(0, len(scores), k):
        grp = scores[i:i + k]
        for j, s in enumerate(grp):
            others = grp[:j] + grp[j + 1:]
            out.append(s - sum(others) / len(others))
    return torch.tensor(out)


def test_rloo_matches_loop_and_identity():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(24, generator=g)
    for k in (2, 3, 4, 8):
        out = rloo_advantages(scores, k)
        torch.testing.assert_close(out, _rloo_loop(scores.tolist(), k))
        # the same as k/(k-1) times the score minus its prompt's mean; sums to 0 per prompt
        s = scores.view(-1, k)
        torch.testing.assert_close(out, (k / (k - 1) * (s - s.mean(1, keepdim=True))).reshape(-1))
        assert out.view(-1, k).sum(1).abs().max().item() < 1e-5


def test_rloo_errors():
    with pytest.raises(ValueError, match="k >= 2"):
        rloo_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="divisible"):
        rloo_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        rloo_advantages(torch.zeros(4, 1), 2)
