"""The separate critic's pass beside the policy's (`engine.overlap`, `model.critic_overlap`):
two threads over two row halves, the same gradients and stats as one pass after the other,
no more memory."""

from __future__ import annotations

import copy
import json
import math
import threading

import pytest
import torch
from memory_helpers import tensor_peak_bytes
from model_helpers import separate_critic_minibatch

from rlhflab.engine import overlap
from rlhflab.engine.update import MinibatchStats, PPOMath, critic_pass, merge_stats, minibatch_loss, update_group
from rlhflab.trainers import ppo
from rlhflab.trainers.common import make_optimizer


@pytest.fixture
def two_threads(torch_threads):
    torch_threads(2)


@pytest.fixture(scope="module")
def critic_run(tmp_path_factory, tiny_model_dir, arith_dir):
    """A separate-critic PPO run (critic_overlap off, the default), its rollout and one
    16-row minibatch of it."""
    from conftest import DEBUG_CONFIG, small_overrides

    from rlhflab.config import load_config

    over = small_overrides(tiny_model_dir, arith_dir, tmp_path_factory.mktemp("run")) + [
        "model.critic=separate", "ppo.mini_batch_size=16", "ppo.vf_coeff=0.5", "ppo.kl_coeff=0.1"]
    return separate_critic_minibatch(load_config(DEBUG_CONFIG, ppo.PPORunConfig, over)[0])


def _grads_after_group(actor, mb, cfg, normalizer, on: bool):
    """`update_group` on a copy of `actor` with the overlap on or off, its optimizer step
    left out: (gradients by name, the minibatch's stats, how many side-by-side calls)."""
    actor = copy.deepcopy(actor)
    actor.critic_overlap = on
    params = actor.trainable_parameters()
    opt = make_optimizer(params, 1e-3)
    calls = []
    real = overlap.side_by_side

    def counting(first, second):
        calls.append(1)
        return real(first, second)

    grads = {}
    opt.step, opt.zero_grad = (lambda *a, **k: None), (lambda *a, **k: None)  # keep the gradients to read
    overlap.side_by_side = counting
    try:
        _, stats = update_group(actor, [mb], opt, params, cfg.ppo, 1.0, PPOMath(), normalizer)
    finally:
        overlap.side_by_side = real
    for name, p in actor.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.clone()
    return grads, stats[0], len(calls)


def test_overlap_gives_the_gradients_and_stats_of_the_passes_one_after_the_other(critic_run, two_threads):
    cfg, actor, mb, n = critic_run
    seq, st_seq, calls_seq = _grads_after_group(actor, mb, cfg, n, on=False)
    par, st_par, calls_par = _grads_after_group(actor, mb, cfg, n, on=True)
    assert calls_seq == 0 and calls_par == 2  # two halves, each side by side
    assert seq.keys() == par.keys()
    assert any(k.startswith("policy.") for k in seq) and any(k.startswith("critic.") for k in seq)
    for name in seq:  # a sum over two halves instead of one sum: float rounding only
        scale = float(seq[name].abs().max()) + 1e-12
        assert float((seq[name] - par[name]).abs().max()) <= 1e-5 * scale, name
    for key in ("policy", "value", "entropy", "total", "policy_clip_frac", "value_clip_frac", "approx_kl"):
        assert getattr(st_par, key) == pytest.approx(getattr(st_seq, key), rel=1e-5, abs=1e-8), key
    assert st_par.value > 0 and st_par.total == pytest.approx(st_par.policy + 0.5 * st_par.value, rel=1e-5)


def test_the_overlap_holds_no_more_tensors_than_the_passes_one_after_the_other(critic_run):
    """The profiler counts only the calling thread's tensors, so the two sides are counted
    apart: each thread's own peak in the overlap is that of its half run alone, and the
    overlap's peak is at most their sum."""
    cfg, actor, mb, n = critic_run
    model = copy.deepcopy(actor)
    model.critic_overlap = False
    params = model.trainable_parameters()
    opt = make_optimizer(params, 1e-3)
    update_group(model, [mb], opt, params, cfg.ppo, 1.0, PPOMath(), n)  # Adam state exists before measuring
    whole = tensor_peak_bytes(lambda: update_group(model, [mb], opt, params, cfg.ppo, 1.0, PPOMath(), n))

    half = overlap.split_rows(mb)[0]

    def policy_half():
        loss, _ = minibatch_loss(model, half, cfg.ppo, 1.0, PPOMath(), n, critic_elsewhere=True)
        loss.backward()

    opt.zero_grad(set_to_none=True)
    policy_peak = tensor_peak_bytes(policy_half)
    critic_peak = tensor_peak_bytes(lambda: critic_pass(model, half, cfg.ppo, PPOMath(), n))
    # Each side's peak holds its model's gradients and half a minibatch of activations; the
    # whole sequential step holds both models' gradients and one model's whole activations.
    assert policy_peak > 0 and critic_peak > 0
    assert policy_peak + critic_peak <= 1.02 * whole, (policy_peak, critic_peak, whole)


def test_split_rows_cuts_whole_groups_and_keeps_the_ptx_batch_once(critic_run):
    _, _, mb, _ = critic_run
    halves = overlap.split_rows(mb)
    assert [len(h) for h in halves] == [8, 8]
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "loss_mask", "advantages",
                 "old_logprobs", "ref_logprobs", "returns", "old_values"):
        torch.testing.assert_close(torch.cat([getattr(h, name) for h in halves]), getattr(mb, name), rtol=0, atol=0)
    # groups of 4 rows to one prompt row each: 5 groups cut 2 + 3 (as equal as whole groups come)
    grouped = copy.copy(mb)
    grouped.group_size = 4
    rows = torch.arange(20)
    grouped.response_ids, grouped.loss_mask = rows[:, None].repeat(1, 3), torch.ones(20, 3)
    grouped.response_mask = grouped.loss_mask
    grouped.prompt_ids, grouped.prompt_mask = torch.arange(5)[:, None], torch.ones(5, 1)
    grouped.advantages = grouped.old_logprobs = grouped.ref_logprobs = grouped.returns = grouped.old_values = None
    grouped.lm_batch, grouped.lm_weight = {"input_ids": torch.ones(1, 2)}, 0.25
    a, b = overlap.split_rows(grouped)
    assert a.prompt_ids.flatten().tolist() == [0, 1] and b.prompt_ids.flatten().tolist() == [2, 3, 4]
    assert a.response_ids[:, 0].tolist() == list(range(8)) and b.response_ids[:, 0].tolist() == list(range(8, 20))
    assert a.lm_batch is grouped.lm_batch and a.lm_weight == 0.25 and b.lm_batch is None and b.lm_weight == 0.0
    grouped.response_ids = rows[:4, None]
    with pytest.raises(ValueError, match="cannot make 2 parts"):
        overlap.split_rows(grouped)


def test_merge_stats_adds_shares_and_weights_fractions_by_tokens():
    a = MinibatchStats(policy=0.5, value=0.25, entropy=1.0, total=0.625, policy_clip_frac=0.1, value_clip_frac=0.0,
                       approx_kl=0.02, kl=0.01, ptx=0.5, kl_seq_sum=2.0)
    b = MinibatchStats(policy=-0.25, value=0.5, entropy=2.0, total=0.0, policy_clip_frac=0.4, value_clip_frac=0.3,
                       approx_kl=0.08, kl=0.03, kl_seq_sum=1.0)
    m = merge_stats([(a, 30.0), (b, 10.0)])
    assert (m.policy, m.value, m.entropy, m.total, m.kl, m.ptx, m.kl_seq_sum) == (0.25, 0.75, 3.0, 0.625, 0.04, 0.5, 3.0)
    # (0.1·30 + 0.4·10) / 40 = 0.175; (0·30 + 0.3·10) / 40 = 0.075; (0.02·30 + 0.08·10) / 40 = 0.035
    assert m.policy_clip_frac == pytest.approx(0.175) and m.value_clip_frac == pytest.approx(0.075)
    assert m.approx_kl == pytest.approx(0.035)
    assert merge_stats([(a, 0.0), (b, 0.0)]).policy_clip_frac == 0.0  # no tokens: nothing clipped


def test_side_by_side_runs_both_at_once_and_divides_the_threads(two_threads):
    meet = threading.Barrier(2, timeout=30)  # passes only if both functions run at the same time
    seen = {}

    def first():
        meet.wait()
        seen["first"] = (threading.current_thread().name, torch.get_num_threads())
        return "a"

    def second():
        meet.wait()
        seen["second"] = (threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled())
        return "b"

    with torch.no_grad():
        assert overlap.side_by_side(first, second) == ("a", "b")
    assert seen["first"] == (threading.current_thread().name, 1)
    name, threads, grad = seen["second"]
    assert name.startswith("rlhflab-critic") and threads == 1 and grad is False  # grad mode carried over
    assert torch.get_num_threads() == 2  # the caller's count is back


def test_side_by_side_waits_for_the_worker_and_raises_the_first_error(two_threads):
    done = []

    def slow_ok():
        threading.Event().wait(0.2)
        done.append("second")
        return 1

    def fails():
        raise KeyError("first")

    with pytest.raises(KeyError, match="first"):
        overlap.side_by_side(fails, slow_ok)
    assert done == ["second"]  # it had finished before the error came out

    def fails_too():
        raise ValueError("second")

    with pytest.raises(ValueError, match="second"):
        overlap.side_by_side(lambda: 0, fails_too)
    with pytest.raises(KeyError, match="first"):
        overlap.side_by_side(fails, fails_too)
    assert torch.get_num_threads() == 2


def test_applies_only_where_it_can_help(critic_run, two_threads):
    _, actor, mb, _ = critic_run
    actor = copy.deepcopy(actor)
    actor.critic_overlap = True
    assert overlap.applies(actor, mb)
    torch.set_num_threads(1)
    assert not overlap.applies(actor, mb)  # one thread: nothing to divide
    torch.set_num_threads(2)
    assert not overlap.applies(actor, overlap.split_rows(mb, 16)[0])  # one row
    actor.critic_overlap = False
    assert not overlap.applies(actor, mb)
    actor.critic_overlap = True
    actor.policy.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.1))  # draws random numbers
    assert not overlap.applies(actor, mb)


def test_ppo_with_a_separate_critic_on_two_threads_runs_the_overlap(ppo_cfg, monkeypatch, tmp_path):
    """The trainer end to end (2 steps, 2 threads, `model.critic_overlap=true`): every update
    minibatch takes the side-by-side path, and the run's metrics are those of a working
    update; with the default (off) none does."""
    calls = []
    real = overlap.side_by_side
    monkeypatch.setattr(overlap, "side_by_side", lambda a, b: calls.append(1) or real(a, b))
    off = ppo_cfg("model.critic=separate", "training.num_threads=2", "training.total_steps=1", "ppo.epochs=1",
                  out_dir=tmp_path / "off")
    ppo.train(off, quiet=True)
    assert calls == []  # opt-in: the default runs the two passes one after the other
    cfg = ppo_cfg("model.critic=separate", "model.critic_overlap=true", "training.num_threads=2",
                  "training.total_steps=2", "ppo.epochs=2")
    res = ppo.train(cfg, quiet=True)
    rows = [json.loads(line) for line in (res.output_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss/value" in r]
    assert len(rows) == 2
    # 16 samples, minibatches of 8, 2 epochs, 2 steps: 8 minibatches, two halves each
    assert len(calls) == 16
    for r in rows:
        assert r["loss/value"] > 0 and math.isfinite(r["loss/total"]) and 0 <= r["params/value_clip_frac"] <= 1


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_worker(two_threads):
    import multiprocessing

    overlap.side_by_side(lambda: 0, lambda: 0)  # the parent's worker thread exists

    def child(q):
        q.put(overlap.side_by_side(lambda: 1, lambda: 2))

    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=child, args=(q,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0 and q.get(timeout=5) == (1, 2)
