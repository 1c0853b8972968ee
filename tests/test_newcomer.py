"""The project as a newcomer meets it: learner mode from a plain install (no pytest), the
pipeline script without an activated venv, one prompt template for eval and generate, and
`--help` that says where the config keys are."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlhflab import cli

ROOT = Path(__file__).resolve().parents[1]


def _no_pytest_env(tmp_path: Path) -> dict[str, str]:
    """An environment in which `import pytest` fails, as after a plain `pip install rlhflab`."""
    blocker = tmp_path / "no-pytest"
    (blocker / "pytest").mkdir(parents=True)
    (blocker / "pytest" / "__init__.py").write_text("raise ImportError('pytest is not installed here')\n")
    (blocker / "_pytest").mkdir()
    (blocker / "_pytest" / "__init__.py").write_text("raise ImportError('pytest is not installed here')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT)]),
            "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def test_learn_check_works_without_pytest(tmp_path):
    from test_learn import REFERENCE_ANSWERS, write_workspace

    env = _no_pytest_env(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import pytest"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "not installed here" in probe.stderr  # the blocker works

    def learn(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rlhflab", "learn", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)

    # Fresh stubs: graded, every exercise fails, exit 1 (today: ModuleNotFoundError: pytest).
    assert learn("init", "stubs").returncode == 0
    proc = learn("check", "1", "--dir", "stubs")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "Exercise 1" in proc.stdout and "FAIL" in proc.stdout
    # The library's own answers: every check passes, exit 0.
    write_workspace(tmp_path / "done", REFERENCE_ANSWERS)
    proc = learn("check", "--dir", "done")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Exercises passed: 5 of 5" in proc.stdout


def test_grader_captures_what_the_learners_code_prints(tmp_path):
    from test_learn import REFERENCE_ANSWERS, write_workspace

    from rlhflab.learn.grader import format_report, grade

    files = dict(REFERENCE_ANSWERS)
    files["ex2_value_loss.py"] = ("from rlhflab.learn.reference import compute_value_loss as _ref\n"
                                  "def compute_value_loss(*a, **k):\n"
                                  "    print('debug: value loss called')\n"
                                  "    raise ValueError('not yet')\n")
    report = grade(write_workspace(tmp_path / "ws", files), [1, 2])
    assert {r.exercise for r in report.results if r.passed} == {1}
    failed = [r for r in report.results if not r.passed]
    assert failed and all(r.exercise == 2 for r in failed) and report.internal_errors == 0
    assert "debug: value loss called" in failed[0].output
    assert "your code printed:" in format_report(report)


def test_pipeline_script_finds_the_repo_venv_without_activation(tmp_path):
    # PATH without any rlhflab, no venv activated: the script uses the repo's .venv.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", "-c", "source scripts/find_rlhflab.sh && echo \"$RLHFLAB\""], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    venv = ROOT / ".venv" / "bin" / "rlhflab"
    if venv.exists():
        assert proc.returncode == 0 and proc.stdout.strip() == str(venv)
    # A checkout with no .venv and nothing on PATH: the fix, not `rlhflab: command not found`.
    bare = tmp_path / "repo"
    (bare / "scripts").mkdir(parents=True)
    for name in ("find_rlhflab.sh", "pipeline_debug.sh"):
        shutil.copy(ROOT / "scripts" / name, bare / "scripts" / name)
    proc = subprocess.run(["bash", "scripts/pipeline_debug.sh", str(tmp_path / "out")], cwd=bare, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "command not found" not in proc.stderr
    assert "error: rlhflab not found: run `make venv`" in proc.stderr
    # $RLHFLAB wins over everything.
    proc = subprocess.run(["bash", "-c", "source scripts/find_rlhflab.sh && echo \"$RLHFLAB\""], cwd=bare,
                          env={**env, "RLHFLAB": "/opt/x/rlhflab"}, capture_output=True, text=True)
    assert proc.stdout.strip() == "/opt/x/rlhflab"


def _defaults(command: str) -> argparse.Namespace:
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(cli.COMMANDS[command][0]).add_parser(parser)
    return parser.parse_args(["--model", "m", "--data", "d"] if command == "eval" else ["--model", "m"])


def test_generate_and_eval_share_the_prompt_template():
    from rlhflab.data.arith import PROMPT_TEMPLATE

    from rlhflab.evaluate import resolve_run_args

    ev = _defaults("eval")
    assert ev.template is None  # eval leaves it unset, so that --run RUN_DIR can supply the run's own
    resolve_run_args(ev)        # without --run: the same default generate has
    assert _defaults("generate").template == ev.template == PROMPT_TEMPLATE
    assert PROMPT_TEMPLATE == "Question: {prompt}\nAnswer:"


@pytest.mark.parametrize("command", ["ppo", "grpo", "rloo", "dpo", "sft", "rm"])
def test_help_points_to_config_show(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"rlhflab config show {command}" in out


def test_make_tiny_and_make_data_help_show_defaults(capsys):
    for command, fragments in (("make-tiny", ["(default: 192)", "(default: outputs/tiny-model)"]),
                               ("make-data", ["(default: 2000)", "(default: 0.6)"])):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        for fragment in fragments:
            assert fragment in out, (command, fragment)
