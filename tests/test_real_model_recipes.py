"""scripts/real_model_recipes.py's timing fields of a results row, from metrics rows written
by hand: minutes of steps, s/step, wall minutes and the per-phase medians (`timing_fields`),
and what `record` reads back from a run folder's metrics.jsonl (`run_folder_fields`).
Evaluation-only lines are not steps; a run without timed steps says None, never 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from file_modules import load_file

ROOT = Path(__file__).resolve().parents[1]


RECIPES = load_file("real_model_recipes", ROOT / "scripts" / "real_model_recipes.py")

# Three timed steps as a policy trainer logs them, the step-0 evaluation before them (its own
# line, no time/*) and a held-out evaluation merged into step 3's row.
STEPS = [
    {"step": 0, "eval/accuracy": 0.315, "eval/reward_mean": 0.3},
    {"step": 1, "time/step": 20.0, "time/generate": 5.0, "time/forward": 4.0, "time/update": 11.0,
     "rollout/reward_mean": 0.2},
    {"step": 2, "time/step": 22.0, "time/generate": 7.0, "time/forward": 4.5, "time/update": 10.5,
     "rollout/reward_mean": 0.3},
    {"step": 3, "time/step": 27.0, "time/generate": 6.0, "time/forward": 3.0, "time/update": 18.0,
     "rollout/reward_mean": 0.4, "eval/accuracy": 0.49},
]
# medians of (5, 7, 6), (4, 4.5, 3), (11, 10.5, 18)
PHASES = {"generate": 6.0, "forward": 4.0, "update": 11.0}


def write_metrics(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_timing_fields_worked_by_hand_with_an_eval_line_mixed_in():
    t = RECIPES.timing_fields(STEPS, wall_seconds=90.0)
    assert t["steps"] == 3                                      # step 0's evaluation line is not a step
    assert t["train_minutes"] == pytest.approx((20 + 22 + 27) / 60)  # 69 s = 1.15 min
    assert t["s_per_step"] == pytest.approx(23.0)               # 69 / 3
    assert t["train_wall_minutes"] == pytest.approx(1.5)        # 90 s
    assert t["phase_seconds"] == PHASES
    # the order of the rows does not matter to a median
    assert RECIPES.phase_seconds(STEPS[::-1]) == PHASES


def test_medians_are_rounded_and_a_phase_some_step_lacks_is_left_out():
    rows = [{"step": 1, "time/step": 9.0, "time/generate": 1.234, "time/update": 2.0},
            {"step": 2, "time/step": 9.0, "time/generate": 1.0, "time/update": 3.0, "time/forward": 1.0}]
    # generate: (1.234 + 1.0) / 2 = 1.117 -> 1.12; update: (2 + 3) / 2 = 2.5; forward: step 1 has none
    assert RECIPES.phase_seconds(rows) == {"generate": 1.12, "update": 2.5}


def test_no_timed_steps_give_none_not_zero():
    evals_only = [{"step": 0, "eval/accuracy": 0.315}]
    assert RECIPES.phase_seconds(evals_only) is None
    assert RECIPES.phase_seconds([]) is None
    # steps logged without any phase timing (time/step alone): no phases either
    assert RECIPES.phase_seconds([{"step": 1, "time/step": 3.0}]) is None
    t = RECIPES.timing_fields(evals_only, wall_seconds=30.0)
    assert t == {"steps": 0, "train_minutes": None, "train_wall_minutes": 0.5, "phase_seconds": None,
                 "s_per_step": None}


def test_run_folder_fields_read_metrics_jsonl(tmp_path):
    run = write_metrics(tmp_path / "run", STEPS)
    assert RECIPES.run_folder_fields(run) == {"eval_by_step": {"0": 0.315, "3": 0.49}, "phase_seconds": PHASES}
    assert RECIPES.run_folder_fields(tmp_path / "no_such_run") == {}
    old = write_metrics(tmp_path / "old", [{"step": 0, "eval/accuracy": 0.3}, {"step": 5, "eval/accuracy": 0.4}])
    assert RECIPES.run_folder_fields(old) == {"eval_by_step": {"0": 0.3, "5": 0.4}, "phase_seconds": None}


def _record(results: Path, row: dict) -> dict:
    # an existing results file: `record` adds to it (a new one would name the machine)
    results.write_text(json.dumps({"name": "r", "script": "s", "command": "c", "machine": "m", "date": "d",
                                   "runs": []}))
    RECIPES.record(results, row, "cmd")
    return json.loads(results.read_text())["runs"][-1]


def test_a_row_from_another_machine_names_it(tmp_path, monkeypatch):
    run = write_metrics(tmp_path / "run", STEPS)
    base = {"recipe": "grpo", "seed": 0, "overrides": [], "run_dir": str(run), "threads": 2}
    monkeypatch.setattr(RECIPES, "machine", lambda: "m")          # the file's own machine ("m")
    assert "machine" not in _record(tmp_path / "results.json", base)
    monkeypatch.setattr(RECIPES, "machine", lambda: "2-core other CPU")
    assert _record(tmp_path / "results.json", base)["machine"] == "2-core other CPU"


def test_record_fills_in_phases_only_for_a_row_without_them(tmp_path):
    run = write_metrics(tmp_path / "run", STEPS)
    base = {"recipe": "grpo", "seed": 0, "overrides": [], "run_dir": str(run), "threads": 2}
    got = _record(tmp_path / "results.json", base)  # a row written before rows kept its phases
    assert got["phase_seconds"] == PHASES and got["eval_by_step"] == {"0": 0.315, "3": 0.49}
    kept = {"generate": 5.2, "forward": 4.4, "update": 9.9}  # the row's own, measured in the run
    assert _record(tmp_path / "results.json", {**base, "phase_seconds": kept})["phase_seconds"] == kept
    # a run folder without timed steps: the row says None, and the docs' table '-'
    untimed = write_metrics(tmp_path / "untimed", [{"step": 0, "eval/accuracy": 0.3}])
    row = _record(tmp_path / "results.json", {**base, "run_dir": str(untimed)})
    assert row["phase_seconds"] is None
    fig = load_file("insert_figures", ROOT / "scripts" / "insert_figures.py")
    table_row = fig.recipes_table({"machine": "m", "date": "d", "script": "s", "command": "c", "runs": [
        {**row, "steps": 0, "before": 0.3, "after": 0.3, "n_eval": 200, "train_minutes": 0.0, "s_per_step": 0.0,
         "load": 1.0}]}).splitlines()[2]
    assert "| 0 | - | 2 |" in table_row  # s/step 0, phases '-', threads 2
