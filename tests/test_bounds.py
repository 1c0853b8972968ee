"""Numbers from outside are bounded: the labelling server answers 400/404 (never 500) to
any integer id, every numeric command-line option is range-checked before work starts,
and the doctor skips malformed metrics rows with a count instead of a traceback."""

from __future__ import annotations

import argparse
import importlib
import json

import pytest
from label_helpers import make_db

from rlhflab import cli
from rlhflab.label.app import create_app


# --------------------------------------------------------------------------------------
# The labelling server
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("pair_id", [10**30, -(10**30), 2**63, -(2**63) - 1, 2**63 - 1, 0, -1])
def test_any_integer_pair_id_is_a_400_or_404(tmp_path, pair_id):
    # 10**30 reached SQLite, whose integers stop at 2**63 - 1: OverflowError, HTTP 500.
    client = create_app(make_db(tmp_path / "p.db")).test_client()
    label = {"submission_id": "sub-000000001", "annotator": "ann", "pair_id": pair_id, "level": 2}
    skip = {"submission_id": "skip-00000001", "annotator": "ann", "pair_id": pair_id}
    for path, body in (("/api/labels", label), ("/api/skip", skip)):
        resp = client.post(path, data=json.dumps(body), content_type="application/json")
        assert resp.status_code in (400, 404), (path, pair_id, resp.status_code)
        assert f"pair {pair_id} does not exist" in resp.get_json()["error"]


# --------------------------------------------------------------------------------------
# Command-line numbers
# --------------------------------------------------------------------------------------
# Numeric options whose range run() or the command's config checks, with a message of its own
# (tests/test_label_cli.py, tests/test_learn.py, tests/test_label_generate.py).
CHECKED_IN_RUN = {("label serve", "--port"), ("label serve", "--labels-per-pair"),
                  ("label serve", "--max-comment"), ("label export", "--min-labels"),
                  ("learn check", "numbers"), ("learn solution", "number"), ("label generate", "--n")}


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(command, parser) for every command and subcommand of `rlhflab`."""
    out = []
    for name, (module, help_) in cli.COMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"rlhflab {name}")
        importlib.import_module(module).add_parser(parser)
        todo = [(name, parser)]
        while todo:
            cmd, p = todo.pop()
            out.append((cmd, p))
            for action in p._actions:
                if isinstance(action, argparse._SubParsersAction):
                    todo += [(f"{cmd} {sub}", sp) for sub, sp in action.choices.items()]
    return out


def test_every_numeric_option_is_range_checked():
    # type=int / type=float accept -1, 0, 1e30: each must be a cliargs type or checked in run().
    unchecked = []
    for cmd, parser in _parsers():
        for action in parser._actions:
            opt = action.option_strings[0] if action.option_strings else action.dest
            if action.type in (int, float) and (cmd, opt) not in CHECKED_IN_RUN:
                unchecked.append(f"{cmd} {opt}")
    assert unchecked == []


@pytest.mark.parametrize("argv, fragment", [
    (["make-data", "--n-train", "-1"], "argument --n-train: must be >= 1, got -1"),
    (["make-data", "--n-test", "0"], "argument --n-test: must be >= 1, got 0"),
    (["make-data", "--wrong-rate", "1.5"], "argument --wrong-rate: must be <= 1, got 1.5"),
    (["make-data", "--seed", "-3"], "argument --seed: must be >= 0, got -3"),
    (["make-tiny", "--layers", "0"], "argument --layers: must be >= 1, got 0"),
    (["make-tiny", "--heads", "two"], "argument --heads: expected a whole number, got 'two'"),
    (["make-prefs", "--samples", "1"], "argument --samples: must be >= 2, got 1"),
    (["eval", "--model", "m", "--data", "d", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1"),
    (["generate", "--model", "m", "--prompt", "p", "--temperature", "0"], "argument --temperature: must be > 0"),
    (["generate", "--model", "m", "--prompt", "p", "--top-p", "nan"], "expected a finite number, got 'nan'"),
    (["quickstart", "--threads", "-2"], "argument --threads: must be >= 1, got -2"),
])
def test_bad_numbers_stop_before_any_work(argv, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and fragment in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_more_problems_than_the_task_holds_is_one_line(tmp_path, capsys):
    # 40,000 + 20,000 distinct problems: more than the draw can give (a RuntimeError today).
    assert cli.main(["make-data", "--out", str(tmp_path / "a"), "--n-train", "40000", "--n-test", "20000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --n-train 40000 + --n-test 20000") and not (tmp_path / "a").exists()


# --------------------------------------------------------------------------------------
# The doctor
# --------------------------------------------------------------------------------------
def test_doctor_skips_malformed_rows_with_a_count(tmp_path, capsys):
    rows = [{"step": i, "rollout/reward_mean": 0.1 * i, "loss/value": 1.0} for i in range(6)]
    lines = [json.dumps(r) for r in rows]
    lines[2] = json.dumps({"step": "x", "rollout/reward_mean": 0.3})       # int("x"): ValueError today
    lines[3] = json.dumps({"step": None, "rollout/reward_mean": 0.3})      # int(None): TypeError today
    lines[4] = json.dumps({"step": 4.5, "rollout/reward_mean": [1, 2]})    # not a whole step
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rc = cli.main(["doctor", str(tmp_path), "--no-plot"])
    out = capsys.readouterr().out
    assert rc in (0, 1)
    assert "3 rows (3 malformed or incomplete rows skipped), last step 5" in out
    assert 'line 3: step "x" is not a whole number >= 0; skipped' in out
    # The plot reads the same rows.
    assert cli.main(["doctor", str(tmp_path)]) in (0, 1)
    assert (tmp_path / "doctor.png").is_file()
