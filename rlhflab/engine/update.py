"""The one policy update every method runs: epochs × shuffled minibatches × gradient
accumulation, each minibatch's loss built from the same parts.

    loss = policy                      clipped surrogate (symmetric, clip-higher, dual clip),
                                       per-token importance weights when another engine sampled
         + vf_coeff · value            clipped value loss (only with a critic: PPO)
         − entropy_coeff · entropy
         + kl_loss_coeff · KL(π‖π_ref)  when the method puts its KL in the loss (GRPO; PPO kl_in: loss)
         + ptx_coeff · LM loss          on rows of `ptx_data` (PPO-ptx; any method)

A method is a configuration of this: its section (a `PolicySection`) gives the clip,
aggregation, epochs and coefficients; its advantages are computed before the update
and arrive on the rollout. What differs between PPO, GRPO, RLOO and the rest is how the
rollout is scored and the advantages are made, not how the policy moves.

Exactness: every minibatch's loss is divided by the token (or sequence) count of its
whole accumulation group, so accumulation 1×8 equals 8×1 exactly. Under several
processes the count is the global one (`engine.dist`), so N processes equal one.

`PPOMath` is the plug-in learner mode uses to run the learner's own functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import torch
from torch import Tensor

from rlhflab import ops
from rlhflab.engine.minibatch import MiniBatch, loss_mask_of, select
from rlhflab.engine.scoring import shared_group_size
from rlhflab.rollout import Rollout


@dataclass
class PPOMath:
    """The pluggable pieces of the update (and PPO's advantages): learner mode swaps in
    the learner's own functions."""

    policy_loss: Callable = ops.ppo_policy_loss
    value_loss: Callable = ops.value_loss
    entropy_loss: Callable = ops.entropy_loss
    advantages: Callable = ops.gae
    minibatch_step: Callable | None = None  # None: `minibatch_loss` below
    update_group: Callable | None = None    # None: `update_group` below


@dataclass
class MinibatchStats:
    """One minibatch's share of its group's losses (they sum to the group's loss), and
    its fractions (averaged over minibatches)."""

    policy: float
    value: float
    entropy: float
    total: float
    policy_clip_frac: float
    value_clip_frac: float
    approx_kl: float
    clip_frac_low: float = 0.0
    clip_frac_high: float = 0.0
    kl: float = 0.0
    ptx: float = 0.0
    kl_seq_sum: float = 0.0  # Σ over rows of Σ_t KL_t (KL in the loss only): params/kl_to_ref


LOSS_KEYS = ("policy", "value", "entropy", "total", "kl", "ptx")
FRACTION_KEYS = ("policy_clip_frac", "value_clip_frac", "approx_kl", "clip_frac_low", "clip_frac_high")


def group_normalizer(loss_mask: Tensor, aggregation: str, max_new_tokens: int) -> float:
    """The denominator of a token-mean (tokens), seq-mean (sequences) or token-sum
    (sequences × max_new_tokens) loss over one accumulation group's rows. (b, T) mask."""
    if aggregation == "token_mean":
        return float(loss_mask.sum().clamp(min=1))
    n_seq = float((loss_mask.sum(-1) > 0).sum().clamp(min=1))
    return n_seq if aggregation == "seq_mean" else n_seq * max_new_tokens


class LossTerms(NamedTuple):
    """The parts of one minibatch's loss; every part already divided by the normalizer."""

    total: Tensor             # the scalar to minimise
    policy: Tensor            # the clipped surrogate (detached, as all below)
    value: Tensor             # the clipped value loss (0 without a critic)
    entropy: Tensor           # the aggregated entropy (not its loss)
    kl: Tensor                # the aggregated KL estimate (0 when the KL is not in the loss)
    clip_frac: Tensor
    approx_kl: Tensor
    clip_frac_low: Tensor
    clip_frac_high: Tensor
    value_clip_frac: Tensor
    kl_seq_sum: Tensor        # Σ over rows of Σ_t KL_t (0 when the KL is not in the loss)


def loss_terms(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, sec, *,
               normalizer: float | None = None, entropy: Tensor | None = None,
               ref_logprobs: Tensor | None = None, values: Tensor | None = None,
               old_values: Tensor | None = None, returns: Tensor | None = None,
               sample_logprobs: Tensor | None = None, math_: PPOMath | None = None) -> LossTerms:
    """The minibatch loss from tensors (all (B, T)), as the module docstring composes it.

    `sec` gives the settings (a method section: clip_eps, clip_eps_high, dual_clip,
    loss_aggregation, entropy_coeff, kl_loss_coeff, kl_estimator, tis_cap and, with
    values, vf_coeff and value_clip). Pure: no model, so it can be checked by hand.
    """
    math_ = math_ or PPOMath()
    agg = dict(aggregation=sec.loss_aggregation, normalizer=normalizer)
    extra = {}
    if sec.clip_eps_high is not None:
        extra["clip_eps_high"] = sec.clip_eps_high
    if getattr(sec, "tis_cap", None) is not None and sample_logprobs is not None:
        extra["token_weights"] = ops.truncated_is_weights(old_logprobs, sample_logprobs, loss_mask, sec.tis_cap)
    pg = math_.policy_loss(logprobs, old_logprobs, advantages, loss_mask, sec.clip_eps,
                           dual_clip=sec.dual_clip, **extra, **agg)
    zero = logprobs.new_zeros(())
    total = pg.loss
    value = value_clip = zero
    if values is not None:
        vl = math_.value_loss(values, old_values, returns, loss_mask, sec.value_clip, **agg)
        total = total + sec.vf_coeff * vl.loss
        value, value_clip = vl.loss.detach(), torch.as_tensor(vl.clip_frac)
    mean_entropy = zero
    if entropy is not None:
        ent = math_.entropy_loss(entropy, loss_mask, **agg)  # no graph when entropy has none
        mean_entropy = ent.entropy
        if sec.entropy_coeff > 0:
            total = total + sec.entropy_coeff * ent.loss
    kl = kl_seq_sum = zero
    if sec.kl_loss_coeff > 0:
        if ref_logprobs is None:
            raise ValueError("loss_terms: a KL term in the loss needs ref_logprobs")
        # k3 by default in GRPO: unbiased and never negative (Schulman, "Approximating KL divergence").
        kl_tok = ops.kl_estimate(logprobs, ref_logprobs, sec.kl_estimator)           # (B, T)
        kl_term = ops.aggregate(kl_tok, loss_mask, **agg)
        total = total + sec.kl_loss_coeff * kl_term
        kl, kl_seq_sum = kl_term.detach(), (kl_tok.detach() * loss_mask).sum()
    low = pg.clip_frac_low if getattr(pg, "clip_frac_low", None) is not None else zero
    high = pg.clip_frac_high if getattr(pg, "clip_frac_high", None) is not None else zero
    return LossTerms(total, pg.loss.detach(), value, mean_entropy, kl, torch.as_tensor(pg.clip_frac),
                     torch.as_tensor(pg.approx_kl), low, high, value_clip, kl_seq_sum)


def minibatch_loss(actor, mb: MiniBatch, sec, temperature: float, math_: PPOMath,
                   normalizer: float) -> tuple[Tensor, MinibatchStats]:
    """The loss of one minibatch (see the module docstring) and its stats."""
    with_values = mb.returns is not None and getattr(actor, "has_values", False)
    out = actor(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask, mb.group_size,
                temperature=temperature, with_values=with_values, with_entropy=True,
                entropy_grad=sec.entropy_coeff > 0)
    old = mb.old_logprobs if mb.old_logprobs is not None else out.logprobs.detach()
    t = loss_terms(out.logprobs, old, mb.advantages, mb.loss_mask, sec, normalizer=normalizer,
                   entropy=out.entropy, ref_logprobs=mb.ref_logprobs,
                   values=out.values if with_values else None, old_values=mb.old_values, returns=mb.returns,
                   sample_logprobs=mb.sample_logprobs, math_=math_)
    stats = MinibatchStats(float(t.policy), float(t.value), float(t.entropy), float(t.total.detach()),
                           float(t.clip_frac), float(t.value_clip_frac), float(t.approx_kl),
                           float(t.clip_frac_low), float(t.clip_frac_high), float(t.kl),
                           kl_seq_sum=float(t.kl_seq_sum))
    return t.total, stats


def _check_finite(loss: Tensor, st: MinibatchStats) -> None:
    if not torch.isfinite(loss):
        raise FloatingPointError(f"loss/total is {float(loss)}; policy={st.policy} value={st.value} "
                                 f"entropy={st.entropy}")


def update_group(actor, minibatches: list[MiniBatch], optimizer, params: list, sec, temperature: float,
                 math_: PPOMath, normalizer: float, ptx=None) -> tuple[float, list[MinibatchStats]]:
    """One optimizer step over an accumulation group: forward, loss and backward per
    minibatch, then clip the global grad norm and step. Returns (pre-clip grad norm, stats).

    `ptx`, when given, is an iterator of LM batches: each minibatch adds
    ptx_coeff · (LM loss of one batch) / len(minibatches), so the group adds one mean.
    """
    step_fn = math_.minibatch_step or minibatch_loss
    stats = []
    for mb in minibatches:
        loss, st = step_fn(actor, mb, sec, temperature, math_, normalizer)
        _check_finite(loss, st)
        if ptx is not None:
            lm = ptx_loss(actor, next(ptx)) / len(minibatches)
            loss = loss + sec.ptx_coeff * lm
            st.ptx = float(lm.detach())
            st.total += sec.ptx_coeff * st.ptx
        loss.backward()
        stats.append(st)
    max_norm = sec.max_grad_norm if sec.max_grad_norm is not None else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))  # the norm before clipping
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stats


def ptx_loss(actor, batch: dict[str, Tensor]) -> Tensor:
    """Token-mean next-token NLL of the policy on one LM batch (input_ids, attention_mask,
    labels with -100 on positions that are not trained)."""
    out = actor.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    logits = out.logits[:, :-1]                                                     # (b, L-1, V)
    labels = batch["labels"][:, 1:]                                                 # (b, L-1)
    keep = labels != -100
    lp = ops.logprobs_from_logits(logits, labels.clamp(min=0))
    return -(lp * keep).sum() / keep.sum().clamp(min=1)


def minibatch_order(roll: Rollout, k: int, generator: torch.Generator) -> Tensor:
    """A shuffled order of the rollout's rows; whole groups of k stay together."""
    n, device = len(roll), roll.response_ids.device
    if k > 1:
        groups = torch.randperm(n // k, generator=generator).to(device)
        return (groups.unsqueeze(1) * k + torch.arange(k, device=device)).reshape(-1)
    return torch.randperm(n, generator=generator).to(device)


def policy_update(actor, optimizer, scheduler, roll: Rollout, sec, *, temperature: float, step: int,
                  seed: int, max_new_tokens: int, math_: PPOMath | None = None,
                  ptx: Iterator | None = None) -> dict[str, float]:
    """`sec.epochs` passes of shuffled minibatches over the rollout; one optimizer step per
    accumulation group. roll.advantages (B, T) must be set; roll.logprobs (the sampling
    policy's) may be None only when the update makes a single optimizer step.

    Returns the update's metrics: loss/* (mean over optimizer steps of each group's
    loss), params/* fractions (mean over minibatches), params/grad_norm and lr.
    """
    math_ = math_ or PPOMath()
    params = actor.trainable_parameters()
    if roll.logprobs is None and sec.optimizer_steps_per_rollout() > 1:
        raise ValueError("policy_update: roll.logprobs (old log-probs) are needed when a step makes "
                         "more than one optimizer step")
    if sec.kl_loss_coeff > 0 and roll.ref_logprobs is None:
        raise ValueError("policy_update: a KL term in the loss needs roll.ref_logprobs")
    loss_mask = loss_mask_of(roll, sec.mask_truncated)                                # (B, T)
    k = shared_group_size(roll, actor.policy, sec.share_prompt)
    if k > 1 and sec.mini_batch_size % k:
        k = 1  # a minibatch would split a group: run the plain pass
    gen = torch.Generator().manual_seed(seed * 7_919 + step)
    update = math_.update_group or update_group
    sums = {key: 0.0 for key in LOSS_KEYS + FRACTION_KEYS}
    grad_norms: list[float] = []
    n_mb = 0
    kl_seq_first_epoch = 0.0
    for epoch in range(sec.epochs):
        order = minibatch_order(roll, k, gen)
        minibatches = [order[i : i + sec.mini_batch_size] for i in range(0, len(roll), sec.mini_batch_size)]
        for start in range(0, len(minibatches), sec.gradient_accumulation_steps):
            group = minibatches[start : start + sec.gradient_accumulation_steps]
            normalizer = group_normalizer(loss_mask[torch.cat(group)], sec.loss_aggregation, max_new_tokens)
            batches = [select(roll, rows, loss_mask, k) for rows in group]
            try:
                grad_norm, stats = update(actor, batches, optimizer, params, sec, temperature, math_, normalizer,
                                          **({"ptx": ptx} if ptx is not None else {}))
            except FloatingPointError as exc:
                raise FloatingPointError(f"step {step}: {exc}") from None
            scheduler.step()
            grad_norms.append(grad_norm)
            for st in stats:
                for key in LOSS_KEYS + FRACTION_KEYS:
                    sums[key] += getattr(st, key)
                if epoch == 0:
                    kl_seq_first_epoch += st.kl_seq_sum
                n_mb += 1
    n_opt = len(grad_norms)
    metrics = {f"loss/{key}": sums[key] / n_opt for key in ("policy", "entropy", "total")}
    metrics["params/policy_clip_frac"] = sums["policy_clip_frac"] / n_mb
    metrics["params/approx_kl"] = sums["approx_kl"] / n_mb
    metrics["params/clip_frac_low"] = sums["clip_frac_low"] / n_mb
    metrics["params/clip_frac_high"] = sums["clip_frac_high"] / n_mb
    if roll.returns is not None and getattr(actor, "has_values", False):
        metrics["loss/value"] = sums["value"] / n_opt
        metrics["params/value_clip_frac"] = sums["value_clip_frac"] / n_mb
    if sec.kl_loss_coeff > 0:
        metrics["loss/kl"] = sums["kl"] / n_opt
        if roll.kl is None:  # no sampling-time KL: the first epoch's, Σ_t per response, mean over responses
            metrics["params/kl_to_ref"] = kl_seq_first_epoch / len(roll)
    if ptx is not None:
        metrics["loss/ptx"] = sums["ptx"] / n_opt
    metrics["params/grad_norm"] = sum(grad_norms) / n_opt
    metrics["lr"] = optimizer.param_groups[0]["lr"]
    return metrics

