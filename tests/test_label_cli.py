"""`rlhflab label import / stats / export / serve` through the real entry point."""

import json

import pytest
from label_helpers import make_db

from rlhflab.cli import main
from rlhflab.label import db as labeldb


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_import_then_export_round_trip(tmp_path, capsys):
    src = tmp_path / "pairs.jsonl"
    src.write_text(json.dumps({"prompt": "p", "response_a": "good", "response_b": "bad", "id": "r1"}) + "\n"
                   + json.dumps({"prompt": "q", "responses": ["x", "y"]}) + "\n")
    db = tmp_path / "pairs.db"
    assert main(["label", "import", str(src), "--db", str(db)]) == 0
    assert "2 pairs added" in capsys.readouterr().out

    conn = labeldb.connect(db)
    for pid in (1, 2):  # annotator says "A much better" on pair 1, "B slightly better" on pair 2
        a_level = 1 if pid == 1 else 4
        level = 6 - a_level if labeldb.is_flipped(conn, pid, "ann") else a_level
        labeldb.submit_label(conn, labeldb.LabelIn(f"cli-sub-{pid:04d}", "ann", pid, level))
    conn.close()

    out = tmp_path / "prefs.jsonl"
    assert main(["label", "export", "--db", str(db), "--out", str(out)]) == 0
    assert "wrote 2 rows" in capsys.readouterr().out
    assert _rows(out) == [
        {"prompt": "p", "chosen": "good", "rejected": "bad", "margin": 1.0, "pair_id": "r1", "n_labels": 1},
        {"prompt": "q", "chosen": "y", "rejected": "x", "margin": 0.5, "pair_id": 2, "n_labels": 1},
    ]

    assert main(["label", "stats", "--db", str(db)]) == 0
    text = capsys.readouterr().out
    assert "2 pairs" in text and "ann" in text and "k=1" in text
    assert main(["label", "stats", "--db", str(db), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["labels"] == 2


def test_export_keep_ties_and_min_labels(tmp_path, capsys):
    db = make_db(tmp_path / "p.db", n_prompts=1)
    conn = labeldb.connect(db)
    labeldb.submit_label(conn, labeldb.LabelIn("tie-sub-0001", "ann", 1, 3))
    conn.close()
    out = tmp_path / "prefs.jsonl"
    assert main(["label", "export", "--db", str(db), "--out", str(out)]) == 2
    assert "no pair to export (1 ties dropped" in capsys.readouterr().err
    assert main(["label", "export", "--db", str(db), "--out", str(out), "--keep-ties"]) == 0
    (row,) = _rows(out)
    assert row["tie"] is True and row["margin"] == 0.0
    assert main(["label", "export", "--db", str(db), "--out", str(out), "--min-labels", "0"]) == 2


@pytest.mark.parametrize("argv, fragment", [
    (["label", "stats", "--db", "nowhere.db"], "--db nowhere.db: no such file"),
    (["label", "export", "--db", "nowhere.db", "--out", "x.jsonl"], "no such file"),
    (["label", "serve", "--db", "nowhere.db"], "no such file"),
    (["label", "import", "nowhere.jsonl", "--db", "{tmp}/new.db"], "nowhere.jsonl: no such file"),
    (["label", "serve", "--db", "{db}", "--host", "0.0.0.0"], "without a token"),
    (["label", "serve", "--db", "{db}", "--token", "short"], "at least 8 characters"),
    (["label", "serve", "--db", "{db}", "--port", "70000"], "--port 70000"),
    (["label", "serve", "--db", "{db}", "--annotator-tokens", "{tmp}/none.json"], "--annotator-tokens"),
    (["label", "generate", "--prompts", "nowhere.jsonl", "--out", "{tmp}/g.db"], "--prompts nowhere.jsonl"),
    (["label", "generate", "--prompts", "x", "--out", "y", "generation.temprature=1"], "temprature"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, argv, fragment):
    monkeypatch.chdir(tmp_path)
    db = make_db(tmp_path / "p.db")
    argv = [a.format(tmp=tmp_path, db=db) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err, err


def test_subcommand_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["label"])
    assert exc.value.code == 2
