"""The packed layout (`rlhflab.models.layout`) against the padded one.

Every decoder pass (policy, value head, separate critic, reference) can run its batch
packed: each sequence's real tokens concatenated into rows, positions restarting per
sequence, a block-diagonal causal mask. The numbers must be the padded pass's: log-probs,
values, every loss term and every parameter's gradient, over batches whose response
lengths differ by 10x or more. The two passes have different shapes (different matmul
sizes, different reduction orders), so they agree to float32 rounding, not bit for bit:
a tolerance of 1e-5 throughout.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhflab.engine.dist import Dist
from rlhflab.engine.minibatch import select
from rlhflab.engine.scoring import score_rollout
from rlhflab.engine.update import PPOMath, critic_and_policy, group_normalizer, minibatch_loss, policy_update
from rlhflab.errors import UserError
from rlhflab.models import layout as layouts
from rlhflab.models.actor_critic import (ActorCritic, Critic, PolicyOnly, Reference, ValueHead, hidden_size_of,
                                         response_hidden)
from rlhflab.rollout import Rollout
from rlhflab.trainers.grpo import GRPOSection
from rlhflab.trainers.ppo import PPOSection

TOL = 1e-5  # passes of different shapes: float32 rounding, never exact
STAT_KEYS = ("policy", "value", "entropy", "kl", "total", "policy_clip_frac", "value_clip_frac", "approx_kl",
             "clip_frac_low", "clip_frac_high")


def test_plan_by_hand():
    # seq 0: prompt [5 6] (one pad before), response [7 8 9]   -> inputs 5 6 7 8     (2+3-1 = 4)
    # seq 1: prompt [4],                     response [3]       -> inputs 4           (1+1-1 = 1)
    # seq 2: prompt [1 2 3],                 response []        -> left out
    # budget = the longest (4): row 0 = seq 0, row 1 = seq 1, padded to width 4
    pi = torch.tensor([[0, 5, 6], [0, 0, 4], [1, 2, 3]])
    pm = torch.tensor([[0, 1, 1], [0, 0, 1], [1, 1, 1]])
    ri = torch.tensor([[7, 8, 9], [3, 0, 0], [0, 0, 0]])
    rm = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    p = layouts.plan(pi, pm, ri, rm)
    assert p.input_ids.tolist() == [[5, 6, 7, 8], [4, 0, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3], [0, 0, 0, 0]]
    assert p.segments.tolist() == [[0, 0, 0, 0], [1, -1, -1, -1]]
    # response token t of seq 0 is predicted by the state at prompt end + t: slots 1, 2, 3;
    # seq 1's token 0 by slot 4 (row 1, column 0); padding reads slot 8 (the zero state)
    assert p.gather.tolist() == [[1, 2, 3], [4, 8, 8], [8, 8, 8]]
    # a budget of 5 puts both in one row: seq 0 at 0..3, seq 1 at 4
    q = layouts.plan(pi, pm, ri, rm, budget=5)
    assert q.input_ids.tolist() == [[5, 6, 7, 8, 4]] and q.position_ids.tolist() == [[0, 1, 2, 3, 0]]
    m = q.mask("bool", torch.float32)[0, 0]
    assert m[4].tolist() == [False, False, False, False, True]   # seq 1 sees only itself
    assert m[3].tolist() == [True, True, True, True, False]      # seq 0's last sees its own past
    add = q.mask("additive", torch.float32)[0, 0]
    assert add[4, 0] == torch.finfo(torch.float32).min and add[4, 4] == 0


def test_shared_plan_by_hand():
    # one group (k = 2) asking prompt [5 6] (one pad before); responses [7 8 9] and [3 4]:
    # the row is the prompt once, then each response but its last token:
    #   slot     0  1 | 2  3 | 4
    #   token    5  6 | 7  8 | 3
    #   position 0  1 | 2  3 | 2    (each response continues from the prompt's 2 tokens)
    pi, pm = torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]])
    ri = torch.tensor([[7, 8, 9], [3, 4, 0]])
    rm = torch.tensor([[1, 1, 1], [1, 1, 0]])
    s = layouts.shared_plan(pi, pm, ri, rm, k=2)
    assert s.input_ids.tolist() == [[5, 6, 7, 8, 3]] and s.position_ids.tolist() == [[0, 1, 2, 3, 2]]
    assert s.segments.tolist() == [[2, 2, 0, 0, 1]]  # B + g = 2 on the prompt, the response's row after
    # token 0 of both responses is predicted by the prompt's last state (slot 1); response 0's
    # tokens 1, 2 by slots 2, 3; response 1's token 1 by slot 4; its padding reads slot 5 (zero)
    assert s.gather.tolist() == [[1, 2, 3], [1, 4, 5]]
    m = s.mask("bool", torch.float32)[0, 0].int().tolist()
    assert m == [[1, 0, 0, 0, 0],   # prompt: causal among itself
                 [1, 1, 0, 0, 0],
                 [1, 1, 1, 0, 0],   # response 0: the whole prompt and its own past
                 [1, 1, 1, 1, 0],
                 [1, 1, 0, 0, 1]]   # response 1: the prompt and itself, never response 0
    add = s.mask("additive", torch.float32)[0, 0]
    assert add[4, 2] == torch.finfo(torch.float32).min and add[4, 1] == 0
    # k = 1 is the packed layout: the same decoder inputs and map back as `plan`
    pi2, pm2 = torch.tensor([[0, 5, 6], [1, 2, 3]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    p, q = layouts.plan(pi2, pm2, ri, rm), layouts.shared_plan(pi2, pm2, ri, rm, k=1)
    for key in ("input_ids", "position_ids", "gather"):
        assert torch.equal(getattr(p, key), getattr(q, key)), key
    assert torch.equal(p.mask("bool", torch.float32), q.mask("bool", torch.float32))


def test_first_fit_decreasing():
    # longest first: 6 -> row 0 (room 1), 4 -> row 1 (room 3), 3 -> row 1 (room 0), 1 -> row 0
    assert layouts.first_fit([3, 6, 1, 4], budget=7) == [[1, 2], [3, 0]]
    assert layouts.first_fit([9, 2], budget=5) == [[0], [1]]  # longer than the budget: a row of its own


def _rollout(vocab: int, group_size: int = 1, seed: int = 0) -> Rollout:
    """8 rows: response lengths 40, 3, 1, 4, 37, 2, 5, 30 (40x apart), prompts of 1..7 tokens,
    each group of `group_size` rows with one prompt."""
    g = torch.Generator().manual_seed(seed)
    rlen = torch.tensor([40, 3, 1, 4, 37, 2, 5, 30])
    plen = torch.tensor([7, 3, 5, 1, 6, 2, 4, 7])
    b, p, t = len(rlen), 7, 40
    if group_size > 1:
        plen = plen[::group_size].repeat_interleave(group_size)
    pm = (torch.arange(p) >= p - plen[:, None]).long()
    rm = (torch.arange(t) < rlen[:, None]).long()
    pi = torch.randint(3, vocab, (b, p), generator=g)
    if group_size > 1:
        pi = pi[::group_size].repeat_interleave(group_size, 0)
    ri = torch.randint(3, vocab, (b, t), generator=g) * rm
    roll = Rollout(pi * pm, pm, ri, rm, torch.zeros(b, dtype=torch.bool), group_size=group_size)
    return roll


def _tiny(model_dir, impl="sdpa"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=impl)


def _fill(roll: Rollout, values: bool, seed: int = 1) -> None:
    """Advantages, returns and old log-probs/values a little off the current ones (so the
    clip fractions are not all 0)."""
    g = torch.Generator().manual_seed(seed)
    m = roll.response_mask.float()
    roll.advantages = torch.randn(m.shape, generator=g) * m
    roll.logprobs = (roll.logprobs + 0.3 * torch.randn(m.shape, generator=g)) * m
    if values:
        roll.returns = torch.randn(m.shape, generator=g) * m
        roll.values = (roll.values + 0.3 * torch.randn(m.shape, generator=g)) * m


def _scored(actor, reference, roll, layout, values):
    r = dataclasses.replace(roll)
    score_rollout(actor, reference, r, with_values=values, micro_batch=4, layout=layout)
    return r


def _loss_and_grads(actor, roll, sec, layout, separate=False):
    actor.zero_grad(set_to_none=True)
    k = roll.group_size if layout == "shared" else 1  # shared: each group's prompt once
    mb = select(roll, torch.arange(len(roll)), roll.response_mask, k, layout)
    norm = group_normalizer(roll.response_mask, sec.loss_aggregation, 40)
    if separate:
        st = critic_and_policy(actor, mb, sec, 1.0, PPOMath(), norm, Dist())
    else:
        loss, st = minibatch_loss(actor, mb, sec, 1.0, PPOMath(), norm)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
    return st, grads


def _assert_parity(actor, reference, roll, sec, values=True, separate=False, layout="packed", relative=False):
    """`layout`'s (or each of a tuple of layouts') scoring, loss terms and gradients against
    the padded pass's, computed once. `relative`: each tolerance TOL times the larger of 1
    and the compared tensor's (or number's) largest magnitude, for a deep model whose float32
    rounding grows with it."""

    def tol(x):
        return TOL * max(1.0, float(torch.as_tensor(x).abs().max())) if relative else TOL

    a = _scored(actor, reference, roll, "padded", values)
    m = roll.response_mask.bool()
    scored = {lay: _scored(actor, reference, roll, lay, values) for lay in
              ((layout,) if isinstance(layout, str) else layout)}
    for lay, b in scored.items():
        for key in ("logprobs", "ref_logprobs") + (("values",) if values else ()):
            x, y = getattr(a, key), getattr(b, key)
            if x is None:
                continue
            assert (x[m] - y[m]).abs().max() <= tol(x[m]), (lay, key)
    _fill(a, values)
    st_pad, g_pad = _loss_and_grads(actor, a, sec, "padded", separate)
    assert st_pad.policy_clip_frac > 0  # the clip is exercised, not all-1 ratios
    assert len(g_pad) == len(list(actor.trainable_parameters()))
    # relative: against the whole gradient's largest magnitude (the backward's rounding
    # follows what flows through every layer, not one small tensor's own scale)
    scale = tol(torch.stack([g.abs().max() for g in g_pad.values()])) if relative else TOL
    for lay in scored:
        st_pack, g_pack = _loss_and_grads(actor, a, sec, lay, separate)
        for key in STAT_KEYS:
            assert abs(getattr(st_pad, key) - getattr(st_pack, key)) <= tol(getattr(st_pad, key)), (lay, key)
        assert g_pad.keys() == g_pack.keys()
        worst = max(float((g_pad[n] - g_pack[n]).abs().max()) for n in g_pad)
        assert worst <= scale, (lay, worst, scale)


def _ppo_sec(**kw):
    return PPOSection(entropy_coeff=0.01, kl_in="loss", kl_coeff=0.1, value_clip=0.2, vf_coeff=0.5, **kw)


def test_ppo_value_head_packed_equals_padded(tiny_model_dir):
    policy = _tiny(tiny_model_dir)
    actor = ActorCritic(policy, value_head=ValueHead(hidden_size_of(policy), init_std=0.1))
    ref = Reference.frozen_copy(policy)
    roll = _rollout(policy.config.vocab_size)
    _assert_parity(actor, ref, roll, _ppo_sec())


def test_ppo_separate_critic_packed_equals_padded(tiny_model_dir):
    policy, base = _tiny(tiny_model_dir), _tiny(tiny_model_dir)
    actor = ActorCritic(policy, critic=Critic(base, ValueHead(hidden_size_of(base), init_std=0.1)))
    roll = _rollout(policy.config.vocab_size)
    _assert_parity(actor, Reference.frozen_copy(policy), roll, _ppo_sec(), separate=True)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", ["packed", "shared"])
def test_grpo_packed_and_shared_equal_padded(tiny_model_dir, impl, layout):
    """GRPO's groups of 4 share a prompt: the padded and packed sides give each row its
    prompt, the shared side runs each group's prompt once (its gradient summed over the
    group's 4 responses)."""
    policy = _tiny(tiny_model_dir, impl)
    actor = PolicyOnly(policy)
    roll = _rollout(policy.config.vocab_size, group_size=4)
    sec = GRPOSection(entropy_coeff=0.01, kl_coeff=0.1, group_size=4)
    _assert_parity(actor, Reference.frozen_copy(policy), roll, sec, values=False, layout=layout)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)  # grouped-query attention (4 heads, 2 K/V), q/k/v biases, tied embeddings
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=True, attn_implementation="sdpa"))


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    # OPT-350m's layout: project_in/out, post-norm, learned positions (offset 2); dropout 0
    # (OPTConfig's default 0.1 would draw other masks in the two passes)
    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(vocab_size=256, hidden_size=16, word_embed_proj_dim=8, ffn_dim=32,
                                    num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                                    do_layer_norm_before=False, dropout=0.0, attn_implementation="sdpa"))


@pytest.mark.parametrize("build", [_qwen2, _opt], ids=["qwen2", "opt"])
def test_other_architectures_packed_equal_padded(build):
    policy = build().float()
    actor = ActorCritic(policy, value_head=ValueHead(hidden_size_of(policy), init_std=0.1))
    roll = _rollout(policy.config.vocab_size)
    _assert_parity(actor, Reference.frozen_copy(policy), roll, _ppo_sec())


@pytest.mark.parametrize("build", [_qwen2, _opt], ids=["qwen2", "opt"])
def test_other_architectures_grpo_shared_equals_padded(build):
    policy = build().float()
    roll = _rollout(policy.config.vocab_size, group_size=4)
    sec = GRPOSection(entropy_coeff=0.01, kl_coeff=0.1, group_size=4)
    _assert_parity(PolicyOnly(policy), Reference.frozen_copy(policy), roll, sec, values=False, layout="shared")


def test_an_all_ones_2d_mask_never_reaches_a_packed_forward(tiny_model_dir):
    """The trap: transformers only looks for packed sequences in the position ids when no 2D
    mask is given, so packed rows with an all-ones 2D mask attend across sequences. Every
    decoder pass of a packed update (scoring, reference, update) must hand a 4D
    block-diagonal mask down to the attention layers."""
    policy = _tiny(tiny_model_dir)
    actor = ActorCritic(policy, value_head=ValueHead(hidden_size_of(policy)))
    ref = Reference.frozen_copy(policy)
    seen = []

    def record(module, args, kwargs):
        seen.append(kwargs.get("attention_mask"))

    hooks = [layer.self_attn.register_forward_pre_hook(record, with_kwargs=True)
             for model in (policy, ref.model) for layer in model.model.layers]
    roll = _rollout(policy.config.vocab_size)
    score_rollout(actor, ref, roll, with_values=True, micro_batch=8, layout="packed")
    _fill(roll, values=True)
    sec = _ppo_sec(epochs=1, mini_batch_size=8, layout="packed")
    opt = torch.optim.SGD(actor.trainable_parameters(), lr=0.0)
    policy_update(actor, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), roll, sec, temperature=1.0,
                  step=0, seed=0, max_new_tokens=40)
    for h in hooks:
        h.remove()
    # 2 layers x (policy score + reference score + update) at least
    assert len(seen) >= 6
    packing = layouts.plan(roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask,
                           layouts.row_budget(policy.config))
    for mask in seen:
        assert mask is not None and mask.ndim == 4 and mask.dtype == torch.bool
        assert mask.shape[0] < len(roll)  # rows were packed: 8 sequences in fewer rows
    assert torch.equal(seen[0], packing.mask("bool", torch.float32))
    # Negative control: the same packed rows under an all-ones 2D mask give other states.
    decoder = policy.model
    with torch.no_grad():
        good = decoder(**layouts.decoder_inputs(decoder, packing, torch.float32)).last_hidden_state
        trap = decoder(input_ids=packing.input_ids, position_ids=packing.position_ids,
                       attention_mask=torch.ones_like(packing.input_ids)).last_hidden_state
    real = packing.segments >= 0
    assert (good - trap)[real].abs().max() > 1e-3


def test_unsupported_attention_is_refused_in_one_line(tiny_model_dir):
    policy = _tiny(tiny_model_dir)
    policy.config._attn_implementation_internal = "flex_attention"
    roll = _rollout(policy.config.vocab_size)
    with pytest.raises(UserError, match=r"^layout: packed runs with attn_implementation sdpa, eager or "
                                        r"flash_attention_2/3, not flex_attention") as e:
        response_hidden(policy, roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask,
                        layout="packed")
    assert "\n" not in str(e.value)


def test_sliding_window_packs_within_it_and_falls_back_beyond(recwarn):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128, sliding_window=16,
                                             attn_implementation="sdpa"))
    roll = _rollout(256)
    args = (roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask)
    m = roll.response_mask.bool()
    # sequences of up to 47 tokens against a 16-token window: padded, with a one-line note
    assert layouts.choose(model.config, "packed", roll.prompt_mask, roll.response_mask) == "padded"
    assert any("sliding window" in str(w.message) for w in recwarn.list)
    # rows 1, 2, 3, 5 and 6 fit in the window (at most 4 + 5 tokens): packed, and equal
    short = torch.tensor([1, 2, 3, 5, 6])
    args = tuple(x[short, :7] if i < 2 else x[short, :5] for i, x in enumerate(args))
    assert layouts.choose(model.config, "packed", args[1], args[3]) == "packed"
    with torch.no_grad():
        a, b = response_hidden(model, *args), response_hidden(model, *args, layout="packed")
    m = args[3].bool()
    assert (a - b)[m].abs().max() <= TOL


def test_shared_runs_padded_beyond_a_sliding_window_and_shares_within_it(recwarn):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128, sliding_window=16,
                                             attn_implementation="sdpa"))
    roll = _rollout(256, group_size=4)
    pi, pm = roll.prompt_ids[::4], roll.prompt_mask[::4]
    seen = []
    real = layouts.shared_plan
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layouts, "shared_plan", lambda *a, **k: seen.append(1) or real(*a, **k))
        mp.setattr(layouts, "_NOTED", set())  # the note is printed once per process: afresh here
        with torch.no_grad():
            # sequences of up to 47 tokens against a 16-token window: padded, with a note
            a = response_hidden(model, pi, pm, roll.response_ids, roll.response_mask, 4, layout="shared")
            assert not seen and any("sliding window" in str(w.message) for w in recwarn.list)
            # responses cut to 5 tokens: at most 7 + 5 positions, inside the window: shared
            ri, rm = roll.response_ids[:, :5], roll.response_mask[:, :5]
            b = response_hidden(model, pi, pm, ri, rm, 4, layout="shared")
            assert seen
            c = response_hidden(model, pi.repeat_interleave(4, 0), pm.repeat_interleave(4, 0), ri, rm)
    full = response_hidden(model, pi.repeat_interleave(4, 0), pm.repeat_interleave(4, 0), roll.response_ids,
                           roll.response_mask).detach()
    m, short = roll.response_mask.bool(), rm.bool()
    assert (a - full)[m].abs().max() <= TOL and (b - c)[short].abs().max() <= TOL


def _gemma3(impl="sdpa"):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # sliding layers of an 8-token window beside full ones; the rollout's sequences run to
    # 47 tokens, so the window cuts. Dropout 0 (both passes must draw nothing).
    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, max_position_embeddings=128, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], attention_dropout=0.0,
        attn_implementation=impl)).float()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_gemma3_packs_with_a_mask_per_layer_type(impl):
    """Gemma 3's decoder takes {layer type: mask}: full layers get the block-diagonal causal
    mask, sliding ones the same cut to the window, so a batch longer than the window packs
    (no fallback) and equals the padded pass."""
    policy = _gemma3(impl)
    roll = _rollout(policy.config.vocab_size)
    assert layouts.layer_masks_accepted(policy.config)
    assert layouts.choose(policy.config, "packed", roll.prompt_mask, roll.response_mask) == "packed"
    seen = {}

    def record(i):
        def hook(module, args, kwargs):
            seen[i] = kwargs.get("attention_mask")
        return hook

    hooks = [layer.self_attn.register_forward_pre_hook(record(i), with_kwargs=True)
             for i, layer in enumerate(policy.model.layers)]
    with torch.no_grad():
        response_hidden(policy, roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask,
                        layout="packed")
    for h in hooks:
        h.remove()
    packing = layouts.plan(roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask,
                           layouts.row_budget(policy.config))
    kind = "bool" if impl == "sdpa" else "additive"
    full = packing.mask(kind, torch.float32)
    assert torch.equal(seen[1], full)  # the full-attention layer
    for i in (0, 2):
        allowed = seen[i][:, 0] if seen[i].dtype == torch.bool else seen[i][:, 0] == 0
        # by hand: row 0 holds the longest sequence (7 + 40 - 1 = 46 inputs) from column 0,
        # so position 20 sees 13..20 (8 positions) and nothing before 13
        assert allowed[0, 20].nonzero().flatten().tolist() == list(range(13, 21))
        assert torch.equal(seen[i], layouts.windowed(full, packing.position_ids, 8))
    actor = ActorCritic(policy, value_head=ValueHead(hidden_size_of(policy), init_std=0.1))
    _assert_parity(actor, Reference.frozen_copy(policy), roll, _ppo_sec())
    # negative control: the full mask on every layer (no window) gives other states
    decoder = policy.model
    with torch.no_grad():
        good = decoder(**layouts.decoder_inputs(decoder, packing, torch.float32)).last_hidden_state
        wrong = decoder(input_ids=packing.input_ids, position_ids=packing.position_ids,
                        attention_mask={"full_attention": full, "sliding_attention": full}).last_hidden_state
    assert (good - wrong)[packing.segments >= 0].abs().max() > 1e-3


@pytest.mark.slow
def test_smollm2_grpo_packed_equals_padded(smollm2_dir):
    """The real model (30 layers, float32): GRPO's scored log-probs, every loss term and every
    parameter's gradient, packed against padded, on 4 sequences of 7 to 60 tokens (groups of
    2 sharing a prompt: packed repeats it per row, shared computes it once). Within 1e-5 of each
    tensor's scale (the gradients: of the whole gradient's): log-probs of random tokens reach
    -23 and gradients 3, where float32 rounding through 30 layers of other shapes differs by
    about 2e-5 (measured: 2.0e-5 on both; one layer norm's gradient 1.14x 1e-5 of its own
    largest entry, so per-tensor scales would fail on rounding alone)."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    plen, rlen = torch.tensor([6, 6, 10, 10]), torch.tensor([54, 1, 3, 37])  # sequences of 60, 7, 13, 47 tokens
    p, t = 10, 54
    pm = (torch.arange(p) >= p - plen[:, None]).long()
    rm = (torch.arange(t) < rlen[:, None]).long()
    pi = torch.randint(3, policy.config.vocab_size, (2, p), generator=g).repeat_interleave(2, 0) * pm
    ri = torch.randint(3, policy.config.vocab_size, (4, t), generator=g) * rm
    roll = Rollout(pi, pm, ri, rm, torch.zeros(4, dtype=torch.bool), group_size=2)
    sec = GRPOSection(entropy_coeff=0.01, kl_coeff=0.1, group_size=2)
    # packed: each row its prompt; shared: a group's prompt once (both attend per sequence)
    _assert_parity(PolicyOnly(policy), Reference.frozen_copy(policy), roll, sec, values=False,
                   layout=("packed", "shared"), relative=True)


def _sdpa_calls(monkeypatch) -> list:
    """Each SDPA call from now on, as (batch, no mask given, causal), in order."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((q.shape[0], attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_sdpa_runs_per_sequence_attention_equal_to_the_mask(tiny_model_dir, monkeypatch):
    """Under SDPA a packed pass attends per sequence (`layouts.attention`: each sequence's
    queries, keys and values gathered into a right-padded batch, causal SDPA), the same
    states as the block-diagonal mask, in one row as in several."""
    policy = _tiny(tiny_model_dir)
    decoder = policy.model
    roll = _rollout(policy.config.vocab_size)
    calls = _sdpa_calls(monkeypatch)
    for budget in (None, 1000):  # rows of the longest sequence; all 8 sequences in one row
        packing = layouts.plan(roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask, budget)
        inputs = layouts.decoder_inputs(decoder, packing, torch.float32)
        with torch.no_grad():
            calls.clear()
            masked = decoder(**inputs).last_hidden_state  # plain SDPA: the mask, packed_index ignored
            assert calls == [(packing.input_ids.shape[0], False, False)] * 2  # 2 layers, the 4D mask
            calls.clear()
            with layouts.attention(decoder):
                assert decoder.config._attn_implementation == layouts.PER_SEQUENCE
                per_seq = decoder(**inputs).last_hidden_state
            assert decoder.config._attn_implementation == "sdpa"
        assert calls == [(8, True, True)] * 2  # the 8 sequences as a batch, causal, no mask
        real = packing.segments >= 0
        assert (masked - per_seq)[real].abs().max() <= TOL


def test_sdpa_runs_the_shared_layout_per_sequence_equal_to_the_tree_mask(tiny_model_dir, monkeypatch):
    """The shared layout under SDPA attends one sequence at a time too: each response with
    its group's prompt (the prompt's queries, keys and values gathered once per response),
    the same states as the tree mask, on the prompt's slots as on every response's."""
    policy = _tiny(tiny_model_dir)
    decoder = policy.model
    roll = _rollout(policy.config.vocab_size, group_size=4)
    calls = _sdpa_calls(monkeypatch)
    prompt_ids, prompt_mask = roll.prompt_ids[::4], roll.prompt_mask[::4]  # a prompt per group
    for budget in (None, 1000):  # rows of the longest group; both groups in one row
        packing = layouts.shared_plan(prompt_ids, prompt_mask, roll.response_ids, roll.response_mask, 4, budget)
        assert packing.input_ids.shape[0] == (2 if budget is None else 1)
        inputs = layouts.decoder_inputs(decoder, packing, torch.float32)
        with torch.no_grad():
            calls.clear()
            masked = decoder(**inputs).last_hidden_state  # plain SDPA: the tree mask
            assert calls == [(packing.input_ids.shape[0], False, False)] * 2
            calls.clear()
            with layouts.attention(decoder):
                per_seq = decoder(**inputs).last_hidden_state
        assert calls == [(8, True, True)] * 2  # a sequence per response, causal, no mask
        real = packing.segments >= 0
        assert (masked - per_seq)[real].abs().max() <= TOL
        assert (masked - per_seq)[packing.prompt].abs().max() <= TOL and bool(packing.prompt.any())


def _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True, softmax_scale=None, **_):
    """What FlashAttention's varlen kernel computes, in plain SDPA: (N, heads, d) flat
    queries, keys and values, each run [cu[i], cu[i+1]) attending causally to itself alone."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and causal
    out = []
    for a, b in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
        qi, ki, vi = (x[a:b].transpose(0, 1) for x in (q, k, v))                     # (h, L, d)
        if ki.shape[0] != qi.shape[0]:
            ki, vi = (x.repeat_interleave(qi.shape[0] // x.shape[0], 0) for x in (ki, vi))
        out.append(torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True,
                                                                    scale=softmax_scale).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("build", [None, _qwen2], ids=["llama", "qwen2"])
def test_flash_attention_packs_by_sequence_boundaries(build, tiny_model_dir, monkeypatch, recwarn):
    """Under flash_attention_2 a packed pass builds no mask: the decoder gets the sequences'
    boundaries as transformers' FlashAttention integration reads them (cu_seq_lens_q/k,
    max_length_q/k) and runs its varlen kernel. transformers' own integration runs here with
    the kernel swapped for `_varlen_reference` (no FlashAttention on a CPU): the packed log-
    probs equal the padded pass's, and the shared layout runs packed with a one-line note."""
    from transformers import modeling_flash_attention_utils as fa

    def process(**kw):  # the kernel's keywords (flash_attn_varlen_func's: causal, softmax_scale)
        return {"causal": kw["is_causal"], "softmax_scale": kw.get("softmax_scale")}

    runs = []

    def kernel(q, k, v, **kw):
        runs.append(len(kw["cu_seqlens_q"]) - 1)
        return _varlen_reference(q, k, v, **kw)

    monkeypatch.setattr(fa, "lazy_import_flash_attention",
                        lambda *a, **k: ((None, kernel, None, None, None), (process, dict)))
    monkeypatch.setattr(layouts, "_NOTED", set())
    policy = _tiny(tiny_model_dir) if build is None else build().float()
    roll = _rollout(policy.config.vocab_size, group_size=4)
    prompts = roll.prompt_ids[::4], roll.prompt_mask[::4]
    with torch.no_grad():
        padded = response_hidden(policy, *prompts, roll.response_ids, roll.response_mask, 4, "padded")
        packing = layouts.plan(roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask, 40)
        policy.config._attn_implementation_internal = "flash_attention_2"
        try:
            inputs = layouts.decoder_inputs(policy.model, packing, torch.float32)
            assert "attention_mask" not in inputs and inputs["max_length_q"] == max(
                int(n) for n in (roll.prompt_mask.sum(1) + roll.response_mask.sum(1) - 1))
            cu = inputs["cu_seq_lens_q"]
            assert cu[0] == 0 and cu[-1] == packing.input_ids.numel() and bool((cu.diff() > 0).all())
            packed = response_hidden(policy, *prompts, roll.response_ids, roll.response_mask, 4, "packed")
            shared = response_hidden(policy, *prompts, roll.response_ids, roll.response_mask, 4, "shared")
        finally:
            policy.config._attn_implementation_internal = "sdpa"
    m = roll.response_mask.bool()
    assert (padded - packed)[m].abs().max() <= TOL and (padded - shared)[m].abs().max() <= TOL
    assert (packed - shared).abs().max() == 0  # shared ran as packed
    layers = policy.config.num_hidden_layers
    assert len(runs) == 2 * layers and all(n >= 8 for n in runs)  # 2 passes; 8 sequences (and row tails)
    assert any("layout: shared runs packed under FlashAttention" in str(w.message) for w in recwarn)
