"""The checks of `rlhflab learn check`, and the diagnosis of each failure.

A check calls one of the learner's functions on one case (rlhflab/learn/cases.py),
compares the result with the reference (rlhflab/learn/reference.py, i.e. the library's
own `rlhflab.ops` and PPO trainer) and, when they differ, says *what* differs and
*why*: it recomputes the result the way a common mistake would (padding counted, the
min of the surrogate missing, GAE run forwards, ...) and names the mistake whose result
matches the learner's. Each finding carries a hint and the page of docs/ to read.

The replays of mistakes below are the grader's diagnostics, not solutions: every one
of them is wrong on purpose.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from rlhflab import ops
from rlhflab.learn import cases, reference
from rlhflab.learn.exercises import BY_NUMBER, doc_link

RTOL, ATOL = 1e-4, 1e-5


class CheckFinding(NamedTuple):
    """What a failed learner-mode check found in the learner's code (not to be confused
    with `rlhflab.doctor.Finding`, a metric-health rule firing during training)."""

    what: str            # what differs, with numbers
    diagnosis: str = ""  # the mistake that explains it, when one is recognised
    hint: str = ""       # what to do
    docs: str = ""       # docs/<page> to read


class CheckFailed(AssertionError):
    """A check's verdict on the learner's code; the grader reports it as a failure."""

    def __init__(self, what: str, diagnosis: str = "", hint: str = "", docs: str = ""):
        self.finding = CheckFinding(what, diagnosis, hint, docs)
        super().__init__("\n".join(x for x in (what, diagnosis and f"diagnosis: {diagnosis}",
                                              hint and f"hint: {hint}", docs and f"read: {docs}") if x))


class Mistake(NamedTuple):
    value: Any        # what the mistaken code would return on this case
    diagnosis: str
    hint: str
    docs: str = ""


@dataclass(frozen=True)
class Check:
    exercise: int
    name: str
    function: str                  # the learner's function it grades
    run: Callable[[Any], None]     # run(workspace) raises CheckFailed or returns

    @property
    def id(self) -> str:
        slug = "".join(ch if ch.isalnum() else "-" for ch in self.name.lower()).strip("-")
        while "--" in slug:
            slug = slug.replace("--", "-")
        return f"ex{self.exercise}-{slug}"


def _docs(exercise: int, i: int = 0) -> str:
    pages = BY_NUMBER[exercise].docs
    return doc_link(pages[min(i, len(pages) - 1)])


MASK_DOC = doc_link("tokens_and_masks.md#masking")
MASK_HINT = ("multiply by response_mask and divide by response_mask.sum() (the number of real "
             "tokens in the whole batch); padding positions hold junk on purpose")


# --------------------------------------------------------------------------------------
# Calling the learner and reading what comes back
# --------------------------------------------------------------------------------------
def learner_function(workspace, exercise: int, name: str) -> Callable:
    """The learner's function, or a CheckFailed saying why it cannot be had."""
    ex = BY_NUMBER[exercise]
    err = workspace.errors.get(exercise)
    if err:
        raise CheckFailed(f"{ex.filename} could not be imported: {err}",
                          hint="fix the error above; `python " + ex.filename + "` shows it with a traceback",
                          docs=_docs(exercise))
    fn = getattr(workspace.modules[exercise], name, None)
    if not callable(fn):
        raise CheckFailed(f"{ex.filename} has no function {name}()",
                          hint=f"keep the name and signature of the stub ({name})", docs=_docs(exercise))
    return fn


def _where(exc: BaseException, workspace_dir: Path | None) -> str:
    """` (ex1_policy_loss.py, line 12: ratio = ...)` for the deepest frame in the workspace."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if workspace_dir is not None
            and Path(f.filename).resolve().parent == workspace_dir.resolve()]
    if not mine:
        return ""
    f = mine[-1]
    return f" ({Path(f.filename).name}, line {f.lineno}: {(f.line or '').strip()})"


def call(workspace, exercise: int, fn: Callable, *args, error_hint: str = "", **kwargs):
    """Call a learner function, turning a stub or an exception into a CheckFailed."""
    ex = BY_NUMBER[exercise]
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise CheckFailed(
            f"{fn.__name__}() is still the stub: it raises NotImplementedError",
            hint=f"fill the gap between the '# ==== YOUR CODE' lines in {ex.filename}: {ex.stub_hint}; "
                 "the file's docstring states the contract",
            docs=_docs(exercise)) from None
    except CheckFailed:
        raise
    except Exception as exc:  # the learner's bug: say what and where, not a grader traceback
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        hint = error_hint or ("check the shapes: every (B, T) input has the same shape, logits are "
                              "(B, T, V); print .shape of your intermediate tensors")
        raise CheckFailed(f"{fn.__name__}() raised {type(exc).__name__}: {msg}"
                          f"{_where(exc, getattr(workspace, 'path', None))}",
                          hint=hint, docs=_docs(exercise)) from None


def unpack(result, fields: tuple[str, ...], fn_name: str, type_name: str) -> tuple:
    """The fields of a NamedTuple / tuple result, by name when it has names."""
    want = f"{type_name}({', '.join(fields)})"
    if hasattr(result, "_fields") and all(hasattr(result, f) for f in fields):
        return tuple(getattr(result, f) for f in fields)
    if isinstance(result, (tuple, list)):
        if len(result) != len(fields):
            raise CheckFailed(f"{fn_name}() returned {len(result)} values; expected {len(fields)}: {want}",
                              hint=f"return {want}; the NamedTuple is defined at the top of the file")
        return tuple(result)
    raise CheckFailed(f"{fn_name}() returned a {type(result).__name__}; expected {want}",
                      hint=f"return {want}; the NamedTuple is defined at the top of the file")


def scalar(x, what: str, b: int, t: int, exercise: int) -> Tensor:
    """A 0-dim float64 tensor from the learner's scalar, or a finding about its shape."""
    if not isinstance(x, Tensor):
        if isinstance(x, (int, float)):
            return torch.tensor(float(x), dtype=torch.float64)
        raise CheckFailed(f"{what} is a {type(x).__name__}; expected a 0-dim tensor",
                          docs=_docs(exercise))
    if x.numel() != 1:
        shape = tuple(x.shape)
        if shape == (b, t):
            hint = "reduce it to one number: the mean over real response tokens, " + MASK_HINT
        elif shape == (b,):
            hint = ("it looks reduced over T only; reduce over the batch too: one token mean over "
                    "every real token of the batch")
        else:
            hint = "a silent broadcast? every (B, T) input must line up element by element"
        raise CheckFailed(f"{what} has shape {shape}; expected a scalar (0-dim tensor)",
                          diagnosis="the result was not reduced to one number" if shape in ((b, t), (b,)) else "",
                          hint=hint, docs=MASK_DOC)
    return x.detach().reshape(()).double()


def _close(got: Tensor, want: Tensor) -> bool:
    got, want = got.detach().double(), want.detach().double()
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=RTOL, atol=ATOL))


def _fmt(x: Tensor) -> str:
    return f"{float(x):.6g}"


def _describe_tensor_diff(what: str, got: Tensor, want: Tensor, mask: Tensor | None) -> tuple[str, str, str]:
    """(what differs, a diagnosis from where it differs, a hint) for two (B, T) tensors."""
    got, want = got.detach().double(), want.detach().double()
    bad = ~torch.isclose(got, want, rtol=RTOL, atol=ATOL)           # (B, T)
    idx = tuple(int(i) for i in bad.nonzero()[0])
    where = "[" + ", ".join(map(str, idx)) + "]"
    text = (f"{what}: {int(bad.sum())} of {bad.numel()} entries differ; first at {where}: "
            f"expected {_fmt(want[idx])}, got {_fmt(got[idx])}")
    if mask is None or mask.shape != bad.shape:
        return text, "", ""
    real = mask.bool()
    if not (bad & real).any():
        return (text, "the real positions are right, but the padding positions are not 0",
                "multiply the result by response_mask so padding comes back as 0")
    if real.dim() != 2:
        return text, "", ""
    last = torch.zeros_like(real)
    lengths = real.long().sum(-1)
    for row, n in enumerate(lengths.tolist()):
        if n:
            last[row, n - 1] = True
    if not (bad & real & ~last).any():
        return (text, "only the last real token of each row differs: the end of the episode is "
                      "handled wrongly", "past the last real token V is 0 and nothing is bootstrapped")
    return text, "", ""


def compare(what: str, got, want: Tensor, mistakes: list[Mistake], hint: str, docs: str,
            mask: Tensor | None = None, nonfinite: tuple[str, str] | None = None) -> None:
    """Raise a CheckFailed naming the matching mistake when `got` differs from `want`."""
    got_t = got.detach() if isinstance(got, Tensor) else torch.as_tensor(got)
    if got_t.shape != want.shape:
        raise CheckFailed(f"{what} has shape {tuple(got_t.shape)}; expected {tuple(want.shape)}",
                          hint="check for a silent broadcast or a reduction over the wrong dim; "
                               "never squeeze() without a dim", docs=docs)
    if _close(got_t, want):
        return
    if not torch.isfinite(got_t.double()).all():
        diag, h = nonfinite or ("", "")
        raise CheckFailed(f"{what} is not finite (nan or inf) where the reference is "
                          f"{_fmt(want) if want.numel() == 1 else 'finite'}",
                          diagnosis=diag, hint=h or hint, docs=docs)
    for m in mistakes:
        value = torch.as_tensor(m.value).detach()
        if value.shape == want.shape and not _close(value, want) and _close(got_t, value):
            raise CheckFailed(_diff_text(what, got_t, want, mask)[0], diagnosis=m.diagnosis,
                              hint=m.hint, docs=m.docs or docs)
    text, diag, h = _diff_text(what, got_t, want, mask)
    raise CheckFailed(text, diagnosis=diag, hint=h or hint, docs=docs)


def _diff_text(what: str, got: Tensor, want: Tensor, mask: Tensor | None) -> tuple[str, str, str]:
    if want.numel() == 1:
        return f"{what}: expected {_fmt(want)}, got {_fmt(got)}", "", ""
    return _describe_tensor_diff(what, got, want, mask)


def _grads_of(x: Tensor) -> Tensor:
    return x.grad if x.grad is not None else torch.zeros_like(x)


def compare_grad(what: str, leaf: Tensor, loss, want_grad: Tensor, mask: Tensor, docs: str) -> None:
    """Backward through the learner's loss and compare the gradient at `leaf`."""
    if not isinstance(loss, Tensor) or not loss.requires_grad:
        raise CheckFailed(f"the loss carries no gradient to {what}",
                          diagnosis="the computation graph is cut somewhere",
                          hint="build the loss from the inputs with torch operations only: no .item(), "
                               ".detach(), .numpy(), float() or torch.no_grad() on the way",
                          docs=docs)
    loss.reshape(()).backward()
    compare(f"gradient of the loss w.r.t. {what}", _grads_of(leaf), want_grad, [],
            "the value is right but its gradient is not: is part of it computed from detached "
            "tensors, or does padding get gradient?", docs, mask=mask)


def _pair(case: dict, keys: tuple[str, ...]) -> list[Tensor]:
    return [case[k].clone() for k in keys]


# --------------------------------------------------------------------------------------
# Exercise 1: policy loss
# --------------------------------------------------------------------------------------
POLICY_KEYS = ("logprobs", "old_logprobs", "advantages", "response_mask")


def _policy_mistakes(c: dict) -> tuple[list[Mistake], list[Mistake]]:
    """(mistakes of the loss, mistakes of clip_frac) on case `c`."""
    lp, old, adv, mask, eps = c["logprobs"], c["old_logprobs"], c["advantages"], c["response_mask"], c["clip_eps"]
    b, t = mask.shape
    ref = lambda **kw: ops.ppo_policy_loss(**{**dict(logprobs=lp, old_logprobs=old, advantages=adv,  # noqa: E731
                                                     response_mask=mask, clip_eps=eps), **kw})
    ratio = torch.exp(lp - old)
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)
    tm = lambda x: ops.aggregate(x, mask)  # noqa: E731 - the token mean over real tokens
    d, d_mask = _docs(1), MASK_DOC
    lr = lp - old  # a "ratio" without its exp
    loss = [
        Mistake(-ref().loss, "the sign is flipped: this is the mean objective, not the loss",
                "the optimiser minimises; return minus the mean objective, i.e. max(-A*r, -A*clip(r)) per token", d),
        Mistake(tm(torch.minimum(unclipped, clipped)),
                "min and max are swapped: clipping on the wrong side (this keeps the optimistic term)",
                "the objective is min(r*A, clip(r)*A); as a loss (its negative) that is max(-r*A, -clip(r)*A)", d),
        Mistake(tm(clipped), "the min with the unclipped surrogate is missing: only the clipped term is used",
                "without the min, a token whose ratio moved the wrong way past the clip gets no gradient to "
                "pull it back; take min(r*A, clip(r)*A) per token", d),
        Mistake(tm(unclipped), "there is no clipping at all: this is the plain surrogate -r*A",
                "clip the ratio to [1 - clip_eps, 1 + clip_eps] and keep the pessimistic of the two terms", d),
        Mistake(ref(logprobs=old, old_logprobs=lp).loss, "the ratio is inverted: exp(old_logprobs - logprobs)",
                "r = pi / pi_old = exp(logprobs - old_logprobs)", d),
        Mistake(tm(torch.maximum(-adv * lr, -adv * lr.clamp(1 - eps, 1 + eps))),
                "the ratio is missing its exp: logprobs - old_logprobs is the log of the ratio",
                "r = exp(logprobs - old_logprobs)", d),
        Mistake(ref(response_mask=torch.ones_like(mask)).loss,
                "padding leaks in: this is the mean over every position, padding included", MASK_HINT, d_mask),
        Mistake(ref(normalizer=float(b * t)).loss,
                "padding is zeroed but still counted: the sum was divided by B*T", MASK_HINT, d_mask),
        Mistake(ref(aggregation="seq_mean").loss,
                "averaged per sequence first, then over sequences",
                "the contract is one token mean over the whole batch: sum(loss_t * mask_t) / sum(mask_t)",
                doc_link("batching.md#exact-gradient-accumulation")),
    ]
    real = mask.bool()
    outside = ((ratio - 1).abs() > eps).double()
    frac = [
        Mistake(ops.masked_mean(outside, mask),
                "clip_frac counts the ratios outside [1 - eps, 1 + eps]",
                "count only the tokens where the clipped term is the one taken (clip(r)*A strictly smaller "
                "than r*A, i.e. -A*clip(r) > -A*r): there the gradient is 0. A ratio beyond the clip that "
                "moved the wrong way is not clipped", d),
        Mistake(((clipped > unclipped).double()).mean(),
                "clip_frac counts padding positions too", MASK_HINT, d_mask),
        Mistake(ops.masked_mean((clipped >= unclipped).double(), mask),
                "clip_frac counts ties: every token inside the clip has clipped == unclipped",
                "count tokens where the clipped term is strictly the one taken (>, not >=)", d),
        Mistake(((clipped > unclipped) & real).double().sum(),
                "clip_frac is a count, not a fraction", "divide by the number of real tokens", d),
    ]
    return loss, frac


def _run_policy(ws, c: dict):
    fn = learner_function(ws, 1, "compute_policy_loss")
    lp, old, adv, mask = _pair(c, POLICY_KEYS)
    lp.requires_grad_(True)
    res = call(ws, 1, fn, lp, old, adv, mask, c["clip_eps"])
    loss, clip_frac = unpack(res, ("loss", "clip_frac"), "compute_policy_loss", "PolicyLoss")
    return lp, loss, clip_frac


def _check_policy_values(ws, c: dict, with_clip_frac: bool = True, extra: list[Mistake] = ()) -> None:
    b, t = c["response_mask"].shape
    _, loss, clip_frac = _run_policy(ws, c)
    want = ops.ppo_policy_loss(*(c[k] for k in POLICY_KEYS), clip_eps=c["clip_eps"])
    loss_m, frac_m = _policy_mistakes(c)
    compare("loss", scalar(loss, "loss", b, t, 1), want.loss.double(), [*extra, *loss_m],
            "compare with the contract in the docstring, token by token", _docs(1))
    if with_clip_frac:
        compare("clip_frac", scalar(clip_frac, "clip_frac", b, t, 1), want.clip_frac.double(), frac_m,
                "clip_frac is the fraction of real tokens where the clipped term is the one taken", _docs(1))


def check_policy_hand(ws) -> None:
    _check_policy_values(ws, cases.policy_hand())


def check_policy_random(ws) -> None:
    _check_policy_values(ws, cases.policy_random())


def check_policy_clip_eps(ws) -> None:
    c = cases.policy_random(seed=11, clip_eps=0.1)
    hard = ops.ppo_policy_loss(*(c[k] for k in POLICY_KEYS), clip_eps=0.2).loss
    _check_policy_values(ws, c, with_clip_frac=False, extra=[
        Mistake(hard, "clip_eps is ignored: the clip looks hard-coded to 0.2",
                "use the clip_eps argument", _docs(1))])


def check_policy_grad(ws) -> None:
    c = cases.policy_random(seed=12)
    lp, loss, _ = _run_policy(ws, c)
    ref_lp = c["logprobs"].clone().requires_grad_(True)
    want = ops.ppo_policy_loss(ref_lp, *(c[k] for k in POLICY_KEYS[1:]), clip_eps=c["clip_eps"]).loss
    b, t = lp.shape
    compare("loss", scalar(loss, "loss", b, t, 1), want.detach().double(), _policy_mistakes(c)[0],
            "compare with the contract in the docstring, token by token", _docs(1))
    want.backward()
    compare_grad("logprobs", lp, loss, ref_lp.grad, c["response_mask"], _docs(1))


# --------------------------------------------------------------------------------------
# Exercise 2: value loss
# --------------------------------------------------------------------------------------
VALUE_KEYS = ("values", "old_values", "returns", "response_mask")


def _value_mistakes(c: dict) -> tuple[list[Mistake], list[Mistake]]:
    v, old, ret, mask, clip = c["values"], c["old_values"], c["returns"], c["response_mask"], c["clip_range"]
    b, t = mask.shape
    ref = lambda **kw: ops.value_loss(**{**dict(values=v, old_values=old, returns=ret,  # noqa: E731
                                                response_mask=mask, clip_range=clip), **kw})
    tm = lambda x: ops.aggregate(x, mask)  # noqa: E731
    d, d_mask = _docs(2), MASK_DOC
    loss = [
        Mistake(2 * ref().loss, "the 1/2 is missing", "loss = 1/2 * mean of the larger squared error", d),
        Mistake(ref(response_mask=torch.ones_like(mask)).loss,
                "padding leaks in: this is the mean over every position, padding included", MASK_HINT, d_mask),
        Mistake(ref(normalizer=float(b * t)).loss,
                "padding is zeroed but still counted: the sum was divided by B*T", MASK_HINT, d_mask),
        Mistake(ref(aggregation="seq_mean").loss, "averaged per sequence first, then over sequences",
                "the contract is one token mean over the whole batch: sum(x_t * mask_t) / sum(mask_t)", d),
    ]
    if clip is not None:
        unclipped = (v - ret).square()
        v_clip = old + (v - old).clamp(-clip, clip)
        clipped = (v_clip - ret).square()
        around_ret = (ret + (v - ret).clamp(-clip, clip) - ret).square()
        loss += [
            Mistake(ref(clip_range=None).loss, "the value clip is missing: this is 1/2 * mean (V - R)^2",
                    "V_clip = old_values + clip(values - old_values, -c, c); take the max of (V - R)^2 and "
                    "(V_clip - R)^2 per token", d),
            Mistake(0.5 * tm(torch.minimum(unclipped, clipped)),
                    "min instead of max: clipping on the wrong side (this keeps the smaller error)",
                    "take the max of the two squared errors: the pessimistic one, as for the policy", d),
            Mistake(0.5 * tm(clipped), "only the clipped error: the max with the unclipped error is missing",
                    "loss_t = max((V - R)^2, (V_clip - R)^2)", d),
            Mistake(0.5 * tm(torch.maximum(unclipped, around_ret)),
                    "the value is clipped around the returns instead of around old_values",
                    "V_clip = old_values + clip(values - old_values, -c, c)", d),
            Mistake(0.5 * tm(torch.maximum(unclipped, (v.clamp(-clip, clip) - ret).square())),
                    "the value itself is clipped to [-c, c] instead of its change from old_values",
                    "V_clip = old_values + clip(values - old_values, -c, c)", d),
        ]
        frac = [
            Mistake(ops.masked_mean(((v - old).abs() > clip).double(), mask),
                    "clip_frac counts the values that moved more than c",
                    "count the tokens where the clipped squared error is strictly the larger one", d),
            Mistake(((clipped > unclipped).double()).mean(), "clip_frac counts padding positions too",
                    MASK_HINT, d_mask),
            Mistake(ops.masked_mean((clipped >= unclipped).double(), mask),
                    "clip_frac counts ties (>= instead of >)",
                    "count the tokens where the clipped error is strictly the larger one", d),
        ]
    else:
        frac = []
    return loss, frac


def _run_value(ws, c: dict, error_hint: str = ""):
    fn = learner_function(ws, 2, "compute_value_loss")
    v, old, ret, mask = _pair(c, VALUE_KEYS)
    v.requires_grad_(True)
    res = call(ws, 2, fn, v, old, ret, mask, c["clip_range"], error_hint=error_hint)
    loss, clip_frac = unpack(res, ("loss", "clip_frac"), "compute_value_loss", "ValueLoss")
    return v, loss, clip_frac


def _check_value_values(ws, c: dict, error_hint: str = "") -> None:
    b, t = c["response_mask"].shape
    _, loss, clip_frac = _run_value(ws, c, error_hint)
    want = ops.value_loss(*(c[k] for k in VALUE_KEYS), clip_range=c["clip_range"])
    loss_m, frac_m = _value_mistakes(c)
    compare("loss", scalar(loss, "loss", b, t, 2), want.loss.double(), loss_m,
            "compare with the contract in the docstring, token by token", _docs(2))
    compare("clip_frac", scalar(clip_frac, "clip_frac", b, t, 2), want.clip_frac.double(), frac_m,
            "clip_frac is the fraction of real tokens where the clipped error is strictly the larger", _docs(2))


def check_value_hand(ws) -> None:
    _check_value_values(ws, cases.value_hand())


def check_value_random(ws) -> None:
    _check_value_values(ws, cases.value_random())


def check_value_no_clip(ws) -> None:
    _check_value_values(ws, cases.value_random(seed=21, clip_range=None),
                        error_hint="clip_range=None means no value clipping: the loss is 1/2 * mean (V - R)^2 "
                                   "and clip_frac is 0")


def check_value_grad(ws) -> None:
    c = cases.value_random(seed=22)
    v, loss, _ = _run_value(ws, c)
    ref_v = c["values"].clone().requires_grad_(True)
    want = ops.value_loss(ref_v, *(c[k] for k in VALUE_KEYS[1:]), clip_range=c["clip_range"]).loss
    b, t = v.shape
    compare("loss", scalar(loss, "loss", b, t, 2), want.detach().double(), _value_mistakes(c)[0],
            "compare with the contract in the docstring, token by token", _docs(2))
    want.backward()
    compare_grad("values", v, loss, ref_v.grad, c["response_mask"], _docs(2))


# --------------------------------------------------------------------------------------
# Exercise 3: entropy loss
# --------------------------------------------------------------------------------------
NONFINITE_ENTROPY = ("log(softmax(logits)) underflows: a probability of exactly 0 gives log 0 = -inf, "
                     "and 0 * -inf = nan",
                     "take log p = torch.log_softmax(logits, dim=-1) and p = its exp (or softmax); "
                     "p * log p is then 0 where p underflows")


def _entropy_mistakes(c: dict) -> tuple[list[Mistake], list[Mistake]]:
    logits, mask = c["logits"], c["response_mask"]
    b, t, v = logits.shape
    h = ops.entropy_from_logits(logits)                                            # (B, T)
    mean_h = ops.masked_mean(h, mask)
    d, d_mask = _docs(3), MASK_DOC
    leaks = [
        (h.mean(), "padding leaks in: this is the mean over every position, padding included"),
        (ops.masked_sum(h, mask) / (b * t), "padding is zeroed but still counted: the sum was divided by B*T"),
        (ops.aggregate(h, mask, "seq_mean"), "averaged per sequence first, then over sequences"),
    ]
    loss = [Mistake(mean_h, "the sign is flipped: the loss is minus the mean entropy",
                    "return loss = -entropy, so that minimising the loss raises the entropy", d),
            Mistake(-mean_h / v, "the entropy is averaged over the vocabulary instead of summed",
                    "H_t = -sum over v of p_v * log p_v: a sum over the last dim", d),
            Mistake(-mean_h / math.log(2.0), "the entropy is in bits (log2); the contract is nats",
                    "use the natural log (torch.log_softmax)", d)]
    loss += [Mistake(-x, diag, MASK_HINT, d_mask) for x, diag in leaks]
    ent = [Mistake(-mean_h, "`entropy` holds minus the entropy (the loss): it should be the mean "
                   "entropy itself, a positive number", "return EntropyLoss(loss=-H, entropy=H)", d),
           Mistake(mean_h / v, "the entropy is averaged over the vocabulary instead of summed",
                   "H_t = -sum over v of p_v * log p_v: a sum over the last dim", d)]
    ent += [Mistake(x, diag, MASK_HINT, d_mask) for x, diag in leaks]
    return loss, ent


def _run_entropy(ws, c: dict):
    fn = learner_function(ws, 3, "compute_entropy_loss")
    logits, mask = c["logits"].clone().requires_grad_(True), c["response_mask"].clone()
    res = call(ws, 3, fn, logits, mask)
    loss, entropy = unpack(res, ("loss", "entropy"), "compute_entropy_loss", "EntropyLoss")
    return logits, loss, entropy


def _check_entropy_values(ws, c: dict) -> None:
    b, t, _ = c["logits"].shape
    _, loss, entropy = _run_entropy(ws, c)
    want = ops.entropy_loss(ops.entropy_from_logits(c["logits"]), c["response_mask"])
    loss_m, ent_m = _entropy_mistakes(c)
    compare("loss", scalar(loss, "loss", b, t, 3), want.loss.double(), loss_m,
            "H_t = -sum_v p_v log p_v, averaged over real tokens; loss = -that", _docs(3),
            nonfinite=NONFINITE_ENTROPY)
    compare("entropy", scalar(entropy, "entropy", b, t, 3), want.entropy.double(), ent_m,
            "entropy is the mean over real tokens of H_t, a positive number in nats", _docs(3),
            nonfinite=NONFINITE_ENTROPY)


def check_entropy_hand(ws) -> None:
    _check_entropy_values(ws, cases.entropy_hand())


def check_entropy_random(ws) -> None:
    _check_entropy_values(ws, cases.entropy_random())


def check_entropy_large_logits(ws) -> None:
    _check_entropy_values(ws, cases.entropy_random(seed=31, scale=100.0))


def check_entropy_grad(ws) -> None:
    c = cases.entropy_random(seed=32)
    logits, loss, _ = _run_entropy(ws, c)
    ref_logits = c["logits"].clone().requires_grad_(True)
    want = ops.entropy_loss(ops.entropy_from_logits(ref_logits), c["response_mask"]).loss
    b, t, _ = logits.shape
    compare("loss", scalar(loss, "loss", b, t, 3), want.detach().double(), _entropy_mistakes(c)[0],
            "H_t = -sum_v p_v log p_v, averaged over real tokens; loss = -that", _docs(3),
            nonfinite=NONFINITE_ENTROPY)
    want.backward()
    mask3 = c["response_mask"].unsqueeze(-1).expand_as(ref_logits)
    compare_grad("logits", logits, loss, ref_logits.grad, mask3, _docs(3))


# --------------------------------------------------------------------------------------
# Exercise 4: GAE and whitening
# --------------------------------------------------------------------------------------
GAE_KEYS = ("rewards", "values", "response_mask")


def _gae_variant(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float,
                 forward: bool = False, gamma_in_recursion: bool = True, gamma_in_delta: bool = True,
                 previous_value: bool = False) -> Tensor:
    """Advantages computed with one of the common mistakes switched on (0 on padding).

    `forward` runs the recursion from t = 0 up; `previous_value` (with it) also takes the
    "next" value from the step before, as a reverse loop turned around does.
    """
    m = mask.double()
    r, v = rewards.double() * m, values.double() * m
    b, t = r.shape
    adv = torch.zeros(b, t, dtype=torch.float64)
    zero = torch.zeros(b, 1, dtype=torch.float64)
    nxt_v = torch.cat([zero, v[:, :-1]], 1) if previous_value else torch.cat([v[:, 1:], zero], 1)  # (B, T)
    delta = r + (gamma if gamma_in_delta else 1.0) * nxt_v - v
    k = (gamma if gamma_in_recursion else 1.0) * lam
    run = torch.zeros(b, dtype=torch.float64)
    order = range(t) if forward else reversed(range(t))
    for i in order:
        run = (delta[:, i] + k * run) * m[:, i]
        adv[:, i] = run
    return adv


def _advantage_mistakes(c: dict) -> list[Mistake]:
    r, v, mask, g, lam = c["rewards"], c["values"], c["response_mask"], c["gamma"], c["lam"]
    ones = torch.ones_like(mask)
    d_gae, d_back = doc_link(BY_NUMBER[4].docs[0]), doc_link(BY_NUMBER[4].docs[1])
    ref = ops.gae(r, v, mask, g, lam).advantages
    return [
        *(Mistake(_gae_variant(r, v, mask, g, lam, forward=True, previous_value=prev),
                  "GAE is computed forwards: A_t is built from A_{t-1}"
                  + (" (and V_{t-1} stands in for V_{t+1})" if prev else ""),
                  "A_t = delta_t + gamma*lam*A_{t+1} needs the later advantage, so walk t from T-1 down to 0",
                  d_back) for prev in (False, True)),
        Mistake(ops.gae(r, v, ones, g, lam).advantages,
                "padding is not masked: the recursion runs through the padding and padding is not 0",
                "mask rewards and values first (padding holds junk), reset the running advantage with the "
                "mask, and return 0 on padding", MASK_DOC),
        Mistake(ops.gae(r, v, ones, g, lam).advantages * mask,
                "GAE does not stop at padding: the last real token bootstraps from the padding after it",
                "the episode ends at the last real token: there V_{t+1} = 0 and A_{t+1} = 0; mask values "
                "and rewards before the loop", d_back),
        Mistake(ops.masked_whiten(ref, mask),
                "the advantages are whitened inside GAE",
                "return the raw advantages here; whitening is whiten_advantages, applied after", d_gae),
        Mistake(ops.gae(r, v, mask, g, 1.0).advantages,
                "lam is missing: the recursion uses gamma alone",
                "A_t = delta_t + gamma*lam*A_{t+1}", d_gae),
        Mistake(_gae_variant(r, v, mask, g, lam, gamma_in_recursion=False),
                "gamma is missing from the recursion: A_t = delta_t + lam*A_{t+1}",
                "A_t = delta_t + gamma*lam*A_{t+1}", d_gae),
        Mistake(_gae_variant(r, v, mask, g, lam, gamma_in_delta=False),
                "gamma is missing from the TD error: delta_t = r_t + V_{t+1} - V_t",
                "delta_t = r_t + gamma*V_{t+1} - V_t", d_gae),
        Mistake(ops.gae(r, v, mask, lam, g).advantages, "gamma and lam are swapped",
                "the arguments are (rewards, values, response_mask, gamma, lam)", d_gae),
    ]


def _returns_mistakes(c: dict, learner_adv: Tensor) -> list[Mistake]:
    r, v, mask, g = c["rewards"], c["values"], c["response_mask"], c["gamma"]
    ref = ops.gae(r, v, mask, g, c["lam"])
    d = doc_link(BY_NUMBER[4].docs[2])
    mc = _gae_variant(r, torch.zeros_like(v), mask, g, 1.0)   # discounted reward-to-go
    return [
        Mistake(ref.advantages, "the returns equal the advantages: the values are not added",
                "returns = advantages + values", d),
        Mistake(ref.advantages + v, "the returns are not 0 on padding (values there are junk)",
                "returns = (advantages + values) * response_mask", MASK_DOC),
        Mistake(mc, "the returns are the discounted sum of rewards (a Monte Carlo return)",
                "the value targets are returns = advantages + values (the lambda-return); for lam < 1 "
                "they differ from the reward-to-go", d),
        Mistake(learner_adv.detach().double() + v.double() * mask,
                "the returns are your advantages + values, but your advantages were whitened or changed "
                "after; returns must use the raw advantages", "returns = raw advantages + values", d),
    ]


def _run_gae(ws, c: dict):
    fn = learner_function(ws, 4, "compute_gae_advantages")
    r, v, mask = _pair(c, GAE_KEYS)
    res = call(ws, 4, fn, r, v, mask, c["gamma"], c["lam"])
    adv, ret = unpack(res, ("advantages", "returns"), "compute_gae_advantages", "GAE")
    for name, x in (("advantages", adv), ("returns", ret)):
        if not isinstance(x, Tensor):
            raise CheckFailed(f"{name} is a {type(x).__name__}; expected a (B, T) tensor", docs=_docs(4))
    return adv, ret


def _check_gae_values(ws, c: dict) -> None:
    adv, ret = _run_gae(ws, c)
    want = ops.gae(*(c[k] for k in GAE_KEYS), c["gamma"], c["lam"])
    mask = c["response_mask"]
    compare("advantages", adv, want.advantages, _advantage_mistakes(c),
            "compare with the worked example in docs/advantages.md step by step", _docs(4), mask=mask)
    compare("returns", ret, want.returns, _returns_mistakes(c, adv),
            "returns = advantages + values, 0 on padding", doc_link(BY_NUMBER[4].docs[2]), mask=mask)


def check_gae_hand(ws) -> None:
    _check_gae_values(ws, cases.gae_hand())


def check_gae_random(ws) -> None:
    _check_gae_values(ws, cases.gae_random())


def check_gae_extra_padding(ws) -> None:
    """Three more padding columns must change nothing on the real positions."""
    short, long_ = cases.gae_random(seed=41), cases.gae_random(seed=41, extra_pad=3)
    long_["rewards"][:, :6], long_["values"][:, :6] = short["rewards"], short["values"]
    adv_s, _ = _run_gae(ws, short)
    adv_l, ret_l = _run_gae(ws, long_)
    want = ops.gae(*(long_[k] for k in GAE_KEYS), long_["gamma"], long_["lam"])
    if _close(adv_l, want.advantages) and _close(ret_l, want.returns):
        return
    if adv_l.shape == want.advantages.shape and not _close(adv_l[:, :6], adv_s):
        raise CheckFailed("adding 3 padding columns changed the advantages of real tokens",
                          diagnosis="the result depends on how much padding follows the response",
                          hint="past the last real token of a row, V and A are 0: the recursion must not "
                               "carry anything from the padding", docs=MASK_DOC)
    _check_gae_values(ws, long_)


def _whiten_mistakes(c: dict) -> list[Mistake]:
    x, mask = c["advantages"].double(), c["response_mask"]
    m = mask.double()
    real = mask.bool()
    n = m.sum()
    mean = (x * m).sum() / n
    var = ((x - mean).square() * m).sum() / n
    d = doc_link(BY_NUMBER[4].docs[3])
    hint_pad = ("take the mean and the variance over real tokens only: sum(x*mask)/sum(mask), "
                "sum((x-mean)^2*mask)/sum(mask); then multiply the result by the mask")
    row_mean = ops.masked_mean(x, mask, dim=-1).unsqueeze(-1)
    row_var = ops.masked_var(x, mask, dim=-1).unsqueeze(-1)
    over_padding = []
    for src, how in ((x, "the padding positions"), (x * m, "the padding, set to 0 but still counted,")):
        for unbiased in (False, True):
            w = (src - src.mean()) / torch.sqrt(src.var(unbiased=unbiased) + 1e-8)
            for out, tail in ((w * m, ""), (w, ", and padding is not 0 in the result")):
                over_padding.append(Mistake(
                    out, f"whitening over padding: the mean and the spread include {how}{tail}", hint_pad, d))
    return [
        *over_padding,
        Mistake((x - mean) / torch.sqrt(var * n / (n - 1) + 1e-8) * m,
                "the unbiased variance (divide by n - 1) was used",
                "the contract uses the population variance: divide by n, the number of real tokens", d),
        Mistake((x - mean) / torch.sqrt(var + 1e-8), "padding positions are not 0 in the result",
                "multiply the result by response_mask", d),
        Mistake(x / torch.sqrt(var + 1e-8) * m, "the mean is not subtracted",
                "whitening centres too: (A - mean) / sqrt(var + 1e-8)", d),
        Mistake(torch.where(real, (x - row_mean) * torch.rsqrt(row_var + 1e-8), torch.zeros_like(x)),
                "each row was whitened on its own",
                "the mean and the variance are over every real token of the whole batch, not per row", d),
    ]


def _check_whiten(ws, c: dict) -> None:
    fn = learner_function(ws, 4, "whiten_advantages")
    x, mask = _pair(c, ("advantages", "response_mask"))
    got = call(ws, 4, fn, x, mask)
    if not isinstance(got, Tensor):
        raise CheckFailed(f"whiten_advantages() returned a {type(got).__name__}; expected a (B, T) tensor",
                          docs=doc_link(BY_NUMBER[4].docs[3]))
    want = ops.masked_whiten(c["advantages"], c["response_mask"])
    compare("whitened advantages", got, want.double(), _whiten_mistakes(c),
            "(A - mean) / sqrt(var + 1e-8) with mean and population variance over real tokens; 0 on padding",
            doc_link(BY_NUMBER[4].docs[3]), mask=c["response_mask"])


def check_whiten_hand(ws) -> None:
    _check_whiten(ws, cases.whiten_hand())


def check_whiten_random(ws) -> None:
    _check_whiten(ws, cases.whiten_random())


# --------------------------------------------------------------------------------------
# Exercise 5: minibatch loss and update step
# --------------------------------------------------------------------------------------
class _Patched:
    """Replace attributes of the learner's exercise modules for the duration of a check.

    Exercise 5 is graded with the library's exercises 1-3 (and update_step with the
    library's minibatch_loss), so each part is graded alone.
    """

    def __init__(self, ws, replace: dict[str, Callable]):
        self.ws, self.replace, self.saved = ws, replace, []

    def __enter__(self):
        for mod in self.ws.modules.values():
            for name, fn in self.replace.items():
                if hasattr(mod, name):
                    self.saved.append((mod, name, getattr(mod, name)))
                    setattr(mod, name, fn)
        return self

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self.saved):
            setattr(mod, name, fn)
        return False


EX123 = {n: reference.REFERENCE_FUNCTIONS[n]
         for n in ("compute_policy_loss", "compute_value_loss", "compute_entropy_loss")}
MB_FIELDS = ("total", "policy", "value", "entropy", "policy_clip_frac", "value_clip_frac")


def _run_minibatch_loss(ws, mb: dict, settings):
    fn = learner_function(ws, 5, "minibatch_loss")
    model = reference.ResponseModel(cases.ToyActorCritic())
    with _Patched(ws, EX123):
        res = call(ws, 5, fn, model, mb, settings)
    return model, unpack(res, MB_FIELDS, "minibatch_loss", "MinibatchLoss")


def _reference_minibatch_loss(mb: dict, settings):
    model = reference.ResponseModel(cases.ToyActorCritic())
    return model, reference.minibatch_loss(model, mb, settings)


def _total_mistakes(parts, settings) -> list[Mistake]:
    pg, vl, ent = (float(parts.policy), float(parts.value), float(parts.entropy))
    vf, ec = settings.vf_coeff, settings.entropy_coeff
    d = _docs(5)
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return [
        Mistake(t(pg + vf * vl + ec * ent), "the entropy term has the wrong sign: the total subtracts the "
                "entropy bonus's loss", "total = policy + vf_coeff*value + entropy_coeff*(entropy loss), and "
                "the entropy loss is -entropy", d),
        Mistake(t(pg + vf * vl), "the entropy term is missing",
                "total = policy + vf_coeff*value + entropy_coeff*(entropy loss)", d),
        Mistake(t(pg + vl - ec * ent), "vf_coeff is missing: the value loss enters with weight 1",
                "multiply the value loss by settings.vf_coeff", d),
        Mistake(t(pg + vf * vl - ent), "entropy_coeff is missing: the entropy loss enters with weight 1",
                "multiply the entropy loss by settings.entropy_coeff", d),
        Mistake(t(pg - vf * vl - ec * ent), "the value loss is subtracted", "the critic minimises its loss "
                "too: + vf_coeff * value", d),
        Mistake(t(pg), "only the policy loss", "total = policy + vf_coeff*value + entropy_coeff*(entropy loss)",
                d),
    ]


def check_minibatch_total(ws) -> None:
    mb, settings = cases.toy_minibatches()[0], cases.toy_settings()
    b, t = mb["response_mask"].shape
    _, got = _run_minibatch_loss(ws, mb, settings)
    _, want = _reference_minibatch_loss(mb, settings)
    compare("total", scalar(got[0], "total", b, t, 5), want.total.detach().double(),
            _total_mistakes(want, settings),
            "forward with `logits, values = model(mb)`, logprobs_from_logits(logits, mb['response_ids']), "
            "then exercises 1-3 on the minibatch's tensors", _docs(5))


def check_minibatch_grad(ws) -> None:
    mb, settings = cases.toy_minibatches()[0], cases.toy_settings()
    model, got = _run_minibatch_loss(ws, mb, settings)
    total = got[0]
    if not isinstance(total, Tensor) or not total.requires_grad:
        raise CheckFailed("total carries no gradient to the model's parameters",
                          hint="build total from model(mb)'s outputs with torch operations: no .item(), "
                               ".detach() or torch.no_grad() on the way", docs=_docs(5))
    total.reshape(()).backward()
    ref_model, want = _reference_minibatch_loss(mb, settings)
    want.total.backward()
    names = ("embed", "lm_head", "value_head")
    for name, p, q in zip(names, model.parameters(), ref_model.parameters(), strict=True):
        compare(f"gradient of total w.r.t. the toy model's {name}", _grads_of(p), q.grad, [],
                "the value is right but not its gradient: is part of the loss built from detached tensors "
                "(e.g. logprobs computed under no_grad, or mb['old_logprobs'] where the new logprobs belong)?",
                _docs(5))


def check_minibatch_parts(ws) -> None:
    mb, settings = cases.toy_minibatches()[0], cases.toy_settings()
    b, t = mb["response_mask"].shape
    _, got = _run_minibatch_loss(ws, mb, settings)
    _, want = _reference_minibatch_loss(mb, settings)
    d = _docs(5)
    for i, field in enumerate(MB_FIELDS[1:], start=1):
        mistakes = []
        if field == "entropy":
            mistakes = [Mistake(-want.entropy.double(), "`entropy` holds the entropy loss (minus the entropy)",
                                "report the mean entropy itself, a positive number", d)]
        compare(field, scalar(got[i], field, b, t, 5), want[i].double(), mistakes,
                f"{field} is the {'mean entropy' if field == 'entropy' else field.replace('_', ' ')} "
                "of this minibatch, as exercises 1-3 return it", d)


class Replay(NamedTuple):
    params: Tensor     # every parameter of the toy model, flattened, after the steps
    grad_norm: float   # the pre-clip norm of the last step


def _replay_mistake(mistake: str, minibatches: list[dict], settings, steps: int) -> Replay:
    """The toy model after `steps` calls of an update step with `mistake` ("" for none)."""
    model = reference.ResponseModel(cases.ToyActorCritic())
    params = model.parameters()
    opt = torch.optim.SGD(params, lr=1.0)
    tokens = [reference.n_tokens(mb) for mb in minibatches]
    max_norm = settings.max_grad_norm if settings.max_grad_norm is not None else float("inf")
    norm = 0.0
    for _ in range(steps):
        for mb, n in zip(minibatches, tokens, strict=True):
            normalizer = {"equal_weights": n * len(minibatches), "no_weights": n}.get(mistake, sum(tokens))
            loss, _ = reference.engine_minibatch_loss(model.actor_critic, reference.MiniBatch.from_mapping(mb),
                                                      settings, 1.0, reference.PPOMath(), normalizer=normalizer)
            loss.backward()
            if mistake == "step_each":
                norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
                opt.step()
                opt.zero_grad(set_to_none=True)
        if mistake != "step_each":
            norm = float(torch.nn.utils.clip_grad_norm_(params, float("inf") if mistake == "no_clip" else max_norm))
            opt.step()
            if mistake != "no_zero_grad":
                opt.zero_grad(set_to_none=True)
    return Replay(torch.cat([p.detach().reshape(-1) for p in params]).double(), norm)


UPDATE_MISTAKES = {
    "no_clip": ("the gradient norm is not clipped",
                "call torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm) after the "
                "backward passes and before optimizer.step()"),
    "equal_weights": ("the minibatches are weighed equally (each mean divided by the number of minibatches), "
                      "not by their tokens",
                      "weight each minibatch's total by (its real tokens) / (the group's real tokens), so the "
                      "group's gradient is its token mean"),
    "no_weights": ("the minibatch losses are summed without weights",
                   "weight each minibatch's total by (its real tokens) / (the group's real tokens)"),
    "step_each": ("the optimizer steps after every minibatch instead of once per group",
                  "accumulate: backward on each minibatch, then clip and step once"),
    "no_zero_grad": ("the gradients are not zeroed: the second step also applies the first step's gradient",
                     "call optimizer.zero_grad() after optimizer.step() (or before the first backward)"),
}


def _run_update(ws, settings, steps: int):
    fn = learner_function(ws, 5, "update_step")
    minibatches = cases.toy_minibatches()
    model = reference.ResponseModel(cases.ToyActorCritic())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    results = []
    with _Patched(ws, {**EX123, "minibatch_loss": reference.minibatch_loss}):
        for _ in range(steps):
            results.append(call(ws, 5, fn, model, minibatches, opt, settings))
    return model, minibatches, results


def _check_update_params(ws, settings, steps: int, candidates: tuple[str, ...]) -> None:
    model, minibatches, _ = _run_update(ws, settings, steps)
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    want = _replay_mistake("", minibatches, settings, steps).params
    start = torch.cat([p.detach().reshape(-1) for p in cases.ToyActorCritic().parameters()]).double()
    if _close(got, want):
        return
    if _close(got, start):
        raise CheckFailed("the parameters did not change",
                          diagnosis="no gradient reached the optimizer, or it never stepped",
                          hint="for each minibatch: total = minibatch_loss(...).total, weight it, .backward(); "
                               "then clip and optimizer.step()", docs=_docs(5, 1))
    mistakes = [Mistake(_replay_mistake(m, minibatches, settings, steps).params, *UPDATE_MISTAKES[m], _docs(5, 1))
                for m in candidates]
    compare(f"the parameters after {steps} update step{'s' if steps > 1 else ''}", got, want, mistakes,
            "one step on the whole group: weighted backward per minibatch, clip, step, zero the gradients",
            _docs(5, 1))


def check_update_no_clip(ws) -> None:
    """max_grad_norm = None: the weighting of the minibatches shows in the step's size."""
    _check_update_params(ws, cases.toy_settings(max_grad_norm=None), 1,
                         ("equal_weights", "no_weights", "step_each"))


def check_update_clipped(ws) -> None:
    _check_update_params(ws, cases.toy_settings(), 1, ("no_clip", "equal_weights", "step_each"))


def check_update_two_steps(ws) -> None:
    """Unclipped, so a gradient left over from the first step shows in full in the second."""
    _check_update_params(ws, cases.toy_settings(max_grad_norm=None), 2,
                         ("no_zero_grad", "equal_weights", "no_weights", "step_each"))


def check_update_stats(ws) -> None:
    settings = cases.toy_settings()
    _, minibatches, results = _run_update(ws, settings, 1)
    loss, grad_norm = unpack(results[0], ("loss", "grad_norm"), "update_step", "UpdateStats")
    ref_model = reference.ResponseModel(cases.ToyActorCritic())
    want = reference.update_step(ref_model, minibatches, torch.optim.SGD(ref_model.parameters(), lr=1.0), settings)
    d = _docs(5, 1)
    as_t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    norm_mistakes = [Mistake(as_t(settings.max_grad_norm), "grad_norm is the norm after clipping",
                             "report the norm before clipping: clip_grad_norm_ returns it", d)]
    norm_mistakes += [Mistake(as_t(_replay_mistake(m, minibatches, settings, 1).grad_norm), *UPDATE_MISTAKES[m], d)
                      for m in ("equal_weights", "no_weights")]
    compare("grad_norm", scalar(grad_norm, "grad_norm", 0, 0, 5), as_t(want.grad_norm), norm_mistakes,
            "grad_norm is the global gradient norm before clipping (what clip_grad_norm_ returns)", d)
    with torch.no_grad():
        mb_means = [float(reference.minibatch_loss(reference.ResponseModel(cases.ToyActorCritic()), mb,
                                                   settings).total) for mb in minibatches]
    compare("loss", scalar(loss, "loss", 0, 0, 5), torch.tensor(want.loss, dtype=torch.float64),
            [Mistake(torch.tensor(sum(mb_means) / len(mb_means), dtype=torch.float64),
                     "loss is the plain mean of the minibatch totals", "report the sum of the token-weighted "
                     "minibatch totals: the loss of the group as one batch", d),
             Mistake(torch.tensor(sum(mb_means), dtype=torch.float64), "loss is the unweighted sum of the "
                     "minibatch totals", "weight each by its share of the group's tokens", d)],
            "loss is the sum of the token-weighted minibatch totals", d)


# --------------------------------------------------------------------------------------
# The list the grader runs, in order
# --------------------------------------------------------------------------------------
CHECKS: tuple[Check, ...] = (
    Check(1, "hand-worked case (the four cases of the clip)", "compute_policy_loss", check_policy_hand),
    Check(1, "random batch with padding", "compute_policy_loss", check_policy_random),
    Check(1, "another clip_eps (0.1)", "compute_policy_loss", check_policy_clip_eps),
    Check(1, "gradient w.r.t. logprobs", "compute_policy_loss", check_policy_grad),
    Check(2, "hand-worked case", "compute_value_loss", check_value_hand),
    Check(2, "random batch with padding", "compute_value_loss", check_value_random),
    Check(2, "clip_range=None (no value clip)", "compute_value_loss", check_value_no_clip),
    Check(2, "gradient w.r.t. values", "compute_value_loss", check_value_grad),
    Check(3, "hand-worked case", "compute_entropy_loss", check_entropy_hand),
    Check(3, "random batch with padding", "compute_entropy_loss", check_entropy_random),
    Check(3, "large logits (numerical stability)", "compute_entropy_loss", check_entropy_large_logits),
    Check(3, "gradient w.r.t. logits", "compute_entropy_loss", check_entropy_grad),
    Check(4, "GAE: hand-worked case (docs/advantages.md)", "compute_gae_advantages", check_gae_hand),
    Check(4, "GAE: random batch with padding", "compute_gae_advantages", check_gae_random),
    Check(4, "GAE: extra padding changes nothing", "compute_gae_advantages", check_gae_extra_padding),
    Check(4, "whitening: hand-worked case (docs/advantages.md)", "whiten_advantages", check_whiten_hand),
    Check(4, "whitening: random batch with padding", "whiten_advantages", check_whiten_random),
    Check(5, "minibatch_loss: total", "minibatch_loss", check_minibatch_total),
    Check(5, "minibatch_loss: gradients", "minibatch_loss", check_minibatch_grad),
    Check(5, "minibatch_loss: logged parts", "minibatch_loss", check_minibatch_parts),
    Check(5, "update_step: one step, no clipping", "update_step", check_update_no_clip),
    Check(5, "update_step: one step, clipped", "update_step", check_update_clipped),
    Check(5, "update_step: two steps in a row", "update_step", check_update_two_steps),
    Check(5, "update_step: returned loss and grad_norm", "update_step", check_update_stats),
)
