"""`rlhflab label export` feeds `rlhflab rm` and `rlhflab dpo` as it is: no conversion.

The rm test is skipped until the reward-model trainer (rlhflab/trainers/rm.py) exists;
the config keys it sets are gathered in RM_KEYS so they can follow its schema in one place.
"""

import json
from pathlib import Path

import pytest
from label_helpers import tiny_model

from rlhflab.cli import main
from rlhflab.label import db as labeldb

REPO = Path(__file__).resolve().parents[1]

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
            # Raw prompts, as `label generate` stores them: dpo_debug's template is applied by the run.
            labeldb.add_candidates(conn, f"{i} + 1?",
                                   [f" The answer is {i + 1}.", " I do not know, sorry."])
    for pid in range(1, 17):
        # a_level 1 (A much better) on even pairs, 2 (A slightly better) on odd ones
        a_level = 1 if pid % 2 == 0 else 2
        level = 6 - a_level if labeldb.is_flipped(conn, pid, "ann") else a_level
        labeldb.submit_label(conn, labeldb.LabelIn(f"rm-sub-{pid:04d}", "ann", pid, level))
    conn.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture
def prefs(tmp_path):
    db = _labelled_db(tmp_path / "pairs.db")
    out = tmp_path / "prefs.jsonl"
    assert main(["label", "export", "--db", str(db), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 16 and {r["margin"] for r in rows} == {0.5, 1.0}
    assert all(r["chosen"].startswith(" The answer is") for r in rows)
    return out


@pytest.mark.timeout(600)
def test_exported_file_trains_a_reward_model(tiny, prefs, tmp_path):
    pytest.importorskip("rlhflab.trainers.rm", reason="the reward-model trainer is not written yet")
    out = tmp_path / "rm-run"
    values = {"model": tiny, "prefs": prefs, "out": out}
    overrides = [f"{k}={str(v).format(**values)}" for k, v in RM_KEYS.items()]
    cfg = tmp_path / "rm.yaml"
    cfg.write_text("{}\n")  # everything comes from the overrides above
    assert main(["rm", "--config", str(cfg), *overrides]) == 0
    assert out.is_dir() and any(out.iterdir())


@pytest.mark.timeout(600)
def test_exported_file_trains_dpo(tiny, prefs, tmp_path):
    pytest.importorskip("rlhflab.trainers.dpo", reason="the DPO trainer is not there")
    out = tmp_path / "dpo-run"
    assert main(["dpo", "--config", str(REPO / "configs" / "dpo_debug.yaml"),
                 f"model.name_or_path={tiny}", f"dataset.path={prefs}", "dataset.eval_path=null",
                 "dpo.task_eval_path=null", f"training.output_dir={out}", "dpo.max_steps=2",
                 "dpo.batch_size=8", "dpo.mini_batch_size=8", "logging.plots=false",
                 "logging.progress_bar=false"]) == 0
    assert (out / "final").is_dir()
