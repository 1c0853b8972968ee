"""The one policy update every method runs: epochs × shuffled minibatches × gradient
accumulation, each minibatch's loss built from the same parts.

    loss = policy                      clipped surrogate (symmetric, clip-higher, dual clip),
                                       importance weights when another engine sampled (per token,
                                       tis_cap; per response, sequence_mask_cap)
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

Token budgets (`mini_batch_tokens`): an optimizer step's rows (the same rows as without
it) are re-cut into micro-batches of at most that many real tokens each, longest first
(`step_micro_batches`), with the same group normaliser, so the update is the row-cut one
to float rounding. The logged fractions keep meaning a mean over the row minibatches
(`fraction_weights`); with PPO-ptx each micro-batch adds one LM batch (the step's mean).

Memory: with a separate critic (`model.critic: separate`) a minibatch takes two passes
(`critic_and_policy`): the critic's forward and backward (`critic_pass`), then the
policy's. The two models share no parameter, so the gradients are those of the summed
loss, and only one model's activations are alive at a time. Under a data-parallel wrapper (one forward and one backward per wrapped module) and in
learner mode the two run in one pass.

`PPOMath` is the plug-in learner mode uses to run the learner's own functions.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import torch
from torch import Tensor

from rlhflab import ops
from rlhflab.engine.dist import Dist
from rlhflab.engine.minibatch import MiniBatch, loss_mask_of, select, sequence_tokens, token_micro_batches
from rlhflab.engine.scoring import group_layout
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
    # Σ_t |log π - log π_sampler| and its token count, from a forward on the sampling weights
    # when nothing recomputed the old log-probs (MiniBatch.measure_gap): rollout/logprob_gap
    gap_sum: float = 0.0
    gap_tokens: float = 0.0
    # responses that sequence_mask_cap left out of the policy loss, and the responses it judged
    # (those with a loss token): rollout/is_masked_frac
    seq_masked: float = 0.0
    seq_judged: float = 0.0
    # the truncated importance weights w = min(pi_old / pi_sampler, tis_cap) on real tokens
    # (tis_cap set and the sampler's log-probs known): Σ (w - 1), Σ (w - 1)², tokens capped, tokens
    is_sum: float = 0.0
    is_sq_sum: float = 0.0
    is_capped: float = 0.0
    is_tokens: float = 0.0


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
    seq_masked: Tensor | None = None  # (B,) bool: rows sequence_mask_cap masked (None when it is off)


def loss_terms(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, sec, *,
               normalizer: float | None = None, entropy: Tensor | None = None,
               ref_logprobs: Tensor | None = None, values: Tensor | None = None,
               old_values: Tensor | None = None, returns: Tensor | None = None,
               sample_logprobs: Tensor | None = None, math_: PPOMath | None = None) -> LossTerms:
    """The minibatch loss from tensors (all (B, T)), as the module docstring composes it.

    `sec` gives the settings (a method section: clip_eps, clip_eps_high, dual_clip,
    loss_aggregation, entropy_coeff, kl_loss_coeff, kl_estimator, tis_cap, sequence_mask_cap and, with
    values, vf_coeff and value_clip). Pure: no model, so it can be checked by hand.
    """
    math_ = math_ or PPOMath()
    agg = dict(aggregation=sec.loss_aggregation, normalizer=normalizer)
    extra = {}
    if sec.clip_eps_high is not None:
        extra["clip_eps_high"] = sec.clip_eps_high
    if getattr(sec, "tis_cap", None) is not None and sample_logprobs is not None:
        extra["token_weights"] = ops.truncated_is_weights(old_logprobs, sample_logprobs, loss_mask, sec.tis_cap)
    seq_masked = None
    if getattr(sec, "sequence_mask_cap", None) is not None and sample_logprobs is not None:
        smw = ops.sequence_mask_weights(old_logprobs, sample_logprobs, loss_mask, sec.sequence_mask_cap)
        extra["token_weights"], seq_masked = smw.weights, smw.masked
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
                     torch.as_tensor(pg.approx_kl), low, high, value_clip, kl_seq_sum, seq_masked)


def inner(module):
    """The model under a data-parallel wrapper (DDP, DeepSpeed keep it in `.module`)."""
    return getattr(module, "module", module)


def critic_apart(actor, mb: MiniBatch, math_: PPOMath, dist: Dist) -> bool:
    """Whether the separate critic takes its own pass before the policy's (see the module
    docstring): a separate critic, values to fit, one unwrapped process, the engine's own
    minibatch loss."""
    return (mb.returns is not None and getattr(actor, "separate_critic", False) and not dist.distributed
            and inner(actor) is actor and math_.minibatch_step is None)


def critic_pass(actor, mb: MiniBatch, sec, math_: PPOMath, normalizer: float):
    """The separate critic's forward, its clipped value loss (`math_.value_loss`) and the
    backward of vf_coeff times it; returns the value loss (its `loss` and `clip_frac`).
    `critic_and_policy` runs the policy's pass after it, or beside it."""
    values = actor.critic(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.attend_mask, mb.group_size,
                          mixed_precision=actor.mixed_precision, **mb.layout_kw)      # (b, T)
    value = math_.value_loss(values, mb.old_values, mb.returns, mb.loss_mask, sec.value_clip,
                             aggregation=sec.loss_aggregation, normalizer=normalizer)
    if not bool(torch.isfinite(value.loss)):
        raise FloatingPointError(f"loss/value is {float(value.loss)}")
    (sec.vf_coeff * value.loss).backward()
    return value


def with_value(st: MinibatchStats, value, vf_coeff: float) -> MinibatchStats:
    """`st` (a policy pass's stats) with the separate critic's value loss counted in."""
    part = float(value.loss.detach())
    return dataclasses.replace(st, value=part, value_clip_frac=float(torch.as_tensor(value.clip_frac)),
                               total=st.total + vf_coeff * part)


def critic_and_policy(actor, mb: MiniBatch, sec, temperature: float, math_: PPOMath,
                      normalizer: float, dist: Dist) -> MinibatchStats:
    """A minibatch with a separate critic: the critic's pass (`critic_pass`) on the whole
    minibatch first, with its own backward, so its activations are freed before the
    policy's pass; then the policy's; the minibatch's stats."""
    value = critic_pass(actor, mb, sec, math_, normalizer)
    loss, st = minibatch_loss(actor, mb, sec, temperature, math_, normalizer, critic_elsewhere=True)
    _check_finite(loss, st, dist)
    dist.backward(loss * dist.scale)
    return with_value(st, value, sec.vf_coeff)


def minibatch_loss(actor, mb: MiniBatch, sec, temperature: float, math_: PPOMath,
                   normalizer: float, critic_elsewhere: bool = False) -> tuple[Tensor, MinibatchStats]:
    """The loss of one minibatch (see the module docstring) and its stats. `actor` may be
    wrapped for data parallelism: its forward is called, so the wrapper sees it.

    `critic_elsewhere`: a separate critic's pass runs on its own (`critic_and_policy`): the
    forward skips it, the loss is the policy's part and the stats leave the value at 0
    (`with_value` adds it).
    """
    with_values = (not critic_elsewhere and mb.returns is not None
                   and getattr(inner(actor), "has_values", False))
    kw = {"lm_batch": mb.lm_batch} if mb.lm_batch is not None else {}
    kw.update(mb.layout_kw)
    out = actor(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.attend_mask, mb.group_size,
                temperature=temperature, with_values=with_values, with_entropy=True,
                entropy_grad=sec.entropy_coeff > 0, **kw)
    old = mb.old_logprobs if mb.old_logprobs is not None else out.logprobs.detach()
    t = loss_terms(out.logprobs, old, mb.advantages, mb.loss_mask, sec, normalizer=normalizer,
                   entropy=out.entropy, ref_logprobs=mb.ref_logprobs,
                   values=out.values if with_values else None, old_values=mb.old_values, returns=mb.returns,
                   sample_logprobs=mb.sample_logprobs, math_=math_)
    total, ptx = t.total, 0.0
    if out.lm_loss is not None:  # PPO-ptx: this minibatch's share of the group's mean LM loss
        total = total + sec.ptx_coeff * mb.lm_weight * out.lm_loss
        ptx = float(out.lm_loss.detach()) * mb.lm_weight
    gap_sum = gap_tokens = 0.0
    if mb.measure_gap and mb.sample_logprobs is not None:  # the sampler's gap, as rollout_metrics logs it
        real = mb.response_mask.to(old.dtype)
        gap_sum = float(((out.logprobs.detach() - mb.sample_logprobs).abs() * real).sum())
        gap_tokens = float(real.sum())
    seq_masked = seq_judged = 0.0
    if t.seq_masked is not None:
        seq_masked = float(t.seq_masked.sum())
        seq_judged = float((mb.loss_mask.sum(-1) > 0).sum())
    stats = MinibatchStats(float(t.policy), float(t.value), float(t.entropy), float(total.detach()),
                           float(t.clip_frac), float(t.value_clip_frac), float(t.approx_kl),
                           float(t.clip_frac_low), float(t.clip_frac_high), float(t.kl), ptx=ptx,
                           kl_seq_sum=float(t.kl_seq_sum), gap_sum=gap_sum, gap_tokens=gap_tokens,
                           seq_masked=seq_masked, seq_judged=seq_judged)
    if getattr(sec, "tis_cap", None) is not None and mb.sample_logprobs is not None:
        with torch.no_grad():  # the same weights loss_terms gave the policy loss
            real = mb.loss_mask.to(old.dtype)
            w = ops.truncated_is_weights(old, mb.sample_logprobs, mb.loss_mask, sec.tis_cap)   # (b, T)
            capped = ((old - mb.sample_logprobs) >= math.log(sec.tis_cap)).to(old.dtype) * real
            # about 1 (the on-policy value): summed as w - 1 in float64, so the spread of weights a
            # rounding apart is not lost in E[w²] - E[w]² (float32 cancels at 2^-12 there)
            d = (w.double() - 1.0) * real.double()
            stats.is_sum, stats.is_sq_sum = float(d.sum()), float((d * d).sum())
            stats.is_capped, stats.is_tokens = float(capped.sum()), float(real.sum())
    return total, stats


def _check_finite(loss: Tensor, st: MinibatchStats, dist: Dist) -> None:
    bad = not bool(torch.isfinite(loss))
    if dist.distributed:  # every rank stops together, or the others would wait forever
        bad = dist.sum(float(bad)) > 0
    if bad:
        raise FloatingPointError(f"loss/total is {float(loss)}; policy={st.policy} value={st.value} "
                                 f"entropy={st.entropy}")


def update_group(actor, minibatches: list[MiniBatch], optimizer, params: list, sec, temperature: float,
                 math_: PPOMath, normalizer: float, ptx=None, dist: Dist | None = None,
                 ) -> tuple[float, list[MinibatchStats]]:
    """One optimizer step over an accumulation group: forward, loss and backward per
    minibatch, then clip the global grad norm and step. Returns (pre-clip grad norm, stats).

    `normalizer` is the group's count over every rank; gradients are all-reduced once,
    after the group's last minibatch. `ptx`, when given, is an iterator of LM batches:
    each minibatch adds ptx_coeff · (LM loss of one batch) / len(minibatches), so the
    group adds one mean (a mean over ranks too). It is computed in the same forward.
    """
    dist = dist or Dist()
    step_fn = math_.minibatch_step or minibatch_loss
    stats = []
    for i, mb in enumerate(minibatches):
        if ptx is not None:
            mb.lm_batch, mb.lm_weight = next(ptx), 1.0 / (len(minibatches) * dist.world_size)
        with dist.accumulating(actor, last=i == len(minibatches) - 1):
            if critic_apart(actor, mb, math_, dist):  # a separate critic: its pass and the policy's
                st = critic_and_policy(actor, mb, sec, temperature, math_, normalizer, dist)
            else:
                loss, st = step_fn(actor, mb, sec, temperature, math_, normalizer)
                _check_finite(loss, st, dist)
                dist.backward(loss * dist.scale)
        stats.append(st)
    max_norm = sec.max_grad_norm if sec.max_grad_norm is not None else float("inf")
    grad_norm = dist.clip_grad_norm_(params, max_norm)  # the norm before clipping
    if not math.isfinite(grad_norm):  # a non-finite gradient never reaches the weights
        raise FloatingPointError(f"the gradient norm is {grad_norm}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stats


def step_micro_batches(roll: Rollout, rows: Tensor, budget: int, k: int, dist: Dist) -> list[Tensor]:
    """An optimizer step's `rows` (this rank's) cut into micro-batches of at most `budget`
    real tokens, longest first (`minibatch.token_micro_batches`); groups of k stay whole.
    Under several processes every rank makes as many as the rank that needs most (the
    gradient sync and the finiteness check are collectives of every micro-batch)."""
    cut = token_micro_batches(roll, rows, budget, k)
    if dist.distributed:
        n = int(dist.max(len(cut)))
        if n > len(cut):
            cut = token_micro_batches(roll, rows, budget, k, parts=n)
    longest = max(sequence_tokens(roll, rows, k), default=0)
    if longest > budget and budget not in _NOTED_OVERSIZE:
        _NOTED_OVERSIZE.add(budget)
        what = "a sequence" if k == 1 else f"a group of {k} answers sharing a prompt"
        warnings.warn(f"mini_batch_tokens: {what} holds {longest} tokens, more than the budget of {budget}; "
                      "each such runs in a micro-batch of its own", stacklevel=2)
    return cut


_NOTED_OVERSIZE: set[int] = set()  # the budgets whose oversize note was given (once per process)


def fraction_weights(batches: list[MiniBatch], n_minibatches: int) -> list[float]:
    """The weights of token micro-batches' fractions (clip fraction, approx KL: each a mean
    over its micro-batch's loss tokens) that make their sum `n_minibatches` times the
    step's token mean: the metrics keep meaning a mean over the minibatches of rows."""
    tokens = [float(b.loss_mask.sum()) for b in batches]
    total = sum(tokens)
    if total == 0:
        return [n_minibatches / len(batches)] * len(batches)
    return [n_minibatches * t / total for t in tokens]


def minibatch_order(roll: Rollout, k: int, generator: torch.Generator) -> Tensor:
    """A shuffled order of the rollout's rows; whole groups of k stay together."""
    n, device = len(roll), roll.response_ids.device
    if k > 1:
        groups = torch.randperm(n // k, generator=generator).to(device)
        return (groups.unsqueeze(1) * k + torch.arange(k, device=device)).reshape(-1)
    return torch.randperm(n, generator=generator).to(device)


def policy_update(actor, optimizer, scheduler, roll: Rollout, sec, *, temperature: float, step: int,
                  seed: int, max_new_tokens: int, math_: PPOMath | None = None,
                  ptx: Iterator | None = None, dist: Dist | None = None) -> dict[str, float]:
    """`sec.epochs` passes of shuffled minibatches over the rollout; one optimizer step per
    accumulation group. roll.advantages (B, T) must be set; roll.logprobs (the sampling
    policy's) may be None only when the update makes a single optimizer step.

    Under several processes `roll` is this rank's share, `sec.mini_batch_size` is the
    global minibatch (each rank takes its share of it) and `actor` the wrapped module.
    Returns the update's metrics: loss/* (mean over optimizer steps of each group's
    loss), params/* fractions (mean over minibatches), params/grad_norm and lr; the same
    on every rank.
    """
    math_ = math_ or PPOMath()
    dist = dist or Dist()
    if dist.distributed and (math_.update_group or math_.minibatch_step):
        raise ValueError("policy_update: learner mode's own update runs in one process")
    module = inner(actor)
    params = module.trainable_parameters()
    if roll.logprobs is None and sec.optimizer_steps_per_rollout() > 1:
        raise ValueError("policy_update: roll.logprobs (old log-probs) are needed when a step makes "
                         "more than one optimizer step")
    if sec.kl_loss_coeff > 0 and roll.ref_logprobs is None:
        raise ValueError("policy_update: a KL term in the loss needs roll.ref_logprobs")
    loss_mask = loss_mask_of(roll, sec.mask_truncated)                                # (B, T)
    mini_batch_size = dist.local(sec.mini_batch_size, "mini_batch_size")
    # the decoder's layout (`models.layout`); a minibatch that would split a group gives each row its prompt
    layout, k = group_layout(roll, module.policy, getattr(sec, "layout", "padded"),
                             whole_groups=mini_batch_size % roll.group_size == 0)
    budget = getattr(sec, "mini_batch_tokens", None)  # None: the minibatches of rows are the passes
    gen = torch.Generator().manual_seed(seed * 7_919 + step)
    update = math_.update_group or update_group
    sums = {key: 0.0 for key in LOSS_KEYS + FRACTION_KEYS}
    grad_norms: list[float] = []
    n_mb = 0
    kl_seq_first_epoch = 0.0
    # Σ |log π - log π_sampler|, tokens, over the passes before the first optimizer step (still the
    # sampling weights) when nothing else measures it: no old log-probs (one optimizer step), or
    # old log-probs that are the sampler's own (generation.old_logprobs: sampler)
    gap = [0.0, 0.0]
    seq_mask = [0.0, 0.0]  # responses masked, responses judged (first epoch: the same old log-probs after)
    weights = [0.0, 0.0, 0.0, 0.0]  # the importance weights' Σ w, Σ w², capped, tokens (first epoch)
    gap_here = (getattr(roll, "sample_logprobs", None) is not None
                and (roll.logprobs is None or getattr(roll, "old_from_sampler", False)))
    for epoch in range(sec.epochs):
        order = minibatch_order(roll, k, gen)
        minibatches = [order[i : i + mini_batch_size] for i in range(0, len(roll), mini_batch_size)]
        for start in range(0, len(minibatches), sec.gradient_accumulation_steps):
            group = minibatches[start : start + sec.gradient_accumulation_steps]
            # The whole group's count, over every rank: accumulation 1x8 == 8x1 and N ranks == 1.
            normalizer = dist.sum(group_normalizer(loss_mask[torch.cat(group)], sec.loss_aggregation,
                                                   max_new_tokens))
            parts = group if budget is None else step_micro_batches(roll, torch.cat(group), budget, k, dist)
            batches = [select(roll, rows, loss_mask, k, layout) for rows in parts]
            for b in batches:
                b.measure_gap = gap_here and epoch == 0 and start == 0
            extra = {"dist": dist} if dist.distributed else {}
            if ptx is not None:
                extra["ptx"] = ptx
            try:
                grad_norm, stats = update(actor, batches, optimizer, params, sec, temperature, math_, normalizer,
                                          **extra)
            except FloatingPointError as exc:
                raise FloatingPointError(f"step {step}: {exc}") from None
            scheduler.step()
            grad_norms.append(grad_norm)
            weights_of = [1.0] * len(stats) if budget is None else fraction_weights(batches, len(group))
            for st, w in zip(stats, weights_of):
                for key in LOSS_KEYS:
                    sums[key] += getattr(st, key)
                for key in FRACTION_KEYS:
                    sums[key] += w * getattr(st, key)
                if epoch == 0:
                    kl_seq_first_epoch += st.kl_seq_sum
                    gap[0] += st.gap_sum
                    gap[1] += st.gap_tokens
                    seq_mask[0] += st.seq_masked
                    seq_mask[1] += st.seq_judged
                    for i, key in enumerate(("is_sum", "is_sq_sum", "is_capped", "is_tokens")):
                        weights[i] += getattr(st, key, 0.0)
            n_mb += len(group)  # row minibatches, however the token budget cut them
    n_opt = len(grad_norms)
    # Each rank's loss parts are its share of the global loss: summed over ranks. The
    # fractions are this rank's means over equal shares: averaged over ranks.
    loss = {key: dist.sum(sums[key]) / n_opt for key in LOSS_KEYS}
    frac = {key: dist.mean(sums[key] / n_mb) for key in FRACTION_KEYS}
    metrics = {f"loss/{key}": loss[key] for key in ("policy", "entropy", "total")}
    metrics["params/policy_clip_frac"] = frac["policy_clip_frac"]
    metrics["params/approx_kl"] = frac["approx_kl"]
    metrics["params/clip_frac_low"] = frac["clip_frac_low"]
    metrics["params/clip_frac_high"] = frac["clip_frac_high"]
    if roll.returns is not None and getattr(module, "has_values", False):
        metrics["loss/value"] = loss["value"]
        metrics["params/value_clip_frac"] = frac["value_clip_frac"]
    if sec.kl_loss_coeff > 0:
        metrics["loss/kl"] = loss["kl"]
        if roll.kl is None:  # no sampling-time KL: the first epoch's, Σ_t per response, mean over responses
            metrics["params/kl_to_ref"] = dist.mean(kl_seq_first_epoch / len(roll))
    if ptx is not None:
        metrics["loss/ptx"] = loss["ptx"]
    if gap_here:
        # no recomputed old log-probs (GRPO with one optimizer step, or old_logprobs: sampler):
        # the update's first passes run on the sampling weights, so the weight-sync canary
        # judges this gap
        tokens = dist.sum(gap[1])
        if tokens > 0:  # (learner mode's own minibatch step does not measure it)
            metrics["rollout/logprob_gap"] = dist.sum(gap[0]) / tokens
    if getattr(sec, "sequence_mask_cap", None) is not None:
        judged = dist.sum(seq_mask[1])
        if judged > 0:  # (no sampler log-probs, or learner mode's own step: nothing judged)
            metrics["rollout/is_masked_frac"] = dist.sum(seq_mask[0]) / judged
    if getattr(sec, "tis_cap", None) is not None and getattr(roll, "sample_logprobs", None) is not None:
        total_w, total_sq, capped, tokens = (dist.sum(x) for x in weights)
        if tokens > 0:  # the first epoch's weights, over every rank (docs/rollout_backends.md)
            mean = total_w / tokens
            metrics["rollout/is_weight_mean"] = 1.0 + mean  # the sums are of w - 1 (`minibatch_loss`)
            metrics["rollout/is_weight_std"] = math.sqrt(max(total_sq / tokens - mean * mean, 0.0))
            metrics["rollout/is_capped_frac"] = capped / tokens
    metrics["params/grad_norm"] = sum(grad_norms) / n_opt
    metrics["lr"] = optimizer.param_groups[0]["lr"]
    return metrics

