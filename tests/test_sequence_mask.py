"""Sequence-level masked importance sampling (`<method>.sequence_mask_cap`, TRL's
`sequence_mask`): the op worked by hand, its padding invariance, the config rules, and
an update on a tiny model where a masked response moves nothing."""

from __future__ import annotations

import math

import pytest
import torch

from rlhflab import ops

# Three responses, T = 3; row 1 has one padding position (its values are junk on purpose).
# Δ = old - sample:  row 0 [0.5, 0.5, 0.2], row 1 [0.1, -0.3, (pad)], row 2 [0.4, 0.6, 0.0]
OLD = torch.tensor([[-1.0, -0.5, -2.0],
                    [-0.9, -1.3, -5.0],
                    [-0.6, -0.4, -1.0]], dtype=torch.float64)
SAMPLE = torch.tensor([[-1.5, -1.0, -2.2],
                       [-1.0, -1.0, 7.0],
                       [-1.0, -1.0, -1.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1],
                     [1, 1, 0],
                     [1, 1, 1]])


def test_hand_worked_ratios_and_mask():
    out = ops.sequence_mask_weights(OLD, SAMPLE, MASK, cap=3.0)
    # ρ_0 = exp(0.5 + 0.5 + 0.2) = e^1.2 = 3.320117 > 3: masked, every weight 0
    # ρ_1 = exp(0.1 - 0.3)       = e^-0.2 = 0.818731: kept, 0.818731 on its 2 real tokens, 0 on padding
    # ρ_2 = exp(0.4 + 0.6 + 0.0) = e^1.0 = 2.718282 <= 3: kept, though its token ratio e^0.6 = 1.822
    torch.testing.assert_close(out.ratio, torch.tensor([math.exp(1.2), math.exp(-0.2), math.e], dtype=torch.float64))
    assert out.masked.tolist() == [True, False, False]
    want = torch.tensor([[0.0, 0.0, 0.0],
                         [math.exp(-0.2), math.exp(-0.2), 0.0],
                         [math.e, math.e, math.e]], dtype=torch.float64)
    torch.testing.assert_close(out.weights, want)
    # a floor of 0.9 also drops row 1 (0.818731 < 0.9); a cap of 3.5 keeps row 0 at 3.320117
    assert ops.sequence_mask_weights(OLD, SAMPLE, MASK, cap=3.0, floor=0.9).masked.tolist() == [True, True, False]
    loose = ops.sequence_mask_weights(OLD, SAMPLE, MASK, cap=3.5)
    assert not loose.masked.any() and loose.weights[0, 0].item() == pytest.approx(3.320117, abs=1e-6)
    assert not out.weights.requires_grad


def test_loop_reference_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    old, sample = 0.3 * torch.randn(6, 9, generator=g), 0.3 * torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.3).long()
    out = ops.sequence_mask_weights(old, sample, mask, cap=1.5)
    for b in range(6):
        s = sum((old[b, t] - sample[b, t]).item() for t in range(9) if mask[b, t])
        rho = math.exp(s)
        assert bool(out.masked[b]) == (rho > 1.5)
        for t in range(9):
            want = rho if (mask[b, t] and rho <= 1.5) else 0.0
            assert out.weights[b, t].item() == pytest.approx(want, rel=1e-5)   # float32 sums: rel 1e-5


def test_padding_changes_nothing_even_with_inf():
    ref = ops.sequence_mask_weights(OLD, SAMPLE, MASK, cap=3.0)
    old = torch.cat([OLD, torch.full((3, 2), math.inf, dtype=torch.float64)], 1)
    sample = torch.cat([SAMPLE, torch.full((3, 2), -math.inf, dtype=torch.float64)], 1)
    mask = torch.cat([MASK, torch.zeros(3, 2, dtype=torch.long)], 1)
    padded = ops.sequence_mask_weights(old, sample, mask, cap=3.0)
    assert torch.equal(padded.weights[:, :3], ref.weights) and torch.equal(padded.weights[:, 3:], torch.zeros(3, 2,
                                                                                                     dtype=torch.float64))
    assert torch.equal(padded.ratio, ref.ratio) and torch.equal(padded.masked, ref.masked)
    # a response with no real token is never masked (ρ = 1), however low the cap
    empty = ops.sequence_mask_weights(OLD[:1], SAMPLE[:1], torch.zeros(1, 3), cap=0.5)
    assert not empty.masked.any() and torch.equal(empty.weights, torch.zeros(1, 3, dtype=torch.float64))


def test_an_overflowing_ratio_is_masked_not_nan():
    out = ops.sequence_mask_weights(torch.tensor([[0.0, 0.0]]), torch.tensor([[-60.0, -60.0]]), torch.ones(1, 2), 3.0)
    assert math.isinf(out.ratio.item()) and out.masked.item()     # e^120 overflows float32
    assert torch.equal(out.weights, torch.zeros(1, 2))


def test_bad_shapes_and_bounds_are_refused():
    with pytest.raises(ValueError, match="equal \\(B, T\\) shapes"):
        ops.sequence_mask_weights(OLD, SAMPLE[:, :2], MASK, cap=3.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        ops.sequence_mask_weights(OLD, SAMPLE, MASK, cap=0.0)
    with pytest.raises(ValueError, match="floor in"):
        ops.sequence_mask_weights(OLD, SAMPLE, MASK, cap=3.0, floor=4.0)


def test_config_rules():
    from rlhflab.config.schema import PolicySection
    from rlhflab.trainers.grpo import GRPOSection
    from rlhflab.trainers.gspo import GSPOSection

    assert PolicySection.__dataclass_fields__["sequence_mask_cap"].default is None   # off by default
    assert not GRPOSection(sequence_mask_cap=3.0).check()
    assert any("set one to null" in e for e in GRPOSection(sequence_mask_cap=3.0, tis_cap=2.0).check())
    assert any("sequence_mask_cap" in e for e in GSPOSection(sequence_mask_cap=3.0).check())
    # the sampler's own old log-probs leave nothing to correct (π_old / π_sampler = 1)
    from rlhflab.config.schema import GenerationConfig
    from rlhflab.trainers.loop import sampler_rules
    errs = sampler_rules(GenerationConfig(old_logprobs="sampler"), GRPOSection(sequence_mask_cap=3.0), "grpo")
    assert len(errs) == 1 and errs[0].startswith("grpo.sequence_mask_cap: weighs by pi_old / pi_sampler")


def _tiny_policy():
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhflab.models.actor_critic import PolicyOnly

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return PolicyOnly(LlamaForCausalLM(cfg).float())


def _minibatch(actor, advantages, shift):
    """Two responses of 3 tokens (row 1 with one pad) after a 2-token prompt; the sampler's
    log-probs sit `shift[b]` nats per real token below the trainer's old ones."""
    from rlhflab.engine.minibatch import MiniBatch

    prompt = torch.tensor([[1, 2], [3, 4]])
    response = torch.tensor([[5, 6, 7], [8, 9, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with torch.no_grad():
        old = actor(prompt, torch.ones_like(prompt), response, mask).logprobs * mask   # (2, 3)
    sample = (old - torch.tensor(shift).unsqueeze(1)) * mask
    adv = torch.tensor(advantages).unsqueeze(1).expand(2, 3) * mask
    return MiniBatch(prompt, torch.ones_like(prompt), response, mask, mask, advantages=adv.float(),
                     old_logprobs=old, sample_logprobs=sample)


def _grads(actor, mb, sec):
    from rlhflab.engine.update import PPOMath, minibatch_loss

    actor.zero_grad(set_to_none=True)
    loss, st = minibatch_loss(actor, mb, sec, 1.0, PPOMath(), normalizer=float(mb.loss_mask.sum()))
    loss.backward()
    return torch.cat([p.grad.flatten() for p in actor.parameters() if p.grad is not None]), st


def test_a_masked_response_gets_no_gradient():
    """Row 0's ratio is e^(3·0.5) = 4.48 > 3: with the mask on, its advantage moves nothing;
    row 1's is e^(2·0.1) = 1.22 and it is weighed by that."""
    from rlhflab.trainers.grpo import GRPOSection

    actor = _tiny_policy()
    on = GRPOSection(kl_coeff=0.0, sequence_mask_cap=3.0)
    off = GRPOSection(kl_coeff=0.0)
    g1, st = _grads(actor, _minibatch(actor, [1.0, -1.0], [0.5, 0.1]), on)
    g2, _ = _grads(actor, _minibatch(actor, [-7.0, -1.0], [0.5, 0.1]), on)   # only the masked row's advantage moved
    assert (st.seq_masked, st.seq_judged) == (1.0, 2.0)
    # the same passes on the same shapes; the gradient differs only by float rounding, if at all
    torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-9)
    # without the mask the same change moves the gradient: the check above can fail
    h1, _ = _grads(actor, _minibatch(actor, [1.0, -1.0], [0.5, 0.1]), off)
    h2, _ = _grads(actor, _minibatch(actor, [-7.0, -1.0], [0.5, 0.1]), off)
    assert (h1 - h2).abs().max() > 1e-3 * h1.abs().max()
    # the kept row alone, unweighted, times its ratio e^0.2 is the masked run's gradient
    k, _ = _grads(actor, _minibatch(actor, [0.0, -1.0], [0.5, 0.1]), off)
    torch.testing.assert_close(g1, math.exp(0.2) * k, rtol=1e-5, atol=1e-8)   # one multiply apart: 1e-5


def test_the_update_logs_the_masked_fraction():
    """4 responses, two minibatches of 2, 2 epochs: rows 0 and 3 masked (ρ = e^1.5 and e^2.0),
    rows 1 and 2 kept (e^0.2, e^-0.4): rollout/is_masked_frac = 2 / 4 = 0.5, counted once."""
    from rlhflab.engine.update import policy_update
    from rlhflab.rollout import Rollout
    from rlhflab.trainers.grpo import GRPOSection

    actor = _tiny_policy()
    prompt = torch.tensor([[1, 2]] * 4)
    response = torch.tensor([[5, 6, 7], [8, 9, 0], [10, 11, 12], [13, 14, 15]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    with torch.no_grad():
        old = actor(prompt, torch.ones_like(prompt), response, mask).logprobs * mask
    shift = torch.tensor([0.5, 0.1, -0.4 / 3, 2.0 / 3]).unsqueeze(1)     # Σ_t: 1.5, 0.2, -0.4, 2.0
    roll = Rollout(prompt, torch.ones_like(prompt), response, mask, torch.zeros(4, dtype=torch.bool),
                   logprobs=old, sample_logprobs=(old - shift) * mask,
                   advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1) * mask)
    sec = GRPOSection(kl_coeff=0.0, sequence_mask_cap=3.0, prompts_per_step=4, group_size=1, mini_batch_size=2,
                      epochs=2)
    opt = torch.optim.SGD(actor.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    metrics = policy_update(actor, opt, sched, roll, sec, temperature=1.0, step=1, seed=0, max_new_tokens=3)
    assert metrics["rollout/is_masked_frac"] == 0.5
    sec_off = GRPOSection(kl_coeff=0.0, prompts_per_step=4, group_size=1, mini_batch_size=2, epochs=2)
    assert "rollout/is_masked_frac" not in policy_update(actor, opt, sched, roll, sec_off, temperature=1.0, step=1,
                                                         seed=0, max_new_tokens=3)
