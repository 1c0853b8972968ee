"""KL estimators and KL-shaped rewards: hand-worked values, Monte Carlo, padding, shapes."""

import math

import pytest
import torch

from rlhflab.ops import KL_KINDS, kl_estimate, kl_shaped_rewards, last_token_index

# d = logprobs - ref_logprobs = [-2, 0, 1.5]
LOGPROBS = torch.tensor([[-3.0, -1.0, -0.5]])
REF = torch.tensor([[-1.0, -1.0, -2.0]])


def test_estimators_hand_worked():
    d = [-2.0, 0.0, 1.5]
    # k1 = d
    torch.testing.assert_close(kl_estimate(LOGPROBS, REF, "k1"), torch.tensor([d]))
    # k2 = mse = d²/2 = [4/2, 0, 2.25/2] = [2, 0, 1.125]
    for kind in ("k2", "mse"):
        torch.testing.assert_close(kl_estimate(LOGPROBS, REF, kind), torch.tensor([[2.0, 0.0, 1.125]]))
    # abs = |d|
    torch.testing.assert_close(kl_estimate(LOGPROBS, REF, "abs"), torch.tensor([[2.0, 0.0, 1.5]]))
    # k3 = (r - 1) - log r with r = π_ref/π = exp(-d):
    #   d = -2:  r = e² = 7.389056; 6.389056 - 2 = 4.389056
    #   d = 0:   r = 1; 0
    #   d = 1.5: r = e^-1.5 = 0.223130; -0.776870 + 1.5 = 0.723130
    torch.testing.assert_close(kl_estimate(LOGPROBS, REF, "k3"),
                               torch.tensor([[4.389056, 0.0, 0.723130]]), rtol=0, atol=1e-5)


def test_k3_uses_reference_over_policy():
    # π = 2·π_ref on the sampled token: d = ln 2, r = 1/2 -> (1/2 - 1) - ln(1/2) = 0.193147.
    # The inverted ratio r = 2 would give (2 - 1) - ln 2 = 0.306853.
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)


def test_k3_never_negative():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(64, 32, generator=g) * 5
    ref = torch.randn(64, 32, generator=g) * 5
    assert (kl_estimate(lp, ref, "k3") >= 0).all()
    assert (kl_estimate(lp, ref, "k2") >= 0).all() and (kl_estimate(lp, ref, "abs") >= 0).all()
    assert (kl_estimate(lp, ref, "k1") < 0).any()  # k1 can be negative, which is why k3 exists


def test_monte_carlo_mean_matches_true_kl():
    # π = [0.5, 0.3, 0.2], π_ref = [0.2, 0.5, 0.3]
    # KL(π‖π_ref) = 0.5 ln 2.5 + 0.3 ln 0.6 + 0.2 ln(2/3)
    #             = 0.458145 - 0.153248 - 0.081093 = 0.223805
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    true_kl = (p * (p / q).log()).sum().item()
    assert true_kl == pytest.approx(0.223805, abs=1e-5)
    g = torch.Generator().manual_seed(1234)
    x = torch.multinomial(p, 100_000, replacement=True, generator=g).view(100, 1000)  # (B, T) ~ π
    lp, ref = p.log()[x], q.log()[x]
    k3 = kl_estimate(lp, ref, "k3").mean().item()
    k1 = kl_estimate(lp, ref, "k1").mean().item()
    assert k3 == pytest.approx(true_kl, abs=0.01)
    assert k1 == pytest.approx(true_kl, abs=0.01)
    # The inverted ratio r = π/π_ref estimates E_π[π/π_ref] - 1 - KL
    #   = (0.25/0.2 + 0.09/0.5 + 0.04/0.3) - 1 - 0.223805 = 0.339529, not the KL.
    d = lp - ref
    inverted = (torch.expm1(d) - d).mean().item()
    assert inverted == pytest.approx(0.339529, abs=0.01)
    assert abs(k3 - inverted) > 0.08


def test_unknown_kind_and_shape_mismatch_raise():
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(LOGPROBS, REF, "k4")
    with pytest.raises(ValueError):
        kl_estimate(LOGPROBS, REF[:, :2], "k1")
    assert set(KL_KINDS) == {"k1", "k2", "k3", "abs", "mse"}


def test_last_token_index():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [1, 3, 0, 0]


MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
# row 0: d = [0.5, -1, (pad)], row 1: d = [0, 1, -0.5], row 2: all padding
LP = torch.tensor([[-1.0, -2.0, 9.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
RLP = torch.tensor([[-1.5, -1.0, 7.0], [-1.0, -2.0, -0.5], [-3.0, -3.0, -3.0]])
SCORES = torch.tensor([2.0, -3.0, 5.0])


def test_kl_shaped_rewards_hand_worked():
    rewards, kl = kl_shaped_rewards(SCORES, LP, RLP, MASK, kl_coeff=0.1, kind="k1")
    # per-token -0.1·d: row 0 [-0.05, 0.1, 0], row 1 [0, -0.1, 0.05]
    # + score at the last real token: row 0 t=1: 0.1 + 2 = 2.1; row 1 t=2: 0.05 - 3 = -2.95
    # row 2 has no response token: all 0, its score goes nowhere
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 2.1, 0.0], [0.0, -0.1, -2.95],
                                                      [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0], [0.0, 1.0, -0.5], [0.0, 0.0, 0.0]]))
    # the KL that is logged is the KL that is penalised (same sign, same estimator)
    torch.testing.assert_close(kl, kl_estimate(LP, RLP, "k1") * MASK)


def test_kl_shaped_rewards_score_clip():
    rewards, _ = kl_shaped_rewards(SCORES, LP, RLP, MASK, kl_coeff=0.1, score_clip=1.0)
    # scores clipped to [-1, 1]: row 0 0.1 + 1 = 1.1; row 1 0.05 - 1 = -0.95
    torch.testing.assert_close(rewards[:2], torch.tensor([[-0.05, 1.1, 0.0], [0.0, -0.1, -0.95]]))


def test_kl_shaped_rewards_padding_and_estimator():
    rewards, kl = kl_shaped_rewards(SCORES, LP, RLP, MASK, kl_coeff=0.5, kind="k3")
    assert (rewards[MASK == 0] == 0).all() and (kl[MASK == 0] == 0).all()
    # kl_coeff = 0: the rewards are the scores alone
    rewards0, _ = kl_shaped_rewards(SCORES, LP, RLP, MASK, kl_coeff=0.0)
    torch.testing.assert_close(rewards0, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, -3.0], [0.0, 0.0, 0.0]]))
    # extra right padding (with garbage log-probs) changes nothing
    pad = torch.full((3, 2), -7.0)
    r_pad, kl_pad = kl_shaped_rewards(SCORES, torch.cat([LP, pad], 1), torch.cat([RLP, pad - 3], 1),
                                      torch.cat([MASK, torch.zeros(3, 2, dtype=MASK.dtype)], 1),
                                      kl_coeff=0.5, kind="k3")
    torch.testing.assert_close(r_pad[:, :3], rewards)
    assert (r_pad[:, 3:] == 0).all() and (kl_pad[:, 3:] == 0).all()


def test_kl_shaped_rewards_shape_errors():
    with pytest.raises(ValueError, match="scores"):
        kl_shaped_rewards(SCORES[:2], LP, RLP, MASK, kl_coeff=0.1)
    with pytest.raises(ValueError, match="scores"):
        kl_shaped_rewards(SCORES[:, None], LP, RLP, MASK, kl_coeff=0.1)
    with pytest.raises(ValueError, match="response_mask"):  # (B, 1) would broadcast silently
        kl_shaped_rewards(SCORES, LP, RLP, MASK[:, :1], kl_coeff=0.1)
