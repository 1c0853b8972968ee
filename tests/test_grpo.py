"""GRPO trainer: config, advantages on tokens, the loss by hand, the ratio's denominator,
no reference at beta 0, truncated-response masking, a CLI run with resume, and learning."""

from __future__ import annotations

import json
import math

import pytest
import torch

import rlhflab.ops
from rlhflab import ops
from rlhflab.config import load_config
from rlhflab.data.prompts import load_prompts
from rlhflab.errors import ConfigError
from rlhflab.models.actor_critic import Reference
from rlhflab.rewards import register
from rlhflab.trainers import grpo
from rlhflab.trainers.common import Timer
from rlhflab.trainers.grpo import GRPORunConfig, grpo_step
from rlhflab.config.schema import GenerationConfig
from rlhflab.engine import scoring
from rlhflab.engine.minibatch import groups_share_prompt, loss_mask_of
from rlhflab.engine.update import PPOMath, loss_terms
from rlhflab.models.actor_critic import decoder_and_head, response_hidden
from rlhflab.models.setup import build_models
from rlhflab.rollout.hf import generate
from rlhflab.trainers.grpo import GRPOSection
from rlhflab.trainers.loop import broadcast_advantages, build_run

from test_grpo_helpers import ROOT, debug_config, easy_task, keep_rollouts, small_model, warm_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return small_model(tmp_path_factory)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return easy_task(tmp_path_factory)


@register("test_length_mod3")
def length_mod3(prompt: str, response: str, example: dict) -> float:
    """A reward that differs inside a group (the length of the text mod 3)."""
    return float(len(response) % 3)


class VariedScorer:
    """Scores that differ inside a group (the length of the text mod 3), so advantages are non-zero."""

    def score(self, prompts, responses, examples):
        return torch.tensor([float(len(r) % 3) for r in responses])


def _setup(model_dir, task_dir, tmp_path, *overrides, need_reference=True, perturb=0.0):
    """A run as `train` builds it (its scorer varies inside groups) and one step's prompts."""
    cfg = debug_config(GRPORunConfig, "grpo_debug.yaml", model_dir, task_dir, tmp_path / "run",
                       "generation.max_new_tokens=6", *overrides)
    torch.manual_seed(0)
    run = build_run(cfg, grpo.method(cfg))
    assert (run.models.reference is not None) == need_reference
    if perturb:  # move the policy away from the reference copy
        with torch.no_grad():
            for p in run.models.policy.parameters():
                p.add_(perturb * torch.randn_like(p))
    run.scorer = VariedScorer()
    examples = load_prompts(cfg.dataset, run.models.tokenizer, "train")[: cfg.grpo.prompts_per_step]
    return cfg, run, examples


def policy_gradient_loss(logprobs, old_logprobs, advantages, loss_mask, aggregation="token_mean",
                         ref_logprobs=None, kl_coeff=0.0, kl_estimator="k3"):
    """The engine's loss with GRPO's settings: clipped surrogate + kl_coeff · KL."""
    sec = GRPOSection(kl_coeff=kl_coeff, kl_estimator=kl_estimator, loss_aggregation=aggregation)
    return loss_terms(logprobs, old_logprobs, advantages, loss_mask, sec, ref_logprobs=ref_logprobs)


def sample_groups(models, examples, k, gen, max_prompt_length, batch_size, share_prompt=True):
    return generate(models.policy, models.tokenizer, [e.prompt for e in examples], n=k,
                    max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_k=gen.top_k,
                    max_prompt_length=max_prompt_length, batch_size=batch_size,
                    examples=[e.row for e in examples], share_prompt=share_prompt)


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
def test_shipped_configs_validate():
    main, _ = load_config(ROOT / "configs" / "grpo_gsm8k.yaml", GRPORunConfig)
    debug, _ = load_config(ROOT / "configs" / "grpo_debug.yaml", GRPORunConfig)
    assert main.grpo.group_size == 4 and main.lora.enabled and main.model.reference == "lora_disabled"
    assert main.grpo.kl_estimator == "k3" and main.generation.max_new_tokens == main.dataset.max_gen_length
    assert debug.model.name_or_path == "outputs/tiny-model" and debug.training.device == "cpu"


@pytest.mark.parametrize("override, message", [
    ("model.reference=none", "model.reference: none leaves no policy"),
    ("grpo.mini_batch_size=999", "grpo.mini_batch_size: 999 is larger than a step's responses"),
    ("grpo.group_size=1", "grpo.group_size: must be > 1"),
    ("grpo.advantage_scale=groups", "did you mean 'group'"),
    ("grpo.grup_size=8", "did you mean grpo.group_size"),
])
def test_bad_config_names_key_and_fix(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(ROOT / "configs" / "grpo_debug.yaml", GRPORunConfig, [override])


def test_beta_zero_allows_reference_none():
    cfg, _ = load_config(ROOT / "configs" / "grpo_debug.yaml", GRPORunConfig,
                         ["grpo.kl_coeff=0", "model.reference=none"])
    assert cfg.grpo.kl_coeff == 0


# --------------------------------------------------------------------------------------
# Advantages and the loss, by hand
# --------------------------------------------------------------------------------------
def test_advantage_is_broadcast_to_every_response_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    adv = broadcast_advantages(torch.tensor([0.5, -2.0, 3.0]), mask)
    assert torch.equal(adv, torch.tensor([[0.5, 0.5, 0.0], [-2.0, -2.0, -2.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"advantages must be \(B,\)"):
        broadcast_advantages(torch.zeros(3, 1), mask)  # a (B, 1) would broadcast silently


# Two groups of 3: scores [1, 0, 0] and [1, 1, 1] (all equal); response lengths 1, 2, 3, 2, 2, 1
# (11 tokens). logprobs == old_logprobs (ratio 1, the first minibatch), so each token's
# policy loss is -A. Reference: log π − log π_ref = ln 2 on every token, so
# k3 = (r − 1) − ln r with r = 1/2: −0.5 + 0.693147 = 0.193147; beta = 0.1 adds 0.0193147.
#
# group: std([1, 0, 0]) = sqrt(((2/3)² + 2·(1/3)²) / 2) = sqrt(1/3) = 0.577350;
#        A = (2/3, −1/3, −1/3) / (0.577350 + 1e-4) = (1.154500, −0.577250, −0.577250); the
#        equal group gets 0 / (0 + 1e-4) = 0.
#        token_mean: −(1.154500·1 − 0.577250·2 − 0.577250·3) / 11 = 1.731750 / 11 = 0.157432
# batch: mean of all six 2/3; the population std (a whole-batch statistic divides by n)
#        sqrt((4·(1/3)² + 2·(2/3)²) / 6) = sqrt(2/9) = 0.471405;
#        A = (2/3, −1/3, −1/3) / 0.471505 = (1.413914, −0.706957, −0.706957)
#        token_mean: −(1.413914 − 0.706957·5) / 11 = 2.120871 / 11 = 0.192806
# none:  A = (2/3, −1/3, −1/3); token_mean: −(2/3 − 5/3) / 11 = 1/11 = 0.090909
# seq_mean (any scale): each response's mean is −A_i; the mean over the 6 is −ΣA/6 = 0,
#        since the advantages of a group sum to 0; only the KL term is left.
HAND = {
    ("group", "token_mean"): 0.157432 + 0.0193147,
    ("batch", "token_mean"): 0.192806 + 0.0193147,
    ("none", "token_mean"): 0.090909 + 0.0193147,
    ("group", "seq_mean"): 0.0 + 0.0193147,
    ("batch", "seq_mean"): 0.0 + 0.0193147,
    ("none", "seq_mean"): 0.0 + 0.0193147,
}


def _crafted():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([1, 2, 3, 2, 2, 1])
    mask = (torch.arange(3)[None] < lengths[:, None]).long()  # (6, 3)
    logprobs = torch.full((6, 3), -1.0)
    ref_logprobs = logprobs - math.log(2.0)
    return scores, mask, logprobs, ref_logprobs


@pytest.mark.parametrize("scale, aggregation", sorted(HAND))
def test_grpo_loss_by_hand(scale, aggregation):
    scores, mask, logprobs, ref_logprobs = _crafted()
    adv = broadcast_advantages(ops.group_advantages(scores, 3, scale), mask)
    terms = policy_gradient_loss(logprobs, logprobs.clone(), adv, mask, aggregation=aggregation,
                                 ref_logprobs=ref_logprobs, kl_coeff=0.1, kl_estimator="k3")
    assert float(terms.total) == pytest.approx(HAND[scale, aggregation], abs=2e-6)
    assert float(terms.kl) == pytest.approx(0.193147, abs=1e-6)
    assert float(terms.clip_frac) == 0.0 and float(terms.approx_kl) == 0.0


def test_truncated_response_left_out_by_hand():
    # Response 1 (A = −0.577250, 2 tokens) hit the length limit. Left out, 9 tokens remain:
    # −(1.154500 − 0.577250·3) / 9 = 0.577250 / 9 = 0.064139, plus the KL 0.0193147.
    scores, mask, logprobs, ref_logprobs = _crafted()
    from rlhflab.rollout import Rollout
    roll = Rollout(prompt_ids=torch.zeros(6, 1, dtype=torch.long), prompt_mask=torch.ones(6, 1, dtype=torch.long),
                   response_ids=torch.zeros(6, 3, dtype=torch.long), response_mask=mask,
                   hit_limit=torch.tensor([False, True, False, False, False, False]))
    loss_mask = loss_mask_of(roll, mask_truncated=True)
    assert loss_mask[1].sum() == 0 and torch.equal(loss_mask[[0, 2, 3, 4, 5]], mask[[0, 2, 3, 4, 5]])
    assert torch.equal(loss_mask_of(roll, mask_truncated=False), mask)
    adv = broadcast_advantages(ops.group_advantages(scores, 3, "group"), mask)
    terms = policy_gradient_loss(logprobs, logprobs, adv, loss_mask, ref_logprobs=ref_logprobs, kl_coeff=0.1)
    assert float(terms.total) == pytest.approx(0.064139 + 0.0193147, abs=2e-6)


def test_equal_rewards_give_zero_advantage_and_no_nan():
    scores = torch.tensor([0.1, 0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 1.0])
    for scale in ("group", "batch", "none"):
        adv = ops.group_advantages(scores, 4, scale)
        assert torch.isfinite(adv).all() and torch.equal(adv, torch.zeros(8))
    logprobs = torch.full((8, 2), -0.5, requires_grad=True)
    mask = torch.ones(8, 2)
    terms = policy_gradient_loss(logprobs, logprobs.detach(), broadcast_advantages(adv, mask), mask)
    terms.total.backward()
    assert float(terms.total.detach()) == 0.0 and torch.equal(logprobs.grad, torch.zeros(8, 2))


# --------------------------------------------------------------------------------------
# The step on a tiny model
# --------------------------------------------------------------------------------------
def _record_policy_loss(run):
    """Plug a wrapped ops.ppo_policy_loss into the run's engine; record max |log π − log π_old|
    and the mask of each call."""
    calls = []
    real = rlhflab.ops.ppo_policy_loss

    def spy(logprobs, old_logprobs, advantages, response_mask, *args, **kwargs):
        m = response_mask.bool()
        gap = (logprobs.detach() - old_logprobs).abs()[m]
        calls.append({"max_log_ratio": float(gap.max()) if gap.numel() else 0.0,
                      "mask": response_mask.clone(), "advantages": advantages.clone()})
        return real(logprobs, old_logprobs, advantages, response_mask, *args, **kwargs)

    run.math = PPOMath(policy_loss=spy)
    return calls


def test_ratio_is_against_the_sampling_policy(model_dir, task_dir, tmp_path, monkeypatch):
    # Two epochs of two minibatches: four optimizer steps, so the old log-probs come from a
    # no-grad pass before the update. The policy is perturbed away from the reference.
    cfg, run, examples = _setup(
        model_dir, task_dir, tmp_path, "grpo.prompts_per_step=4", "grpo.group_size=4",
        "grpo.mini_batch_size=8", "grpo.gradient_accumulation_steps=1", "grpo.epochs=2",
        "grpo.learning_rate=1e-2", "grpo.kl_coeff=0.1", perturb=0.05)
    seen = keep_rollouts(monkeypatch, grpo)
    calls = _record_policy_loss(run)
    metrics = grpo_step(run, examples, 1, Timer())
    (roll,) = seen
    assert roll.logprobs is not None and len(calls) == 4
    # Before any update the policy is the sampling policy: the ratio is 1 (up to float noise
    # from the minibatch's different padding) ...
    assert calls[0]["max_log_ratio"] < 1e-5
    # ... and it is not the reference, which is far from the policy here.
    mask = roll.response_mask.bool()
    assert float((roll.logprobs - roll.ref_logprobs).abs()[mask].max()) > 0.1
    # After the first optimizer step the policy has moved away from π_old.
    assert max(c["max_log_ratio"] for c in calls[1:]) > 1e-4
    # The advantage on every token of a response is that response's group advantage.
    adv = roll.advantages
    for i in range(len(roll)):
        real_tokens = adv[i][mask[i]]
        assert torch.allclose(real_tokens, real_tokens[0].expand_as(real_tokens))
        assert torch.all(adv[i][~mask[i]] == 0)
    for key in ("rollout/reward_mean", "rollout/reward_std", "rollout/zero_spread_frac", "loss/policy",
                "loss/kl", "loss/entropy", "params/policy_clip_frac", "params/clip_frac_low",
                "params/clip_frac_high", "params/kl_to_ref", "rollout/response_length", "params/grad_norm"):
        assert math.isfinite(metrics[key]), key
    assert metrics["params/kl_to_ref"] > 0


@pytest.mark.parametrize("layout", ["shared", "padded"])
def test_one_optimizer_step_reuses_the_forward_pass(model_dir, task_dir, tmp_path, monkeypatch, layout):
    # One epoch, both minibatches in one accumulation group: π_old is the current policy,
    # no scoring pass is made and the ratio is exactly 1.
    cfg, run, examples = _setup(
        model_dir, task_dir, tmp_path, "grpo.prompts_per_step=4", "grpo.group_size=4",
        "grpo.mini_batch_size=8", "grpo.gradient_accumulation_steps=2", "grpo.epochs=1",
        "grpo.kl_coeff=0", f"grpo.layout={layout}", need_reference=False)
    passes = []
    real_score = grpo.score_rollout
    monkeypatch.setattr(grpo, "score_rollout", lambda *a, **k: passes.append(k["with_policy"]) or real_score(*a, **k))
    calls = _record_policy_loss(run)
    before = [p.detach().clone() for p in run.models.actor.trainable_parameters()]
    grpo_step(run, examples, 1, Timer())
    assert passes == [False] and len(calls) == 2  # no policy scoring pass
    assert all(c["max_log_ratio"] == 0.0 for c in calls)
    assert any(not torch.equal(b, p) for b, p in zip(before, run.models.actor.trainable_parameters()))


def test_mask_truncated_leaves_truncated_responses_out(model_dir, task_dir, tmp_path, monkeypatch):
    cfg, run, examples = _setup(
        model_dir, task_dir, tmp_path, "grpo.prompts_per_step=4", "grpo.group_size=4",
        "grpo.mini_batch_size=16", "grpo.mask_truncated=true", "grpo.kl_coeff=0", need_reference=False)
    calls = _record_policy_loss(run)
    def every_other_truncated(roll):
        roll.hit_limit = torch.arange(len(roll)) % 2 == 0  # every other response "truncated"

    seen = keep_rollouts(monkeypatch, grpo, every_other_truncated)
    grpo_step(run, examples, 1, Timer())
    (call,) = calls
    (roll,) = seen
    # The minibatch is the shuffled rollout; map its rows back through the advantages.
    assert call["mask"].shape[0] == len(roll)
    kept = ~roll.hit_limit
    assert 0 < int(kept.sum()) < len(roll)
    assert int((call["mask"].sum(-1) > 0).sum()) == int((kept & (roll.response_mask.sum(-1) > 0)).sum())
    assert int(call["mask"].sum()) == int(roll.response_mask[kept].sum())  # only their tokens count


def test_random_policy_all_equal_rewards_is_finite(model_dir, task_dir, tmp_path):
    # The untrained model never answers: every reward is 0, every group has zero spread.
    from rlhflab.rewards import build_reward

    def one_step(perturb: float) -> dict:
        cfg, run, examples = _setup(model_dir, task_dir, tmp_path / str(perturb), "grpo.kl_coeff=0.04",
                                    perturb=perturb)
        run.scorer = build_reward(cfg.reward)
        metrics = grpo_step(run, examples, 1, Timer())
        assert metrics["rollout/zero_spread_frac"] == 1.0 and metrics["rollout/advantage_abs_mean"] == 0.0
        assert all(math.isfinite(v) for v in metrics.values())
        return metrics

    # policy == reference and advantages 0: the only gradient is the k3 term's, whose
    # derivative in the log-ratio d = ref - logp is 1 - exp(d) ~ -d, linear in d. The
    # reference's log-probs (one no-grad pass over the rollout) and the update's (micro-batch
    # passes of other shapes) may differ by float32 rounding alone, |d| ~ 1e-7 (Intel's MKL
    # rounds differently by shape, AMD's path here gives d = 0 and a gradient of exactly 0;
    # 2.5e-9 was seen on an Intel Xeon). Moving the policy 1e-2 from the reference gives
    # |d| ~ 1e-2 by the same linear map, so the ratio of the two gradients is ~1e-5: a bound
    # of 1e-3 holds with room on every CPU, while any real gradient (a non-zero advantage, a
    # KL term that does not vanish at pi = ref) makes the ratio of order 1.
    at_reference = one_step(0.0)["params/grad_norm"]
    moved = one_step(1e-2)["params/grad_norm"]
    assert moved > 0 and at_reference <= 1e-3 * moved, (at_reference, moved)


def test_beta_zero_loads_no_reference(model_dir, task_dir, tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a reference was built although beta = 0")

    monkeypatch.setattr(Reference, "frozen_copy", classmethod(forbidden))
    monkeypatch.setattr(Reference, "lora_disabled", classmethod(forbidden))
    cfg = debug_config(GRPORunConfig, "grpo_debug.yaml", model_dir, task_dir, tmp_path / "run",
                       "grpo.kl_coeff=0", "training.total_steps=1", "training.eval_interval=0",
                       "training.save_interval=0", "generation.max_new_tokens=4")
    res = grpo.train(cfg, quiet=True)
    assert res.models.reference is None
    assert "params/kl_to_ref" not in res.history[0] and "loss/kl" not in res.history[0]


def test_lora_reference_is_the_adapter_disabled_policy(model_dir, task_dir, tmp_path):
    cfg = debug_config(GRPORunConfig, "grpo_debug.yaml", model_dir, task_dir, tmp_path / "run",
                       "lora.enabled=true", "lora.r=4", "model.reference=copy")
    models = build_models(cfg.model, cfg.lora, "cpu", need_reference=True)
    assert models.reference.model is None and models.reference.policy is models.policy
    n_params = sum(p.numel() for p in models.actor.parameters())
    assert n_params == sum(p.numel() for p in models.policy.parameters())  # no second copy


# --------------------------------------------------------------------------------------
# Prompt sharing: each group's prompt computed once, the same results as the plain pass
# --------------------------------------------------------------------------------------
def test_shared_prompt_sampling_matches_plain_sampling(model_dir, task_dir, tmp_path):
    cfg, run, _ = _setup(model_dir, task_dir, tmp_path, "grpo.kl_coeff=0", need_reference=False)
    models = run.models
    examples = load_prompts(cfg.dataset, models.tokenizer, "train")[:3]
    greedy = GenerationConfig(max_new_tokens=6, top_k=1)  # top-k 1: the sampled token is the argmax
    shared = sample_groups(models, examples, 4, greedy, 64, batch_size=8, share_prompt=True)
    plain = sample_groups(models, examples, 4, greedy, 64, batch_size=8, share_prompt=False)
    assert torch.equal(shared.response_ids, plain.response_ids)
    assert torch.equal(shared.prompt_ids, plain.prompt_ids) and shared.responses == plain.responses
    assert groups_share_prompt(shared.prompt_ids, shared.prompt_mask, 4)
    assert not groups_share_prompt(shared.prompt_ids, shared.prompt_mask, 3)


def test_layout_auto_shares_the_prompt_on_a_cpu_only(model_dir, task_dir, tmp_path):
    """`grpo.layout: auto` (the default): the shared layout (a group's prompt once) on a CPU,
    padded on any other device (a model on the meta device stands in for a GPU here); shared,
    packed and padded as set, on any device; a rollout whose groups do not share a prompt, or
    minibatches that would split a group, give each row its prompt (shared: packed)."""
    from rlhflab import cpu

    cfg, run, _ = _setup(model_dir, task_dir, tmp_path, "grpo.kl_coeff=0", need_reference=False)
    assert cfg.grpo.layout == "auto"
    models = run.models
    examples = load_prompts(cfg.dataset, models.tokenizer, "train")[:2]
    roll = sample_groups(models, examples, 4, GenerationConfig(max_new_tokens=4), 64, batch_size=8)
    on_meta = torch.nn.Linear(2, 2, device="meta")
    assert scoring.group_layout(roll, models.policy, "auto") == ("shared", 4)
    assert scoring.group_layout(roll, on_meta, "auto") == ("padded", 1)
    assert scoring.group_layout(roll, on_meta, "shared") == ("shared", 4)
    assert [scoring.group_layout(roll, models.policy, x) for x in ("padded", "packed")] == [("padded", 1), ("packed", 1)]
    assert scoring.group_layout(roll, models.policy, "shared", whole_groups=False) == ("packed", 1)
    assert scoring.group_layout(roll, models.policy, "auto", whole_groups=False) == ("padded", 1)
    assert [cpu.share_prompt(d, "auto") for d in ("cpu", torch.device("cuda"))] == [True, False]
    impl, models.policy.config._attn_implementation = models.policy.config._attn_implementation, "flex_attention"
    assert scoring.group_layout(roll, models.policy, "auto") == ("padded", 1)  # packing refuses it: padded
    models.policy.config._attn_implementation = impl
    roll.prompt_ids[1, -1] += 1  # row 1 no longer asks its group's prompt
    assert scoring.group_layout(roll, models.policy, "auto") == ("padded", 1)
    assert scoring.group_layout(roll, models.policy, "shared") == ("packed", 1)


def test_grouped_forward_matches_the_full_pass_values_and_gradients(model_dir, task_dir, tmp_path):
    cfg, run, _ = _setup(model_dir, task_dir, tmp_path, need_reference=True)
    models = run.models
    examples = load_prompts(cfg.dataset, models.tokenizer, "train")[:3]
    roll = sample_groups(models, examples, 4, GenerationConfig(max_new_tokens=6), 64, batch_size=12)
    mask = roll.response_mask.float()
    policy, params = models.policy, list(models.policy.parameters())

    def grads(logprobs):
        policy.zero_grad()
        (logprobs * mask).sum().backward()
        return [p.grad.clone() for p in params]

    _, head = decoder_and_head(policy)
    grouped = head(response_hidden(policy, roll.prompt_ids[::4], roll.prompt_mask[::4], roll.response_ids,
                                   roll.response_mask, 4, layout="shared"))
    lp_grouped = ops.logprobs_from_logits(grouped, roll.response_ids)
    full = models.actor.forward_response(roll.input_ids(), roll.attention_mask(), roll.prompt_len).logits
    lp_full = ops.logprobs_from_logits(full, roll.response_ids)
    assert torch.allclose(lp_grouped * mask, lp_full * mask, atol=1e-5)
    for a, b in zip(grads(lp_grouped), grads(lp_full)):  # the prompt's gradient sums over its 4 responses
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        ref_shared = scoring.score_rollout(models.actor, models.reference, roll, micro_batch=8,
                                           with_policy=False, layout="shared").ref_logprobs
        ref_plain = scoring.score_rollout(models.actor, models.reference, roll, micro_batch=8,
                                          with_policy=False, layout="padded").ref_logprobs
    assert torch.allclose(ref_shared, ref_plain, atol=1e-5)


# --------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_run_writes_outputs_and_resumes_exactly(model_dir, task_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhflab.cli import main

    common = [f"model.name_or_path={model_dir}", f"dataset.path={task_dir / 'train.jsonl'}",
              f"dataset.eval_path={task_dir / 'test.jsonl'}", "dataset.num_eval_samples=8",
              "generation.max_new_tokens=6", "training.total_steps=2", "training.save_interval=1",
              "training.eval_interval=2", "training.num_threads=1", "logging.progress_bar=false",
              "grpo.prompts_per_step=4", "grpo.mini_batch_size=8", "grpo.epochs=2"]
    full, part = tmp_path / "full", tmp_path / "part"
    config = tmp_path / "grpo.yaml"  # the debug config with a reward that varies inside groups
    config.write_text(f"defaults: [{ROOT / 'configs/grpo_debug.yaml'}]\n"
                      "reward:\n  sources: [{type: rule, name: test_length_mod3}]\n")
    assert main(["grpo", "--config", str(config), *common, f"training.output_dir={full}"]) == 0
    for name in ("effective_config.yaml", "metrics.jsonl", "step_1/trainer_state.pt", "final/config.json",
                 "plots/reward.png", "plots/zero_spread.png", "train_result.json"):
        assert (full / name).exists(), name
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]
    for key in ("time/generate", "time/score", "time/forward", "time/update", "perf/episodes_per_s"):
        assert key in rows[1], key
    AutoModelForCausalLM.from_pretrained(full / "final")  # loads with no rlhflab code
    # Resume from step_1 in a fresh folder: the final weights match the uninterrupted run.
    assert main(["grpo", "--config", str(config), *common, f"training.output_dir={part}",
                 "--resume", str(full / "step_1")]) == 0
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    a = AutoModelForCausalLM.from_pretrained(full / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(part / "final").state_dict()
    assert any(not torch.allclose(a[k], start[k]) for k in a)  # training moved the weights
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_cli_bad_override_is_one_line_error(capsys):
    from rlhflab.cli import main

    assert main(["grpo", "--config", str(ROOT / "configs/grpo_debug.yaml"), "grpo.kl_coeff=-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "grpo.kl_coeff: must be >= 0" in err and "Traceback" not in err


@pytest.mark.slow
def test_grpo_raises_held_out_accuracy(tmp_path_factory, tmp_path):
    # The warm start imitates demonstrations that are off by one 60 % of the time; GRPO with
    # the GSM8K checker as the reward should move greedy answers towards the right ones.
    cfg = debug_config(GRPORunConfig, "grpo_debug.yaml", warm_model(tmp_path_factory),
                       easy_task(tmp_path_factory), tmp_path / "run",
                       "training.total_steps=20", "training.eval_interval=20", "training.save_interval=0",
                       "dataset.num_eval_samples=100", "grpo.group_size=8", "grpo.prompts_per_step=4",
                       "grpo.batch_size=32", "grpo.mini_batch_size=32", "grpo.gradient_accumulation_steps=1",
                       "grpo.learning_rate=1e-4")
    res = grpo.train(cfg, quiet=True)
    before, after = res.eval_before["eval/accuracy"], res.eval_after["eval/accuracy"]
    print(f"GRPO held-out accuracy {before:.2f} -> {after:.2f}")
    assert after >= before + 0.08, (before, after)


def test_one_optimizer_step_logs_the_samplers_gap_from_the_updates_forward(model_dir, task_dir, tmp_path,
                                                                           monkeypatch):
    """GRPO with one optimizer step per rollout computes no old log-probs, so rollout_metrics
    has no rollout/logprob_gap; the update's own forward (the old policy, before its one
    step) measures it instead, and the vLLM weight-sync canary reads it."""
    import copy

    cfg, run, examples = _setup(model_dir, task_dir, tmp_path, "grpo.prompts_per_step=4", "grpo.group_size=4",
                                "grpo.mini_batch_size=8", "grpo.gradient_accumulation_steps=2", "grpo.epochs=1",
                                "grpo.kl_coeff=0", need_reference=False)  # 16 rows: 2 minibatches, one step
    assert run.sec.optimizer_steps_per_rollout() == 1
    seen = {}
    real_update = grpo.run_update

    def with_sampler_logprobs(run_, roll, step):
        assert roll.logprobs is None  # not computed: one optimizer step
        exact = scoring.score_rollout(run_.models.actor, None, copy.copy(roll), temperature=cfg.generation.temperature,
                                      micro_batch=64).logprobs                      # (B, T) the policy now
        t = torch.arange(roll.response_ids.shape[1])
        delta = (0.05 + 0.1 * (t % 3)).expand_as(exact)   # 0.05, 0.15, 0.25, 0.05, ... per position
        roll.sample_logprobs = (exact - delta) * roll.response_mask                 # a sampler off by delta
        mask = roll.response_mask.float()
        seen["expected"] = float((delta * mask).sum() / mask.sum())
        return real_update(run_, roll, step)

    monkeypatch.setattr(grpo, "run_update", with_sampler_logprobs)
    metrics = grpo_step(run, examples, 1, Timer())
    assert 0.05 <= seen["expected"] <= 0.25
    # the mean |log π - log π_sampler| over real tokens, up to float noise of the minibatch's padding
    assert metrics["rollout/logprob_gap"] == pytest.approx(seen["expected"], abs=1e-5)


def test_no_sampler_logprobs_no_gap_metric(model_dir, task_dir, tmp_path):
    cfg, run, examples = _setup(model_dir, task_dir, tmp_path, "grpo.prompts_per_step=2", "grpo.group_size=4",
                                "grpo.mini_batch_size=8", "grpo.epochs=1", "grpo.kl_coeff=0", need_reference=False)
    assert "rollout/logprob_gap" not in grpo_step(run, examples, 1, Timer())  # the hf backend: nothing to compare
