"""The grader's own parts: the hand-worked cases, the mistake replays, the templates, links, config."""

from __future__ import annotations

import importlib.util
import inspect
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from rlhflab import ops
from rlhflab.learn import cases, checks, reference
from rlhflab.learn.exercises import BY_NUMBER, EXERCISES
from rlhflab.learn.workspace import template_text

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ hand-worked cases
def test_hand_worked_cases_match_their_comments():
    c = cases.policy_hand()
    out = ops.ppo_policy_loss(c["logprobs"], c["old_logprobs"], c["advantages"], c["response_mask"], c["clip_eps"])
    # (-1.2 + 0.8 - 1.8 + 1.5) / 4 = -0.175; tokens 0 and 1 of 4 on the clipped branch
    assert out.loss.item() == pytest.approx(-0.175, abs=1e-6)
    assert out.clip_frac.item() == pytest.approx(0.5)

    c = cases.value_hand()
    out = ops.value_loss(c["values"], c["old_values"], c["returns"], c["response_mask"], c["clip_range"])
    # 1/2 * (1.0 + 1.0 + 0.64) / 3 = 0.44; only token 2's clipped error is the larger
    assert out.loss.item() == pytest.approx(0.44, abs=1e-6)
    assert out.clip_frac.item() == pytest.approx(1 / 3)
    assert ops.value_loss(c["values"], c["old_values"], c["returns"], c["response_mask"], None).loss.item() \
        == pytest.approx(0.375, abs=1e-6)  # 1/2 * (1 + 1 + 0.25) / 3

    c = cases.entropy_hand()
    h = ops.entropy_from_logits(c["logits"])
    assert h[0, 0].item() == pytest.approx(math.log(4), abs=1e-6)
    assert h[0, 1].item() == pytest.approx(-(0.4 * math.log(0.4) + 0.6 * math.log(0.2)), abs=1e-6)  # 1.332179
    assert ops.entropy_loss(h, c["response_mask"]).loss.item() == pytest.approx(-1.359237, abs=1e-6)

    c = cases.gae_hand()
    out = ops.gae(c["rewards"], c["values"], c["response_mask"], c["gamma"], c["lam"])
    # delta = [1.25, 0.2, -1.0]; A_1 = 0.2 + 0.855 * -1.0; A_0 = 1.25 + 0.855 * -0.655
    assert out.advantages.tolist()[0] == pytest.approx([0.689975, -0.655, -1.0, 0.0, 0.0], abs=1e-6)
    assert out.returns.tolist()[0] == pytest.approx([2.689975, 1.845, 2.0, 0.0, 0.0], abs=1e-6)

    c = cases.whiten_hand()
    w = ops.masked_whiten(c["advantages"], c["response_mask"])
    assert w.tolist()[0] == pytest.approx([1.388, -0.457, -0.930, 0.0], abs=1e-3)  # docs/advantages.md's table


def test_random_cases_exercise_both_sides_of_every_clip_and_hold_junk_on_padding():
    c = cases.policy_random()
    ratio = torch.exp(c["logprobs"] - c["old_logprobs"])[c["response_mask"].bool()]
    assert (ratio > 1.2).any() and (ratio < 0.8).any() and ((ratio - 1).abs() < 0.2).any()
    c = cases.value_random()
    moved = (c["values"] - c["old_values"])[c["response_mask"].bool()]
    assert (moved > 0.2).any() and (moved < -0.2).any() and (moved.abs() < 0.2).any()
    for c, key in ((cases.policy_random(), "advantages"), (cases.gae_random(), "values"),
                   (cases.whiten_random(), "advantages")):
        pad = ~c["response_mask"].bool()
        assert pad.any() and (c[key][pad].abs() > 1).all()


# ------------------------------------------------------------------ mistakes
def _all_mistakes():
    c = cases.policy_random()
    want = ops.ppo_policy_loss(*(c[k] for k in checks.POLICY_KEYS), clip_eps=c["clip_eps"])
    loss_m, frac_m = checks._policy_mistakes(c)
    yield from (("policy loss", m, want.loss) for m in loss_m)
    yield from (("policy clip_frac", m, want.clip_frac) for m in frac_m)
    c = cases.value_random()
    want = ops.value_loss(*(c[k] for k in checks.VALUE_KEYS), clip_range=c["clip_range"])
    loss_m, frac_m = checks._value_mistakes(c)
    yield from (("value loss", m, want.loss) for m in loss_m)
    yield from (("value clip_frac", m, want.clip_frac) for m in frac_m)
    c = cases.entropy_random()
    want = ops.entropy_loss(ops.entropy_from_logits(c["logits"]), c["response_mask"])
    loss_m, ent_m = checks._entropy_mistakes(c)
    yield from (("entropy loss", m, want.loss) for m in loss_m)
    yield from (("entropy", m, want.entropy) for m in ent_m)
    c = cases.gae_random()
    want = ops.gae(*(c[k] for k in checks.GAE_KEYS), c["gamma"], c["lam"])
    yield from (("advantages", m, want.advantages) for m in checks._advantage_mistakes(c))
    yield from (("returns", m, want.returns) for m in checks._returns_mistakes(c, want.advantages * 2))
    c = cases.whiten_random()
    want = ops.masked_whiten(c["advantages"], c["response_mask"])
    yield from (("whitening", m, want) for m in checks._whiten_mistakes(c))


def test_every_mistake_replay_differs_from_the_reference():
    """A replay equal to the reference could never be told apart from a correct answer."""
    seen = 0
    for what, mistake, want in _all_mistakes():
        value = torch.as_tensor(mistake.value)
        assert value.shape == want.shape, (what, mistake.diagnosis)
        assert not checks._close(value, want), (what, mistake.diagnosis)
        assert mistake.hint and mistake.docs.startswith("docs/"), (what, mistake.diagnosis)
        seen += 1
    assert seen > 50


def test_update_step_mistake_replays_differ_from_the_reference():
    mbs = cases.toy_minibatches()
    for settings, names in ((cases.toy_settings(None), ("equal_weights", "no_weights", "step_each")),
                            (cases.toy_settings(), ("no_clip", "equal_weights", "step_each"))):
        want = checks._replay_mistake("", mbs, settings, 1).params
        for name in names:
            assert not checks._close(checks._replay_mistake(name, mbs, settings, 1).params, want), name
    two = checks._replay_mistake("", mbs, cases.toy_settings(None), 2).params
    assert not checks._close(checks._replay_mistake("no_zero_grad", mbs, cases.toy_settings(None), 2).params, two)


def test_reference_update_step_is_exact_gradient_accumulation():
    """The group of minibatches (13 and 3 tokens) steps as one batch of both would."""
    settings = cases.toy_settings(None)
    mbs = cases.toy_minibatches()
    a = reference.ResponseModel(cases.ToyActorCritic())
    reference.update_step(a, mbs, torch.optim.SGD(a.parameters(), lr=1.0), settings)
    # One minibatch holding every row: pad the shorter one's columns to the same width.
    t = max(mb["response_ids"].shape[1] for mb in mbs)
    pad = lambda x, width: torch.nn.functional.pad(x, (0, width - x.shape[1]))  # noqa: E731
    keys = ("response_ids", "response_mask", "old_logprobs", "advantages", "returns", "old_values")
    whole = {k: torch.cat([pad(mb[k], t) for mb in mbs]) for k in keys}
    for k in ("input_ids", "attention_mask"):  # the prompt (2 tokens) and the response
        whole[k] = torch.cat([pad(mb[k], 2 + t) for mb in mbs])
    whole.update(prompt_len=2, ref_logprobs=None)
    b = reference.ResponseModel(cases.ToyActorCritic())
    reference.update_step(b, [whole], torch.optim.SGD(b.parameters(), lr=1.0), settings)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)


# ------------------------------------------------------------------ templates and registry
def _load_templates(tmp_path: Path) -> dict[str, object]:
    for e in EXERCISES:
        (tmp_path / e.filename).write_text(template_text(e.filename))
    sys.path.insert(0, str(tmp_path))
    try:
        mods = {}
        for e in EXERCISES:
            sys.modules.pop(e.module, None)
        for e in EXERCISES:
            spec = importlib.util.spec_from_file_location(e.module, tmp_path / e.filename)
            mods[e.module] = importlib.util.module_from_spec(spec)
            sys.modules[e.module] = mods[e.module]
            spec.loader.exec_module(mods[e.module])
        return mods
    finally:
        sys.path.remove(str(tmp_path))
        for e in EXERCISES:
            sys.modules.pop(e.module, None)


def test_templates_match_the_reference_signatures_and_raise_not_implemented(tmp_path):
    mods = _load_templates(tmp_path)
    for e in EXERCISES:
        for name in e.functions:
            stub = getattr(mods[e.module], name)
            ref = reference.REFERENCE_FUNCTIONS[name]
            assert list(inspect.signature(stub).parameters) == list(inspect.signature(ref).parameters), name
            args = [None] * len(inspect.signature(stub).parameters)
            with pytest.raises(NotImplementedError, match=f"exercise {e.number}"):
                stub(*args)
    # The NamedTuples the stubs return have the fields the grader reads.
    assert mods["ex1_policy_loss"].PolicyLoss._fields == reference.PolicyLoss._fields
    assert mods["ex5_minibatch_update"].MinibatchLoss._fields == checks.MB_FIELDS
    assert mods["ex5_minibatch_update"].UpdateStats._fields == reference.UpdateStats._fields


def test_every_function_of_every_exercise_has_checks():
    graded = {(c.exercise, c.function) for c in checks.CHECKS}
    assert graded == {(e.number, f) for e in EXERCISES for f in e.functions}
    assert len({c.id for c in checks.CHECKS}) == len(checks.CHECKS)


def _anchors(page: Path) -> set[str]:
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_docs_links_point_at_existing_sections():
    sources = [Path(checks.__file__), Path(checks.__file__).with_name("exercises.py"),
               Path(checks.__file__).with_name("solution.py")]
    links = set()
    for src in sources:
        links |= set(re.findall(r"\b([a-z_]+\.md(?:#[\w\-]+)?)", src.read_text()))
    for e in EXERCISES:
        links |= set(e.docs)
    assert len(links) > 8
    for link in sorted(links):
        page, _, anchor = link.partition("#")
        path = REPO / "docs" / page
        assert path.is_file(), link
        if anchor:
            assert anchor in _anchors(path), link
    assert (REPO / "docs" / "learner_mode.md").is_file()
    assert "learner_mode.md" in (REPO / "docs" / "README.md").read_text()


def test_packaged_run_config_is_the_repos_debug_config():
    """`learn run` from an installed package uses a copy of configs/ppo_debug.yaml."""
    import dataclasses

    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPORunConfig
    from rlhflab.learn.runner import packaged_config, repo_debug_config
    repo, _ = load_config(repo_debug_config(), PPORunConfig)
    packaged, _ = load_config(packaged_config(), PPORunConfig)
    for cfg in (repo, packaged):  # plug-ins are looked for next to each file: the one key that may differ
        cfg.reward.plugin_dir = cfg.eval.plugin_dir = cfg.env.plugin_dir = None
    assert dataclasses.asdict(packaged) == dataclasses.asdict(repo), \
        "configs/ppo_debug.yaml changed: refresh the copy with `python -m rlhflab.learn.runner`"
    assert "plugin_dir: null" in packaged_config().read_text()  # no checkout's absolute path in the package


def test_refreshing_the_packaged_config_writes_no_absolute_plugin_folder(tmp_path):
    from rlhflab.config import load_config
    from rlhflab.learn.runner import write_packaged_config
    from rlhflab.trainers.ppo import PPORunConfig

    text = write_packaged_config(tmp_path / "copy.yaml").read_text()
    assert str(REPO) not in text and text.count("plugin_dir: null") == 3
    cfg, _ = load_config(tmp_path / "copy.yaml", PPORunConfig)
    assert cfg.reward.plugin_dir == str(tmp_path)  # filled at load time with the copy's own folder


def test_exercise_registry_is_consistent():
    assert [e.number for e in EXERCISES] == [1, 2, 3, 4, 5]
    assert BY_NUMBER[5].functions == ("minibatch_loss", "update_step")
    for e in EXERCISES:
        assert e.module.startswith(f"ex{e.number}_") and e.stub_hint
