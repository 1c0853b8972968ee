"""The PPO trainer on the tiny model: prompts per step, ratio == 1 before the first update,
the reference never changing, LoRA, KL off, gradient accumulation 1x8 == 8x1, a 2-step run."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from rlhflab import ops
from rlhflab.data.prompts import PromptExample, load_prompts, step_prompts
from rlhflab.models.actor_critic import Reference, load_value_head, position_ids_from, unwrap
from rlhflab.models.load import load_model
from rlhflab.trainers import ppo
from rlhflab.trainers.common import Timer, make_optimizer, make_scheduler
from rlhflab.engine.update import policy_update
from rlhflab.trainers.loop import build_run, rollout_metrics
from rlhflab.trainers.ppo import PPOMath, collect_rollout, ppo_minibatch_loss

METRIC_KEYS = ["rollout/reward_mean", "loss/policy", "loss/value", "loss/entropy", "loss/total",
               "params/policy_clip_frac", "params/value_clip_frac", "params/approx_kl",
               "params/kl_to_ref", "params/grad_norm", "lr", "time/generate", "time/score",
               "time/forward", "time/update", "perf/tokens_per_s"]


def _setup(cfg, seed=0):
    """Models, optimizer, scheduler and one collected rollout, as `train` makes them."""
    torch.manual_seed(seed)
    run = build_run(cfg, ppo.method(cfg))
    examples = step_prompts(load_prompts(cfg.dataset, run.models.tokenizer, "train"),
                            cfg.ppo.rollout_samples, cfg.training.seed, 1)
    roll = collect_rollout(run, examples, Timer())
    optimizer = make_optimizer(run.models.actor.trainable_parameters(), cfg.ppo.learning_rate)
    scheduler = make_scheduler(optimizer, 10)
    return run.models, roll, optimizer, scheduler


def ppo_update(models, optimizer, scheduler, roll, cfg, step, math_):
    """The trainer's phase 5 on a collected rollout."""
    return policy_update(models.actor, optimizer, scheduler, roll, cfg.ppo, temperature=cfg.generation.temperature,
                         step=step, seed=cfg.training.seed, max_new_tokens=cfg.generation.max_new_tokens,
                         math_=math_)


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], module: torch.nn.Module) -> list[str]:
    return [k for k, v in module.state_dict().items() if not torch.equal(before[k], v)]


# --------------------------------------------------------------------------------------
# Prompts per step
# --------------------------------------------------------------------------------------
def test_step_prompts_fresh_each_step_and_resume_safe():
    examples = [PromptExample(f"q{i}", {"i": i}) for i in range(10)]
    ids = lambda xs: [x.row["i"] for x in xs]  # noqa: E731
    s1, s2 = ids(step_prompts(examples, 4, seed=0, step=1)), ids(step_prompts(examples, 4, seed=0, step=2))
    assert s1 != s2                                                        # a new order each step
    assert s1 == ids(step_prompts(examples, 4, seed=0, step=1))            # same (seed, step): same draw
    assert s1 != ids(step_prompts(examples, 4, seed=1, step=1))            # the seed matters
    assert len(set(s1)) == 4                                               # no repeats within a step
    # Over steps the whole dataset is seen.
    seen = set()
    for step in range(1, 30):
        seen.update(ids(step_prompts(examples, 4, seed=0, step=step)))
    assert seen == set(range(10))
    # More prompts than rows: whole permutations, each row 2 or 3 times in 25.
    counts = torch.bincount(torch.tensor(ids(step_prompts(examples, 25, seed=0, step=3))), minlength=10)
    assert counts.sum() == 25 and counts.min() >= 2 and counts.max() <= 3


def test_load_prompts(tmp_path):
    from rlhflab.config import DatasetConfig
    from rlhflab.data.arith import write_jsonl
    from rlhflab.errors import UserError

    rows = [{"q": f"what is {i} + 1?", "final": str(i + 1), "answer": "a worked solution"} for i in range(6)]
    write_jsonl(rows, tmp_path / "train.jsonl")
    write_jsonl(rows[:3], tmp_path / "test.jsonl")
    d = DatasetConfig(path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "test.jsonl"),
                      prompt_field="q", answer_field="final", prompt_template="Q: {prompt}\nA:",
                      num_samples=4, num_eval_samples=2)
    train = load_prompts(d, split="train")
    assert [e.prompt for e in train] == [f"Q: what is {i} + 1?\nA:" for i in range(4)]  # first num_samples rows
    # The configured answer field is what the reward reads as row["answer"], even when the
    # row has an "answer" field of its own.
    assert [e.row["answer"] for e in train] == ["1", "2", "3", "4"]
    assert len(load_prompts(d, split="eval")) == 2
    bad = DatasetConfig(path=str(tmp_path / "train.jsonl"), prompt_field="question")
    with pytest.raises(UserError, match="row 0 lacks field.*'question'.*prompt_field"):
        load_prompts(bad, split="train")


# --------------------------------------------------------------------------------------
# The first update: ratio == 1, reference frozen
# --------------------------------------------------------------------------------------
def test_ratio_is_one_before_the_first_update(ppo_cfg):
    # Two minibatches accumulated into one optimizer step: both come before any update.
    cfg = ppo_cfg("ppo.gradient_accumulation_steps=2", "ppo.epochs=2")
    models, roll, optimizer, scheduler = _setup(cfg)
    seen, stats = [], []

    def spy_policy_loss(logprobs, old_logprobs, advantages, mask, *args, **kwargs):
        seen.append((logprobs.detach().clone(), old_logprobs.clone(), mask.clone()))
        return ops.ppo_policy_loss(logprobs, old_logprobs, advantages, mask, *args, **kwargs)

    def spy_step(*args):
        loss, st = ppo_minibatch_loss(*args)
        stats.append(st)
        return loss, st

    ppo_update(models, optimizer, scheduler, roll, cfg, 1,
               PPOMath(policy_loss=spy_policy_loss, minibatch_step=spy_step))
    assert len(seen) == 4  # 2 epochs x 2 minibatches
    for lp, old, mask in seen[:2]:  # the first group, before the optimizer step
        ratio = torch.exp(lp - old)[mask.bool()]
        assert ratio.numel() > 0
        torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)
    for st in stats[:2]:
        assert st.policy_clip_frac == 0.0 and st.value_clip_frac == 0.0
        assert st.approx_kl < 1e-10
    # After the update the policy has moved, so the second epoch sees ratios != 1.
    lp, old, mask = seen[-1]
    assert (torch.exp(lp - old)[mask.bool()] - 1).abs().max() > 1e-4


@pytest.mark.parametrize("critic", ["value_head", "separate"])
def test_compiled_layers_keep_the_ratio_at_one_before_the_first_update(ppo_cfg, critic):
    """`model.compile_layers`: the rollout's scoring pass and the update's pass both run the
    compiled layers (the policy's, a separate critic's, the reference's), so the first
    minibatch's ratio is 1 as in eager runs; the layers were compiled, not skipped."""
    from rlhflab.models.actor_critic import decoder_and_head
    from rlhflab.models.compiled import _COMPILED
    from rlhflab.models.lean import read_past_forward

    torch._dynamo.reset()
    cfg = ppo_cfg("model.compile_layers=true", "cpu.matmul=torch", f"model.critic={critic}", "ppo.kl_coeff=0.1",
                  "ppo.epochs=2")
    models, roll, optimizer, scheduler = _setup(cfg)
    seen = []

    def spy_policy_loss(logprobs, old_logprobs, advantages, mask, *args, **kwargs):
        seen.append((logprobs.detach().clone(), old_logprobs.clone(), mask.clone()))
        return ops.ppo_policy_loss(logprobs, old_logprobs, advantages, mask, *args, **kwargs)

    ppo_update(models, optimizer, scheduler, roll, cfg, 1, PPOMath(policy_loss=spy_policy_loss))
    lp, old, mask = seen[0]
    ratio = torch.exp(lp - old)[mask.bool()]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)
    lp, old, mask = seen[-1]
    assert (torch.exp(lp - old)[mask.bool()] - 1).abs().max() > 1e-4  # and the update moved the policy
    wrapped = [models.actor.policy, models.reference.model]
    wrapped += [models.actor.critic.base] if critic == "separate" else []
    assert all(decoder_and_head(m)[0] in _COMPILED for m in wrapped)
    assert not any(read_past_forward(m) for m in wrapped)  # no lean MLP: dynamo would recompile per layer
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0


def test_reference_never_changes_across_a_ppo_step(ppo_cfg):
    cfg = ppo_cfg("ppo.kl_coeff=0.1")
    models, roll, optimizer, scheduler = _setup(cfg)
    ref = models.reference.model
    policy = models.actor.policy
    ref_before, policy_before = _snapshot(ref), _snapshot(policy)
    ref_logits_before = models.reference.response_logits(roll.input_ids(), roll.attention_mask(), roll.prompt_len)
    ppo_update(models, optimizer, scheduler, roll, cfg, 1, PPOMath())
    assert _changed(ref_before, ref) == []
    assert _changed(policy_before, policy) != []                        # the policy did train
    assert all(not p.requires_grad and p.grad is None for p in ref.parameters())
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer.isdisjoint(id(p) for p in ref.parameters())
    ptrs = {p.data_ptr() for p in policy.parameters()}
    assert ptrs.isdisjoint(p.data_ptr() for p in ref.parameters())     # nothing shared by accident
    after = models.reference.response_logits(roll.input_ids(), roll.attention_mask(), roll.prompt_len)
    assert torch.equal(after, ref_logits_before)


def test_lora_policy_with_adapter_disabled_reference(ppo_cfg, tiny_model_dir):
    cfg = ppo_cfg("lora.enabled=true", "lora.r=4", "lora.alpha=8", "model.reference=lora_disabled",
                  "ppo.kl_coeff=0.1", "ppo.learning_rate=1e-2")
    models, roll, optimizer, scheduler = _setup(cfg)
    policy = models.actor.policy
    assert models.reference.model is None and models.reference.policy is policy  # no second copy
    assert sum(isinstance(m, type(unwrap(policy))) for m in policy.modules()) == 1
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    base_before = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    ids, am, p = roll.input_ids(), roll.attention_mask(), roll.prompt_len
    plain, _ = load_model(str(tiny_model_dir))
    t = roll.response_ids.shape[1]
    base_logits = plain(input_ids=ids, attention_mask=am, position_ids=position_ids_from(am)).logits[:, p - 1 : p + t - 1]
    torch.testing.assert_close(models.reference.response_logits(ids, am, p), base_logits, rtol=0, atol=1e-5)
    # Before training the adapter is a no-op (lora_B = 0): KL to the reference is 0.
    torch.testing.assert_close(roll.ref_logprobs, roll.logprobs, rtol=0, atol=1e-5)

    ppo_update(models, optimizer, scheduler, roll, cfg, 1, PPOMath())
    assert all(torch.equal(base_before[n], p) for n, p in policy.named_parameters() if not p.requires_grad)
    with torch.no_grad():
        pol_logits = models.actor.forward_response(ids, am, p).logits
        ref_logits = models.reference.response_logits(ids, am, p)
    torch.testing.assert_close(ref_logits, base_logits, rtol=0, atol=1e-5)  # still the base model
    assert (pol_logits - ref_logits).abs().max() > 1e-3                     # the policy moved away


def test_kl_off_builds_and_calls_no_reference(ppo_cfg, monkeypatch):
    calls = []
    real = Reference.logprobs
    monkeypatch.setattr(Reference, "logprobs",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    cfg = ppo_cfg("ppo.kl_coeff=0.1")
    models, roll, *_ = _setup(cfg)
    assert models.reference is not None and calls and roll.ref_logprobs is not None  # the contrast
    calls.clear()
    cfg = ppo_cfg("ppo.kl_coeff=0")
    models, roll, optimizer, scheduler = _setup(cfg)
    assert models.reference is None and calls == [] and roll.ref_logprobs is None
    assert (roll.kl == 0).all()
    roll.scores = torch.zeros(len(roll))
    assert rollout_metrics(roll)["params/kl_to_ref"] == 0.0
    ppo_update(models, optimizer, scheduler, roll, cfg, 1, PPOMath())
    assert calls == []


def test_rollout_metrics_log_the_critics_explained_variance(ppo_cfg):
    _, roll, *_ = _setup(ppo_cfg())
    keep = roll.response_mask.bool()
    r, v = roll.returns[keep].double(), roll.values[keep].double()     # real response tokens only
    want = 1 - (r - v).var(unbiased=False) / r.var(unbiased=False)
    assert rollout_metrics(roll)["rollout/explained_variance"] == pytest.approx(float(want), abs=1e-5)
    # values equal to the returns explain all of them; returns that do not vary leave
    # nothing to explain, and nothing is logged (NaN would trip the doctor's nan_metric)
    roll.values = roll.returns.clone()
    assert rollout_metrics(roll)["rollout/explained_variance"] == 1.0
    roll.returns = torch.full_like(roll.returns, 0.5)
    assert "rollout/explained_variance" not in rollout_metrics(roll)


def test_separate_critic_trains_its_own_model(ppo_cfg):
    cfg = ppo_cfg("model.critic=separate", "ppo.vf_coeff=1.0")
    models, roll, optimizer, scheduler = _setup(cfg)
    ac = models.actor
    assert ac.separate_critic and ac.value_head is None
    critic_before, policy_before = _snapshot(ac.critic), _snapshot(ac.policy)
    ppo_update(models, optimizer, scheduler, roll, cfg, 1, PPOMath())
    assert _changed(critic_before, ac.critic) and _changed(policy_before, ac.policy)
    ptrs = {p.data_ptr() for p in ac.policy.parameters()}
    assert ptrs.isdisjoint(p.data_ptr() for p in ac.critic.parameters())


# --------------------------------------------------------------------------------------
# Gradient accumulation: 1 minibatch of 8 == 8 minibatches of 1
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_gradient_accumulation_1x8_equals_8x1(ppo_cfg, aggregation):
    common = ("ppo.rollout_samples=8", "ppo.batch_size=8", "ppo.epochs=1", "ppo.entropy_coeff=0.01",
              f"ppo.loss_aggregation={aggregation}")
    cfg_a = ppo_cfg(*common, "ppo.mini_batch_size=8", "ppo.gradient_accumulation_steps=1")
    cfg_b = ppo_cfg(*common, "ppo.mini_batch_size=1", "ppo.gradient_accumulation_steps=8")
    models_a, roll, _, _ = _setup(cfg_a)
    # Responses of different lengths (1..8 tokens), so that a mean per minibatch would
    # weigh tokens unequally; only the group's token count as normalizer gives 1x8 == 8x1.
    t = roll.response_mask.shape[1]
    lengths = torch.arange(len(roll)) % t + 1                                     # (B,)
    roll.response_mask = roll.response_mask * (torch.arange(t) < lengths[:, None])  # (B, T)
    assert len(set(roll.response_mask.sum(-1).tolist())) > 4
    models_b = copy.deepcopy(models_a)
    results = []
    for cfg, models in ((cfg_a, models_a), (cfg_b, models_b)):
        params = models.actor.trainable_parameters()
        optimizer = make_optimizer(params, cfg.ppo.learning_rate)
        scheduler = make_scheduler(optimizer, 10)
        grads = []
        optimizer.register_step_pre_hook(lambda opt, args, kwargs, _grads=grads, _params=params: _grads.append(
            [p.grad.clone() if p.grad is not None else None for p in _params]))
        metrics = ppo_update(models, optimizer, scheduler, roll, cfg, 1, PPOMath())
        results.append((grads, metrics, [p.detach().clone() for p in params]))
    (grads_a, m_a, params_a), (grads_b, m_b, params_b) = results
    assert len(grads_a) == len(grads_b) == 1  # one optimizer step each
    n_checked = 0
    for ga, gb in zip(grads_a[0], grads_b[0], strict=True):
        if ga is None:
            assert gb is None
            continue
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-7)
        n_checked += 1
    assert n_checked > 10
    for pa, pb in zip(params_a, params_b, strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6)
    for key in ("loss/policy", "loss/value", "loss/total", "loss/entropy", "params/grad_norm"):
        assert m_a[key] == pytest.approx(m_b[key], rel=1e-4, abs=1e-7), key
    # loss/entropy is the mean entropy (per token or per sequence): near log V for the
    # untrained model (V=514, log 514 = 6.24), not 1/8 of it as when each minibatch's share
    # of the group was averaged.
    vocab = models_a.actor.policy.config.vocab_size
    assert 0.9 * math.log(vocab) < m_b["loss/entropy"] <= math.log(vocab)


# --------------------------------------------------------------------------------------
# A 2-step run
# --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_step_run(ppo_cfg, tiny_model_dir, tmp_path):
    cfg = ppo_cfg("training.total_steps=2", "training.eval_interval=2", "logging.plots=true")
    res = ppo.train(cfg, quiet=True)
    out = tmp_path / "run"
    assert res.output_dir == out and res.final_dir == out / "final"

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert set(rows[0]) == {"step", "eval/reward_mean", "eval/accuracy"}  # before training
    for row in rows[1:]:
        missing = [k for k in METRIC_KEYS if k not in row]
        assert not missing, missing
        assert all(isinstance(row[k], (int, float)) and math.isfinite(row[k]) for k in METRIC_KEYS)
    assert "eval/accuracy" in rows[2] and 0.0 <= rows[2]["eval/accuracy"] <= 1.0
    assert rows[1]["lr"] == cfg.ppo.learning_rate
    assert res.eval_before is not None and res.eval_after is not None and res.samples_per_s > 0

    # The policy moved; final/ holds it, loadable with transformers alone.
    cfg_json = json.loads((out / "final" / "config.json").read_text())
    assert "auto_map" not in cfg_json and cfg_json["architectures"] == ["LlamaForCausalLM"]
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    trained = res.models.actor.policy
    changed = [n for (n, a), (_, b) in zip(start.named_parameters(), final.named_parameters(), strict=True)
               if not torch.equal(a, b)]
    assert len(changed) > len(list(start.parameters())) // 2
    for (n, a), (_, b) in zip(final.state_dict().items(), trained.state_dict().items(), strict=True):
        assert torch.equal(a, b), n

    # The value head reloads to the trained tensors.
    head = res.models.actor.value_head
    fresh = copy.deepcopy(head)
    torch.nn.init.zeros_(fresh.summary.weight)
    load_value_head(fresh, out / "final")
    assert torch.equal(fresh.summary.weight, head.summary.weight)
    assert torch.equal(fresh.summary.bias, head.summary.bias)

    # effective_config.yaml holds the resolved values; plots and evals are written.
    eff = yaml.safe_load((out / "effective_config.yaml").read_text())
    assert eff["training"]["total_steps"] == 2 and eff["model"]["name_or_path"] == str(tiny_model_dir)
    assert eff["generation"]["max_new_tokens"] == 8
    plots = {p.name for p in (out / "plots").glob("*.png")}
    assert {"losses.png", "reward.png", "kl.png", "clipping.png"} <= plots
    assert (out / "eval" / "step_0.jsonl").exists() and (out / "eval" / "step_2.jsonl").exists()
    assert not list(out.glob("step_*"))  # save_interval=0


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(opt, total_steps=10, warmup_steps=2, schedule="cosine", min_lr=0.1)
    lrs = []
    for _ in range(11):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # warmup: (0+1)/2, (1+1)/2; then 0.1 + 0.9 * 0.5 * (1 + cos(pi * (s - 2) / 8))
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0) and lrs[2] == pytest.approx(1.0)
    assert lrs[6] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert lrs[10] == pytest.approx(0.1)             # the floor at the end
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
