"""`rlhflab label export` feeds `rlhflab rm` as it is: no conversion step in between.

Skipped until the reward-model trainer (rlhflab/trainers/rm.py) exists. The config keys
it sets are gathered in RM_KEYS so they can follow the trainer's schema in one place.
"""

import json

import pytest

from rlhflab.cli import main
from rlhflab.label import db as labeldb

pytestmark = pytest.mark.slow

# dotted key -> value; {model}, {prefs}, {out} are filled in by the test
RM_KEYS = {
    "model.name_or_path": "{model}",
    "data.path": "{prefs}",
    "training.output_dir": "{out}",
    "training.device": "cpu",
    "rm.max_steps": "4",
    "rm.batch_size": "4",
}


def _labelled_db(path):
    """16 pairs whose labels always prefer the response that answers with a number."""
    conn = labeldb.connect(path, create=True)
    with labeldb.transaction(conn):
        for i in range(16):
            labeldb.add_candidates(conn, f"Question: {i} + 1?\nAnswer:",
                                   [f" The answer is {i + 1}.", " I do not know, sorry."])
    for pid in range(1, 17):
        # a_level 1 (A much better) on even pairs, 2 (A slightly better) on odd ones
        a_level = 1 if pid % 2 == 0 else 2
        level = 6 - a_level if labeldb.is_flipped(conn, pid, "ann") else a_level
        labeldb.submit_label(conn, labeldb.LabelIn(f"rm-sub-{pid:04d}", "ann", pid, level))
    conn.close()
    return path


@pytest.mark.timeout(600)
def test_exported_file_trains_a_reward_model(tmp_path):
    db = _labelled_db(tmp_path / "pairs.db")
    prefs = tmp_path / "prefs.jsonl"
    assert main(["label", "export", "--db", str(db), "--out", str(prefs)]) == 0
    rows = [json.loads(line) for line in prefs.read_text().splitlines()]
    assert len(rows) == 16 and {r["margin"] for r in rows} == {0.5, 1.0}
    assert all(r["chosen"].startswith(" The answer is") for r in rows)

    pytest.importorskip("rlhflab.trainers.rm", reason="the reward-model trainer is not written yet")
    from rlhflab.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    out = tmp_path / "rm-run"
    values = {"model": model, "prefs": prefs, "out": out}
    overrides = [f"{k}={str(v).format(**values)}" for k, v in RM_KEYS.items()]
    cfg = tmp_path / "rm.yaml"
    cfg.write_text("{}\n")  # everything comes from the overrides above
    assert main(["rm", "--config", str(cfg), *overrides]) == 0
    assert out.is_dir() and any(out.iterdir())
