"""Token-budget micro-batches (`<method>.mini_batch_tokens`) in the PPO family.

An optimizer step's rows are the same with or without a budget; the budget only re-cuts
them into passes of at most that many real tokens (prompt + response, no padding), each
divided by the whole step's normaliser. So the update must be the row-cut one: the same
losses and the same parameters after the step. The passes differ in shape (other rows
together, other widths), so the numbers agree to float32 rounding, not bit for bit: a
tolerance of 1e-5, as for the packed layout against the padded one (tests/test_layout.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhflab.config import load_config
from rlhflab.engine import update as update_mod
from rlhflab.engine.minibatch import cut_by_tokens, sequence_tokens, token_micro_batches
from rlhflab.engine.scoring import micro_batches, row_order, score_rollout
from rlhflab.engine.update import PPOMath, policy_update, step_micro_batches, update_group
from rlhflab.errors import ConfigError
from rlhflab.models.actor_critic import ActorCritic, PolicyOnly, Reference, ValueHead, hidden_size_of
from rlhflab.rollout import Rollout
from rlhflab.trainers.grpo import GRPOSection
from rlhflab.trainers.ppo import PPORunConfig, PPOSection
from test_layout import _fill  # advantages and old log-probs a little off the current ones

TOL = 1e-5  # passes of different shapes: float32 rounding, never exact
RLEN = [40, 3, 1, 4, 37, 2, 5, 30]  # response lengths, 40x apart
PLEN = [7, 3, 5, 1, 6, 2, 4, 7]     # prompt lengths
# sequence tokens (prompt + response): 47, 6, 6, 5, 43, 4, 9, 37


def _rollout(vocab: int = 256, group_size: int = 1, seed: int = 0) -> Rollout:
    """8 rows with the lengths above; with `group_size` k each group of k rows shares the
    prompt of its first row."""
    g = torch.Generator().manual_seed(seed)
    rlen, plen = torch.tensor(RLEN), torch.tensor(PLEN)
    b, p, t = len(rlen), 7, 40
    if group_size > 1:
        plen = plen[::group_size].repeat_interleave(group_size)
    pm = (torch.arange(p) >= p - plen[:, None]).long()                               # (B, P) left-padded
    rm = (torch.arange(t) < rlen[:, None]).long()                                    # (B, T) right-padded
    pi = torch.randint(3, vocab, (b, p), generator=g)
    if group_size > 1:
        pi = pi[::group_size].repeat_interleave(group_size, 0)
    ri = torch.randint(3, vocab, (b, t), generator=g) * rm
    return Rollout(pi * pm, pm, ri, rm, torch.zeros(b, dtype=torch.bool), group_size=group_size)


def _rows(cut) -> list[list[int]]:
    return [mb.tolist() for mb in cut]


# ----------------------------------------------------------------------------- the cut by hand
def test_the_cut_by_hand():
    roll = _rollout()
    rows = torch.arange(8)
    assert sequence_tokens(roll, rows) == [47, 6, 6, 5, 43, 4, 9, 37]
    # budget 50, longest first (stable): 47 | 43 | 37 + 9 = 46 (+6 > 50) | 6 + 6 + 5 + 4 = 21
    assert _rows(token_micro_batches(roll, rows, 50)) == [[0], [4], [7, 6], [1, 2, 3, 5]]
    # in the order given (the scoring passes: row_order, shortest first):
    # 4 + 5 + 6 + 6 + 9 = 30 (+37 > 50) | 37 | 43 | 47
    order = row_order(roll, 1, by_length=True)
    assert order.tolist() == [5, 3, 1, 2, 6, 7, 4, 0]
    assert _rows(token_micro_batches(roll, order, 50, longest_first=False)) == [[5, 3, 1, 2, 6], [7], [4], [0]]
    # groups of 4 sharing a prompt count it once: 7 + (40+3+1+4) = 55 and 6 + (37+2+5+30) = 80
    grouped = _rollout(group_size=4)
    assert sequence_tokens(grouped, rows, 4) == [55, 80]
    assert _rows(token_micro_batches(grouped, rows, 100, 4)) == [[4, 5, 6, 7], [0, 1, 2, 3]]
    assert _rows(token_micro_batches(grouped, rows, 135, 4)) == [[4, 5, 6, 7, 0, 1, 2, 3]]


def test_a_sequence_over_the_budget_runs_alone(monkeypatch):
    roll = _rollout()
    # budget 40: 47 and 43 are over it, alone; 37 (+9 > 40) alone; 9 + 6 + 6 + 5 + 4 = 30
    assert _rows(token_micro_batches(roll, torch.arange(8), 40)) == [[0], [4], [7], [6, 1, 2, 3, 5]]
    assert cut_by_tokens([12, 2, 2], 10) == [[0], [1, 2]]
    monkeypatch.setattr(update_mod, "_NOTED_OVERSIZE", set())
    with pytest.warns(UserWarning, match="a sequence holds 47 tokens, more than the budget of 40"):
        step_micro_batches(roll, torch.arange(8), 40, 1, update_mod.Dist())


def test_ranks_make_as_many_passes_as_the_rank_that_needs_most():
    class TwoRanks:  # this rank's cut makes 4 micro-batches; the other rank's 6
        distributed = True

        @staticmethod
        def max(n):
            return max(n, 6)

    roll = _rollout()
    # from [0] [4] [7, 6] [1, 2, 3, 5]: the fullest of two units or more is split where it halves best:
    # [7, 6] (46) -> [7] [6]; then [1, 2, 3, 5] (21): 6+6 = 12 against 5+4 = 9 -> [1, 2] [3, 5]
    cut = step_micro_batches(roll, torch.arange(8), 50, 1, TwoRanks())
    assert _rows(cut) == [[0], [4], [7], [6], [1, 2], [3, 5]]
    grouped = _rollout(group_size=4)  # groups stay whole when split
    assert _rows(token_micro_batches(grouped, torch.arange(8), 200, 4, parts=2)) == [[4, 5, 6, 7], [0, 1, 2, 3]]
    with pytest.raises(ValueError, match="cannot make 3 micro-batches"):
        token_micro_batches(grouped, torch.arange(8), 200, 4, parts=3)


# ----------------------------------------------------------------------------- parity with rows
def _tiny(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")


def _one_step(actor, roll, sec):
    """policy_update's one optimizer step (SGD, lr 1, no clipping: the parameters move by
    minus the gradient); its metrics, the parameters after, and each step's pass sizes."""
    start = {n: p.detach().clone() for n, p in actor.named_parameters()}
    sizes = []

    def recording(actor_, batches, *args, **kw):
        sizes.append([len(b) for b in batches])
        return update_group(actor_, batches, *args, **kw)

    opt = torch.optim.SGD(actor.trainable_parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    metrics = policy_update(actor, opt, sched, dataclasses.replace(roll), sec, temperature=1.0, step=0, seed=0,
                            max_new_tokens=40, math_=PPOMath(update_group=recording))
    after = {n: p.detach().clone() for n, p in actor.named_parameters()}
    with torch.no_grad():
        for n, p in actor.named_parameters():
            p.copy_(start[n])
    return metrics, after, sizes


def _assert_same_update(actor, roll, sec, budget, expect_sizes, fractions_too):
    rows_m, rows_p, rows_sizes = _one_step(actor, roll, sec)
    tok_m, tok_p, tok_sizes = _one_step(actor, roll, dataclasses.replace(sec, mini_batch_tokens=budget))
    assert tok_sizes == [expect_sizes] and tok_sizes != rows_sizes  # the budget did re-cut the step
    assert rows_m.keys() == tok_m.keys()
    for key in rows_m:
        if key.startswith("loss/") or (fractions_too and key.startswith("params/")):
            assert abs(rows_m[key] - tok_m[key]) <= TOL * max(1.0, abs(rows_m[key])), key
    assert rows_m["params/policy_clip_frac"] > 0  # the clip is exercised, not all-1 ratios
    worst = max(float((rows_p[n] - tok_p[n]).abs().max()) for n in rows_p)
    moved = max(float((rows_p[n] - p).abs().max()) for n, p in actor.named_parameters())
    assert worst <= TOL and moved > 1e-3, (worst, moved)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_ppo_value_head_token_budget_equals_rows(tiny_model_dir, layout, recwarn):
    policy = _tiny(tiny_model_dir)
    actor = ActorCritic(policy, value_head=ValueHead(hidden_size_of(policy), init_std=0.1))
    ref = Reference.frozen_copy(policy)
    roll = _rollout(policy.config.vocab_size)
    rows_scored = dataclasses.replace(roll)
    score_rollout(actor, ref, rows_scored, with_values=True, micro_batch=4, layout=layout)
    tok_scored = dataclasses.replace(roll)
    score_rollout(actor, ref, tok_scored, with_values=True, micro_batch=4, layout=layout, mini_batch_tokens=50)
    m = roll.response_mask.bool()
    for key in ("logprobs", "values", "ref_logprobs"):
        assert (getattr(rows_scored, key)[m] - getattr(tok_scored, key)[m]).abs().max() <= TOL, key
    _fill(rows_scored, values=True)
    sec = PPOSection(rollout_samples=8, mini_batch_size=4, gradient_accumulation_steps=2, epochs=1,
                     entropy_coeff=0.01, kl_in="loss", kl_coeff=0.1, value_clip=0.2, vf_coeff=0.5,
                     max_grad_norm=None, layout=layout)
    # one optimizer step of two minibatches of 4 rows; the budget of 40 re-cuts its 8 rows as
    # [0] [4] [7] [6 1 2 3 5] (the first two over the budget: alone). The fractions are a mean
    # over two minibatches of rows against a token mean of the step: not compared here.
    _assert_same_update(actor, rows_scored, sec, 40, [1, 1, 1, 5], fractions_too=False)


@pytest.mark.parametrize("layout", ["shared"])  # groups stay whole where the prompt is shared
def test_grpo_shared_prompt_token_budget_equals_rows(tiny_model_dir, layout):
    policy = _tiny(tiny_model_dir)
    actor = PolicyOnly(policy)
    ref = Reference.frozen_copy(policy)
    roll = _rollout(policy.config.vocab_size, group_size=4)
    scored = dataclasses.replace(roll)
    score_rollout(actor, ref, scored, micro_batch=8, layout=layout, mini_batch_tokens=100)
    assert len(micro_batches(roll, 8, 4, mini_batch_tokens=100)) == 2  # the groups' 55 and 80 tokens apart
    _fill(scored, values=False)
    sec = GRPOSection(group_size=4, prompts_per_step=2, mini_batch_size=8, epochs=1, entropy_coeff=0.01,
                      kl_coeff=0.1, max_grad_norm=None, layout=layout)
    # one minibatch of 8 rows (two groups); the budget of 100 runs each group of 4 alone. With one
    # minibatch per step the fractions are the step's token means either way: compared too.
    _assert_same_update(actor, scored, sec, 100, [4, 4], fractions_too=True)


# ----------------------------------------------------------------------------- the key
def test_a_bad_budget_is_a_one_line_error():
    from pathlib import Path

    debug = Path(__file__).parent / "data" / "config" / "debug.yaml"  # generation.max_new_tokens: 16
    for value, expected in [("0", "ppo.mini_batch_tokens: must be > 0, got 0"),
                            ("8", "ppo.mini_batch_tokens: 8 cannot hold one response of generation.max_new_tokens "
                                  "(16); set it to at least 16 or null (rows)")]:
        with pytest.raises(ConfigError) as info:
            load_config(debug, PPORunConfig, [f"ppo.mini_batch_tokens={value}"])
        (line,) = str(info.value).splitlines()
        assert expected in line
    cfg, _ = load_config(debug, PPORunConfig, ["ppo.mini_batch_tokens=64"])
    assert cfg.ppo.mini_batch_tokens == 64
    assert load_config(debug, PPORunConfig)[0].ppo.mini_batch_tokens is None  # rows, as before
