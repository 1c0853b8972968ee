"""`generation.old_logprobs: sampler`: the old policy of the update taken from the sampler's
own log-probs (the hf draw records them), no policy pass before the update, the same old
policy as the recomputed one up to float rounding, the gap still measured for the canary."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import rlhflab.ops
from rlhflab.config import load_config
from rlhflab.config.schema import GenerationConfig
from rlhflab.errors import ConfigError
from rlhflab.data.prompts import load_prompts, step_prompts
from rlhflab.engine import scoring
from rlhflab.models.actor_critic import ActorCritic, Critic, PolicyOnly, ValueHead, hidden_size_of
from rlhflab.models.load import disable_dropout, load_model
from rlhflab.rollout import generate
from rlhflab.trainers import grpo, ppo
from rlhflab.trainers.common import Timer
from rlhflab.trainers.grpo import GRPORunConfig, grpo_step
from rlhflab.trainers.loop import build_run, rollout_metrics
from rlhflab.trainers.ppo import PPOMath

from model_helpers import favour_token
from test_grpo_helpers import ROOT, debug_config, easy_task, small_model

EOS = 0  # the tiny tokenizer's <|endoftext|>
PROMPTS = ["Question: Ada has 3 pens and gets 4 more. How many pens?\nAnswer:", "Question: 1 + 2?\nAnswer:",
           "Question: What is 12 minus 5?\nAnswer:"]


def _recomputed(model, roll, temperature):
    """The teacher-forced log-probs of the rollout's tokens: what `old_logprobs: recompute` takes."""
    return scoring.score_rollout(PolicyOnly(model), None, copy.copy(roll), temperature=temperature,
                                 micro_batch=64).logprobs


@pytest.mark.parametrize("n, temperature, seed", [(1, 0.7, None), (3, 1.0, None), (2, 0.8, 5)])
def test_the_hf_draw_records_the_log_probs_the_update_would_recompute(tiny_model_dir, n, temperature, seed):
    torch.manual_seed(0)
    model, tok = load_model(str(tiny_model_dir))
    disable_dropout(model)
    favour_token(model, tok, PROMPTS, EOS, 3.0)  # some responses end early, others do not
    torch.manual_seed(1)
    roll = generate(model, tok, PROMPTS, n=n, max_new_tokens=10, temperature=temperature, seed=seed,
                    batch_size=4, sample_logprobs=True)  # batch 4: several generate calls, collated
    mask = roll.response_mask.bool()
    assert roll.sample_logprobs is not None and roll.sample_logprobs.shape == roll.response_ids.shape
    assert (~mask).any() and mask.sum(1).min() < mask.sum(1).max()  # rows of different lengths
    assert torch.all(roll.sample_logprobs[~mask] == 0) and torch.all(roll.sample_logprobs[mask] < 0)
    exact = _recomputed(model, roll, temperature)
    torch.testing.assert_close(roll.sample_logprobs, exact, rtol=0, atol=2e-5)
    # the comparison can fail: the same tokens at another temperature are far off
    assert float((_recomputed(model, roll, 1.6 * temperature) - roll.sample_logprobs).abs().max()) > 1e-2


def test_with_min_new_tokens_the_log_probs_are_the_policys_not_the_banned_ones(tiny_model_dir):
    """The end token is kept out of the first positions by the draw, after it recorded the
    token's log-probability under the policy itself: what the update recomputes."""
    torch.manual_seed(0)
    model, tok = load_model(str(tiny_model_dir))
    disable_dropout(model)
    favour_token(model, tok, PROMPTS, EOS, 3.0)  # some responses end early, others do not
    torch.manual_seed(3)
    roll = generate(model, tok, PROMPTS, n=4, max_new_tokens=10, min_new_tokens=5, temperature=0.9,
                    sample_logprobs=True)
    lengths = roll.response_mask.sum(1)
    assert int(lengths.min()) >= 5 and bool((lengths < 10).any())  # the ban held; EOS came after it
    exact = _recomputed(model, roll, 0.9)
    torch.testing.assert_close(roll.sample_logprobs, exact, rtol=0, atol=2e-5)
    # the banned distribution's log-probs would be higher by -log(1 - p(EOS)) in the first positions
    p_eos = _recomputed_eos_prob(model, roll, 0.9)[:, :5]
    assert float(p_eos.min()) > 1e-3


def _recomputed_eos_prob(model, roll, temperature):
    from rlhflab.models.actor_critic import position_ids_from
    ids, am = roll.input_ids(), roll.attention_mask()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, position_ids=position_ids_from(am)).logits
    p = roll.prompt_len
    return (logits[:, p - 1 : -1] / temperature).softmax(-1)[..., EOS]


def test_without_the_option_hf_gives_no_sampler_log_probs(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    assert generate(model, tok, PROMPTS, max_new_tokens=4, temperature=0.7).sample_logprobs is None
    # greedy decoding draws nothing: nothing recorded, even when asked
    assert generate(model, tok, PROMPTS, max_new_tokens=4, greedy=True, sample_logprobs=True).sample_logprobs is None


@pytest.mark.parametrize("critic", ["value_head", "separate"])
def test_a_values_only_pass_equals_the_full_pass(tiny_model_dir, critic):
    torch.manual_seed(0)
    model, tok = load_model(str(tiny_model_dir))
    disable_dropout(model)
    if critic == "separate":
        base, _ = load_model(str(tiny_model_dir))
        disable_dropout(base)
        ac = ActorCritic(model, critic=Critic(base))
    else:
        ac = ActorCritic(model, value_head=ValueHead(hidden_size_of(model)))
    torch.manual_seed(2)
    roll = generate(model, tok, PROMPTS, max_new_tokens=6, temperature=1.0)
    args = (roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask)
    with torch.no_grad():
        full = ac(*args, with_values=True)
        only = ac(*args, with_values=True, with_logprobs=False)
    assert only.logprobs is None and full.logprobs is not None
    torch.testing.assert_close(only.values, full.values, rtol=0, atol=0)
    with pytest.raises(ValueError, match="values only"):
        ac(*args, with_values=False, with_logprobs=False)


# --------------------------------------------------------------------------------------
# PPO: no policy pass before the update
# --------------------------------------------------------------------------------------
def _spy_actor_calls(monkeypatch):
    """Record, for each ActorCritic / PolicyOnly forward, (with_logprobs, grad enabled)."""
    calls = []
    real = PolicyOnly.forward

    sig = inspect.signature(real)

    def spy(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        calls.append((bound.arguments["with_logprobs"], torch.is_grad_enabled()))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PolicyOnly, "forward", spy)
    return calls


@pytest.mark.parametrize("critic", ["value_head", "separate"])
def test_ppo_takes_the_samplers_log_probs_and_skips_the_policy_pass(ppo_cfg, monkeypatch, critic):
    over = ["model.critic=separate"] if critic == "separate" else []
    cfg = ppo_cfg("generation.old_logprobs=sampler", "generation.temperature=0.8", *over)
    torch.manual_seed(0)
    run = build_run(cfg, ppo.method(cfg))
    examples = step_prompts(load_prompts(cfg.dataset, run.models.tokenizer, "train"), 16, cfg.training.seed, 1)
    calls = _spy_actor_calls(monkeypatch)
    roll = ppo.collect_rollout(run, examples, Timer())
    # the forward phase asked the actor for values only (a separate critic: its pass alone)
    assert calls == [(False, False)] * len(calls) and len(calls) >= 1
    assert roll.old_from_sampler
    torch.testing.assert_close(roll.logprobs, roll.sample_logprobs * roll.response_mask, rtol=0, atol=0)
    recompute = scoring.score_rollout(run.models.actor, None, copy.copy(roll), temperature=0.8,
                                      micro_batch=cfg.ppo.mini_batch_size, with_values=True)
    torch.testing.assert_close(roll.logprobs, recompute.logprobs, rtol=0, atol=2e-5)
    torch.testing.assert_close(roll.values, recompute.values, rtol=0, atol=1e-6)
    assert "rollout/logprob_gap" not in rollout_metrics(roll)  # it would compare the sampler with itself
    from test_ppo import ppo_update
    optimizer = torch.optim.AdamW(run.models.actor.trainable_parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    metrics = ppo_update(run.models, optimizer, scheduler, roll, cfg, 1, PPOMath())
    # measured by the update's first passes, on the sampling weights: float noise only
    assert 0 <= metrics["rollout/logprob_gap"] < 1e-4


def test_ppo_recompute_is_still_the_default(ppo_cfg, monkeypatch):
    cfg = ppo_cfg()
    assert cfg.generation.old_logprobs == "recompute"
    torch.manual_seed(0)
    run = build_run(cfg, ppo.method(cfg))
    examples = step_prompts(load_prompts(cfg.dataset, run.models.tokenizer, "train"), 16, cfg.training.seed, 1)
    calls = _spy_actor_calls(monkeypatch)
    roll = ppo.collect_rollout(run, examples, Timer())
    assert calls and all(c == (True, False) for c in calls)
    assert not roll.old_from_sampler and roll.sample_logprobs is None


# --------------------------------------------------------------------------------------
# GRPO with several optimizer steps, and the gap the canary reads
# --------------------------------------------------------------------------------------
def _grpo(tmp_path_factory, tmp_path, *overrides):
    """A GRPO run on the shared small model and easy task (built once a session), 16 rows of
    4 groups, 2 epochs of 2 minibatches, and one step's prompts."""
    cfg = debug_config(GRPORunConfig, "grpo_debug.yaml", small_model(tmp_path_factory),
                       easy_task(tmp_path_factory), tmp_path / "run",
                       "generation.max_new_tokens=6", "grpo.prompts_per_step=4", "grpo.group_size=4",
                       "grpo.mini_batch_size=8", "grpo.epochs=2", "grpo.kl_coeff=0", *overrides)
    torch.manual_seed(0)
    run = build_run(cfg, grpo.method(cfg))

    class Varied:  # scores that differ inside a group, so advantages are not 0
        def score(self, prompts, responses, examples):
            return torch.tensor([float(len(r) % 3) for r in responses])

    run.scorer = Varied()
    return cfg, run, load_prompts(cfg.dataset, run.models.tokenizer, "train")[:4]


def test_grpo_epochs_ratio_starts_at_one_against_the_samplers_old_policy(tmp_path_factory, tmp_path, monkeypatch):
    cfg, run, examples = _grpo(tmp_path_factory, tmp_path, "generation.old_logprobs=sampler",
                               "grpo.gradient_accumulation_steps=1", "grpo.learning_rate=1e-2")
    assert cfg.grpo.optimizer_steps_per_rollout() == 4
    ratios = []
    real = rlhflab.ops.ppo_policy_loss

    def spy(logprobs, old_logprobs, advantages, response_mask, *args, **kwargs):
        ratios.append(float((logprobs.detach() - old_logprobs).abs()[response_mask.bool()].max()))
        return real(logprobs, old_logprobs, advantages, response_mask, *args, **kwargs)

    run.math = PPOMath(policy_loss=spy)
    calls = _spy_actor_calls(monkeypatch)
    metrics = grpo_step(run, examples, 1, Timer())
    assert not any(grad is False for _, grad in calls)  # no pass outside the update
    assert len(ratios) == 4 and ratios[0] < 1e-5 and max(ratios[1:]) > 1e-4
    assert 0 <= metrics["rollout/logprob_gap"] < 1e-4


def test_the_update_measures_the_samplers_gap_on_its_first_passes(tmp_path_factory, tmp_path, monkeypatch):
    """Two epochs, accumulation 2: the first optimizer step's two minibatches cover every row on
    the sampling weights; a sampler off by a known delta shows as that delta."""
    cfg, run, examples = _grpo(tmp_path_factory, tmp_path, "generation.old_logprobs=sampler",
                               "grpo.gradient_accumulation_steps=2")
    assert cfg.grpo.optimizer_steps_per_rollout() == 2
    seen = {}
    real_generate = run.backend.generate

    def off_by_delta(*args, **kwargs):
        roll = real_generate(*args, **kwargs)
        t = torch.arange(roll.response_ids.shape[1])
        delta = (0.05 + 0.1 * (t % 3)).expand_as(roll.sample_logprobs)
        mask = roll.response_mask.float()
        roll.sample_logprobs = (roll.sample_logprobs - delta) * mask
        seen["expected"] = float((delta * mask).sum() / mask.sum())
        return roll

    monkeypatch.setattr(run.backend, "generate", off_by_delta)
    metrics = grpo_step(run, examples, 1, Timer())
    assert 0.05 <= seen["expected"] <= 0.25
    assert metrics["rollout/logprob_gap"] == pytest.approx(seen["expected"], abs=1e-4)


# --------------------------------------------------------------------------------------
# Config: what the option cannot go with
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend, key, value", [("hf", "top_k", 5), ("hf", "top_p", 0.9), ("vllm", "top_k", 5),
                                                  ("vllm", "min_new_tokens", 2)])
def test_sampler_refuses_settings_that_change_the_samplers_log_probs(backend, key, value):
    cfg = GenerationConfig(old_logprobs="sampler", backend=backend, max_new_tokens=8, **{key: value})
    (err,) = cfg.check()
    assert err.startswith("old_logprobs: sampler") and f"{key} {value}" in err and "recompute" in err
    assert GenerationConfig(old_logprobs="recompute", backend=backend, max_new_tokens=8, **{key: value}).check() == []
    # hf takes its log-probs before the min-tokens ban (the draw applies it): allowed there
    assert GenerationConfig(old_logprobs="sampler", max_new_tokens=8, min_new_tokens=4).check() == []


def test_sampler_refuses_tis_and_trpo():
    from rlhflab.trainers.trpo import TRPORunConfig

    with pytest.raises(ConfigError, match=r"grpo.tis_cap: weighs by pi_old / pi_sampler"):
        load_config(ROOT / "configs" / "grpo_debug.yaml", GRPORunConfig,
                    ["generation.old_logprobs=sampler", "grpo.tis_cap=2.0"])
    with pytest.raises(ConfigError, match=r"generation.old_logprobs: sampler is not available to trpo"):
        load_config(ROOT / "configs" / "trpo_debug.yaml", TRPORunConfig, ["generation.old_logprobs=sampler"])
