"""The measured figures the pages quote come from one results file each.

- every marked section (`<!-- figure:VIEW -->` ... `<!-- /figure -->`) of README.md,
  docs/*.md and bench/README.md is what scripts/insert_figures.py writes from its results
  file now: a hand edit of a quoted figure, or a results file re-measured without
  rerunning the script, fails here;
- every view is shown on some page, and every results file names its script (which
  exists), the command, the machine, the date and at least two runs;
- the ranges are worked by hand; scripts/measure_readme.py writes a results file that the
  views read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from file_modules import load_file

ROOT = Path(__file__).resolve().parents[1]


FIG = load_file("insert_figures", ROOT / "scripts" / "insert_figures.py")


@pytest.fixture(scope="module")
def filled() -> dict[Path, str]:
    return FIG.pages()


def test_pages_match_their_results_files(filled):
    assert filled, "no page quotes a measured figure between markers"
    for page, text in filled.items():
        assert page.read_text(encoding="utf-8") == text, (
            f"{page.relative_to(ROOT)}: a figure differs from its results file; "
            "run .venv/bin/python scripts/insert_figures.py (and do not edit between the markers)")


def test_every_view_is_shown_and_every_results_file_is_read(filled):
    shown = {v for text in filled.values() for v in FIG.views_in(text)}
    assert shown == set(FIG.VIEWS), f"views on no page: {sorted(set(FIG.VIEWS) - shown)}"
    files = {p.stem for d in FIG.RESULT_DIRS for p in d.glob("*.json")}
    assert files == {name for name, _ in FIG.VIEWS.values()}, "a results file that no view reads, or the reverse"


@pytest.mark.parametrize("name", sorted({name for name, _ in FIG.VIEWS.values()}))
def test_results_file_says_where_it_comes_from(name):
    rec = FIG.load_results(name)
    script = rec["script"]
    assert (ROOT / script).is_file(), f"{name}.json names {script}, which does not exist"
    assert script in rec["command"], f"{name}.json: the command does not run {script}"
    assert len(rec["runs"]) >= 2, f"{name}.json: a figure needs its range over repeated runs"
    assert rec["date"][:4].isdigit() and rec["machine"]


def test_a_hand_edited_figure_is_caught(filled):
    page, text = next((p, t) for p, t in filled.items() if "figure:quickstart-table" in t)
    quoted = FIG.pct_span([r["accuracy_sft"] for r in FIG.load_results("quickstart")["runs"]])
    edited = text.replace(f"| {quoted} |", "| 12.5% |")
    assert edited != text                                   # the page quotes the results file's figure
    assert FIG.fill(edited) == text                         # the script writes it back


def test_markers_must_pair_and_name_a_view():
    with pytest.raises(SystemExit, match="do not pair up"):
        FIG.fill("<!-- figure:quickstart-output -->\nno closing marker\n")
    with pytest.raises(SystemExit, match="unknown figure 'nope'"):
        FIG.fill("<!-- figure:nope -->\n<!-- /figure -->")
    # a marker mentioned inside a sentence (docs/README.md explains them) is not one
    mention = "between `<!-- figure:NAME -->` markers\n"
    assert FIG.fill(mention) == mention


def test_spans_worked_by_hand():
    assert FIG.span([145.2, 151.4, 161.8]) == "145-162"              # rounded ends
    assert FIG.span([145.2, 151.4, 161.8], "{:.1f}") == "145.2-161.8"
    # the same in every run: one value (the quickstart's reward after SFT is 0.29350000117)
    assert FIG.span([0.29350000117, 0.29350000117], "{:.3f}") == "0.294"
    assert FIG.pct_span([0.215, 0.215, 0.215]) == "21.5%"
    assert FIG.pct_span([0.79, 0.815]) == "79.0-81.5%"
    # the median of six ratios: (2.15 + 2.15) / 2
    assert FIG._median_span([2.28, 2.15, 2.22, 1.96, 2.12, 2.15]) == "1.96-2.28 (median 2.15)"


def test_runs_that_differ_are_quoted_as_a_range():
    rec = FIG.load_results("quickstart")
    rec["runs"] = [dict(rec["runs"][0]), dict(rec["runs"][1])]
    rec["runs"][0]["accuracy_sft"] = rec["runs"][1]["accuracy_sft"] = 0.215
    rec["runs"][0]["accuracy_ppo"], rec["runs"][1]["accuracy_ppo"] = 0.895, 0.905
    rec["name"] = "quickstart"
    row = FIG.quickstart_table(rec).splitlines()[2]
    # 89.5 - 21.5 = 68.0 and 90.5 - 21.5 = 69.0 points
    assert "| 2 | 21.5% |" in row and "| 89.5-90.5% (+68.0-69.0 points) |" in row


def test_measure_readme_writes_what_the_views_read(tmp_path, monkeypatch):
    measure = load_file("measure_readme", ROOT / "scripts" / "measure_readme.py")
    run = {"accuracy after SFT (greedy)": 0.2, "accuracy after PPO step 10": 0.7, "accuracy after PPO (greedy)": 0.8,
           "reward after SFT": 0.28, "reward after PPO": 0.82, "seconds, all five stages (summary.json)": 70.0,
           "seconds, SFT warm start": 45.0, "seconds, the whole command": 75.0, "PPO episodes/s": 80.0,
           "accuracy after SFT (sampled, temperature 1)": 0.35, "load average before": 0.5, "load average after": 0.9}
    rec = measure.quickstart_record([run, {**run, "PPO episodes/s": 76.0}], "scripts/measure_readme.py --runs 2")
    assert rec["load_average"] == [0.5, 0.9] and rec["shown_run"] == 2
    assert rec["conditions"] == "on a quiet machine"          # load 0.9 on 2 cores
    (tmp_path / "quickstart.json").write_text(json.dumps(rec))
    monkeypatch.setattr(FIG, "RESULT_DIRS", (tmp_path,))
    table = FIG.render("quickstart-table")
    assert "| 2 | 20.0% | 70.0% | 80.0% (+60.0 points) | 0.280 | 0.820 |" in table
    assert "| 76.0-80.0 | 35.0% |" in table
    assert "wall time 70 s, PPO 76.00 episodes/s" in FIG.render("quickstart-output")   # the second run's table


def test_recipe_rows_show_wall_minutes_and_phases_where_recorded():
    base = {"recipe": "grpo", "seed": 0, "steps": 50, "before": 0.315, "after": 0.49, "n_eval": 200,
            "train_minutes": 16.9, "s_per_step": 20.3, "threads": 2, "load": 2.3, "overrides": []}
    rec = {"machine": "m", "date": "d", "script": "s", "command": "c", "runs": [
        {**base, "train_wall_minutes": 17.82, "phase_seconds": {"generate": 5.16, "forward": 4.38, "update": 9.94}},
        {**base, "seed": 1, "note": "earlier settings"}]}
    new, old = FIG.recipes_table(rec).splitlines()[2:4]
    # 31.5% -> 49.0% is +17.5; the phases' medians at one decimal; a row without them shows '-'
    assert "| 31.5% → 49.0% (200 rows) | +17.5 | - | 16.9 | 17.8 | 20 | 5.2 / 4.4 / 9.9 | 2 | 2.3 | - |" in new
    assert "| 16.9 | - | 20 | - | 2 |" in old and old.endswith("| earlier settings |")


def test_summary_is_one_range_over_the_shipped_runs_of_every_machine():
    base = {"recipe": "ppo", "seed": 0, "steps": 44, "before": 0.315, "after": 0.525, "n_eval": 200,
            "train_minutes": 18.6, "s_per_step": 25.4, "threads": 2, "load": 1.9, "overrides": []}
    rec = {"machine": "2-core Intel", "date": "d", "script": "s", "command": "c", "runs": [
        base, {**base, "seed": 1, "after": 0.52},
        {**base, "recipe": "grpo", "after": 0.5, "machine": "2-core AMD"},
        {**base, "after": 0.9, "note": "earlier settings"},             # not the config as it is now
        {**base, "after": 0.1, "n_eval": 100}]}                          # not the 200 held-out rows
    rows = FIG.recipes_table(rec).splitlines()
    assert rows[4].endswith("| on a 2-core AMD |") and rows[2].endswith("| - |")
    # gains 52.5 - 31.5 = +21.0, 52.0 - 31.5 = +20.5, 50.0 - 31.5 = +18.5: the range +18.5 to +21.0
    assert FIG.recipes_summary(rec) == (
        "On SmolLM2-135M-Instruct, 3 runs of the 2 shipped recipes (seeds, two 2-core CPUs) raised held-out greedy "
        "accuracy on easy word problems from 31.5% by **+18.5 to +21.0 points**.")
