"""The packed layout in SFT, the reward model, DPO and PPO-ptx, against the padded one.

Each pass can run its batch packed (`models.layout`): whole sequences (SFT, the reward
model, PPO-ptx's LM rows) through `plan_sequences`, prompt|response pairs (DPO's policy and
reference) through `response_hidden`. The numbers must be the padded pass's: the NLL, the
scores, every loss term and every parameter's gradient, over batches whose lengths differ
by 10x or more. The two passes have different shapes (other matmul sizes and reduction
orders), so they agree to float32 rounding, not bit for bit: a tolerance of 1e-5
throughout, on means (a token-mean NLL, per-pair losses) whose size is a few units.
"""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from rlhflab.data import sft as sftdata
from rlhflab.engine.dist import Forward
from rlhflab.engine.minibatch import select
from rlhflab.engine.update import PPOMath, group_normalizer, minibatch_loss
from rlhflab.models import layout as layouts
from rlhflab.models.actor_critic import ActorCritic, PolicyOnly, Reference, ValueHead, hidden_size_of, lm_loss
from rlhflab.rewards.model import sequence_scores
from rlhflab.trainers.dpo import DPOSection, ReferenceCache, TokenizedPair, dpo_micro_batch_loss
from rlhflab.trainers.ppo import PPOSection
from rlhflab.trainers.rm import pairwise_loss
from rlhflab.trainers.sft import batch_nll

TOL = 1e-5  # passes of different shapes: float32 rounding, never exact
LENGTHS = [40, 3, 26, 2, 4, 31, 1, 5]  # 40x apart


def _opt_config():
    from transformers import OPTConfig

    # OPT-350m's layout: project_in/out, post-norm, learned positions (offset 2); dropout 0
    return OPTConfig(vocab_size=256, hidden_size=16, word_embed_proj_dim=8, ffn_dim=32, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=128, do_layer_norm_before=False, dropout=0.0,
                     pad_token_id=1, attn_implementation="sdpa")


def _lm(arch, dirs):
    from transformers import AutoModelForCausalLM, OPTForCausalLM

    torch.manual_seed(0)
    if arch == "opt":
        return OPTForCausalLM(_opt_config()).float()
    return AutoModelForCausalLM.from_pretrained(dirs[arch], dtype=torch.float32, attn_implementation="sdpa")


def _scorer(arch, dirs):
    from transformers import AutoModelForSequenceClassification, OPTForSequenceClassification

    torch.manual_seed(0)
    if arch == "opt":
        cfg = _opt_config()
        cfg.num_labels = 1
        return OPTForSequenceClassification(cfg).float()
    return AutoModelForSequenceClassification.from_pretrained(dirs[arch], num_labels=1, dtype=torch.float32,
                                                              attn_implementation="sdpa")


@pytest.fixture(scope="module")
def dirs(tiny_model_dir, tiny_arch_dirs):
    return {"llama": tiny_model_dir, "qwen2": tiny_arch_dirs["qwen2"]}


ARCHS = ["llama", "qwen2", "opt"]


def _sequences(vocab, lengths=LENGTHS, prompt=3, seed=0):
    """Right-padded (B, L) ids and mask of the given lengths, labels -100 on each row's
    first `prompt` tokens (at most all but one) and on padding: an SFT micro-batch."""
    g = torch.Generator().manual_seed(seed)
    n = torch.tensor(lengths)
    mask = (torch.arange(max(lengths)) < n[:, None]).long()
    ids = torch.randint(3, vocab, mask.shape, generator=g) * mask
    labels = torch.where(mask.bool(), ids, sftdata.IGNORE_INDEX)
    labels[torch.arange(max(lengths)) < torch.clamp(n - 1, max=prompt)[:, None]] = sftdata.IGNORE_INDEX
    return ids, mask, labels


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads(a, b, model):
    assert a.keys() == b.keys() and len(a) == sum(p.requires_grad for p in model.parameters())
    worst = max(float((a[n] - b[n]).abs().max()) for n in a)
    assert worst <= TOL, worst


def _masks_seen(models):
    """Record the attention mask every self-attention layer of `models` is handed."""
    seen, hooks = [], []
    for model in models:
        for mod in model.modules():
            if type(mod).__name__.endswith("Attention"):
                hooks.append(mod.register_forward_pre_hook(
                    lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True))
    return seen, hooks


class packed_pass:
    """While a pass runs, record what the attention of `models` gets; on leaving, check that
    it ran packed (a 4D boolean mask over fewer rows than the batch's `rows`) when `layout`
    is packed, so a silent fallback to padded cannot pass for parity."""

    def __init__(self, layout, rows, *models):
        self.layout, self.rows, self.models = layout, rows, models

    def __enter__(self):
        self.seen, self.hooks = _masks_seen(self.models)

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        if self.layout == "packed" and exc[0] is None:
            _assert_block_masks(self.seen, 1)
            assert all(m.shape[0] < self.rows for m in self.seen)


def _assert_block_masks(seen, n_layers):
    """Every mask a packed forward hands the attention is 4D (the block-diagonal one), never
    the all-ones 2D mask that lets packed sequences attend to each other."""
    assert len(seen) >= n_layers
    for mask in seen:
        assert mask is not None and mask.ndim == 4 and mask.dtype == torch.bool


def test_plan_sequences_by_hand():
    # row 0: [5 6 7] (length 3), row 1: [4] (1), row 2: empty, row 3: [8 9] (2); budget = longest (3)
    # first-fit decreasing: [0] -> row 0 (room 0); [3] -> row 1 (room 1); [1] -> row 1 (room 0)
    ids = torch.tensor([[5, 6, 7], [4, 0, 0], [0, 0, 0], [8, 9, 0]])
    mask = (ids > 0).long()
    p = layouts.plan_sequences(ids, mask)
    assert p.input_ids.tolist() == [[5, 6, 7], [8, 9, 4]]
    assert p.position_ids.tolist() == [[0, 1, 2], [0, 1, 0]]
    assert p.segments.tolist() == [[0, 0, 0], [3, 3, 1]]
    # (B, L): each real token's slot; padding reads slot 6 (the zero state after R·W = 6)
    assert p.gather.tolist() == [[0, 1, 2], [5, 6, 6], [6, 6, 6], [3, 4, 6]]
    m = p.mask("bool", torch.float32)[1, 0]
    assert m.tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    # the states map back: unpack of per-slot values 0..5 gives each token's own slot
    slots = torch.arange(6.0).view(2, 3, 1)
    assert p.unpack(slots)[..., 0].tolist() == [[0, 1, 2], [5, 0, 0], [0, 0, 0], [3, 4, 0]]
    # a budget of 6 puts all three in one row
    assert layouts.plan_sequences(ids, mask, budget=6).input_ids.tolist() == [[5, 6, 7, 8, 9, 4]]


@pytest.mark.parametrize("arch", ARCHS)
def test_sft_nll_and_grads_packed_equal_padded(arch, dirs):
    model = _lm(arch, dirs)
    ids, mask, labels = _sequences(model.config.vocab_size)
    out = {}
    for layout in ("padded", "packed"):
        model.zero_grad(set_to_none=True)
        with packed_pass(layout, len(ids), model):
            nll = batch_nll(model, ids, mask, labels, layout)
        (nll.total / nll.tokens).backward()
        out[layout] = (float(nll.total.detach()) / nll.tokens, nll.tokens, _grads(model))
    (a, na, ga), (b, nb, gb) = out["padded"], out["packed"]
    # row of n tokens: labels on positions max(1, min(n-1, 3)) .. n-1, so n - max(1, min(n-1, 3)) of them:
    # 37 + 1 + 23 + 1 + 1 + 28 + 0 + 2 = 93
    assert na == nb == 93
    assert abs(a - b) <= TOL and a > 1.0  # a real NLL (about log 256 = 5.5 at init)
    _assert_grads(ga, gb, model)


def test_sft_packed_under_a_budget_and_through_a_lora_head(tiny_model_dir):
    """The token budget as the row width (several sequences per row), and the path where
    the LM head is not a plain linear map (LoRA on it: the model's own logits)."""
    from peft import LoraConfig, get_peft_model

    model = _lm("llama", {"llama": tiny_model_dir})
    ids, mask, labels = _sequences(model.config.vocab_size)
    assert layouts.plan_sequences(ids, mask, budget=48).input_ids.shape[0] == 3  # 112 tokens in rows of <= 48
    with torch.no_grad():
        pad = batch_nll(model, ids, mask, labels)
    with torch.no_grad(), packed_pass("packed", 4, model):
        packed = batch_nll(model, ids, mask, labels, "packed", budget=48)
    assert abs(float(pad.total - packed.total)) / pad.tokens <= TOL
    torch.manual_seed(1)
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["lm_head", "q_proj"], init_lora_weights=False))
    with torch.no_grad():
        a = batch_nll(lora, ids, mask, labels)
        with packed_pass("packed", len(ids), model):
            b = batch_nll(lora, ids, mask, labels, "packed")
    assert abs(float(a.total - b.total)) / a.tokens <= TOL and abs(float(a.total - pad.total)) > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_rm_scores_loss_and_grads_packed_equal_padded(arch, dirs):
    model = _scorer(arch, dirs)
    # 4 pairs, chosen lengths 40, 3, 26, 2 and rejected 4, 31, 1, 5, packed together
    ids, mask, _ = _sequences(model.config.vocab_size, seed=1)
    margin = torch.tensor([0.5, 0.0, 1.0, 0.2])
    tie = torch.tensor([False, False, True, False])
    out = {}
    for layout in ("padded", "packed"):
        model.zero_grad(set_to_none=True)
        with packed_pass(layout, len(ids), model):
            scores = sequence_scores(model, ids, mask, layout)
        chosen, rejected = scores[:4], scores[4:]
        loss = pairwise_loss(chosen, rejected, margin, tie, center_coeff=0.1)
        loss.loss.backward()
        out[layout] = (chosen.detach(), rejected.detach(), float(loss.loss), _grads(model))
    (c0, r0, l0, g0), (c1, r1, l1, g1) = out["padded"], out["packed"]
    assert (c0 - c1).abs().max() <= TOL and (r0 - r1).abs().max() <= TOL
    assert abs(l0 - l1) <= TOL and (c0 - r0).abs().min() > 1e-4  # scores that differ, not all one value
    _assert_grads(g0, g1, model)


def _pairs(vocab, seed=2):
    """6 pairs: prompts of 1..7 tokens, chosen and rejected of 1..40 (40x apart)."""
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    shape = [(7, 40, 3), (2, 1, 30), (5, 4, 2), (1, 25, 1), (3, 2, 38), (6, 5, 4)]
    return [TokenizedPair(tok(p), tok(c), tok(r)) for p, c, r in shape]


@pytest.mark.parametrize("arch", ARCHS)
def test_dpo_reference_loss_and_grads_packed_equal_padded(arch, dirs):
    policy = _lm(arch, dirs)
    actor, ref = PolicyOnly(policy), Reference.frozen_copy(policy)
    with torch.no_grad():  # a reference a little away from the policy, so the rewards are not all 0
        for p in ref.model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    pairs = _pairs(policy.config.vocab_size)
    sec = DPOSection(beta=0.5, sft_coeff=0.3)
    out = {}
    for layout in ("padded", "packed"):
        cache = ReferenceCache(ref, pairs, 0, torch.device("cpu"), batch_size=6, layout=layout)
        with packed_pass(layout, 12, ref.model):
            rc, rr = cache.get(range(6))
        sec.layout = layout
        actor.zero_grad(set_to_none=True)
        with packed_pass(layout, 12, policy):
            loss, st = dpo_micro_batch_loss(actor, pairs, rc, rr, sec, 0, "cpu")
        loss.backward()
        out[layout] = (rc, rr, float(loss), st, _grads(actor))
    (rc0, rr0, l0, s0, g0), (rc1, rr1, l1, s1, g1) = out["padded"], out["packed"]
    assert (rc0 - rc1).abs().max() <= TOL * 40 and (rr0 - rr1).abs().max() <= TOL * 40  # sums of <= 42 log-probs
    assert abs(l0 - l1) <= TOL and abs(s0.loss - s1.loss) <= TOL and abs(s0.nll - s1.nll) <= TOL
    assert (s0.chosen_rewards - s1.chosen_rewards).abs().max() <= TOL * 20  # beta 0.5 x sums of 40 log-probs
    assert (s0.rejected_rewards - s1.rejected_rewards).abs().max() <= TOL * 20
    assert s0.chosen_rewards.abs().max() > 1e-3
    _assert_grads(g0, g1, actor)


def _ptx_step(actor, layout, lm_batch, sec):
    from test_layout import _fill, _rollout

    roll = _rollout(actor.policy.config.vocab_size)
    with torch.no_grad():
        out = actor(roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask)
    roll.logprobs, roll.values = out.logprobs, out.values
    _fill(roll, values=True)
    actor.zero_grad(set_to_none=True)
    mb = select(roll, torch.arange(len(roll)), roll.response_mask, 1, layout)
    mb.lm_batch, mb.lm_weight = lm_batch, 0.5
    with packed_pass(layout, len(roll), actor.policy):
        loss, st = minibatch_loss(actor, mb, sec, 1.0, PPOMath(),
                                  group_normalizer(roll.response_mask, "token_mean", 40))
    loss.backward()
    return st, _grads(actor)


def test_ppo_ptx_step_packed_equals_padded(tiny_model_dir):
    policy = _lm("llama", {"llama": tiny_model_dir})
    actor = ActorCritic(policy, value_head=ValueHead(hidden_size_of(policy), init_std=0.1))
    ids, mask, labels = _sequences(policy.config.vocab_size, seed=3)
    lm_batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    sec = PPOSection(ptx_coeff=0.7, entropy_coeff=0.01, vf_coeff=0.5, value_clip=0.2)
    st0, g0 = _ptx_step(actor, "padded", lm_batch, sec)
    st1, g1 = _ptx_step(actor, "packed", lm_batch, sec)
    assert st0.ptx > 1.0 and abs(st0.ptx - st1.ptx) <= TOL
    with torch.no_grad():  # the ptx term is the LM loss of the rows either way
        assert abs(st0.ptx - 0.5 * float(lm_loss(policy, lm_batch))) <= TOL
    for key in ("policy", "value", "entropy", "total"):
        assert abs(getattr(st0, key) - getattr(st1, key)) <= TOL, key
    _assert_grads(g0, g1, actor)


def test_an_all_ones_2d_mask_never_reaches_these_packed_forwards(tiny_model_dir):
    """SFT's, the reward model's, DPO's (policy and reference) and PPO-ptx's packed passes
    hand every attention layer the 4D block-diagonal mask; the padded passes a 2D one (so
    the hook does see what the layers get)."""
    from transformers import AutoModelForSequenceClassification

    policy = _lm("llama", {"llama": tiny_model_dir})
    scorer = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
    ref = Reference.frozen_copy(policy)
    n_layers = policy.config.num_hidden_layers
    ids, mask, labels = _sequences(policy.config.vocab_size)
    pairs = _pairs(policy.config.vocab_size)
    sec = DPOSection(layout="packed")
    seen, hooks = _masks_seen([policy, scorer, ref.model])
    try:
        with torch.no_grad():
            batch_nll(policy, ids, mask, labels, "packed")
            _assert_block_masks(seen, n_layers)
            assert torch.equal(seen[0], layouts.plan_sequences(ids, mask).mask("bool", torch.float32))
            seen.clear()
            sequence_scores(scorer, ids, mask, "packed")
            _assert_block_masks(seen, n_layers)
            seen.clear()
            rc, rr = ReferenceCache(ref, pairs, 0, torch.device("cpu"), 6, "packed").get(range(6))
            dpo_micro_batch_loss(PolicyOnly(policy), pairs, rc, rr, sec, 0, "cpu")
            _assert_block_masks(seen, 2 * n_layers)
            seen.clear()
            lm_loss(policy, {"input_ids": ids, "attention_mask": mask, "labels": labels}, layout="packed")
            _assert_block_masks(seen, n_layers)
        # Negative control: the packed rows under an all-ones 2D mask give another NLL.
        packing = layouts.plan_sequences(ids, mask)
        with torch.no_grad():
            trap = policy(input_ids=packing.input_ids, position_ids=packing.position_ids,
                          attention_mask=torch.ones_like(packing.input_ids)).logits
            good = policy(**layouts.decoder_inputs(policy.model, packing, torch.float32)).logits
        real = packing.segments >= 0
        assert (good - trap)[real].abs().max() > 1e-3
    finally:
        for h in hooks:
            h.remove()


# --------------------------------------------------------------------------------------
# Token-budget micro-batches (sft/rm/dpo.mini_batch_tokens)
# --------------------------------------------------------------------------------------
def test_cut_rows_by_tokens_by_hand():
    from rlhflab.trainers.common import cut_rows_by_tokens

    # lengths 5, 9, 2, 7, 3 in a budget of 10, longest first: rows 1 (9), 3 (7), 0 (5), 4 (3), 2 (2);
    # 9 | 9 + 7 > 10: 7 | 7 + 5 > 10: 5 + 3 + 2 = 10
    assert cut_rows_by_tokens([5, 9, 2, 7, 3], 10) == [[1], [3], [0, 4, 2]]
    assert cut_rows_by_tokens([12, 1], 10) == [[0], [1]]  # longer than the budget: its own micro-batch


def test_cut_rows_by_tokens_makes_as_many_micro_batches_on_every_rank():
    from types import SimpleNamespace

    from rlhflab.trainers.common import cut_rows_by_tokens

    def rank(most: int):  # a rank of a run whose busiest rank needs `most` micro-batches
        return SimpleNamespace(distributed=True, max=lambda n: max(n, most))

    lengths = [5, 9, 2, 7, 3]  # alone: [[1], [3], [0, 4, 2]] (the case above)
    assert cut_rows_by_tokens(lengths, 10, rank(3)) == [[1], [3], [0, 4, 2]]
    # 4: the micro-batch of most tokens (5 + 3 + 2) split where it halves best: 5 | 3 + 2
    assert cut_rows_by_tokens(lengths, 10, rank(4)) == [[1], [3], [0], [4, 2]]
    # 5: then 7 | 9 cannot split (one row each), so 3 + 2 does: a row per micro-batch
    assert cut_rows_by_tokens(lengths, 10, rank(5)) == [[1], [3], [0], [4], [2]]
    assert cut_rows_by_tokens(lengths, 10, SimpleNamespace(distributed=False)) == [[1], [3], [0, 4, 2]]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_sft_token_budget_gives_the_row_cut_update(tiny_model_dir, layout):
    """sft.mini_batch_tokens: the step's 8 rows (lengths 1..40) cut into micro-batches of at
    most 48 real tokens, the summed NLL over the step's token count: the same loss and
    gradient as the 2 x 4-row micro-batches."""
    from rlhflab.trainers.sft import accumulate_group, step_micro_batches

    model = _lm("llama", {"llama": tiny_model_dir})
    ids, mask, labels = _sequences(model.config.vocab_size)
    rows = [sftdata.TokenizedExample(i[m.bool()].tolist(), lab[m.bool()].tolist(), 0, False)
            for i, m, lab in zip(ids, mask, labels)]
    micro = [rows[:4], rows[4:]]
    out = {}
    for tokens in (None, 48):
        group = step_micro_batches(micro, tokens, 0)
        model.zero_grad(set_to_none=True)
        nll = accumulate_group(Forward(model, partial(batch_nll, layout=layout, budget=tokens)), group,
                               torch.device("cpu"))
        out[tokens] = (len(group), nll.total / nll.tokens, nll.tokens, _grads(model))
    (n0, l0, t0, g0), (n1, l1, t1, g1) = out[None], out[48]
    # lengths in micro-batches of <= 48, longest first: 40 | 31 | 26 + 5 + 4 + 3 + 2 + 1 (41)
    assert n0 == 2 and n1 == 3 and t0 == t1 == 93
    assert abs(l0 - l1) <= TOL
    _assert_grads(g0, g1, model)


def _step_one(train, cfg_cls, config, model_dir, out, *overrides):
    from rlhflab.config import load_config

    from test_grpo_helpers import ROOT

    cfg, _ = load_config(ROOT / "configs" / config, cfg_cls, [
        f"model.name_or_path={model_dir}", f"training.output_dir={out}", "training.num_threads=1",
        "logging.progress_bar=false", "logging.plots=false", "logging.doctor=false", *overrides])
    res = train(cfg, quiet=True)
    rows = [json.loads(line) for line in (res.output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("step") == 1][-1]


def test_trainers_token_budget_packed_step_equals_row_step(tiny_sft_rm_dir, arith_dir, tmp_path):
    """One optimizer step of SFT, RM and DPO with mini_batch_tokens and layout: packed logs the
    same loss and pre-clip gradient norm as the row-cut, padded step (the same rows, the same
    normaliser). AdamW's first step would magnify rounding where a gradient is near 0, so the
    step's loss and gradient norm are compared, not the weights after it."""
    import shutil

    from rlhflab.data import arith
    from rlhflab.data import preferences as prefdata
    from rlhflab.trainers import dpo as dpo_trainer
    from rlhflab.trainers.rm import RMRunConfig, train_rm
    from rlhflab.trainers.sft import SFTRunConfig, train_sft

    sft_rows = arith.noisy_demonstrations(arith.make_split(64, seed=3), wrong_rate=0.0, seed=0)
    sft_file = tmp_path / "sft.jsonl"
    sft_file.write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
    prefs = prefdata.write_arith_pairs(tmp_path / "prefs", n_train=64, n_test=8, seed=5)
    task = tmp_path / "task"
    shutil.copytree(arith_dir, task)
    pairs = prefdata.write_off_by_one_pairs(task)
    runs = {
        "sft": (train_sft, SFTRunConfig, "sft_debug.yaml", "sft", [
            f"data.path={sft_file}", "data.eval_path=null", "data.eval_fraction=0.1", "sft.max_steps=1",
            "sft.batch_size=8", "sft.gradient_accumulation_steps=2", "sft.eval_before=false",
            "sft.num_eval_generate=0", "sft.logging_steps=1"], ("train/loss", "params/grad_norm")),
        "rm": (train_rm, RMRunConfig, "rm_debug.yaml", "rm", [
            f"data.path={prefs['train']}", f"data.eval_path={prefs['test']}", "rm.max_steps=1", "rm.batch_size=4",
            "rm.gradient_accumulation_steps=2", "rm.eval_before=false", "rm.logging_steps=1",
            "rm.center_coeff=0.1"], ("train/loss", "params/grad_norm")),
        "dpo": (dpo_trainer.train, dpo_trainer.DPORunConfig, "dpo_debug.yaml", "dpo", [
            f"dataset.path={pairs['train']}", f"dataset.eval_path={pairs['test']}", "dpo.task_eval_path=null",
            "dpo.max_steps=1", "dpo.batch_size=8", "dpo.mini_batch_size=8", "dpo.sft_coeff=0.5",
            "training.eval_interval=0", "training.save_interval=0"], ("loss", "nll/chosen", "params/grad_norm")),
    }
    for name, (train, cls, config, sec, overrides, keys) in runs.items():
        a = _step_one(train, cls, config, tiny_sft_rm_dir, tmp_path / f"{name}-rows", *overrides)
        b = _step_one(train, cls, config, tiny_sft_rm_dir, tmp_path / f"{name}-tokens", *overrides,
                      f"{sec}.mini_batch_tokens=64", f"{sec}.layout=packed")
        for key in keys:
            assert abs(a[key] - b[key]) <= TOL * max(1.0, abs(a[key])), (name, key, a[key], b[key])
        assert a["params/grad_norm"] > 1e-3, name
