"""Learner mode end to end: init, check (stubs, correct answers, broken variants), solution, run.

The correct answers below are what a learner might write: loops, boolean indexing,
torch.where, min of objectives. They are deliberately written differently from
rlhflab.ops (the reference), so passing the grader means agreeing with the library,
not copying it. Each broken variant is one edit of a correct answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhflab import ops
from rlhflab.cli import main
from rlhflab.errors import UserError
from rlhflab.learn import cases
from rlhflab.learn.exercises import EXERCISES
from rlhflab.learn.grader import format_report, grade
from rlhflab.learn.workspace import Workspace

ANSWERS = {
    "ex1_policy_loss.py": '''
from typing import NamedTuple
import torch

class PolicyLoss(NamedTuple):
    loss: torch.Tensor
    clip_frac: torch.Tensor

def compute_policy_loss(logprobs, old_logprobs, advantages, response_mask, clip_eps=0.2):
    real = response_mask.bool()
    ratio = torch.exp(logprobs - old_logprobs)
    surr1 = ratio * advantages
    surr2 = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    objective = torch.min(surr1, surr2)
    n = real.sum()
    loss = -torch.where(real, objective, torch.zeros_like(objective)).sum() / n
    clip_frac = (real & (surr2 < surr1)).sum() / n
    return PolicyLoss(loss, clip_frac)
''',
    "ex2_value_loss.py": '''
from typing import NamedTuple
import torch

class ValueLoss(NamedTuple):
    loss: torch.Tensor
    clip_frac: torch.Tensor

def compute_value_loss(values, old_values, returns, response_mask, clip_range=0.2):
    real = response_mask.bool()
    err = (values - returns) ** 2
    if clip_range is None:
        return ValueLoss(0.5 * err[real].mean(), torch.tensor(0.0))
    v_clip = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    err_clip = (v_clip - returns) ** 2
    worst = torch.max(err, err_clip)
    return ValueLoss(0.5 * worst[real].mean(), (err_clip > err)[real].float().mean())
''',
    "ex3_entropy_loss.py": '''
from typing import NamedTuple
import torch

class EntropyLoss(NamedTuple):
    loss: torch.Tensor
    entropy: torch.Tensor

def compute_entropy_loss(logits, response_mask):
    logp = torch.log_softmax(logits.float(), dim=-1)
    h = -(logp.exp() * logp).sum(dim=-1)
    mean_h = h[response_mask.bool()].mean()
    return EntropyLoss(-mean_h, mean_h.detach())
''',
    "ex4_gae.py": '''
from typing import NamedTuple
import torch

class GAE(NamedTuple):
    advantages: torch.Tensor
    returns: torch.Tensor

def compute_gae_advantages(rewards, values, response_mask, gamma=1.0, lam=0.95):
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    returns = torch.zeros_like(rewards)
    for b in range(B):
        n = int(response_mask[b].sum())
        next_adv, next_value = 0.0, 0.0
        for t in reversed(range(n)):
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            next_adv = delta + gamma * lam * next_adv
            advantages[b, t] = next_adv
            returns[b, t] = next_adv + values[b, t]
            next_value = values[b, t]
    return GAE(advantages, returns)

def whiten_advantages(advantages, response_mask):
    real = response_mask.bool()
    vals = advantages[real]
    mean = vals.mean()
    var = ((vals - mean) ** 2).mean()
    out = torch.zeros_like(advantages)
    out[real] = (vals - mean) / torch.sqrt(var + 1e-8)
    return out
''',
    "ex5_minibatch_update.py": '''
from typing import NamedTuple
import torch
from rlhflab.ops import logprobs_from_logits
from ex1_policy_loss import compute_policy_loss
from ex2_value_loss import compute_value_loss
from ex3_entropy_loss import compute_entropy_loss

class MinibatchLoss(NamedTuple):
    total: torch.Tensor
    policy: torch.Tensor
    value: torch.Tensor
    entropy: torch.Tensor
    policy_clip_frac: torch.Tensor
    value_clip_frac: torch.Tensor

class UpdateStats(NamedTuple):
    loss: float
    grad_norm: float

def minibatch_loss(model, mb, settings):
    logits, values = model(mb)
    logprobs = logprobs_from_logits(logits, mb["response_ids"])
    mask = mb["response_mask"]
    pl = compute_policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], mask, settings.clip_eps)
    vl = compute_value_loss(values, mb["old_values"], mb["returns"], mask, settings.value_clip)
    el = compute_entropy_loss(logits, mask)
    total = pl.loss + settings.vf_coeff * vl.loss + settings.entropy_coeff * el.loss
    return MinibatchLoss(total, pl.loss.detach(), vl.loss.detach(), el.entropy, pl.clip_frac, vl.clip_frac)

def update_step(model, minibatches, optimizer, settings):
    counts = [float(mb["response_mask"].sum()) for mb in minibatches]
    group = sum(counts)
    optimizer.zero_grad()
    total = 0.0
    for mb, n in zip(minibatches, counts):
        weighted = minibatch_loss(model, mb, settings).total * (n / group)
        weighted.backward()
        total += weighted.item()
    max_norm = settings.max_grad_norm if settings.max_grad_norm is not None else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)
    optimizer.step()
    return UpdateStats(total, float(norm))
''',
}

# The library itself, in the exercises' signatures: "the reference solution passes all".
REFERENCE_ANSWERS = {
    "ex1_policy_loss.py": "from rlhflab.learn.reference import compute_policy_loss\n",
    "ex2_value_loss.py": "from rlhflab.learn.reference import compute_value_loss\n",
    "ex3_entropy_loss.py": "from rlhflab.learn.reference import compute_entropy_loss\n",
    "ex4_gae.py": "from rlhflab.learn.reference import compute_gae_advantages, whiten_advantages\n",
    "ex5_minibatch_update.py": "from rlhflab.learn.reference import minibatch_loss, update_step\n",
}

# name: (file, text to replace, replacement, exercise, words the diagnosis must contain)
BROKEN = {
    "surrogate without the min": (
        "ex1_policy_loss.py", "objective = torch.min(surr1, surr2)", "objective = surr2", 1,
        "the min with the unclipped surrogate is missing"),
    "clipping on the wrong side": (
        "ex1_policy_loss.py", "objective = torch.min(surr1, surr2)", "objective = torch.max(surr1, surr2)", 1,
        "min and max are swapped: clipping on the wrong side"),
    "policy loss sign flip": (
        "ex1_policy_loss.py", "loss = -torch.where", "loss = torch.where", 1, "the sign is flipped"),
    "policy loss over padding": (
        "ex1_policy_loss.py", "loss = -torch.where(real, objective, torch.zeros_like(objective)).sum() / n",
        "loss = -objective.mean()", 1, "padding leaks in"),
    "clip_frac of ratios outside the clip": (
        "ex1_policy_loss.py", "(real & (surr2 < surr1))", "(real & ((ratio - 1).abs() > clip_eps))", 1,
        "clip_frac counts the ratios outside"),
    "no value clipping": (
        "ex2_value_loss.py", "worst = torch.max(err, err_clip)", "worst = err", 2, "the value clip is missing"),
    "value loss without the half": (
        "ex2_value_loss.py", "ValueLoss(0.5 * worst[real].mean()", "ValueLoss(worst[real].mean()", 2,
        "the 1/2 is missing"),
    "entropy loss sign flip": (
        "ex3_entropy_loss.py", "EntropyLoss(-mean_h, mean_h.detach())", "EntropyLoss(mean_h, mean_h.detach())", 3,
        "the sign is flipped"),
    "entropy from log(softmax)": (
        "ex3_entropy_loss.py", "logp = torch.log_softmax(logits.float(), dim=-1)",
        "logp = torch.log(torch.softmax(logits.float(), dim=-1))", 3, "log(softmax(logits)) underflows"),
    "forward-order GAE": (
        "ex4_gae.py", "for t in reversed(range(n)):", "for t in range(n):", 4, "GAE is computed forwards"),
    "GAE through the padding": (
        "ex4_gae.py", "        n = int(response_mask[b].sum())\n", "        n = T\n", 4, "padding is not masked"),
    "returns without the values": (
        "ex4_gae.py", "returns[b, t] = next_adv + values[b, t]", "returns[b, t] = next_adv", 4,
        "the values are not added"),
    "whitening over padding": (
        "ex4_gae.py", "    out[real] = (vals - mean) / torch.sqrt(var + 1e-8)\n",
        "    out = (advantages - advantages.mean()) / advantages.std() * response_mask\n", 4,
        "whitening over padding"),
    "whitening with the unbiased variance": (
        "ex4_gae.py", "var = ((vals - mean) ** 2).mean()", "var = vals.var()", 4, "the unbiased variance"),
    "total with the entropy sign flipped": (
        "ex5_minibatch_update.py", "+ settings.entropy_coeff * el.loss", "- settings.entropy_coeff * el.loss", 5,
        "the entropy term has the wrong sign"),
    "minibatches weighed equally": (
        "ex5_minibatch_update.py", "* (n / group)", "/ len(minibatches)", 5, "weighed equally"),
    "no gradient clipping": (
        "ex5_minibatch_update.py", "clip_grad_norm_(list(model.parameters()), max_norm)",
        "clip_grad_norm_(list(model.parameters()), float('inf'))", 5, "the gradient norm is not clipped"),
    "no zero_grad": (
        "ex5_minibatch_update.py", "    optimizer.zero_grad()\n", "", 5, "the gradients are not zeroed"),
}


def write_workspace(path: Path, files: dict[str, str], edit: tuple[str, str, str] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        if edit is not None and name == edit[0]:
            assert edit[1] in text, f"the broken variant's edit does not apply to {name}"
            text = text.replace(edit[1], edit[2])
        (path / name).write_text(text)
    return path


def rlhflab_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "rlhflab", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=240)


# ------------------------------------------------------------------------------ init
def test_init_writes_the_five_exercises_with_contracts(tmp_path, capsys):
    ws = tmp_path / "ws"
    assert main(["learn", "init", str(ws)]) == 0
    names = sorted(p.name for p in ws.iterdir())
    assert names == sorted([e.filename for e in EXERCISES] + ["README.md"])
    for e in EXERCISES:
        text = (ws / e.filename).read_text()
        for word in ("Contract", "Why", "(B, T)", "response_mask", "# ==== YOUR CODE", "# ==== END OF YOUR CODE",
                     f"rlhflab learn check {e.number}", *(f"def {f}(" for f in e.functions)):
            assert word in text, (e.filename, word)
        compile(text, e.filename, "exec")
    assert "next: open" in capsys.readouterr().out
    # A second init would overwrite the learner's work: refused, exit 2, one line.
    (ws / "ex1_policy_loss.py").write_text("# my work\n")
    assert main(["learn", "init", str(ws)]) == 2
    assert "already exist" in capsys.readouterr().err
    assert (ws / "ex1_policy_loss.py").read_text() == "# my work\n"
    assert main(["learn", "init", str(ws), "--force"]) == 0
    assert "Contract" in (ws / "ex1_policy_loss.py").read_text()


# ------------------------------------------------------------------------------ check
STUB_HINTS = {  # a phrase of each exercise's stub hint, and of the page it points to
    1: ("exp(logprobs - old_logprobs)", "docs/trpo_to_ppo.md#3-ppo-the-trust-region-moved-into-the-objective"),
    2: ("larger of the two squared errors", "docs/knobs.md#value_clip-the-value-clip"),
    3: ("log_softmax(logits)", "docs/knobs.md#entropy_coeff-the-entropy-bonus"),
    4: ("walk t from the last position to the first", "docs/advantages.md#gae-a-dial-between-the-two"),
    5: ("weighted by its share of the group's tokens", "docs/ppo_step.md#the-losses-of-phase-5"),
}


def test_check_on_untouched_stubs_fails_each_exercise_with_a_hint(tmp_path):
    ws = tmp_path / "ws"
    assert rlhflab_cli("learn", "init", str(ws)).returncode == 0
    res = rlhflab_cli("learn", "check", "--dir", str(ws))
    assert res.returncode == 1, res.stderr
    out = res.stdout
    assert "Exercises passed: 0 of 5 (checks: 0 of 24)" in out
    for e in EXERCISES:
        assert f"Exercise {e.number}  {e.title}" in out
        for fn in e.functions:
            assert f"{fn}() is still the stub: it raises NotImplementedError" in out
        phrase, page = STUB_HINTS[e.number]
        assert phrase in " ".join(out.split()), phrase  # the report wraps long lines
        assert f"read: {page}" in out
        assert f"'# ==== YOUR CODE' lines in {e.filename}" in " ".join(out.split())
    assert f"Next: fix exercise 1 (ex1_policy_loss.py) and run `rlhflab learn check 1 --dir {ws}`" in out
    assert not list(ws.rglob("__pycache__")), "grading must not litter the learner's folder"


def test_correct_answers_pass_every_check(tmp_path, capsys):
    ws = write_workspace(tmp_path / "ws", ANSWERS)
    assert main(["learn", "check", "--dir", str(ws)]) == 0
    out = capsys.readouterr().out
    assert "Exercises passed: 5 of 5 (checks: 24 of 24)" in out
    assert "FAIL" not in out
    assert f"rlhflab learn run --dir {ws}" in out


def test_reference_solution_passes_every_check(tmp_path):
    report = grade(write_workspace(tmp_path / "ws", REFERENCE_ANSWERS))
    assert report.ok, format_report(report)
    assert len(report.results) == 24


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_variant_is_caught_with_the_right_hint(tmp_path, name):
    file, old, new, number, diagnosis = BROKEN[name]
    report = grade(write_workspace(tmp_path / "ws", ANSWERS, (file, old, new)), [number])
    assert not report.ok
    failed = [r for r in report.results if not r.passed]
    assert failed, f"{name}: no check failed"
    assert any(diagnosis in r.finding.diagnosis for r in failed), (name, format_report(report))
    # Every diagnosis comes with a hint and a page to read.
    assert all(r.finding.hint and r.finding.docs.startswith("docs/") for r in failed)


def test_check_one_exercise_grades_only_it(tmp_path, capsys):
    ws = write_workspace(tmp_path / "ws", ANSWERS, ("ex4_gae.py", "for t in reversed(range(n)):",
                                                    "for t in range(n):"))
    assert main(["learn", "check", "2", "--dir", str(ws)]) == 0   # exercise 4 is broken, 2 is not
    out = capsys.readouterr().out
    assert "Exercise 2" in out and "Exercise 4" not in out and "checks: 4 of 4" in out
    assert main(["learn", "check", "4", "--dir", str(ws)]) == 1


def test_check_reports_where_the_learners_code_failed(tmp_path, capsys):
    broken = dict(ANSWERS)
    broken["ex1_policy_loss.py"] = ANSWERS["ex1_policy_loss.py"].replace(
        "    surr1 = ratio * advantages\n", "    print('ratio', tuple(ratio.shape))\n    surr1 = ratio * advantages[:, :2]\n")
    broken["ex2_value_loss.py"] = "def compute_value_loss(values, old_values returns):\n    pass\n"
    ws = write_workspace(tmp_path / "ws", broken)
    assert main(["learn", "check", "1", "2", "5", "--dir", str(ws)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    # an exception: its type, its message, the learner's line, and what the code printed
    assert "compute_policy_loss() raised RuntimeError: The size of tensor a (5) must match" in out
    assert "(ex1_policy_loss.py, line 13: surr1 = ratio * advantages[:, :2])" in out
    assert "your code printed: | ratio (1, 5)" in out
    # a syntax error: the file and the line; exercise 5 imports exercise 2, so it fails too
    assert "ex2_value_loss.py could not be imported: ex2_value_loss.py line 1" in out
    assert "ex5_minibatch_update.py could not be imported" in out


def test_check_errors_speak_to_the_user(tmp_path, capsys):
    assert main(["learn", "check", "--dir", str(tmp_path / "nowhere")]) == 2
    assert "rlhflab learn init" in capsys.readouterr().err
    assert main(["learn", "check", "--dir", str(tmp_path)]) == 2           # a folder without exercises
    assert "no exercise files here" in capsys.readouterr().err
    assert main(["learn", "check", "7", "--dir", str(tmp_path)]) == 2
    assert "numbered 1 to 5" in capsys.readouterr().err


# ------------------------------------------------------------------------------ solution
@pytest.mark.parametrize("number,functions", [
    (1, ["def ppo_policy_loss(", "def aggregate(", "def compute_policy_loss("]),
    (2, ["def value_loss(", "def compute_value_loss("]),
    (3, ["def entropy_from_logits(", "def entropy_loss(", "def compute_entropy_loss("]),
    (4, ["def gae(", "def masked_whiten(", "def compute_gae_advantages(", "def whiten_advantages("]),
    (5, ["def minibatch_loss(", "def loss_terms(", "def update_group(", "def policy_update(",
         "def update_step("]),
])
def test_solution_prints_the_library_code_with_commentary(capsys, number, functions):
    assert main(["learn", "solution", str(number)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("=" * 88) and f"Exercise {number}:" in out
    for f in functions:
        assert f in out
    assert "rlhflab/ops/" in out or "rlhflab/engine/update.py" in out   # where the source lives
    assert "Read: docs/" in out


# ------------------------------------------------------------------------------ run
def test_plug_uses_the_library_where_an_exercise_is_still_the_stub(tmp_path):
    from rlhflab.learn.runner import plug
    from rlhflab.trainers.ppo import PPOMath
    main(["learn", "init", str(tmp_path / "ws")])
    with Workspace(tmp_path / "ws") as ws:
        plugged = plug(ws, whiten=True)
    lib = PPOMath()
    assert plugged.math.policy_loss is lib.policy_loss and plugged.math.value_loss is lib.value_loss
    assert plugged.math.minibatch_step is None and plugged.math.update_group is None
    assert all("library" in plugged.used[f] for f in ("compute_policy_loss", "compute_gae_advantages",
                                                      "minibatch_loss", "update_step"))


def test_plug_runs_update_step_with_the_librarys_minibatch_loss_in_place_of_a_stub(tmp_path):
    from rlhflab.learn.runner import plug
    stub = ANSWERS["ex5_minibatch_update.py"].replace(
        "    logits, values = model(mb)\n", "    raise NotImplementedError\n    logits, values = model(mb)\n")
    with Workspace(write_workspace(tmp_path / "ws", {**ANSWERS, "ex5_minibatch_update.py": stub})) as ws:
        plugged = plug(ws, whiten=True)
    assert plugged.math.minibatch_step is None and plugged.math.update_group is not None
    assert "library" in plugged.used["minibatch_loss"] and plugged.used["update_step"] == "yours"


def test_plug_leaves_out_an_update_step_that_does_not_call_minibatch_loss(tmp_path):
    """The run logs each minibatch's losses from the minibatch_loss calls update_step makes."""
    from rlhflab.learn.runner import plug
    # The reference's update_step calls the trainer's own group step, not minibatch_loss by name.
    with Workspace(write_workspace(tmp_path / "ws", REFERENCE_ANSWERS)) as ws:
        plugged = plug(ws, whiten=True)
    assert plugged.math.update_group is None and plugged.math.minibatch_step is not None
    assert plugged.used["update_step"].startswith("the library's: yours called minibatch_loss 0 time(s) "
                                                  "for 2 minibatches")


def test_plug_refuses_an_exercise_that_crashes(tmp_path):
    from rlhflab.learn.runner import plug
    ws = write_workspace(tmp_path / "ws", {**ANSWERS, "ex1_policy_loss.py": ANSWERS["ex1_policy_loss.py"].replace(
        "ratio = torch.exp(logprobs - old_logprobs)", "ratio = torch.exp(logprobs - old_logprobs[:, :2])")})
    with Workspace(ws) as w, pytest.raises(UserError, match="exercise 1 .* fails on a small input"):
        plug(w, whiten=True)


def test_plugged_functions_reproduce_the_trainers_math_under_accumulation(tmp_path):
    """The adapters rescale the learner's token means by the group normalizer exactly."""
    from rlhflab.learn.runner import plug
    with Workspace(write_workspace(tmp_path / "ws", ANSWERS)) as ws:
        math_ = plug(ws, whiten=True).math
        c = cases.policy_random()
        args = [c[k] for k in ("logprobs", "old_logprobs", "advantages", "response_mask")]
        mine = math_.policy_loss(*args, c["clip_eps"], normalizer=40.0)
        lib = ops.ppo_policy_loss(*args, c["clip_eps"], normalizer=40.0)
        assert torch.allclose(mine.loss, lib.loss, atol=1e-6) and torch.allclose(mine.approx_kl, lib.approx_kl)
        v = cases.value_random()
        vargs = [v[k] for k in ("values", "old_values", "returns", "response_mask")]
        assert torch.allclose(math_.value_loss(*vargs, 0.2, normalizer=40.0).loss,
                              ops.value_loss(*vargs, 0.2, normalizer=40.0).loss, atol=1e-6)
        g = cases.gae_random()
        adv, ret = math_.advantages(g["rewards"], g["values"], g["response_mask"], g["gamma"], g["lam"])
        want = ops.gae(g["rewards"], g["values"], g["response_mask"], g["gamma"], g["lam"])
        assert torch.allclose(adv, ops.masked_whiten(want.advantages, g["response_mask"]), atol=1e-5)
        assert torch.allclose(ret, want.returns, atol=1e-6)


def test_plugged_update_step_is_the_trainers_group_step(tmp_path):
    """The learner's update_step as PPOMath.update_group: same parameters, grad norm and
    per-minibatch stats as the engine's `update_group` on a group of 13 + 3 tokens."""
    from rlhflab.engine.minibatch import MiniBatch
    from rlhflab.learn.runner import plug
    from rlhflab.trainers.ppo import PPOMath, ppo_update_group
    settings = cases.toy_settings()
    mbs = [MiniBatch.from_mapping(mb) for mb in cases.toy_minibatches()]  # what the trainer hands over
    normalizer = 16.0  # 13 + 3 real tokens: the trainer's token count of the group
    with Workspace(write_workspace(tmp_path / "ws", ANSWERS)) as ws:
        math_ = plug(ws, whiten=True).math
        runs = []
        for math_i, update_group in ((math_, math_.update_group), (PPOMath(), ppo_update_group)):
            ac = cases.ToyActorCritic()
            params = list(ac.trainable_parameters())
            opt = torch.optim.SGD(params, lr=1.0)
            grad_norm, stats = update_group(ac, mbs, opt, params, settings, 1.0, math_i, normalizer)
            runs.append((grad_norm, stats, torch.cat([p.detach().reshape(-1) for p in params])))
    (mine_norm, mine_stats, mine_params), (lib_norm, lib_stats, lib_params) = runs
    assert mine_norm == pytest.approx(lib_norm, rel=1e-5) and mine_norm > settings.max_grad_norm  # clipped
    assert torch.allclose(mine_params, lib_params, atol=1e-6)
    assert len(mine_stats) == len(lib_stats) == 2
    for a, b in zip(mine_stats, lib_stats, strict=True):
        for k in ("policy", "value", "entropy", "total", "policy_clip_frac", "value_clip_frac", "approx_kl"):
            assert getattr(a, k) == pytest.approx(getattr(b, k), rel=1e-5, abs=1e-7), k


@pytest.mark.slow
def test_learn_run_trains_two_steps_and_matches_the_library(tmp_path, capsys):
    """`learn run` with correct answers: exit 0, two PPO steps, the learner's update_step
    steps the optimizer, and step 1 equals the library's."""
    from rlhflab.learn.runner import run_learner
    # The learner's update_step leaves a mark per call (its module is re-imported per run).
    counted = ANSWERS["ex5_minibatch_update.py"].replace(
        "    optimizer.step()\n",
        "    optimizer.step()\n    with open(__file__ + '.calls', 'a') as f:\n"
        "        f.write(','.join(str(len(mb['response_ids'])) for mb in minibatches) + '\\n')\n")
    ws = write_workspace(tmp_path / "ws", {**ANSWERS, "ex5_minibatch_update.py": counted})
    # Accumulation 2: 16 samples in minibatches of 8 make one group of 2 per epoch, so the
    # learner's token weighting matters; 2 epochs x 2 steps = 4 calls of update_step, after
    # the one on the toy group (3 and 2 rows) that checks it before the run.
    steps = ["training.total_steps=2", "training.eval_interval=0", "logging.plots=false",
             "ppo.gradient_accumulation_steps=2"]
    assert main(["learn", "run", "--dir", str(ws), "--quiet", "--cold", *steps]) == 0
    metrics = (ws / "runs" / "001" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2]
    calls = ws / "ex5_minibatch_update.py.calls"
    assert calls.read_text().split() == ["3,2"] + ["8,8"] * 4
    # Same seed, same first rollout: the learner's functions give the library's numbers.
    res = run_learner(ws, steps, compare=True, quiet=True, warm=False)
    # The learner's run calls it again; the library's run does not.
    assert calls.read_text().split() == (["3,2"] + ["8,8"] * 4) * 2
    mine, lib = res["yours"].history[0], res["library"].history[0]
    assert res["yours"].output_dir == ws / "runs" / "002"
    for key in ("loss/policy", "loss/value", "loss/entropy", "params/policy_clip_frac", "params/approx_kl",
                "params/grad_norm", "rollout/advantage_mean", "rollout/return_mean"):
        assert mine[key] == pytest.approx(lib[key], rel=1e-4, abs=1e-6), key


def test_learn_run_warm_start_is_made_once_and_used(tmp_path, monkeypatch):
    """By default `learn run` trains the quickstart's SFT'd policy (made once per workspace),
    with the quickstart's PPO settings; --cold keeps the untrained tiny model."""
    import rlhflab.quickstart as qs
    from rlhflab.learn import runner

    calls = []

    def fake_warm_start(folder, quiet=False, **kw):
        calls.append(folder)
        (folder / "sft" / "final").mkdir(parents=True)
        (folder / "sft" / "final" / "config.json").write_text("{}")
        (folder / "data").mkdir()
        for name in ("train.jsonl", "test.jsonl"):
            (folder / "data" / name).write_text("")

    monkeypatch.setattr(qs, "prepare_warm_start", fake_warm_start)
    ws = tmp_path / "ws"
    for _ in range(2):
        cfg, _ = runner.load_run_config(ws, [], quiet=True, warm=True)
    assert calls == [ws / "inputs"]  # made once, reused by the second run
    assert cfg.model.name_or_path == str(ws / "inputs" / "sft" / "final")
    assert cfg.dataset.eval_path == str(ws / "inputs" / "data" / "test.jsonl")
    assert (cfg.ppo.rollout_samples, cfg.training.total_steps, cfg.training.eval_interval) == (64, 10, 5)
