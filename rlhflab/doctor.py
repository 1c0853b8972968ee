"""The training doctor: rules that read the per-step metrics and say what looks unhealthy.

Two ways in:

- During training: every trainer (SFT, the reward model, DPO and the RL loop) makes a
  ``Doctor(method=..., max_grad_norm=...)`` and feeds it each logged row
  (`rlhflab.trainers.common.log_step`). A rule reports once when it starts firing and
  stays quiet until it clears, so a long bad stretch prints one line, not one per step.
- After (or during) a run: ``rlhflab doctor RUN_DIR`` replays ``metrics.jsonl`` through
  the same rules (the method read from the run's effective_config.yaml), prints one line
  per rule (OK, or the finding and the step it first fired) and draws ``doctor.png``.

Each method gets the rules that apply to it (`RULE_SETS`): PPO/GRPO/RLOO and the other
RL methods the clip, value, KL, entropy and reward rules; SFT a loss that does not fall
and overfitting; the reward model and DPO pairwise accuracy stuck at chance and a margin
that keeps growing (DPO also chosen and rejected log-probs falling together); SFT, RM
and DPO a gradient-norm spike. Every rule skips quietly when its metric is missing.

The one "stop" rule, `non_finite`, is also the only place the divergence decision is
made: NaN or infinity in a loss or a gradient norm (`is_stop_metric`) stops the run
with one line naming the step and the learning-rate knob (`divergence_message`). The
trainers' `check_finite_step` (before ``optimizer.step()``, so a NaN never reaches the
weights) and `check_finite_model` (before a save) raise the same `TrainingDiverged`.

The thresholds are rules of thumb, not laws; each one lives in `DoctorConfig` with its
reason, and `docs/metrics.md` explains each pattern.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, NamedTuple, Optional, Sequence

from rlhflab.config.methods import method_sections
from rlhflab.errors import TrainingDiverged, UserError
from rlhflab.metrics import read_metrics

Severity = Literal["warn", "stop"]

# Metric names the rules read (written by the trainers, see docs/metrics.md).
REWARD_MEAN = "rollout/reward_mean"
REWARD_STD = "rollout/reward_std"
ZERO_SPREAD = "rollout/zero_spread_frac"
VALUE_LOSS = "loss/value"
EXPLAINED_VAR = "rollout/explained_variance"  # 1 − Var(returns − values)/Var(returns), the rollout's values
ENTROPY = "loss/entropy"
POLICY_CLIP = "params/policy_clip_frac"
GRAD_NORM = "params/grad_norm"
GRAD_NORM_MAX = "params/grad_norm_max"  # SFT/RM: the largest per-step norm of a logging window
KL_TO_REF = "params/kl_to_ref"
EVAL_REWARD = "eval/reward_mean"  # the optimised reward on the held-out prompts; every other
                                  # eval/* metric (accuracy, eval.rewards) is a held-out check
# SFT, reward model (RM) and DPO metrics
TRAIN_LOSS = "train/loss"         # SFT and RM (DPO logs its training loss as "loss")
EVAL_LOSS = "eval/loss"
RM_ACCURACY = "train/accuracy"    # share of pairs with r(chosen) > r(rejected)
RM_GAP = "eval/score_gap"         # held-out mean of r(chosen) - r(rejected)
DPO_ACCURACY = "rewards/accuracies"
DPO_MARGIN = "rewards/margins"    # mean of beta * (log-ratio of chosen - log-ratio of rejected)
DPO_CHOSEN = "logps/chosen"       # the policy's sequence log-probs, batch means
DPO_REJECTED = "logps/rejected"
LOGPROB_GAP = "rollout/logprob_gap"  # vLLM: mean |trainer - sampler| log-prob per response token
VERSION_GAP = "rollout/version_gap"  # max_staleness >= 1: updates between the sampling weights and the trained ones
IS_CAPPED = "rollout/is_capped_frac"  # share of response tokens whose importance weight reached tis_cap
APPROX_KL = "params/approx_kl"       # how far an update moved the policy from the one that sampled
MAX_TURNS_FRAC = "episode/hit_max_turns_frac"  # multi-turn: episodes stopped at env.max_turns
TOOL_ERROR_RATE = "episode/tool_error_rate"    # failed tool calls / tool calls
EARLY_TURN_TOKENS = "episode/early_turn_tokens_mean"  # action tokens per turn before the last
ENV_REWARD = "episode/env_reward_mean"         # the environment's turn rewards summed per episode



@dataclass
class DoctorConfig:
    """Thresholds of the rules. The defaults suit the debug runs of each method on a small
    LM; loosen them for a run that is known to behave differently."""

    # The trainer's method (ppo, grpo, sft, rm, dpo, ...): which rule set runs
    # (`rule_set_for`) and whose section's knobs the advice names ("rl": ppo's).
    method: str = "rl"

    # policy_clip_frac: PPO clips a token once its ratio leaves [1-eps, 1+eps]; a healthy
    # update clips a few percent of tokens. Above this for `clip_frac_patience` steps in a
    # row, each update moves the policy too far.
    clip_frac_max: float = 0.3
    clip_frac_patience: int = 2
    # grad_norm: the pre-clip global gradient norm; clipping hides spikes, but a norm
    # many times the clip for several steps in a row means the loss surface is steep.
    max_grad_norm: Optional[float] = 1.0   # the trainer's ppo.max_grad_norm; None: 1.0 is used
    # The config key of the KL weight, named in advice: ppo.kl_coeff, grpo.kl_coeff, trpo.max_kl.
    kl_knob: str = "ppo.kl_coeff"
    grad_norm_factor: float = 10.0
    grad_norm_patience: int = 3
    # value_loss: after `value_window` steps, fires when the mean of the last
    # `value_avg_steps` values is not below `value_drop` times the mean of the first
    # `value_avg_steps` AND the critic explains none of the returns' variance over those
    # last steps: the mean explained variance (`rollout/explained_variance`) at most
    # `value_ev_min`. The loss alone misleads: its size is the returns' variance times the
    # unexplained share, and with a 0/1 reward at success rate p that variance is p(1 − p),
    # which rises with p while p < 0.5. The SmolLM2 PPO runs of docs/real_models.md
    # (held-out accuracy 31.5% -> 54.5% on seed 1; their value columns are
    # tests/data/smollm2_ppo_s*_value.jsonl) had value losses that rose from 0.085 to 0.086
    # (seed 1) and 0.082 to 0.084 (seed 0), means of steps 1-5 and 16-20, while their
    # estimated explained variance over steps 16-20 was +0.16 and +0.11.
    # A metrics file without the logged explained variance (older runs) gets an estimate:
    # 1 − 2 · loss/value / reward_std² (loss/value is half a mean squared error; the
    # response-level reward variance stands in for the per-token return variance). It is
    # rough: measured during the update, on the batch the critic just fitted, and it counts
    # the critic's offset as error. With neither logged the loss is judged alone.
    value_window: int = 20
    value_avg_steps: int = 5
    value_drop: float = 0.9
    # 0: a critic no better than a constant (the zero head before it trains, one that never
    # trains, one that only tracks the batch's mean return) sits at 0 and fires; one that
    # adds noise sits below it.
    value_ev_min: float = 0.0
    # kl_to_ref: rising over the last `kl_window` steps (least-squares slope > 0 and the
    # last value >= `kl_growth` times the window's first) and above `kl_max`. The PPO
    # trainer logs params/kl_to_ref as nats summed over a response, averaged over the batch.
    kl_window: int = 10
    kl_growth: float = 1.5
    kl_max: float = 5.0
    # entropy: the mean of the last `entropy_avg_steps` values below `entropy_floor`
    # nats per token, or below the run's starting entropy divided by `entropy_drop_factor`.
    entropy_floor: float = 0.05
    entropy_drop_factor: float = 10.0
    entropy_avg_steps: int = 3
    # reward_constant: reward_std <= `reward_eps` (every reward equal) for
    # `reward_patience` steps in a row; GRPO's zero_spread_frac >= `zero_spread_max`
    # (almost no group has a reward spread) for as long.
    reward_patience: int = 3
    reward_eps: float = 1e-8
    zero_spread_max: float = 0.95
    # ... and, however short the run (from `zero_spread_min_steps` steps), when in more than
    # half of its steps at least `zero_spread_most` of the groups had no spread (a 3-step run
    # at 0.75-0.875 once said "healthy").
    zero_spread_most: float = 0.5
    zero_spread_min_steps: int = 2
    # reward_hacking: at the latest evaluation a held-out check (eval/accuracy or an
    # eval.rewards metric, higher is better) is more than `hack_check_drop` (relative)
    # below its best so far, while the optimised reward on the same prompts
    # (eval/reward_mean) is more than `hack_reward_rise` (relative) above its first value
    # and has not fallen by more than that since the check's best. "Has not fallen"
    # rather than "rose": a learned reward is often already saturated when the policy
    # starts to game it. 0.15 stays above the noise of a 200-prompt accuracy near 0.9.
    hack_check_drop: float = 0.15
    hack_reward_rise: float = 0.02
    # logprob_gap (generation.backend=vllm): the sampler's log-probs drifting from the
    # trainer's. The baseline is the median of the first `gap_baseline_steps` logged gaps;
    # a later gap above both `gap_factor` x baseline and baseline + `gap_floor` (nats per
    # token) fires (`sync_gap_limit`). The same defaults as the training-time canary
    # (generation.vllm.sync_check_factor, generation.vllm.sync_check_floor): a float32 run's gap of
    # 3e-7 may triple without meaning anything, a bfloat16 one of ~0.01-0.03 moves by tens
    # of percent; a weight push that went wrong showed here as 4.5e-3 (one stale matrix of
    # the tiny test model, float32) to 0.09 (nothing pushed), in TRL #5312 as 0.015 -> 0.201.
    # With generation.vllm.sync_interval > 1 part of the gap is the weights' staleness.
    gap_factor: float = 10.0
    gap_floor: float = 1e-3
    gap_baseline_steps: int = 3
    # stale_sampler (generation.max_staleness >= 1): the share of response tokens whose
    # importance weight pi_old / pi_sampler reached tis_cap (rollout/is_capped_frac). Past
    # it the sampler is so far behind that the capped weights bias the update.
    capped_frac_limit: float = 0.2
    # kl_fading (the tutorial FAQ's "approx_kl decreasing, nothing is learning"): over the
    # last `fade_window` steps params/approx_kl (how far each update moved the policy)
    # has a negative slope and the median of its last `fade_avg_steps` values is below
    # the median of its first ones divided by `fade_factor`, while rollout/reward_mean
    # moved by at most `fade_reward_move` times the rollout's reward_std between the same
    # ends, and the learning rate did not fall by half (a decaying schedule shrinks the
    # updates on purpose). Medians: approx_kl jumps 10x between single steps of a healthy
    # run (the quickstart PPO: 0.0005 to 0.017 over 20 steps, its reward 0.35 -> 0.63).
    # scripts/doctor_symptoms.py: the quickstart PPO with kl_coeff 2.0 (reward flat near
    # 0.45) fires at step 10 with a factor of 3 (its approx_kl medians 0.0039 -> 0.0011,
    # 3.6x); the healthy runs (seeds 0, 1, 2) stay silent down to 2.
    fade_window: int = 10
    fade_avg_steps: int = 3
    fade_factor: float = 3.0
    fade_reward_move: float = 0.1
    # value_flat_early (the FAQ's "loss/value flat over the first rollouts"): the value
    # rule above waits `value_window` steps; this one judges the first
    # `value_early_steps`: the mean of the last `value_avg_early` of them not below
    # `value_drop` times the mean of the first ones, while the rewards vary (mean
    # reward_std above reward_eps), and, as for value_loss, the mean explained variance of
    # those last steps at most `value_ev_min`. Once `value_window` values exist it hands
    # over to value_loss. The quickstart PPO's critic fell to 0.78x of its start by step 8;
    # with ppo.vf_coeff 0 (scripts/doctor_symptoms.py) it rose, 0.137 -> 0.169, and this
    # fired. The SmolLM2 PPO runs' losses rose too (0.0615 -> 0.0935, seed 1), while their
    # estimated explained variance at steps 6-8 was +0.05 (both seeds).
    value_early_steps: int = 8
    value_avg_early: int = 3

    # --- the stop rule (every method)
    # The config key a diverging run is told to lower; None: <method>.learning_rate
    # (for the RL set: ppo.learning_rate).
    lr_knob: Optional[str] = None
    # --- SFT, RM, DPO
    # grad_norm_spike: one logged pre-clip norm above `spike_factor` times the median of
    # the previous `spike_history` (at least `spike_min_history` of them): one bad batch or
    # a learning rate at the edge of stability. Healthy runs here vary by 3x at most.
    spike_factor: float = 10.0
    spike_history: int = 20
    spike_min_history: int = 5
    # loss_flat (SFT): after `loss_window` logged values, the mean of the last
    # `loss_avg_steps` must be below `loss_drop` times the mean of the first ones.
    loss_window: int = 6
    loss_avg_steps: int = 2
    loss_drop: float = 0.95
    # overfitting: at `overfit_patience` evaluations in a row the held-out loss is more
    # than `overfit_rise` (relative) above its best so far, while the training loss has
    # fallen since the best. One high evaluation is not enough: the RM debug run's
    # held-out loss once rose 16% (0.428 -> 0.497) and fell to 0.36 at the next.
    overfit_rise: float = 0.1
    overfit_patience: int = 2
    # accuracy_at_chance (RM train/accuracy, DPO rewards/accuracies): after
    # `chance_min_values` logged values, the mean of the last `chance_window` is at or
    # below 0.5 + `chance_band`. Measured here: the RM debug runs' first 20 logs average
    # 0.57 (they learn); a DPO run from the SFT model (held-out accuracy 0.59 -> 0.70)
    # had 20-step means of 0.534-0.672, one from the untrained tiny model (which learns
    # nothing) 0.472-0.544. So a window of 20 and a band of 0.03: a hint, not a verdict.
    chance_min_values: int = 20
    chance_window: int = 20
    chance_band: float = 0.03
    # margin_growth: the RM's held-out score gap (eval/score_gap, in reward units) or DPO's
    # rewards/margins above `rm_margin_max` / `dpo_margin_max` and higher than at the
    # previous logged value: the scores grow without bound (an over-confident model,
    # whose rewards PPO can exploit).
    rm_margin_max: float = 10.0
    dpo_margin_max: float = 10.0
    # logps_falling (DPO): the mean of the last `logp_avg_steps` chosen sequence log-probs
    # is more than `logp_drop` nats below the mean of the first ones (the chosen responses
    # became e^2 = 7x less likely), and the rejected fell too.
    logp_avg_steps: int = 5
    logp_drop: float = 2.0
    # Multi-turn episodes (an `env:` section; docs/environments.md). max_turns: at least
    # `max_turns_frac` of the episodes stopped at env.max_turns for `max_turns_patience`
    # steps in a row. tool_errors: the mean of the last `tool_avg_steps` tool-error rates is
    # `tool_error_rise` above the mean of the first ones and at least `tool_error_min`.
    # early_turns_collapse: no environment reward at any turn (the reward only judges the
    # final answer) while the action tokens of the turns before the last fell below
    # `early_turn_drop` times their start (means of `early_turn_avg_steps` values, after
    # `early_turn_window` steps).
    max_turns_frac: float = 0.5
    max_turns_patience: int = 3
    tool_avg_steps: int = 3
    tool_error_rise: float = 0.2
    tool_error_min: float = 0.3
    early_turn_window: int = 8
    early_turn_avg_steps: int = 3
    early_turn_drop: float = 0.3

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


@dataclass(frozen=True)
class Finding:
    """One rule that started firing at `step`. `message` says what and what to do."""

    rule: str
    severity: Severity
    step: int
    message: str

    @property
    def stop(self) -> bool:
        """True when the trainer should stop (keep the last good checkpoint)."""
        return self.severity == "stop"

    def __str__(self) -> str:
        return f"doctor [{self.severity}] step {self.step} {self.rule}: {self.message}"


# --------------------------------------------------------------------------- the stop rule
# NaN or infinity in a loss or a gradient norm stops a run. The decision (`non_finite`)
# and its wording (`divergence_message`) live here once; the trainers' check_finite_step
# and check_finite_model, the live doctor and `rlhflab doctor` all use them.

STOP_NAMES = {"loss": "the loss", GRAD_NORM: "the gradient norm"}  # how the message names them


def is_stop_metric(key: str) -> bool:
    """A loss or a gradient norm: `loss`, `loss/*`, `*/loss`, `params/grad_norm` (and its window max)."""
    return key == "loss" or key.startswith("loss/") or key.endswith("/loss") or key in (GRAD_NORM, GRAD_NORM_MAX)


def non_finite(metrics: Mapping[str, Any]) -> str:
    """'' when every loss and gradient norm in `metrics` is finite (None values are not
    checked); else what is not, e.g. "the loss is nan" or "loss/value is inf"."""
    bad = []
    for key, value in metrics.items():
        v = _as_float(value)
        if v is not None and is_stop_metric(key) and not math.isfinite(v):
            bad.append(f"{STOP_NAMES.get(key, key)} is {v}")
    return ", ".join(bad[:4]) + (" ..." if len(bad) > 4 else "")


def divergence_message(what: str, knob: str = "the learning rate", lr: float | None = None) -> str:
    """The one wording of a stop: what is not finite, the knob to lower and its value now."""
    now = f" (now {lr:g})" if lr is not None else ""
    return (f"training diverged ({what}); lower {knob}{now}, or clip harder with a smaller max_grad_norm; "
            f"no checkpoint with non-finite weights was saved")


def stop_if_diverged(step: int, metrics: Mapping[str, Any], *, knob: str = "the learning rate",
                     lr: float | None = None) -> None:
    """Raise `TrainingDiverged` ("step N: training diverged (...)") when a loss or gradient
    norm in `metrics` is NaN or infinite: the `non_finite` rule, applied before the
    optimizer steps (`rlhflab.trainers.common.check_finite_step`)."""
    what = non_finite(metrics)
    if what:
        raise TrainingDiverged(f"step {step}: {divergence_message(what, knob, lr)}")


def check_finite(name: str, tensor: Any, step: int | None = None, *, knob: str = "the learning rate",
                 lr: float | None = None) -> None:
    """Raise `TrainingDiverged` if `tensor` (a torch tensor or a number) holds NaN or inf,
    naming it and, for a tensor, where the first bad value is.

    For a loop of your own: call it on each loss before ``backward()``; a NaN gradient
    step ruins the weights of every later checkpoint. It costs one device sync per call;
    call it on scalars, not on every activation.
    """
    where = f"step {step}: " if step is not None else ""
    if isinstance(tensor, (int, float)) and not isinstance(tensor, bool):
        if not math.isfinite(tensor):
            raise TrainingDiverged(where + divergence_message(f"{name} is {float(tensor)}", knob, lr))
        return
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"check_finite: {name} is a {type(tensor).__name__}, not a tensor or number")
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return
    n_bad = int((~finite).sum())
    n_nan = int(torch.isnan(tensor).sum())
    if tensor.dim() == 0:
        what = f"{name} is {tensor.item()}"
    else:
        first = tuple(int(i) for i in (~finite).nonzero()[0].tolist())
        what = (f"{name} has {n_bad} non-finite of {tensor.numel()} values ({n_nan} NaN, "
                f"{n_bad - n_nan} inf; first at index {first}, shape {tuple(tensor.shape)})")
    raise TrainingDiverged(where + divergence_message(what, knob, lr))


# --------------------------------------------------------------------------- rules
# A rule reads the history and returns None (not enough data to judge), "" (healthy)
# or a message (firing).

History = dict[str, list[tuple[int, float]]]


def _values(history: History, key: str) -> list[float]:
    return [v for _, v in history.get(key, [])]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _slope(ys: Sequence[float]) -> float:
    """Least-squares slope of ys against 0, 1, 2, ..."""
    n = len(ys)
    xm, ym = (n - 1) / 2, _mean(ys)
    den = sum((i - xm) ** 2 for i in range(n))
    return sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / den if den else 0.0


def _section(cfg: DoctorConfig) -> str:
    """The config section whose knobs the advice names."""
    return "ppo" if cfg.method == "rl" else cfg.method


def lr_knob(cfg: DoctorConfig) -> str:
    """The learning-rate key the advice names: cfg.lr_knob, else <section>.learning_rate."""
    return cfg.lr_knob or f"{_section(cfg)}.learning_rate"


class Fall(NamedTuple):
    start: float   # mean of the first k values
    recent: float  # mean of the last k values
    k: int


def _fall(xs: Sequence[float], window: int, avg_steps: int) -> Optional[Fall]:
    """The start and recent means of a series once it has `window` values (None before):
    k = `avg_steps`, at most half the values."""
    if len(xs) < window:
        return None
    k = max(1, min(avg_steps, len(xs) // 2))
    return Fall(_mean(xs[:k]), _mean(xs[-k:]), k)


def _rule_non_finite(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    what = non_finite(latest)
    return divergence_message(what, lr_knob(cfg), latest.get("lr")) if what else ""


def _rule_nan_metric(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    bad = [k for k, v in latest.items() if not math.isfinite(v) and not is_stop_metric(k)]
    if not bad:
        return ""
    names = ", ".join(f"{k}={latest[k]}" for k in bad[:4]) + (" ..." if len(bad) > 4 else "")
    return (f"non-finite metric(s) {names} (not a loss or gradient, so the run goes on): check the "
            f"reward or the held-out data behind them (a held-out check with no rows to judge is NaN)")


def _rule_clip_frac(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    xs = _values(history, POLICY_CLIP)
    if len(xs) < cfg.clip_frac_patience:
        return None
    recent = xs[-cfg.clip_frac_patience:]
    if min(recent) <= cfg.clip_frac_max:
        return ""
    return (f"policy clip fraction {recent[-1]:.2f} has been above {cfg.clip_frac_max} for "
            f"{len(recent)} steps: each update moves the policy too far from the one that "
            f"sampled the data. Lower {lr_knob(cfg)} (e.g. by 3-10x) or the update epochs")


def _rule_grad_norm(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    xs = _values(history, GRAD_NORM)
    if len(xs) < cfg.grad_norm_patience:
        return None
    ref = cfg.max_grad_norm or 1.0
    limit = cfg.grad_norm_factor * ref
    recent = xs[-cfg.grad_norm_patience:]
    if min(recent) <= limit:
        return ""
    return (f"pre-clip gradient norm {recent[-1]:.3g} has been over {cfg.grad_norm_factor:g}x "
            f"max_grad_norm ({ref:g}) for {len(recent)} steps: clipping hides it, but the "
            f"updates are unstable. Lower the learning rate; check the reward scale "
            f"(reward.score_clip, ppo.whiten_advantages) and the value loss")


class CriticFit(NamedTuple):
    explained: float  # mean explained variance over the judged steps
    logged: bool      # True: rollout/explained_variance; False: estimated from the value loss


def _critic_fit(history: History, steps: Sequence[int], cfg: DoctorConfig) -> Optional[CriticFit]:
    """The critic's mean explained variance over `steps`: the logged
    rollout/explained_variance where the run logs it, else (an older metrics file) the
    estimate 1 − 2 · loss/value / reward_std² of the steps whose rewards vary (see
    `DoctorConfig.value_ev_min`); None when neither can be had."""
    want = set(steps)
    logged = [v for s, v in history.get(EXPLAINED_VAR, []) if s in want]
    if logged:
        return CriticFit(_mean(logged), True)
    spread = {s: v * v for s, v in history.get(REWARD_STD, []) if s in want and v * v > cfg.reward_eps}
    estimated = [1.0 - 2.0 * loss / spread[s] for s, loss in history.get(VALUE_LOSS, []) if s in spread]
    return CriticFit(_mean(estimated), False) if estimated else None


def _fit_words(fit: Optional[CriticFit], cfg: DoctorConfig) -> str:
    """What the finding says about the critic's explained variance, and what that means."""
    if fit is None:
        return (f" (the run logs neither {EXPLAINED_VAR} nor {REWARD_STD}, so the loss is judged alone; "
                f"it also rises when the returns' variance does): the critic may not be learning the returns")
    how = ("" if fit.logged else
           f", estimated as 1 - 2 * loss/value / reward_std^2, since this run does not log {EXPLAINED_VAR}")
    return (f" and the critic explains none of the returns' variance (explained variance {fit.explained:+.2f} "
            f"over those steps, at most {cfg.value_ev_min:g}{how}): the critic predicts the returns no better "
            f"than a constant, so it adds nothing to the advantages")


def _rule_value_loss(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    pts = history.get(VALUE_LOSS, [])
    fall = _fall([v for _, v in pts], cfg.value_window, cfg.value_avg_steps)
    if fall is None:
        return None
    start, recent, k = fall
    if recent < cfg.value_drop * start:
        return ""
    fit = _critic_fit(history, [s for s, _ in pts[-k:]], cfg)
    if fit is not None and fit.explained > cfg.value_ev_min:
        return ""  # the loss follows the returns' variance, but the critic explains part of it
    return (f"value loss has not fallen in {len(pts)} steps (mean {recent:.3g} over the last "
            f"{k} steps vs {start:.3g} at the start){_fit_words(fit, cfg)}. Check ppo.vf_coeff (raise it), "
            f"ppo.critic_learning_rate, ppo.value_clip (loosen it), the reward scale, and that the value head "
            f"is saved/loaded")


def _rule_kl(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    xs = _values(history, KL_TO_REF)
    if len(xs) < cfg.kl_window:
        return None
    w = xs[-cfg.kl_window:]
    rising = _slope(w) > 0 and (w[0] <= 0 or w[-1] >= cfg.kl_growth * w[0])
    if not (rising and w[-1] > cfg.kl_max):
        return ""
    return (f"KL to the reference rose from {w[0]:.3g} to {w[-1]:.3g} over the last "
            f"{len(w)} steps and keeps rising: the policy is drifting from the reference, "
            f"often toward reward hacking. Raise {cfg.kl_knob} (e.g. 2x) or lower the learning rate")


def _rule_entropy(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    xs = _values(history, ENTROPY)
    k = cfg.entropy_avg_steps
    if len(xs) < k:
        return None
    start, recent = _mean(xs[:k]), _mean(xs[-k:])
    if recent < cfg.entropy_floor:
        why = f"below the floor of {cfg.entropy_floor} nats per token"
    elif len(xs) >= 2 * k and start > 0 and recent < start / cfg.entropy_drop_factor:
        why = f"more than {cfg.entropy_drop_factor:g}x below its start ({start:.3g})"
    else:
        return ""
    return (f"entropy collapsed to {recent:.3g} ({why}): the policy is nearly deterministic, "
            f"so rollouts stop exploring and samples within a prompt look alike. Raise "
            f"{cfg.kl_knob} or the entropy bonus, lower the learning rate, or check "
            f"generation.temperature")


def _rule_reward_constant(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    n = cfg.reward_patience
    stds = _values(history, REWARD_STD)
    spreads = _values(history, ZERO_SPREAD)
    if len(stds) < n and len(spreads) < max(1, min(n, cfg.zero_spread_min_steps)):
        return None
    if len(stds) >= n and max(abs(s) for s in stds[-n:]) <= cfg.reward_eps:
        means = _values(history, REWARD_MEAN)
        if means and abs(means[-1]) <= cfg.reward_eps:
            what = "every reward has been 0"
        elif means:
            what = f"every reward has been equal ({means[-1]:.3g})"
        else:
            what = "every reward has been equal (reward_std = 0)"
        cut = _values(history, "rollout/hit_limit_frac")
        cutoff = (f"; {cut[-1]:.0%} of responses hit max_new_tokens without EOS, so answers "
                  f"may be cut off" if cut and cut[-1] >= 0.5 else "")
        return (f"{what} for {n} steps: the advantages carry no signal{cutoff}. Read a few "
                f"samples (eval/step_N.jsonl, `rlhflab generate`) and check the reward "
                f"function, the answer format the checker expects, and max_new_tokens")
    if len(spreads) >= n and min(spreads[-n:]) >= cfg.zero_spread_max:
        return (f"{spreads[-1]:.0%} of groups had identical rewards for {n} steps: their "
                f"advantages are 0, so there is almost nothing to learn from. The prompts are "
                f"too easy or too hard; raise the group size or the temperature, or change the data")
    most = [x for x in spreads if x >= cfg.zero_spread_most]
    if len(spreads) >= cfg.zero_spread_min_steps and 2 * len(most) > len(spreads):
        return (f"in {len(most)} of {len(spreads)} steps at least {cfg.zero_spread_most:.0%} of groups had identical "
                f"rewards ({min(spreads):.0%}-{max(spreads):.0%} of them): their advantages are 0, so most samples "
                f"teach nothing. The prompts are too easy or too hard; raise the group size or the temperature, "
                f"or change the data")
    return ""


def _relative(delta: float, base: float) -> float:
    return delta / max(abs(base), 1e-6)


def _rule_reward_hacking(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    reward = dict(history.get(EVAL_REWARD, []))
    checks = sorted(k for k in history if k.startswith("eval/") and k != EVAL_REWARD)
    judged = False
    for key in checks:
        pts = [(s, v) for s, v in history[key] if s in reward]  # evaluations that have both
        if len(pts) < 2:
            continue
        judged = True
        best_step, best = max(pts, key=lambda sv: sv[1])  # the earliest best
        (first_step, _), (now_step, now) = pts[0], pts[-1]
        r_first, r_best, r_now = reward[first_step], reward[best_step], reward[now_step]
        fell = _relative(best - now, best) > cfg.hack_check_drop
        reward_up = _relative(r_now - r_first, r_first) > cfg.hack_reward_rise
        reward_held = _relative(r_best - r_now, r_best) <= cfg.hack_reward_rise
        if now_step > best_step and fell and reward_up and reward_held:
            return (f"the held-out check {key} fell from {best:.3g} at step {best_step} to {now:.3g} while the "
                    f"optimised reward ({EVAL_REWARD}) stayed up ({r_first:.3g} at step {first_step}, "
                    f"{r_best:.3g} at step {best_step}, {r_now:.3g} now): the policy is exploiting the reward, "
                    f"not doing the task (reward hacking). Read eval/step_{now_step}.jsonl; prefer the model "
                    f"of step {best_step}, raise {cfg.kl_knob}, or fix the reward")
    return "" if judged else None


def gap_baseline(gaps: Sequence[float], n: int = 3) -> float:
    """The median of the first `n` logprob gaps: the run's own level of sampler/trainer
    disagreement (kernels, dtype, top-k/top-p truncation), before anything went wrong."""
    first = sorted(gaps[:n])
    if not first:
        raise ValueError("gap_baseline needs at least one gap")
    mid = len(first) // 2
    return first[mid] if len(first) % 2 else (first[mid - 1] + first[mid]) / 2


def sync_gap_limit(baseline: float, factor: float, floor: float) -> float:
    """The largest healthy gap: above both `factor` x baseline and baseline + `floor`.
    The factor alone would trip on a float32 run's noise (3e-7 -> 9e-7), the floor alone
    would miss a jump of a bfloat16 run's larger gap."""
    return max(factor * baseline, baseline + floor)


def sync_gap_tripped(baseline: float, gap: float, factor: float, floor: float) -> bool:
    """True when `gap` is beyond `sync_gap_limit` (a NaN gap too: the log-probs broke)."""
    return not gap <= sync_gap_limit(baseline, factor, floor)


def _rule_logprob_gap(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    pts = history.get(LOGPROB_GAP, [])
    if len(pts) < 2:
        return None
    if history.get(VERSION_GAP) and history[VERSION_GAP][-1][1] > 0:
        # asynchronous rollouts: the gap is mostly the policy's move over the version gap;
        # every push is judged apart by the producer's probe canary (rollout/push_gap)
        return ""
    # The latest gap against the median of the first ones before it (as the canary judges).
    base = gap_baseline([v for _, v in pts[:-1]], cfg.gap_baseline_steps)
    limit = sync_gap_limit(base, cfg.gap_factor, cfg.gap_floor)
    step, gap = pts[-1]
    if gap <= limit:
        return ""
    i = len(pts) - 1
    while i > 0 and pts[i - 1][1] > limit:  # the first step of this stretch above the limit
        i -= 1
    (prev_step, prev) = pts[-2]
    if i < len(pts) - 1:
        how = f"has been above {limit:.3g} since step {pts[i][0]} and is {gap:.3g} at step {step}"
    elif gap > cfg.gap_factor * prev:  # one step multiplied it: typically the push before this rollout
        how = f"jumped from {prev:.3g} at step {prev_step} to {gap:.3g} at step {step}"
    else:
        how = f"rose across the run to {gap:.3g} at step {step}"
    return (f"{LOGPROB_GAP} {how}, beyond the limit {limit:.3g} set by its first steps ({base:.3g}): the "
            f"sampler no longer draws from the policy being trained. With generation.backend=vllm suspect "
            f"the weight sync first (a tensor not pushed, an engine asleep); with generation.vllm.sync_interval "
            f"> 1 part of the gap is the weights' staleness")


def _rule_stale_sampler(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    pts = history.get(IS_CAPPED, [])
    if not pts:  # a synchronous run (or no tis_cap): nothing to judge
        return None
    step, capped = pts[-1]
    if capped <= cfg.capped_frac_limit:
        return ""
    gaps = history.get(VERSION_GAP, [])
    gap = f" (episodes {gaps[-1][1]:g} versions old)" if gaps else ""
    return (f"{IS_CAPPED} is {capped:.2f} at step {step}{gap}, above {cfg.capped_frac_limit:g}: the sampler is so far "
            f"from the policy being trained that many importance weights hit tis_cap and the update is biased; "
            f"lower generation.max_staleness or the learning rate")


def _median(xs: Sequence[float]) -> float:
    ys = sorted(xs)
    mid = len(ys) // 2
    return ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2


def _rule_kl_fading(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    kl = history.get(APPROX_KL, [])
    if len(kl) < cfg.fade_window:
        return None
    w = kl[-cfg.fade_window:]
    steps = {s for s, _ in w}
    rewards = [v for s, v in history.get(REWARD_MEAN, []) if s in steps]
    stds = [v for s, v in history.get(REWARD_STD, []) if s in steps]
    k = max(1, min(cfg.fade_avg_steps, cfg.fade_window // 2))
    if len(rewards) < 2 * k or not stds:
        return None
    xs = [v for _, v in w]
    start, recent = _median(xs[:k]), _median(xs[-k:])
    if not (start > 0 and _slope(xs) < 0 and recent < start / cfg.fade_factor):
        return ""
    spread = _mean(stds)
    if spread <= cfg.reward_eps:
        return ""  # every reward equal: reward_constant's finding
    r0, r1 = _mean(rewards[:k]), _mean(rewards[-k:])
    if abs(r1 - r0) > cfg.fade_reward_move * spread:
        return ""  # the reward moved: the updates shrink because the policy got there
    lrs = [v for s, v in history.get("lr", []) if s in steps]
    if len(lrs) >= 2 and lrs[0] > 0 and lrs[-1] < 0.5 * lrs[0]:
        return ""  # the schedule shrinks the updates
    return (f"{APPROX_KL} fell from {start:.3g} to {recent:.3g} over the last {len(w)} steps while the reward "
            f"stayed at {r1:.3g} ({r1 - r0:+.3g}, against a spread of {spread:.3g} within a rollout): the "
            f"updates shrink toward nothing and nothing is learning. The KL penalty may outweigh the reward "
            f"(lower {cfg.kl_knob}, e.g. 3-10x, and watch params/kl_to_ref); else raise {lr_knob(cfg)} "
            f"or check that the reward can tell the responses apart")


def _rule_value_flat_early(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    pts = history.get(VALUE_LOSS, [])
    n = cfg.value_early_steps
    if len(pts) < n:
        return None
    if len(pts) >= cfg.value_window:
        return ""  # the value_loss rule judges from here on
    first = pts[:n]
    steps = {s for s, _ in first}
    stds = [v for s, v in history.get(REWARD_STD, []) if s in steps]
    if not stds or _mean(stds) <= cfg.reward_eps:
        return ""  # no spread in the rewards: nothing for the critic to learn (reward_constant)
    xs = [v for _, v in first]
    k = max(1, min(cfg.value_avg_early, n // 2))
    start, recent = _mean(xs[:k]), _mean(xs[-k:])
    if recent < cfg.value_drop * start:
        return ""
    fit = _critic_fit(history, [s for s, _ in first[-k:]], cfg)
    if fit is not None and fit.explained > cfg.value_ev_min:
        return ""  # the loss follows the returns' variance, but the critic explains part of it
    return (f"value loss has not fallen over the first {n} rollouts ({start:.3g} -> {recent:.3g}, means of "
            f"{k}) while the rewards vary (reward_std {_mean(stds):.3g}){_fit_words(fit, cfg)}. Check that "
            f"the value head trains (ppo.vf_coeff > 0, model.value_head_dropout), raise ppo.vf_coeff or "
            f"ppo.critic_learning_rate or loosen ppo.value_clip, and check the reward scale; the value_loss "
            f"rule judges again after {cfg.value_window} steps")


# ------------------------------------------------------------ SFT, reward model, DPO

def _rule_grad_norm_spike(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    # SFT and RM log the mean norm of a window of steps, which would dilute one spike; the
    # window's max is what a spike shows in.
    pts = history.get(GRAD_NORM_MAX) or history.get(GRAD_NORM, [])
    before = [v for _, v in pts[:-1]][-cfg.spike_history:]
    if len(before) < cfg.spike_min_history:
        return None
    step, now = pts[-1]
    median = sorted(before)[len(before) // 2]
    if now <= cfg.spike_factor * median:
        return ""
    return (f"pre-clip gradient norm {now:.3g} at step {step} is {now / max(median, 1e-12):.0f}x the median "
            f"({median:.3g}) of the {len(before)} logged before it: one batch pushed the weights hard. "
            f"If it recurs, lower {lr_knob(cfg)} or {_section(cfg)}.max_grad_norm, and look for "
            f"odd rows (very long or empty responses) in the data")


def _rule_loss_flat(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    xs = _values(history, TRAIN_LOSS)
    fall = _fall(xs, cfg.loss_window, cfg.loss_avg_steps)
    if fall is None:
        return None
    start, recent, k = fall
    if recent < cfg.loss_drop * start:
        return ""
    return (f"training loss has not fallen in {len(xs)} logged values (mean {recent:.3g} over the last "
            f"{k} vs {start:.3g} at the start): the model is not learning the data. Raise "
            f"{lr_knob(cfg)} (e.g. 3x), check that responses are not all masked or cut off "
            f"(data.max_seq_length), and that the rows are what you expect; a model that already "
            f"knows the data starts near its floor and can be left alone")


def _train_loss_key(history: History) -> Optional[str]:
    return next((k for k in (TRAIN_LOSS, "loss") if k in history), None)


def _rule_overfitting(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    evals = history.get(EVAL_LOSS, [])
    train_key = _train_loss_key(history)
    if len(evals) < cfg.overfit_patience + 1 or train_key is None:
        return None
    train = history[train_key]

    def train_at(step: int) -> float:  # the last training loss logged at or before `step`
        earlier = [v for s, v in train if s <= step]
        return earlier[-1] if earlier else train[0][1]

    best_step, best = min(evals, key=lambda sv: sv[1])  # the earliest best
    now_step, now = evals[-1]
    recent = evals[-cfg.overfit_patience:]
    rose = (len(recent) == cfg.overfit_patience and recent[0][0] > best_step
            and all(_relative(v - best, best) > cfg.overfit_rise for _, v in recent))
    train_fell = train_at(now_step) < train_at(best_step)
    if not (rose and train_fell):
        return ""
    sec = _section(cfg)
    stop = (f"lower {sec}.epochs (or {sec}.max_steps)" if cfg.method in ("sft", "rm", "dpo")
            else "train for fewer steps")
    return (f"held-out loss rose from {best:.3g} at step {best_step} to {now:.3g} at step {now_step} "
            f"({len(recent)} evaluations above {1 + cfg.overfit_rise:g}x its best) while the training loss fell ({train_at(best_step):.3g} -> {train_at(now_step):.3g}): "
            f"the model is memorising the training rows (overfitting). Prefer the model of step "
            f"{best_step}; {stop}, add data, or raise {sec}.weight_decay")


def _rule_accuracy_at_chance(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    key = DPO_ACCURACY if cfg.method == "dpo" else RM_ACCURACY
    xs = _values(history, key)
    if len(xs) < cfg.chance_min_values:
        return None
    recent = _mean(xs[-cfg.chance_window:])
    if recent > 0.5 + cfg.chance_band:
        return ""
    if cfg.method == "dpo":
        what = "implicit-reward accuracy"
        check = ("dpo.beta is not tiny, and that chosen and rejected differ within "
                 "dpo.max_response_length")
    else:
        what = "pairwise accuracy"
        check = ("chosen and rejected are not swapped, and that the texts differ within data.max_length "
                 "(they are cut from the left)")
    return (f"{key}: {what} {recent:.2f} over the last {min(cfg.chance_window, len(xs))} logged values, "
            f"after {len(xs)}: the model does not tell chosen from rejected (0.5 is chance). Raise "
            f"{lr_knob(cfg)}; check that {check}")


def _rule_margin_growth(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    key, limit = (DPO_MARGIN, cfg.dpo_margin_max) if cfg.method == "dpo" else (RM_GAP, cfg.rm_margin_max)
    xs = _values(history, key)
    if len(xs) < 2:
        return None
    if not (xs[-1] > limit and xs[-1] > xs[-2]):
        return ""
    if cfg.method == "dpo":
        fix = (f"raise dpo.beta or switch to the bounded IPO loss (dpo.loss_kind=ipo), lower "
               f"{lr_knob(cfg)}, or stop earlier")
    else:
        fix = (f"lower {lr_knob(cfg)} or rm.epochs (the model of an earlier evaluation may rank as "
               f"well); when PPO uses this model, set reward.score_clip")
    return (f"{key} is {xs[-1]:.3g} and still growing (above {limit:g}): the scores keep "
            f"moving apart after the pairs are already ranked, an over-confident model whose rewards "
            f"are easy to exploit. To stop it: {fix}")


def _multiturn_applies(history: History, key: str) -> Optional[str]:
    """None until an RL run has logged a step; "" (nothing to judge, healthy) for a
    single-turn run, which logs no episode/* metrics; else "check" (judge `key`)."""
    if key in history:
        return "check"
    return "" if history.get(REWARD_MEAN) else None


def _rule_max_turns(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    applies = _multiturn_applies(history, MAX_TURNS_FRAC)
    if applies != "check":
        return applies
    n = cfg.max_turns_patience
    fracs = _values(history, MAX_TURNS_FRAC)
    if len(fracs) < n:
        return None
    if min(fracs[-n:]) < cfg.max_turns_frac:
        return ""
    return (f"{fracs[-1]:.0%} of episodes stopped at env.max_turns for {n} steps: the environment never says "
            f"done for them, so their final answer is whatever the last turn said. Read a few episodes "
            f"(eval/step_N.jsonl), then make the task or the feedback clearer, or raise env.max_turns")


def _rule_tool_errors(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    applies = _multiturn_applies(history, TOOL_ERROR_RATE)
    if applies != "check":
        return applies
    k = cfg.tool_avg_steps
    rates = _values(history, TOOL_ERROR_RATE)
    if len(rates) < 2 * k:
        return None
    start, recent = _mean(rates[:k]), _mean(rates[-k:])
    if recent - start < cfg.tool_error_rise or recent < cfg.tool_error_min:
        return ""
    return (f"the tool-error rate rose from {start:.0%} to {recent:.0%} of calls: the policy is drifting away "
            f"from the call format (or calling tools with arguments they refuse). Read the tool messages in a few "
            f"episodes; lower {lr_knob(cfg)}, raise the KL weight ({cfg.kl_knob}), or start from a model that "
            f"follows env.tool_format")


def _rule_early_turns(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    applies = _multiturn_applies(history, EARLY_TURN_TOKENS)
    if applies != "check":
        return applies
    tokens = _values(history, EARLY_TURN_TOKENS)
    env_reward = _values(history, ENV_REWARD)
    fall = _fall(tokens, cfg.early_turn_window, cfg.early_turn_avg_steps)
    if fall is None:
        return None
    if any(abs(r) > 1e-12 for r in env_reward) or fall.recent >= cfg.early_turn_drop * fall.start:
        return ""
    return (f"only the final answer is rewarded and the turns before it shrank from {fall.start:.1f} to "
            f"{fall.recent:.1f} action tokens: the policy learns to skip the work of the earlier turns "
            f"(tool calls, guesses) that the environment answers. Reward the turns themselves (a per-turn reward "
            f"from step()), or raise the KL weight ({cfg.kl_knob})")


def _rule_logps_falling(history: History, latest: dict[str, float], cfg: DoctorConfig) -> Optional[str]:
    chosen, rejected = _values(history, DPO_CHOSEN), _values(history, DPO_REJECTED)
    k = cfg.logp_avg_steps
    if min(len(chosen), len(rejected)) < 2 * k:
        return None
    c0, c1 = _mean(chosen[:k]), _mean(chosen[-k:])
    r0, r1 = _mean(rejected[:k]), _mean(rejected[-k:])
    if not (c0 - c1 > cfg.logp_drop and r1 < r0):
        return ""
    return (f"the policy's log-prob of the chosen responses fell from {c0:.3g} to {c1:.3g} (rejected: "
            f"{r0:.3g} -> {r1:.3g}): DPO widens the gap by pushing both down, so probability moves "
            f"to responses in neither set. Raise dpo.beta, lower {lr_knob(cfg)}, or add the chosen "
            f"responses' NLL to the loss (dpo.sft_coeff, as RPO does)")


@dataclass(frozen=True)
class Rule:
    name: str
    severity: Severity
    metric: str             # what it reads, for the report
    healthy: str            # one line: what OK means
    check: Callable[[History, dict[str, float], DoctorConfig], Optional[str]] = field(repr=False)


NON_FINITE = Rule("non_finite", "stop", "every loss and gradient norm", "every loss and gradient norm is finite",
                  _rule_non_finite)
NAN_METRIC = Rule("nan_metric", "warn", "every other metric", "every other metric is finite", _rule_nan_metric)
GRAD_SPIKE = Rule("grad_norm_spike", "warn", f"{GRAD_NORM_MAX} (else {GRAD_NORM})", "no gradient norm far above the ones before it",
                  _rule_grad_norm_spike)
OVERFITTING = Rule("overfitting", "warn", f"{EVAL_LOSS} against the training loss",
                   "held-out loss does not rise while the training loss falls", _rule_overfitting)

# The RL methods (PPO, GRPO, RLOO, REINFORCE++, Dr. GRPO, TRPO).
RULES: tuple[Rule, ...] = (
    NON_FINITE, NAN_METRIC,
    Rule("policy_clip_frac", "warn", POLICY_CLIP, "policy clip fraction stays low", _rule_clip_frac),
    Rule("grad_norm", "warn", GRAD_NORM, "pre-clip gradient norm stays near max_grad_norm", _rule_grad_norm),
    Rule("value_loss", "warn", f"{VALUE_LOSS} against {EXPLAINED_VAR}",
         "value loss falls, or the critic explains part of the returns' variance", _rule_value_loss),
    Rule("kl_to_ref", "warn", KL_TO_REF, "KL to the reference stays bounded", _rule_kl),
    Rule("entropy", "warn", ENTROPY, "entropy stays above its floor", _rule_entropy),
    Rule("reward_constant", "warn", f"{REWARD_STD}, {ZERO_SPREAD}", "rewards vary", _rule_reward_constant),
    Rule("reward_hacking", "warn", f"{EVAL_REWARD} against eval/accuracy and eval.rewards",
         "held-out checks do not fall while the reward stays up", _rule_reward_hacking),
    Rule("logprob_gap", "warn", LOGPROB_GAP, "the sampler's log-probs stay as close to the trainer's as at the start",
         _rule_logprob_gap),
    Rule("stale_sampler", "warn", f"{IS_CAPPED} against {VERSION_GAP}",
         "few importance weights of a stale sampler reach tis_cap", _rule_stale_sampler),
    Rule("kl_fading", "warn", f"{APPROX_KL} against {REWARD_MEAN}",
         "the updates do not fade to nothing while the reward stands still", _rule_kl_fading),
    Rule("value_flat_early", "warn", f"{VALUE_LOSS} against {EXPLAINED_VAR} over the first rollouts",
         "value loss falls from the start, or the critic explains part of the returns' variance",
         _rule_value_flat_early),
    # Multi-turn episodes (healthy by definition in a single-turn run).
    Rule("max_turns", "warn", MAX_TURNS_FRAC, "most episodes end before env.max_turns", _rule_max_turns),
    Rule("tool_errors", "warn", TOOL_ERROR_RATE, "the tool-error rate does not rise", _rule_tool_errors),
    Rule("early_turns_collapse", "warn", f"{EARLY_TURN_TOKENS} against {ENV_REWARD}",
         "the turns before the last do not shrink to nothing when only the final answer is rewarded",
         _rule_early_turns),
)
RULE_SETS: dict[str, tuple[Rule, ...]] = {
    "rl": RULES,
    "sft": (NON_FINITE, NAN_METRIC, GRAD_SPIKE,
            Rule("loss_flat", "warn", TRAIN_LOSS, "training loss falls", _rule_loss_flat),
            OVERFITTING),
    "rm": (NON_FINITE, NAN_METRIC, GRAD_SPIKE,
           Rule("accuracy_at_chance", "warn", RM_ACCURACY, "pairwise accuracy above chance",
                _rule_accuracy_at_chance),
           Rule("margin_growth", "warn", RM_GAP, "held-out score gap stays bounded", _rule_margin_growth),
           OVERFITTING),
    "dpo": (NON_FINITE, NAN_METRIC, GRAD_SPIKE,
            Rule("accuracy_at_chance", "warn", DPO_ACCURACY, "implicit-reward accuracy above chance",
                 _rule_accuracy_at_chance),
            Rule("margin_growth", "warn", DPO_MARGIN, "reward margin stays bounded", _rule_margin_growth),
            Rule("logps_falling", "warn", f"{DPO_CHOSEN}, {DPO_REJECTED}",
                 "the chosen responses' log-prob does not collapse", _rule_logps_falling),
            OVERFITTING),
}


def _has_critic(history: History) -> bool:
    return VALUE_LOSS in history


def _multi_turn(history: History) -> bool:
    return any(k.startswith("episode/") for k in history) or TOOL_ERROR_RATE in history


# Rules that judge what only some runs have: a critic (value_loss on GRPO has nothing to
# read), multi-turn episodes (max_turns, tool_errors on a single-turn run).
NEEDS: dict[str, Callable[[History], bool]] = {
    "value_loss": _has_critic, "value_flat_early": _has_critic,
    "max_turns": _multi_turn, "tool_errors": _multi_turn, "early_turns_collapse": _multi_turn,
}


def applies(rule: Rule, history: History) -> bool:
    """Whether `rule` can judge this run: False for a rule whose metrics this kind of run
    never logs, once the run has logged a step (before that, every rule may apply)."""
    need = NEEDS.get(rule.name)
    return need is None or not history or need(history)


def rule_set_for(method: str) -> str:
    """The RULE_SETS key of a trainer's method: sft, rm and dpo have their own; every
    other method (ppo, grpo, rloo, reinforce_pp, dr_grpo, trpo, ...) uses "rl"."""
    return method if method in RULE_SETS else "rl"


RULE_NAMES = tuple(r.name for r in RULES)


def _as_float(v: Any) -> Optional[float]:
    """A metric value as a float; None for non-numbers (strings, lists, null, bools)."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v.strip().lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(v)
    try:  # numpy / torch scalars
        return float(v) if hasattr(v, "__float__") and getattr(v, "ndim", 0) == 0 else None
    except (TypeError, ValueError):
        return None


class Doctor:
    """Feed it one metrics dict per step; it returns the findings that are new.

    ``observe(step, metrics) -> list[Finding]``: a rule's finding is returned on the step
    it starts firing, then not again until the rule has cleared (gone back to healthy)
    and fires anew. `active` holds the rules firing now, `first_fired` the step each
    rule first fired, `findings` every finding returned so far.
    """

    def __init__(self, config: DoctorConfig | None = None, *, rules: Sequence[Rule] | None = None,
                 **thresholds: Any):
        # Doctor(max_grad_norm=0.5) is short for Doctor(DoctorConfig(max_grad_norm=0.5)).
        unknown = set(thresholds) - set(DoctorConfig.field_names())
        if unknown:
            raise TypeError(f"Doctor: unknown threshold(s) {sorted(unknown)}; "
                            f"known: {', '.join(DoctorConfig.field_names())}")
        self.config = dataclasses.replace(config or DoctorConfig(), **thresholds)
        self.rules = tuple(rules if rules is not None else RULE_SETS[rule_set_for(self.config.method)])
        self.history: History = {}
        self.active: dict[str, Finding] = {}
        self.first_fired: dict[str, int] = {}
        self.findings: list[Finding] = []
        self.state: dict[str, Optional[str]] = {r.name: None for r in self.rules}
        self.steps = 0
        self.last_step: Optional[int] = None

    def observe(self, step: int, metrics: dict[str, Any]) -> list[Finding]:
        latest: dict[str, float] = {}
        for key, raw in metrics.items():
            if key == "step":
                continue
            v = _as_float(raw)
            if v is not None:
                latest[key] = v
                if math.isfinite(v):  # a NaN is the non_finite rule's; other rules see finite values
                    self.history.setdefault(key, []).append((step, v))
        self.steps += 1
        self.last_step = step
        new: list[Finding] = []
        for rule in self.rules:
            msg = rule.check(self.history, latest, self.config)
            self.state[rule.name] = msg
            if msg:
                if rule.name not in self.active:
                    finding = Finding(rule.name, rule.severity, step, msg)
                    self.active[rule.name] = finding
                    self.first_fired.setdefault(rule.name, step)
                    self.findings.append(finding)
                    new.append(finding)
            elif msg == "":
                self.active.pop(rule.name, None)
        return new

    @property
    def should_stop(self) -> bool:
        """True while a "stop" finding is active."""
        return any(f.stop for f in self.active.values())


# --------------------------------------------------------------------------- the CLI

def _find_metrics(run_dir: str) -> Path:
    p = Path(run_dir)
    if p.is_file():
        return p
    if not p.exists():
        raise UserError(f"{p}: no such run folder; pass the training.output_dir of a run "
                        f"(the folder holding metrics.jsonl)")
    if not p.is_dir():
        raise UserError(f"{p}: not a folder or a metrics.jsonl file; pass a run's output folder")
    m = p / "metrics.jsonl"
    if not m.is_file():
        raise UserError(f"{m}: not found; is {p} a run's output folder? metrics.jsonl appears "
                        f"after the first training step")
    return m


def _effective_config(run_dir: Path) -> dict:
    """The run's effective_config.yaml as a dict ({} when it is missing or unreadable)."""
    cfg_path = run_dir / "effective_config.yaml"
    if not cfg_path.is_file():
        return {}
    try:
        import yaml

        data = yaml.safe_load(cfg_path.read_text(encoding="utf-8"))
    except Exception:
        return {}
    return data if isinstance(data, dict) else {}


def _max_grad_norm_from(config: dict, method: str) -> Optional[float]:
    """<method>.max_grad_norm (or any section's max_grad_norm) from the effective config."""
    sections = [config.get(method)] + list(config.values())
    for section in sections:
        if isinstance(section, dict) and "max_grad_norm" in section:
            v = section["max_grad_norm"]
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    return None


# The section only that method's config has; the RL methods are told apart by theirs.
_METHOD_SECTIONS = method_sections()  # the one registry of methods (rlhflab/config/methods.py)


def guess_method(config: dict, records: Sequence[dict[str, Any]]) -> str:
    """The run's method: the method section of its effective config, else from the metrics
    it logs (DPO's rewards/margins, the RM's train/accuracy, SFT's train/loss), else "rl"."""
    for name in _METHOD_SECTIONS:
        if isinstance(config.get(name), dict):
            return name
    keys = {k for row in records for k in row}
    for key, method in ((DPO_MARGIN, "dpo"), (RM_ACCURACY, "rm"), (TRAIN_LOSS, "sft")):
        if key in keys:
            return method
    return "rl"


PLOT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", (REWARD_MEAN, "eval/reward_mean", "eval/accuracy")),
    ("loss", (TRAIN_LOSS, "loss", EVAL_LOSS)),
    ("pairwise accuracy", (RM_ACCURACY, DPO_ACCURACY, "eval/rewards/accuracies")),
    ("margin", (RM_GAP, DPO_MARGIN)),
    ("sequence log-probs", (DPO_CHOSEN, DPO_REJECTED)),
    ("value loss", (VALUE_LOSS,)),
    ("critic: explained variance of the returns", (EXPLAINED_VAR,)),
    ("KL to reference (nats per response)", (KL_TO_REF,)),
    ("entropy (nats per token)", (ENTROPY,)),
    ("update size: clip fractions, approx KL", (POLICY_CLIP, "params/value_clip_frac", "params/approx_kl")),
    ("grad norm (pre-clip)", (GRAD_NORM, GRAD_NORM_MAX)),
    ("sampler vs trainer log-prob gap (nats per token)", (LOGPROB_GAP,)),
)
# the panel on which each rule's firing step is marked (non_finite: every panel)
RULE_PANEL = {"reward_constant": "reward", "reward_hacking": "reward", "value_loss": "value loss",
              "kl_to_ref": "KL to reference (nats per response)", "entropy": "entropy (nats per token)",
              "policy_clip_frac": "update size: clip fractions, approx KL",
              "grad_norm": "grad norm (pre-clip)", "grad_norm_spike": "grad norm (pre-clip)",
              "loss_flat": "loss", "overfitting": "loss", "accuracy_at_chance": "pairwise accuracy",
              "margin_growth": "margin", "logps_falling": "sequence log-probs",
              "logprob_gap": "sampler vs trainer log-prob gap (nats per token)",
              "kl_fading": "update size: clip fractions, approx KL", "value_flat_early": "value loss"}


def plot_trends(records: Sequence[dict[str, Any]], out: Path, findings: Sequence[Finding] = (),
                config: DoctorConfig | None = None, title: str = "") -> Optional[Path]:
    """Draw the key metrics (those present) in a grid, with the rule thresholds as dotted
    lines and the step each finding fired as a red mark. Returns the path, or None when
    no key metric is present."""
    cfg = config or DoctorConfig()
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in records:
        for key, raw in row.items():
            v = _as_float(raw)
            if key != "step" and v is not None:
                xs, ys = series.setdefault(key, ([], []))
                xs.append(int(row["step"]))
                ys.append(v if math.isfinite(v) else math.nan)  # a gap in the line
    # Held-out checks (eval.rewards' metrics) join the reward panel of an RL run.
    listed = {k for _, keys in PLOT_PANELS for k in keys}
    held_out = (sorted(k for k in series if k.startswith("eval/") and k not in listed)
                if EVAL_REWARD in series else [])
    panels = [(t, [k for k in (*keys, *(held_out if t == "reward" else ())) if k in series])
              for t, keys in PLOT_PANELS]
    panels = [(t, ks) for t, ks in panels if ks]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = 2 if len(panels) > 1 else 1
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 2.4 * nrows), sharex=True,
                             squeeze=False)
    thresholds = {POLICY_CLIP: cfg.clip_frac_max, KL_TO_REF: cfg.kl_max,
                  GRAD_NORM: cfg.grad_norm_factor * (cfg.max_grad_norm or 1.0),
                  ENTROPY: cfg.entropy_floor, EXPLAINED_VAR: cfg.value_ev_min}
    for ax, (panel_title, keys) in zip(axes.flat, panels):
        for key in keys:
            xs, ys = series[key]
            ax.plot(xs, ys, label=key, lw=1.2, marker="." if len(xs) < 30 else None)
            if key == REWARD_MEAN and REWARD_STD in series and len(series[REWARD_STD][0]) == len(xs):
                sd = series[REWARD_STD][1]
                ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)],
                                alpha=0.15, lw=0)
            if key in thresholds:
                ax.axhline(thresholds[key], color="grey", ls=":", lw=1)
        for key in (GRAD_NORM, LOGPROB_GAP):  # spans decades: 3e-7 healthy, 0.2 after a bad sync
            if key not in keys:
                continue
            ys = [y for y in series[key][1] if math.isfinite(y) and y > 0]
            if ys and max(ys) / min(ys) > 50:
                ax.set_yscale("log")
        for f in findings:
            if f.rule in ("non_finite", "nan_metric") or RULE_PANEL.get(f.rule) == panel_title:
                ax.axvline(f.step, color="tab:red", lw=1, alpha=0.6)
        ax.set_title(panel_title, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("step", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def diagnose(records: Sequence[dict[str, Any]], config: DoctorConfig | None = None) -> Doctor:
    """Replay a run's records through a fresh Doctor and return it."""
    doctor = Doctor(config)
    for row in records:
        doctor.observe(int(row["step"]), row)
    return doctor


def format_report(doctor: Doctor, source: str, n_records: int, notes: Sequence[str] = ()) -> str:
    """One line per rule: OK, n/a (not enough data), or WARN/STOP with the first step."""
    skipped = f" ({len(notes)} malformed or incomplete rows skipped)" if notes else ""
    lines = [f"doctor: {source}: {n_records} rows{skipped}, last step {doctor.last_step}, "
             f"{rule_set_for(doctor.config.method)} rules (method {doctor.config.method})"]
    shown = 5  # a file full of bad lines: the first few, then the count
    lines += [f"  note: {n}" for n in notes[:shown]]
    if len(notes) > shown:
        lines.append(f"  note: ... and {len(notes) - shown} more")
    rules = [r for r in doctor.rules if applies(r, doctor.history)]
    left_out = len(doctor.rules) - len(rules)
    if left_out:
        lines[0] += f" ({left_out} that cannot apply to this run left out)"
    width = max(len(r.name) for r in rules)
    for rule in rules:
        name = rule.name.ljust(width)
        if rule.name in doctor.first_fired:
            first = doctor.first_fired[rule.name]
            finding = doctor.active.get(rule.name) or next(
                f for f in reversed(doctor.findings) if f.rule == rule.name)
            now = "still firing" if rule.name in doctor.active else "cleared since"
            lines.append(f"  {rule.severity.upper():<4}  {name}  first at step {first} "
                         f"({now}): {finding.message}")
        elif doctor.state.get(rule.name) is None:
            lines.append(f"  n/a   {name}  not enough data ({rule.metric})")
        else:
            lines.append(f"  OK    {name}  {rule.healthy}")
    fired = [r for r in doctor.rules if r.name in doctor.first_fired]
    if not fired:
        lines.append("verdict: healthy (no rule fired)")
    else:
        stop = any(r.severity == "stop" for r in fired)
        lines.append(f"verdict: {len(fired)} rule(s) fired" + ("; the run should have stopped" if stop else ""))
    return "\n".join(lines)


def add_parser(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run's output folder (holding metrics.jsonl), or a metrics.jsonl file")
    parser.add_argument("--out", default=None,
                        help="where to write the trend plot (default: RUN_DIR/doctor.png)")
    parser.add_argument("--no-plot", action="store_true", help="print the report only")
    parser.add_argument("--method", default=None,
                        help="the run's method (sft, rm, dpo, ppo, grpo, ...), which picks the rules; "
                             "default: read from RUN_DIR/effective_config.yaml, else guessed from the metrics")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="change a threshold, e.g. --set clip_frac_max=0.4 (repeatable); "
                             f"keys: {', '.join(DoctorConfig.field_names())}")
    parser.epilog = ("Exit status: 0 when every rule is OK, 1 when any rule fired, "
                     "2 for a bad path or option.")


def _config_from(overrides: Sequence[str], max_grad_norm: Optional[float], method: str = "rl") -> DoctorConfig:
    cfg = DoctorConfig(method=method)
    if max_grad_norm is not None:
        cfg.max_grad_norm = max_grad_norm
    fields = {f.name: f for f in dataclasses.fields(DoctorConfig)}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            import difflib

            near = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {near[0]}?" if near else f"; keys: {', '.join(fields)}"
            raise UserError(f"--set {item!r}: expected KEY=VALUE with a known key{hint}")
        if key == "method":
            raise UserError(f"--set {item!r}: the rule set is chosen with --method {value.strip() or 'NAME'}")
        current = getattr(cfg, key)
        optional = key in ("max_grad_norm", "lr_knob")
        if optional and value.strip().lower() in ("none", "null"):
            setattr(cfg, key, None)
            continue
        kind = (str if isinstance(current, str) or key == "lr_knob"
                else int if isinstance(current, int) and key != "max_grad_norm" else float)
        try:
            setattr(cfg, key, kind(value))
        except ValueError:
            raise UserError(f"--set {item!r}: {value!r} is not a valid {kind.__name__}") from None
    return cfg


def run(args) -> int:
    metrics_path = _find_metrics(args.run_dir)
    run_dir = metrics_path.parent
    notes: list[str] = []
    records = read_metrics(metrics_path, notes)
    if not records:
        raise UserError(f"{metrics_path}: no complete step yet; wait for the first step to be "
                        f"logged, or check that this is a training run's metrics file")
    effective = _effective_config(run_dir)
    method = args.method or guess_method(effective, records)
    cfg = _config_from(args.overrides, _max_grad_norm_from(effective, method), method)
    doctor = diagnose(records, cfg)
    print(format_report(doctor, str(metrics_path), len(records), notes))
    if not args.no_plot:
        out = Path(args.out) if args.out else run_dir / "doctor.png"
        written = plot_trends(records, out, doctor.findings, cfg, title=str(run_dir))
        print(f"plot: {written}" if written else "plot: none of the key metrics is logged; no plot")
    return 1 if doctor.first_fired else 0
