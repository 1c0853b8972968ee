"""The packed layout on multi-turn episodes and in TRPO, against the padded one.

A multi-turn episode's response part holds the model's turns (actions) and the tools'
answers (context) in one right-padded row: the forward attends to every real token
(`response_attention_mask`, what the engine hands the decoder pass as its response mask),
the losses read the action tokens alone (`response_mask`). Packed, the attention mask is
contiguous (a prefix of the row), so the batch packs; the action mask, which has holes,
would not. TRPO's natural-gradient step, its line search and its value fit run every
decoder pass in `trpo.layout`.

Padded and packed passes have different shapes (different matmul sizes and reduction
orders), so they agree to float32 rounding, never bit for bit: a tolerance of 1e-5.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rlhflab.engine.minibatch import select
from rlhflab.engine.scoring import score_rollout
from rlhflab.engine.update import PPOMath, group_normalizer, minibatch_loss
from rlhflab.envs import EnvConfig, collate_episodes, run_episodes, setup_episodes
from rlhflab.envs.rollout import episodes_to_rollout
from rlhflab.models import layout as layouts
from rlhflab.models.actor_critic import ActorCritic, Reference, ValueHead, hidden_size_of
from rlhflab.trainers.ppo import PPOSection
from rlhflab.trainers.trpo import TRPOSection, fit_values, natural_gradient_step

from test_envs import TOOLS_PY, FakeModel

TOL = 1e-5  # passes of different shapes: float32 rounding, never exact
STAT_KEYS = ("policy", "value", "entropy", "kl", "total", "policy_clip_frac", "value_clip_frac", "approx_kl")

# Game k's replies, turn by turn: tool calls (one with a bad argument, answered by an
# error message), long and short answers, so that the episodes' real response parts run
# from 2 to about 300 tokens and the tools' answers sit between the model's turns.
SCRIPT = {0: ["CALL add(a=2, b=3)", "It is 5."],
          1: ["7"],
          2: ["CALL add(a=20, b=22)", "CALL add(a=1)", "CALL add(a=40, b=2)",
              "The sum is 42: I called the tool twice with good arguments and once without b, which it refused, "
              "and both good calls came back with 42, so 42 it is."],
          3: ["Hm, 6."]}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from rlhflab.models.tiny import make_tiny_model

    # 512 positions: the tools' system message alone is 170 tokens of this tokenizer
    return make_tiny_model(tmp_path_factory.mktemp("chatml-512"), hidden_size=64, num_layers=2, num_heads=2,
                           chat_template="chatml", max_positions=512)


@pytest.fixture(scope="module")
def tool_rollout(chat_model, tmp_path_factory):
    """4 tool-use episodes (scripted replies, the real tool and template) as the engine's Rollout."""
    from transformers import AutoTokenizer

    plugins = tmp_path_factory.mktemp("tool-plugins")
    (plugins / "add_tool_pk.py").write_text(TOOLS_PY)
    tok = AutoTokenizer.from_pretrained(chat_model)
    setup = setup_episodes(EnvConfig(name=None, plugin_dir=str(plugins), tools=["add_tool_pk:add"]), tok)
    fake = FakeModel(tok, setup.renderer.end_of_turn_id, SCRIPT)
    eps = run_episodes(setup, [{"prompt": f"Game {k}: what is 20 + 22?"} for k in SCRIPT], fake, max_turns=4)
    assert [e.tool_calls for e in eps] == [1, 0, 3, 0] and [e.tool_errors for e in eps] == [0, 0, 1, 0]
    return episodes_to_rollout(collate_episodes(eps, tok.pad_token_id), tok)


def _actor(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return ActorCritic(policy, value_head=ValueHead(hidden_size_of(policy), init_std=0.1))


def _record_choices(monkeypatch) -> list[str]:
    """The layout every non-padded decoder pass ran with (`layouts.choose`'s answers, in
    order; a padded pass does not ask)."""
    seen: list[str] = []
    choose = layouts.choose

    def spy(*args, **kw):
        seen.append(choose(*args, **kw))
        return seen[-1]

    monkeypatch.setattr(layouts, "choose", spy)
    return seen


def test_tool_episodes_pack_on_their_attention_mask(tool_rollout, chat_model):
    roll = tool_rollout
    attend, action = roll.response_attention_mask, roll.response_mask
    context = attend.bool() & ~action.bool()
    assert int(context.sum()) > 50 and attend.sum(1).max() >= 20 * attend.sum(1).min()  # lengths 2 .. ~300
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(chat_model, attn_implementation="sdpa")
    assert layouts.choose(config, "packed", roll.prompt_mask, attend) == "packed"
    # The action mask has holes (the tools' answers): packing by it would not be exact.
    with pytest.warns(UserWarning, match="runs padded"):
        assert layouts.choose(config, "packed", roll.prompt_mask, action) == "padded"
    # The 4 sequences (prompt + response, the last token left out) in 3 rows: the short
    # answer of game 3 shares the row of game 0, so the block-diagonal mask does separate them.
    plan = layouts.plan(roll.prompt_ids, roll.prompt_mask, roll.response_ids, attend)
    assert plan.input_ids.shape[0] == 3
    assert sorted(len(set(plan.segments[r][plan.segments[r] >= 0].tolist())) for r in range(3)) == [1, 1, 2]


def test_tool_episodes_packed_equal_padded(tool_rollout, chat_model, monkeypatch):
    """PPO with a value head and a reference on the tool episodes: log-probs, values and
    reference log-probs of the scoring, then every loss term and every gradient."""
    actor = _actor(chat_model)
    ref = Reference.frozen_copy(actor.policy)
    seen = _record_choices(monkeypatch)
    scored = {}
    for layout in ("padded", "packed"):
        r = dataclasses.replace(tool_rollout)
        score_rollout(actor, ref, r, with_values=True, micro_batch=4, layout=layout)
        scored[layout] = r
    assert seen == ["packed"] * 2  # the packed scoring's policy (values from its states) and reference passes
    attend = tool_rollout.response_attention_mask.bool()
    for key in ("logprobs", "ref_logprobs", "values"):
        a, b = getattr(scored["padded"], key), getattr(scored["packed"], key)
        assert (a - b)[attend].abs().max() <= TOL, key
    roll = scored["padded"]
    g = torch.Generator().manual_seed(1)
    m = roll.response_mask.float()  # targets on the action tokens, as the engine makes them
    roll.advantages = torch.randn(m.shape, generator=g) * m
    roll.returns = torch.randn(m.shape, generator=g) * m
    roll.logprobs = (roll.logprobs + 0.3 * torch.randn(m.shape, generator=g)) * m
    roll.values = (roll.values + 0.3 * torch.randn(m.shape, generator=g)) * m
    sec = PPOSection(entropy_coeff=0.01, kl_in="loss", kl_coeff=0.1, value_clip=0.2, vf_coeff=0.5)
    norm = group_normalizer(roll.response_mask, sec.loss_aggregation, 64)
    out = {}
    for layout in ("padded", "packed"):
        actor.zero_grad(set_to_none=True)
        mb = select(roll, torch.arange(len(roll)), roll.response_mask, 1, layout)
        loss, st = minibatch_loss(actor, mb, sec, 1.0, PPOMath(), norm)
        loss.backward()
        out[layout] = st, {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
    assert seen[2:] == ["packed"]
    (st_pad, g_pad), (st_pack, g_pack) = out["padded"], out["packed"]
    for key in STAT_KEYS:
        assert abs(getattr(st_pad, key) - getattr(st_pack, key)) <= TOL, key
    assert st_pad.policy_clip_frac > 0  # the clip is exercised, not all-1 ratios
    assert g_pad.keys() == g_pack.keys() and len(g_pad) == len(list(actor.trainable_parameters()))
    worst = max(float((g_pad[n] - g_pack[n]).abs().max()) for n in g_pad)
    print(f"episodes: worst gradient gap {worst:.2e}")
    assert worst <= TOL, worst


def test_trpo_step_packed_equals_padded(tool_rollout, chat_model, monkeypatch):
    """One TRPO update (the natural-gradient step with its line search, then the value fit)
    from the same start in each layout: every decoder pass of the packed one runs packed,
    and the parameters after it agree."""
    start = _actor(chat_model)
    roll = dataclasses.replace(tool_rollout)
    score_rollout(start, None, roll, with_values=True, micro_batch=4)
    g = torch.Generator().manual_seed(2)
    m = roll.response_mask.float()
    roll.advantages = torch.randn(m.shape, generator=g) * m
    roll.returns = roll.values + torch.randn(m.shape, generator=g) * m
    seen = _record_choices(monkeypatch)
    after, stats = {}, {}
    for layout in ("padded", "packed"):
        actor = copy.deepcopy(start)
        sec = TRPOSection(rollout_samples=4, max_kl=0.01, cg_iterations=6, line_search_steps=4, value_epochs=1,
                          value_mini_batch_size=2, learning_rate=1e-2, layout=layout)
        seen.clear()
        stats[layout] = natural_gradient_step(actor, roll, sec)
        opt = torch.optim.AdamW(actor.value_head.parameters(), lr=sec.learning_rate)
        stats[layout].update(fit_values(actor, opt, roll, sec, step=1, seed=0))
        # packed: old and current distributions, each line-search try, then 2 value minibatches
        passes = 2 + stats[layout]["trpo/line_search_steps"] + 2
        assert seen == ([] if layout == "padded" else ["packed"] * passes), seen
        after[layout] = {n: p.detach().clone() for n, p in actor.named_parameters()}
    pad, pack = stats["padded"], stats["packed"]
    assert pad["trpo/step_fraction"] > 0 and pad["trpo/step_fraction"] == pack["trpo/step_fraction"]
    for key in ("trpo/kl", "trpo/surrogate_improvement", "trpo/grad_norm", "loss/value"):
        assert pad[key] == pytest.approx(pack[key], rel=1e-4, abs=1e-6), key
    moved = max(float((after["padded"][n] - p.detach()).abs().max()) for n, p in start.named_parameters())
    gap = max(float((after["padded"][n] - after["packed"][n]).abs().max()) for n in after["padded"])
    print(f"trpo: packed vs padded {gap:.2e}, moved {moved:.2e}")
    assert gap <= TOL and moved > 100 * gap, (gap, moved)
