"""Reward and check plug-ins: every way of naming one, the batched form, one-line errors,
and the preflight that calls them before any model loads."""

from __future__ import annotations

import itertools
import json
import textwrap
from pathlib import Path

import pytest
import torch

from rlhflab.config import load_config
from rlhflab.config.schema import RewardConfig, RewardSource
from rlhflab.errors import UserError
from rlhflab.rewards import REGISTRY, RuleScorer, batched, build_reward, resolve_rule
from rlhflab.trainers.ppo import PPORunConfig

_ids = itertools.count()

REVERSE = """
def score(prompt, response, example):
    return 1.0 if response.strip() == example["answer"] else 0.25

def exact(prompt, response, example):
    return response.strip() == example["answer"]
"""


def write_module(folder: Path, body: str = REVERSE) -> str:
    """A plug-in module with a name no other test uses (imports are cached per name)."""
    name = f"plugin_{next(_ids)}_{folder.name.replace('-', '_')}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(textwrap.dedent(body))
    return name


def score_one(spec: str, plugin_dir=None, response=" tac") -> float:
    return float(RuleScorer(resolve_rule(spec, plugin_dir), spec).score(["cat"], [response], [{"answer": "tac"}])[0])


# --------------------------------------------------------------------------------------
# Naming a plug-in
# --------------------------------------------------------------------------------------
def test_module_function_from_the_current_directory(tmp_path, monkeypatch):
    name = write_module(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert score_one(f"{name}:score") == 1.0
    assert score_one(f"{name}:score", response=" cat") == 0.25


@pytest.mark.parametrize("form", ["{name}.py", "./{name}.py", "sub/{name}.py", "./sub/{name}.py", "{abs}"])
def test_file_paths_relative_and_absolute(tmp_path, monkeypatch, form):
    sub = tmp_path / "sub"
    name = write_module(sub if "sub" in form else tmp_path)
    folder = sub if "sub" in form else tmp_path
    monkeypatch.chdir(tmp_path)
    spec = form.format(name=name, abs=folder / f"{name}.py") + ":score"
    assert score_one(spec) == 1.0


def test_relative_to_the_config_folder_from_another_cwd(tmp_path, monkeypatch):
    """A config next to its reward file works from any directory: load_config fills
    reward.plugin_dir and eval.plugin_dir with the config's folder."""
    cfg_dir, elsewhere = tmp_path / "task", tmp_path / "elsewhere"
    elsewhere.mkdir()
    mod = write_module(cfg_dir)
    fname = write_module(cfg_dir)
    (cfg_dir / "ppo.yaml").write_text(
        f"reward:\n  sources:\n    - {{type: rule, name: '{mod}:score', weight: 2.0}}\n"
        f"    - {{type: rule, name: '{fname}.py:score'}}\n"
        f"eval:\n  correct: '{mod}:exact'\n")
    monkeypatch.chdir(elsewhere)
    cfg, effective = load_config(cfg_dir / "ppo.yaml", PPORunConfig)
    assert cfg.reward.plugin_dir == cfg.eval.plugin_dir == str(cfg_dir.resolve())
    assert effective.reward.plugin_dir == str(cfg_dir.resolve())  # recorded for a re-run
    # 2.0 * 1.0 + 1.0 for the right answer; 2.0 * 0.25 + 0.25 for a wrong one.
    got = build_reward(cfg.reward).score(["cat", "dog"], [" tac", " dog"], [{"answer": "tac"}, {"answer": "god"}])
    assert got.tolist() == pytest.approx([3.0, 0.75])
    # The current directory still comes first, and a plugin_dir set by hand is kept.
    cfg2, _ = load_config(cfg_dir / "ppo.yaml", PPORunConfig, [f"reward.plugin_dir={elsewhere}"])
    assert cfg2.reward.plugin_dir == str(elsewhere) and cfg2.eval.plugin_dir == str(cfg_dir.resolve())
    with pytest.raises(UserError, match=f"file {fname}.py not found \\(looked at {elsewhere / fname}.py\\)"):
        build_reward(cfg2.reward)


def test_a_config_built_in_code_searches_the_current_directory_only(tmp_path, monkeypatch):
    cfg, _ = load_config(None, PPORunConfig)
    assert cfg.reward.plugin_dir is None
    name = write_module(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert score_one(f"{name}:score", cfg.reward.plugin_dir) == 1.0


def test_registered_rules_still_win_and_the_help_names_only_real_ones():
    assert resolve_rule("gsm8k") is REGISTRY["gsm8k"]
    help_line = RewardSource.__dataclass_fields__["name"].metadata["help"]
    assert "gsm8k_strict" not in help_line
    named = [w.strip("(),") for w in help_line.split() if w.strip("(),").startswith("gsm8k")]
    assert named and all(n in REGISTRY for n in named)


# --------------------------------------------------------------------------------------
# The batched form
# --------------------------------------------------------------------------------------
def test_batched_is_called_once_per_batch_with_lists(tmp_path, monkeypatch):
    name = write_module(tmp_path, """
        from rlhflab.rewards import batched
        CALLS = []

        @batched
        def lengths(prompts, responses, examples):
            CALLS.append((list(prompts), list(responses), [e["k"] for e in examples]))
            return [len(r) for r in responses]
        """)
    monkeypatch.chdir(tmp_path)
    fn = resolve_rule(f"{name}:lengths")
    got = RuleScorer(fn, "x").score(["a", "b", "c"], ["x", "yy", ""], [{"k": 1}, {"k": 2}, {"k": 3}])
    assert got.tolist() == [1.0, 2.0, 0.0] and got.dtype == torch.float32
    assert __import__(name).CALLS == [(["a", "b", "c"], ["x", "yy", ""], [1, 2, 3])]


def test_batched_by_attribute_and_its_return_checked():
    def tensor_scores(prompts, responses, examples):
        return torch.tensor([0.5] * len(responses))
    tensor_scores.batched = True  # what a file that does not import rlhflab writes
    assert RuleScorer(tensor_scores).score(["a", "b"], ["x", "y"], [{}, {}]).tolist() == [0.5, 0.5]

    @batched
    def short(prompts, responses, examples):
        return [1.0]
    with pytest.raises(UserError, match=r"returned 1 values for 2 responses; return one reward per response"):
        RuleScorer(short, "m:short").score(["a", "b"], ["x", "y"], [{}, {}])


# --------------------------------------------------------------------------------------
# One-line errors
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, spec, message", [
    (REVERSE, "{name}:scor", r"has no 'scor'; did you mean 'score'\? it defines: score, exact"),
    ("import no_such_dependency_xyz\n", "{name}:score",
     r"importing it raised ModuleNotFoundError: No module named 'no_such_dependency_xyz' at plugin_\w+\.py:1; fix"),
    ("def score(prompt, response):\n    return 1.0\n", "{name}:score",
     r"takes \(prompt, response\) but is called as fn\(prompt, response, example\)"),
    ("def score(p, r, e):\n    return e['target']\n", "{name}:score",
     r"raised KeyError: 'target' at plugin_\w+\.py:2 on prompt 'cat'; fix the function"),
    ("def score(p, r, e):\n    return 'high'\n", "{name}:score", r"returned str 'high' for prompt 'cat'; return a number"),
    ("def score(p, r, e):\n    return [1.0]\n", "{name}:score", r"return a number \(a list: mark a function .*batched\)"),
    ("def score(p, r, e):\n    return float('nan')\n", "{name}:score", r"returned nan .* must return a finite number"),
    ("score = 3\n", "{name}:score", r"is a int, not a function"),
    ("def score(p, r, e)\n    return 1\n", "{name}:score", r"importing it raised SyntaxError.* at plugin_\w+\.py:1"),
])
def test_errors_are_one_line_and_name_the_fix(tmp_path, monkeypatch, body, spec, message):
    name = write_module(tmp_path, body)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=message) as err:
        score_one(spec.format(name=name))
    assert "\n" not in str(err.value)


def test_missing_module_and_file_say_where_they_were_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"no module 'my_rewardz' in the current directory \(.*\), the config's "
                                        r"folder \(/nowhere\) or the installed packages"):
        resolve_rule("my_rewardz:score", "/nowhere")
    with pytest.raises(UserError, match=r"file my_rewardz.py not found \(looked at .*my_rewardz.py, "
                                        r"/nowhere/my_rewardz.py\)"):
        resolve_rule("my_rewardz.py:score", "/nowhere")
    with pytest.raises(UserError, match=r"not registered; did you mean 'gsm8k'\?.*or give module:function"):
        resolve_rule("gsm8kk")
    with pytest.raises(UserError, match=r"write module:function"):
        resolve_rule("my_rewards:")


def test_checks_must_return_booleans(tmp_path, monkeypatch):
    from rlhflab.evaluate import EvalChecks, judge

    name = write_module(tmp_path, "def half(p, r, e):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    checks = EvalChecks(resolve_rule(f"{name}:half"), f"{name}:half")
    with pytest.raises(UserError, match=r"returned 0.5 .* a check must return True or False"):
        judge(checks, ["cat"], [" tac"], [{}])


# --------------------------------------------------------------------------------------
# Preflight: before any model loads
# --------------------------------------------------------------------------------------
@pytest.fixture
def task(tmp_path):
    """A reversal task folder: train/test rows with non-default field names, a plug-in file."""
    folder = tmp_path / "task"
    folder.mkdir()
    rows = [{"word": w, "reversed": w[::-1]} for w in ("cat", "dog", "bird", "fish")]
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _task_overrides(task: Path, model_dir: Path, out: Path, reward: str, correct: str | None = None) -> list[str]:
    over = [f"model.name_or_path={model_dir}", f"dataset.path={task / 'train.jsonl'}",
            f"dataset.eval_path={task / 'test.jsonl'}", "dataset.prompt_field=word", "dataset.answer_field=reversed",
            'dataset.prompt_template="Reverse: {prompt}\\nAnswer:"', f"training.output_dir={out}",
            f"reward.sources=[{{type: rule, name: '{reward}'}}]", "training.device=cpu"]
    return over + ([f"eval.correct='{correct}'"] if correct else [])


def test_preflight_calls_each_plugin_once_on_a_row_and_reports(task, tmp_path, monkeypatch, capsys):
    from rlhflab.rewards.preflight import preflight

    name = write_module(task, """
        SEEN = []
        def score(prompt, response, example):
            SEEN.append((prompt, response, dict(example)))
            return 1.0 if response.strip() == example["answer"] else 0.0
        def exact(prompt, response, example):
            return response.strip() == example["reversed"]
        """)
    monkeypatch.chdir(task)
    cfg, _ = load_config(None, PPORunConfig, _task_overrides(task, tmp_path, tmp_path / "out",
                                                             f"{name}:score", f"{name}:exact"))
    calls = preflight(cfg)
    # The row as the trainer passes it: every field, plus `answer` copied from answer_field;
    # the stand-in response is that answer, so a sound reward gives it full marks.
    assert __import__(name).SEEN == [("Reverse: cat\nAnswer:", "tac",
                                      {"word": "cat", "reversed": "tac", "answer": "tac"})]
    assert [(c.key, c.value) for c in calls] == [("reward.sources[0]", 1.0), ("eval.correct", 1.0)]
    out = capsys.readouterr().out
    assert f"preflight: reward.sources[0] {name}:score on row 0 of {task / 'train.jsonl'}" in out
    assert f"eval/accuracy: eval.correct ({name}:exact)" in out


def test_preflight_says_when_accuracy_is_not_logged(task, tmp_path, monkeypatch, capsys):
    from rlhflab.rewards.preflight import preflight

    name = write_module(task)
    monkeypatch.chdir(task)
    cfg, _ = load_config(None, PPORunConfig, _task_overrides(task, tmp_path, tmp_path / "o", f"{name}:score"))
    preflight(cfg)
    assert "eval/accuracy: not logged (the held-out rows have no numeric answers for the GSM8K checker); set eval.correct" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["ppo", "grpo", "rloo", "reinforce-pp", "dr-grpo", "trpo"])
def test_a_broken_plugin_fails_before_any_model_loads(command, task, tmp_path, monkeypatch):
    """The model builder of the RL loop is replaced by a tripwire: the error must come
    first, as one line naming the config key, the plug-in, the row and the fix, with no
    output folder made."""
    import importlib

    from rlhflab.config.cli import SCHEMAS
    from rlhflab.trainers import loop

    def tripwire(*a, **k):
        raise AssertionError("a model was loaded before the plug-in was checked")
    monkeypatch.setattr(loop, "build_models", tripwire)
    name = write_module(task, "def score(prompt, response, example):\n    return example['target']\n")
    monkeypatch.chdir(task)
    module_name, _, schema_name = SCHEMAS[command].partition(":")
    module = importlib.import_module(module_name)
    out = tmp_path / "out"
    cfg, _ = load_config(None, getattr(module, schema_name), _task_overrides(task, tmp_path, out, f"{name}:score"))
    with pytest.raises(UserError) as err:
        module.train(cfg, quiet=True)
    msg = str(err.value)
    assert msg.startswith(f"preflight of reward.sources[0] on row 0 of {task / 'train.jsonl'}: plug-in '{name}:score' "
                          f"raised KeyError: 'target' at {name}.py:2 on prompt 'Reverse: cat\\nAnswer:'")
    assert "\n" not in msg and not out.exists()


def test_preflight_checks_model_paths_without_loading_them(task, tmp_path):
    from rlhflab.rewards.preflight import preflight

    cfg, _ = load_config(None, PPORunConfig, _task_overrides(task, tmp_path, tmp_path / "o", "gsm8k") + [
        f"reward.sources=[{{type: classifier, path: {tmp_path / 'no-such-classifier'}, label: POSITIVE}}]"])
    with pytest.raises(UserError, match=r"preflight: reward.sources\[0\] \(classifier\) path .*no-such-classifier"
                                        r"' does not exist"):
        preflight(cfg, quiet=True)


def test_cli_prints_the_preflight_error_and_exits_2(task, tmp_path, monkeypatch, capsys):
    from rlhflab.cli import main

    (task / "ppo.yaml").write_text(
        f"model: {{name_or_path: {tmp_path / 'no-model-needed'}}}\n"
        f"dataset: {{path: train.jsonl, eval_path: test.jsonl, prompt_field: word, answer_field: reversed}}\n"
        "reward:\n  sources: [{type: rule, name: missing_rewards.py:score}]\n"
        f"training: {{output_dir: {tmp_path / 'out'}, device: cpu}}\n")
    monkeypatch.chdir(task)
    assert main(["ppo", "--config", "ppo.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: preflight of reward.sources[0]: plug-in 'missing_rewards.py:score': file "
                          "missing_rewards.py not found") and err.count("\n") == 1


def test_an_error_inside_a_library_names_the_plugins_own_line(tmp_path, monkeypatch):
    name = write_module(tmp_path, "import json\n\ndef score(p, r, e):\n    return json.loads(r)\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=rf"raised JSONDecodeError: .* at {name}\.py:4 on prompt 'cat'"):
        score_one(f"{name}:score")
