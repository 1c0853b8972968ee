"""PPO for language models: `rlhflab ppo --config configs/ppo_debug.yaml [key=value ...]`.

One visible loop, in the order of the algorithm:

    1. rollout      sample responses to fresh prompts (KV cache, no gradients)
    2. score        the reward of each response (rule, reward model, classifier)
    3. forward      one teacher-forced pass: old logprobs, values, reference logprobs;
                    KL-shaped per-token rewards
    4. advantages   GAE in reverse, then whitening over response tokens
    5. update       `ppo.epochs` epochs of shuffled minibatches, gradient accumulation,
                    clipped policy and value losses, entropy bonus, grad-norm clipping
    6. log, evaluate, save

The math lives in `rlhflab.ops`; this file only orders it. Where we depart from the
common recipe:
- Dropout is switched off in the policy, the critic and the reference, so that before
  the first update the ratio π/π_old is exactly 1 (PPO's clip assumes it).
- Logits are computed only for response positions (`ActorCritic.forward_response`).
- Token-mean losses under gradient accumulation are divided by the token count of the
  whole accumulated batch, so accumulation 1×8 equals 8×1 exactly.
- The reference forward is skipped when `ppo.kl_coeff` is 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from rlhflab import ops
from rlhflab.config import PPORunConfig, load_config, save_effective_config
from rlhflab.data.prompts import load_prompts, step_prompts
from rlhflab.evaluate import build_eval_checks, evaluate_policy, save_samples
from rlhflab.metrics import MetricsLogger
from rlhflab.models.actor_critic import ActorCritic, Critic, Reference, ValueHead, hidden_size_of, load_value_head
from rlhflab.models.checkpoint import prune_checkpoints, restore_trainer_state, save_checkpoint
from rlhflab.models.load import add_lora, disable_dropout, load_model, resolve_device
from rlhflab.rewards import build_reward
from rlhflab.rewards.preflight import preflight
from rlhflab.rollout import Rollout, forward_response, generate, score_rollout
from rlhflab.trainers.common import (Timer, check_resume_dir, finish_run, format_metrics, last_eval,
                                     log_step, make_doctor, make_optimization, prepare_output_dir,
                                     print_before_after, seed_everything, set_threads, write_train_result)


# --------------------------------------------------------------------------------------
# The pluggable math: learner mode swaps these for the learner's own functions.
# --------------------------------------------------------------------------------------
@dataclass
class PPOMath:
    """The five core pieces of PPO, as used by the loop below."""

    policy_loss: Callable = ops.ppo_policy_loss
    value_loss: Callable = ops.value_loss
    entropy_loss: Callable = ops.entropy_loss
    advantages: Callable = ops.gae
    minibatch_step: Callable | None = None  # None: `ppo_minibatch_loss` below
    update_group: Callable | None = None    # None: `ppo_update_group` below


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------
@dataclass
class Models:
    actor_critic: ActorCritic
    reference: Reference | None
    tokenizer: object
    device: torch.device


def build_models(cfg: PPORunConfig, resume_dir: Path | None = None) -> Models:
    """Policy (+LoRA), value head or separate critic, and the frozen reference."""
    m, device = cfg.model, resolve_device(cfg.training.device)
    load_kw = dict(torch_dtype=m.torch_dtype, device=str(device), trust_remote_code=m.trust_remote_code,
                   tokenizer=m.tokenizer)
    full_resume = resume_dir is not None and not cfg.lora.enabled
    policy, tok = load_model(str(resume_dir) if full_resume else m.name_or_path, **load_kw)
    need_ref = cfg.ppo.kl_coeff > 0 and m.reference != "none"
    reference = None
    if need_ref and m.reference == "copy":
        # The reference is always the starting policy, also when resuming.
        ref_model = load_model(m.name_or_path, **load_kw)[0] if full_resume else policy
        reference = Reference.frozen_copy(ref_model)
        disable_dropout(reference.model)
        if full_resume:
            del ref_model
    if cfg.lora.enabled:
        if resume_dir is not None:
            from peft import PeftModel
            policy = PeftModel.from_pretrained(policy, str(resume_dir / "adapter"), is_trainable=True)
        else:
            policy = add_lora(policy, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules)
    if need_ref and m.reference == "lora_disabled":
        reference = Reference.lora_disabled(policy)
    disable_dropout(policy)
    if m.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    hidden = hidden_size_of(policy)
    if m.critic == "separate":
        src = str(resume_dir / "critic") if resume_dir is not None else (m.critic_name_or_path or m.name_or_path)
        base = load_model(src, **load_kw)[0]
        disable_dropout(base)
        critic = Critic(base, ValueHead(hidden_size_of(base)).to(device))
        if resume_dir is not None:
            load_value_head(critic.value_head, resume_dir / "critic")
        ac = ActorCritic(policy, critic=critic)
    else:
        head = ValueHead(hidden).to(device)
        if resume_dir is not None:
            load_value_head(head, resume_dir)
        ac = ActorCritic(policy, value_head=head)
    ac.train()
    return Models(ac, reference, tok, device)


# --------------------------------------------------------------------------------------
# Phases 1-4: rollout, score, forward + KL-shaped rewards, advantages
# --------------------------------------------------------------------------------------
def collect_rollout(models: Models, examples, cfg: PPORunConfig, scorer, timer: Timer,
                    math_: PPOMath) -> Rollout:
    """Phases 1-4 for one PPO step; returns a rollout with advantages and returns set."""
    ac, tok, p, g = models.actor_critic, models.tokenizer, cfg.ppo, cfg.generation
    # 1. rollout: sample one response per prompt, batch_size prompts at a time.
    with timer("generate"):
        roll = generate(ac.policy, tok, [e.prompt for e in examples], max_new_tokens=g.max_new_tokens,
                        min_new_tokens=g.min_new_tokens, temperature=g.temperature, top_k=g.top_k,
                        top_p=g.top_p, max_prompt_length=cfg.dataset.max_prompt_length,
                        batch_size=p.batch_size, examples=[e.row for e in examples])
    # 2. score: one float per response, batched.
    with timer("score"):
        scores = scorer.score(roll.prompts, roll.responses, roll.examples).float().to(models.device)
        if cfg.reward.missing_eos_penalty:
            scores = scores - cfg.reward.missing_eos_penalty * roll.hit_limit.float()
        roll.scores = scores                                                        # (B,)
    # 3. forward: old logprobs and values (one pass), reference logprobs (one pass).
    with timer("forward"):
        score_rollout(ac, models.reference, roll, temperature=g.temperature,
                      micro_batch=max(p.mini_batch_size, p.batch_size))
        ref_lp = roll.ref_logprobs if roll.ref_logprobs is not None else roll.logprobs
        coeff = p.kl_coeff if p.kl_in == "reward" else 0.0
        roll.rewards, roll.kl = ops.kl_shaped_rewards(
            roll.scores, roll.logprobs, ref_lp, roll.response_mask, coeff, p.kl_estimator,
            cfg.reward.score_clip)                                                   # (B, T) each
        rewards = roll.rewards
        if p.whiten_rewards:
            rewards = ops.masked_whiten(rewards, roll.response_mask, shift_mean=False)
        # 4. advantages: GAE (reverse recursion), then whitening over real tokens only.
        adv, ret = math_.advantages(rewards, roll.values, roll.response_mask, p.gamma, p.lam)
        if p.whiten_advantages:
            adv = ops.masked_whiten(adv, roll.response_mask)
        roll.advantages, roll.returns = adv, ret
    return roll


# --------------------------------------------------------------------------------------
# Phase 5: the update
# --------------------------------------------------------------------------------------
@dataclass
class MinibatchStats:
    policy: float
    value: float
    entropy: float
    total: float
    policy_clip_frac: float
    value_clip_frac: float
    approx_kl: float


def _trim(rows: torch.Tensor, roll: Rollout):
    """A minibatch with all-padding columns dropped (prompt left, response right)."""
    pm, rm = roll.prompt_mask[rows], roll.response_mask[rows]
    p_keep = int(pm.sum(0).nonzero().min()) if pm.any() else pm.shape[1] - 1
    t_keep = int(rm.sum(0).nonzero().max()) + 1 if rm.any() else 1
    prompt_ids, prompt_mask = roll.prompt_ids[rows, p_keep:], pm[:, p_keep:]
    resp = slice(0, t_keep)
    mb = {
        "input_ids": torch.cat([prompt_ids, roll.response_ids[rows, resp]], 1),
        "attention_mask": torch.cat([prompt_mask, rm[:, resp].to(prompt_mask.dtype)], 1),
        "prompt_len": prompt_ids.shape[1],
        "response_ids": roll.response_ids[rows, resp],
        "response_mask": rm[:, resp],
        "old_logprobs": roll.logprobs[rows, resp],
        "advantages": roll.advantages[rows, resp],
        "returns": roll.returns[rows, resp],
        "old_values": roll.values[rows, resp],
        "ref_logprobs": None if roll.ref_logprobs is None else roll.ref_logprobs[rows, resp],
    }
    return mb


def ppo_minibatch_loss(ac: ActorCritic, mb: dict, p, temperature: float, math_: PPOMath,
                       normalizer: float) -> tuple[torch.Tensor, MinibatchStats]:
    """Loss of one minibatch: policy + vf_coeff·value + entropy_coeff·(−entropy) [+ KL]."""
    need_entropy_grad = p.entropy_coeff > 0
    out = forward_response(ac, mb["input_ids"], mb["attention_mask"], mb["response_ids"],
                           mb["prompt_len"], temperature, with_values=True,
                           with_entropy=True, entropy_grad=need_entropy_grad)
    mask = mb["response_mask"]
    agg = dict(aggregation=p.loss_aggregation, normalizer=normalizer)
    pg = math_.policy_loss(out.logprobs, mb["old_logprobs"], mb["advantages"], mask, p.clip_eps,
                           dual_clip=p.dual_clip, **agg)
    vl = math_.value_loss(out.values, mb["old_values"], mb["returns"], mask, p.value_clip, **agg)
    ent = math_.entropy_loss(out.entropy, mask, **agg)  # without grad when entropy_coeff is 0
    total = pg.loss + p.vf_coeff * vl.loss + p.entropy_coeff * ent.loss
    if p.kl_in == "loss" and mb["ref_logprobs"] is not None and p.kl_coeff > 0:
        kl = ops.kl_estimate(out.logprobs, mb["ref_logprobs"], p.kl_estimator)
        total = total + p.kl_coeff * ops.aggregate(kl, mask, **agg)
    stats = MinibatchStats(float(pg.loss.detach()), float(vl.loss.detach()), float(ent.entropy), float(total.detach()),
                           float(pg.clip_frac), float(vl.clip_frac), float(pg.approx_kl))
    return total, stats


def ppo_update_group(ac: ActorCritic, minibatches: list[dict], optimizer, params: list,
                     p, temperature: float, math_: PPOMath,
                     normalizer: float) -> tuple[float, list[MinibatchStats]]:
    """One optimizer step over an accumulation group: forward, losses and backward per
    minibatch, then clip the global grad norm and step. Returns (pre-clip grad norm, stats)."""
    minibatch_step = math_.minibatch_step or ppo_minibatch_loss
    stats = []
    for mb in minibatches:
        loss, st = minibatch_step(ac, mb, p, temperature, math_, normalizer)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss/total is {float(loss)}; policy={st.policy} "
                                     f"value={st.value} entropy={st.entropy}")
        loss.backward()
        stats.append(st)
    max_norm = p.max_grad_norm if p.max_grad_norm is not None else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))  # the norm before clipping
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stats


def ppo_update(models: Models, optimizer, scheduler, roll: Rollout, cfg: PPORunConfig,
               step: int, math_: PPOMath) -> dict[str, float]:
    """5. `epochs` passes of shuffled minibatches; one optimizer step per accumulation group."""
    ac, p = models.actor_critic, cfg.ppo
    params = ac.trainable_parameters()
    n = len(roll)
    g = torch.Generator().manual_seed(cfg.training.seed * 7_919 + step)
    loss_sums: dict[str, float] = {}
    frac_sums: dict[str, float] = {}
    n_groups = n_mb = 0
    grad_norms: list[float] = []
    update_group = math_.update_group or ppo_update_group
    for _epoch in range(p.epochs):
        order = torch.randperm(n, generator=g).to(roll.prompt_ids.device)
        minibatches = [order[i : i + p.mini_batch_size] for i in range(0, n, p.mini_batch_size)]
        for start in range(0, len(minibatches), p.gradient_accumulation_steps):
            group = minibatches[start : start + p.gradient_accumulation_steps]
            rows = torch.cat(group)
            # The whole group's token (or sequence) count: accumulation 1x8 == 8x1 exactly.
            if p.loss_aggregation == "token_mean":
                normalizer = float(roll.response_mask[rows].sum().clamp(min=1))
            else:
                normalizer = float((roll.response_mask[rows].sum(-1) > 0).sum().clamp(min=1))
            try:
                grad_norm, stats = update_group(ac, [_trim(r, roll) for r in group], optimizer, params,
                                                p, cfg.generation.temperature, math_, normalizer)
            except FloatingPointError as exc:
                raise FloatingPointError(f"step {step}: {exc}") from None
            scheduler.step()
            grad_norms.append(grad_norm)
            for st in stats:
                # Losses and the entropy are divided by the whole group's normalizer, so
                # their sum over a group's minibatches is the group's value.
                for k in ("policy", "value", "total", "entropy"):
                    loss_sums[k] = loss_sums.get(k, 0.0) + getattr(st, k)
                for k in ("policy_clip_frac", "value_clip_frac", "approx_kl"):
                    frac_sums[k] = frac_sums.get(k, 0.0) + getattr(st, k)
                n_mb += 1
            n_groups += 1
    out = {f"loss/{k}": v / n_groups for k, v in loss_sums.items()}
    out["params/policy_clip_frac"] = frac_sums["policy_clip_frac"] / n_mb
    out["params/value_clip_frac"] = frac_sums["value_clip_frac"] / n_mb
    out["params/approx_kl"] = frac_sums["approx_kl"] / n_mb
    out["params/grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["lr"] = optimizer.param_groups[0]["lr"]
    return out


def rollout_metrics(roll: Rollout) -> dict[str, float]:
    mask = roll.response_mask.float()
    lengths = mask.sum(-1)
    return {
        "rollout/reward_mean": float(roll.scores.mean()),
        "rollout/reward_std": float(roll.scores.std()) if len(roll) > 1 else 0.0,
        "rollout/response_length": float(lengths.mean()),
        "rollout/hit_limit_frac": float(roll.hit_limit.float().mean()),
        "rollout/value_mean": float(ops.masked_mean(roll.values, mask)),
        "rollout/advantage_mean": float(ops.masked_mean(roll.advantages, mask)),
        "rollout/return_mean": float(ops.masked_mean(roll.returns, mask)),
        # The same estimator that is penalised, summed over a response, averaged over the batch.
        "params/kl_to_ref": float((roll.kl * mask).sum(-1).mean()),
    }


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path
    history: list[dict] = field(default_factory=list)
    eval_before: dict | None = None
    eval_after: dict | None = None
    episodes_per_s: float = 0.0


def _evaluate(models: Models, eval_examples, scorer, cfg: PPORunConfig, out_dir: Path, step: int,
              quiet: bool = False, n_show: int = 2, checks=None) -> dict:
    """Greedy held-out evaluation; every sample saved, the first `n_show` printed."""
    res = evaluate_policy(models.actor_critic.policy, models.tokenizer, eval_examples, scorer,
                          max_new_tokens=cfg.generation.max_new_tokens,
                          max_prompt_length=cfg.dataset.max_prompt_length,
                          batch_size=cfg.training.eval_batch_size, checks=checks)
    path = save_samples(res, out_dir / "eval" / f"step_{step}.jsonl")
    if not quiet:
        from tqdm import tqdm
        when = "step 0 (before training)" if step == 0 else f"step {step}"
        lines = [f"eval at {when}: " + format_metrics(res.metrics()) + f" (all samples: {path})"]
        lines += [f"  {s['prompt']!r}\n    -> {s['response']!r}  score {s['score']:.2f}" for s in res.samples[:n_show]]
        tqdm.write("\n".join(lines))
    return res.metrics()


def train(cfg: PPORunConfig, resume: str | Path | None = None, math_: PPOMath | None = None,
          effective=None, quiet: bool = False) -> TrainResult:
    """Run PPO as configured; returns where the outputs went and the metric history."""
    math_ = math_ or PPOMath()
    t, p = cfg.training, cfg.ppo
    set_threads(t.num_threads)
    preflight(cfg, quiet)  # every reward/check plug-in imported and called once, before any model loads
    resume_dir = check_resume_dir(resume)
    out_dir = prepare_output_dir(t.output_dir, resume=resume_dir is not None)
    save_effective_config(effective if effective is not None else cfg, out_dir)
    seed_everything(t.seed)

    models = build_models(cfg, resume_dir)
    train_examples = load_prompts(cfg.dataset, models.tokenizer, "train")
    eval_examples = load_prompts(cfg.dataset, models.tokenizer, "eval") if t.eval_interval else []
    scorer = build_reward(cfg.reward, models.device)
    checks = build_eval_checks(cfg.eval, models.device) if eval_examples else None

    n_minibatches = math.ceil(p.rollout_samples / p.mini_batch_size)
    updates_per_step = p.epochs * math.ceil(n_minibatches / p.gradient_accumulation_steps)
    optimizer, scheduler = make_optimization(models.actor_critic.trainable_parameters(), p,
                                             t.total_ppo_steps * updates_per_step)
    start_step = restore_trainer_state(resume_dir, optimizer, scheduler) if resume_dir is not None else 0

    doctor = make_doctor(cfg.logging.doctor, p.max_grad_norm, "ppo.kl_coeff")
    logger = MetricsLogger(out_dir, cfg.logging.report_to, cfg.logging.run_name, cfg.logging.wandb_project,
                           config=dataclasses.asdict(cfg), resume=resume_dir is not None,
                           resume_step=start_step if resume_dir is not None else None)
    result = TrainResult(out_dir, out_dir / "final")
    if eval_examples and start_step == 0:
        result.eval_before = _evaluate(models, eval_examples, scorer, cfg, out_dir, 0, quiet, checks=checks)
        logger.log(0, result.eval_before)

    from tqdm import tqdm
    bar = tqdm(range(start_step, t.total_ppo_steps), initial=start_step, total=t.total_ppo_steps,
               disable=quiet or not cfg.logging.progress_bar, desc="ppo", dynamic_ncols=True)
    total_episodes, total_seconds = 0, 0.0
    for step_idx in bar:
        step = step_idx + 1
        timer = Timer()
        t0 = time.perf_counter()
        # 1-4. rollout, score, KL-shaped rewards, advantages (no gradients).
        examples = step_prompts(train_examples, p.rollout_samples, t.seed, step)
        roll = collect_rollout(models, examples, cfg, scorer, timer, math_)
        # 5. update epochs over minibatches.
        with timer("update"):
            upd = ppo_update(models, optimizer, scheduler, roll, cfg, step, math_)
        step_seconds = time.perf_counter() - t0
        total_episodes += len(roll)
        total_seconds += step_seconds
        # 6. log, evaluate, save.
        metrics = {**rollout_metrics(roll), **upd, **timer.metrics(),
                   "perf/episodes_per_s": len(roll) / step_seconds,
                   "perf/tokens_per_s": float(roll.response_mask.sum()) / max(timer.seconds["generate"], 1e-9)}
        if eval_examples and t.eval_interval and (step % t.eval_interval == 0 or step == t.total_ppo_steps):
            metrics.update(_evaluate(models, eval_examples, scorer, cfg, out_dir, step, quiet, checks=checks))
        log_step(logger, result.history, doctor, step, metrics)
        bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}", kl=f"{metrics['params/kl_to_ref']:.3f}")
        if t.save_interval and step % t.save_interval == 0 and step < t.total_ppo_steps:
            save_checkpoint(out_dir / f"step_{step}", models.actor_critic, models.tokenizer,
                            optimizer=optimizer, scheduler=scheduler, step=step)
            prune_checkpoints(out_dir, t.keep_last_checkpoints)
    bar.close()
    save_checkpoint(result.final_dir, models.actor_critic, models.tokenizer, optimizer=optimizer,
                    scheduler=scheduler, step=t.total_ppo_steps)
    finish_run(logger, out_dir, models.device, cfg.logging.plots)
    result.eval_after = last_eval(result.history)
    result.episodes_per_s = total_episodes / total_seconds if total_seconds else 0.0
    return result


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/ppo_debug.yaml")
    parser.add_argument("--resume", default=None, help="continue from a step_N/ checkpoint folder")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. ppo.kl_coeff=0.1")


def run(args: argparse.Namespace) -> int:
    cfg, effective = load_config(args.config, PPORunConfig, args.overrides)
    res = train(cfg, resume=args.resume, effective=effective)
    print(f"done: {res.output_dir} (final model in {res.final_dir}); "
          f"{res.episodes_per_s:.2f} episodes/s")
    print_before_after(res.eval_before, res.eval_after)
    write_train_result(res.output_dir, eval_before=res.eval_before, eval_after=res.eval_after,
                       episodes_per_s=res.episodes_per_s)
    return 0
