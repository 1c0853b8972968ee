"""`rlhflab learn solution N`: the library's implementation of exercise N, with comments.

There is no separate solution file to drift from the code: this prints the source of
the functions in `rlhflab.ops` and the update engine that the grader compares against
(`inspect.getsource`), a commentary on how they map onto the exercise, and the thin
adapter (rlhflab/learn/reference.py) that gives them the exercise's signature.
"""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

from rlhflab import ops
from rlhflab.learn import reference
from rlhflab.learn.exercises import BY_NUMBER, doc_link
from rlhflab.engine import update

SOURCES = {
    1: (ops.ppo_policy_loss, ops.aggregate),
    2: (ops.value_loss,),
    3: (ops.entropy_from_logits, ops.entropy_loss),
    4: (ops.gae, ops.masked_whiten, ops.masked_mean, ops.masked_var),
    5: (update.minibatch_loss, update.loss_terms, update.update_group, update.policy_update),
}

ADAPTERS = {
    1: (reference.compute_policy_loss,),
    2: (reference.compute_value_loss,),
    3: (reference.compute_entropy_loss,),
    4: (reference.compute_gae_advantages, reference.whiten_advantages),
    5: (reference.ResponseModel.__call__, reference.minibatch_loss, reference.update_step),
}

COMMENTARY = {
    1: """\
The exercise is `ppo_policy_loss` with its defaults. Points to compare with yours:
- The ratio is exp(logprobs - old_logprobs): a difference of log-probs, never a quotient.
- The loss per token is max(-A*r, -A*clip(r)): the max of the two *negatives* is the min
  of the two objectives, the pessimistic one. With min you would keep the optimistic term
  and lose the clip's protection (docs/trpo_to_ppo.md, the four cases).
- clip_frac counts tokens where the clipped term is strictly larger as a loss, i.e. where
  the gradient is cut; a ratio past the clip that moved the wrong way is not counted.
- `aggregate` does the masking: sum(loss * mask) / sum(mask). Under gradient accumulation
  the trainer passes `normalizer` = the token count of the whole group (docs/batching.md).
- `clip_eps_high` (asymmetric clip) and `dual_clip` are extensions you did not need.""",
    2: """\
The exercise is `value_loss` with its defaults. Points to compare with yours:
- The clip is on the *change* of the value: V_clip = V_old + clip(V - V_old, -c, c),
  anchored at the rollout's values, not at the returns and not on V itself.
- max of the two squared errors, as the policy loss takes the pessimistic term: once V has
  moved past the clip towards the target, the clipped error is the larger and constant,
  so the gradient is 0.
- The 1/2 makes the gradient V - R. clip_range=None gives the plain regression.""",
    3: """\
The exercise is `entropy_from_logits` followed by `entropy_loss`.
- H = logsumexp(z) - sum_v p_v z_v is the same number as -sum_v p_v log p_v, written so that
  no log of a zero probability is ever taken; log_softmax works too. log(softmax(z)) does
  not: a probability that underflows to 0 gives 0 * -inf = nan.
- Logits are cast to float32 first (a bfloat16 model's logits are too coarse for it).
- The loss is -mean H over real tokens; `entropy` is the mean itself, detached, for logging.
- In the trainer the forward pass computes the entropy (B, T) and the PPOMath hook gets
  that; your version starts one step earlier, from the logits.""",
    4: """\
`gae` is exercise 4's first part; the trainer then calls `masked_whiten` (second part).
- Rewards and values are multiplied by the mask before the loop, and the running
  advantage is multiplied by the mask at every step, so nothing leaks from padding and
  extra right padding changes nothing.
- The loop runs in reverse over t, on whole (B,) columns; V_{t+1} starts at 0: the
  episode ends at the last real token.
- returns = advantages + values (masked), computed from the raw advantages: whitening
  happens afterwards, in the trainer (phase 4 of trainers/ppo.py), over real tokens only.
- `masked_whiten` uses the population variance (divide by n) and eps = 1e-8 inside the
  square root, and returns 0 on padding.""",
    5: """\
Exercise 5 is phase 5 of every policy method: the engine in engine/update.py, which
PPO, GRPO, RLOO and the rest share. Its `minibatch_loss` is your `minibatch_loss` (the
forward pass, then `loss_terms` puts the parts together); `update_group` (backward per
minibatch, clip, step, zero_grad once per accumulation group) is your `update_step`.
`policy_update` around them makes the groups and their normalizer, and steps the
learning-rate scheduler.
- The actor-critic's forward runs once over prompt+response and returns the response
  tokens' logprobs, values and entropy (your `model(mb)` returns the logits instead).
- Every loss of a minibatch is divided by `normalizer`, the real-token count of the whole
  accumulation group, which is the same as your "minibatch mean times its share of the
  group's tokens": accumulation 1x8 equals 8x1 exactly (docs/batching.md).
- `clip_grad_norm_` returns the norm before clipping; that is what is logged.
- The entropy is computed without a graph when entropy_coeff is 0 (memory).""",
}


def _source(obj) -> str:
    fn = inspect.unwrap(obj)
    try:
        path = Path(inspect.getsourcefile(fn) or "?")
        line = inspect.getsourcelines(fn)[1]
        where = f"{_short(path)}:{line}"
    except (OSError, TypeError):  # pragma: no cover - only when sources are not installed
        where = "?"
    return f"# ---- {fn.__qualname__}  ({where})\n{textwrap.dedent(inspect.getsource(fn))}"


def _short(path: Path) -> str:
    parts = path.resolve().parts
    return "/".join(parts[parts.index("rlhflab"):]) if "rlhflab" in parts else str(path)


def solution_text(number: int) -> str:
    ex = BY_NUMBER[number]
    rule = "=" * 88
    out = [rule, f"Exercise {number}: {ex.title}  ({', '.join(ex.functions)} in {ex.filename})", rule, "",
           COMMENTARY[number], "",
           "Read: " + ", ".join(doc_link(p) for p in ex.docs), "",
           "The library's code (what `rlhflab learn check` compares yours with):", ""]
    out += [_source(f) for f in SOURCES[number]]
    out += ["", "The adapter that gives it your exercise's signature (rlhflab/learn/reference.py):", ""]
    out += [_source(f) for f in ADAPTERS[number]]
    return "\n".join(out).rstrip() + "\n"
