"""`rlhflab label generate` on a tiny local model: N samples per prompt become pairs."""

import json
from math import comb

import pytest
import torch
from label_helpers import tiny_model

from rlhflab.cli import main
from rlhflab.label import db as labeldb

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = ["User: explain loops\nAssistant:", "Question: 2 + 3?\nAnswer:", "User: a poem\nAssistant:"]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows + rows[:1]))  # one duplicate
    return path


def _spy_generate(monkeypatch):
    """Record the keyword arguments every model.generate call receives."""
    import rlhflab.models.load as load

    calls = []
    real = load.load_model

    def wrapped(*args, **kwargs):
        model, tok = real(*args, **kwargs)
        inner = model.generate

        def generate(*a, **kw):
            calls.append(kw)
            return inner(*a, **kw)

        model.generate = generate
        return model, tok

    monkeypatch.setattr(load, "load_model", wrapped)
    return calls


def test_generate_samples_n_per_prompt_and_stores_all_pairs(tiny, prompts, tmp_path, capsys, monkeypatch):
    calls = _spy_generate(monkeypatch)
    cfg = tmp_path / "gen.yaml"
    cfg.write_text("generation:\n  max_new_tokens: 12\n  temperature: 1.3\n  top_p: 0.95\nbatch_size: 2\n")
    db = tmp_path / "pairs.db"
    argv = ["label", "generate", "--model", str(tiny), "--prompts", str(prompts), "--n", "4",
            "--out", str(db), "--config", str(cfg), "generation.top_k=50"]
    assert main(argv) == 0
    assert "3 rows" in capsys.readouterr().out  # the duplicate prompt is dropped

    # sampling settings come from the config (file + dotted override); 3 prompts in batches of 2,
    # each prompt's row repeated n = 4 times (rlhflab.rollout.generate): 2 x 4 rows, then 1 x 4
    assert len(calls) == 2
    assert [kw["input_ids"].shape[0] for kw in calls] == [8, 4]
    for kw in calls:
        assert kw["do_sample"] is True
        assert (kw["max_new_tokens"], kw["temperature"], kw["top_p"], kw["top_k"]) == (12, 1.3, 0.95, 50)
        ids = kw["input_ids"]
        assert torch.equal(ids[0::4], ids[3::4])  # rows [4i, 4i+4) answer prompt i

    conn = labeldb.connect(db)
    assert labeldb.count(conn, "prompts") == 3
    per_prompt = conn.execute("SELECT prompt_id, COUNT(*) FROM responses GROUP BY prompt_id").fetchall()
    assert all(1 <= n <= 4 for _, n in per_prompt)
    # every two distinct responses of a prompt form one pair: sum of C(k, 2)
    assert labeldb.count(conn, "pairs") == sum(comb(n, 2) for _, n in per_prompt)
    assert {r[0] for r in conn.execute("SELECT source FROM responses")} == {str(tiny)}
    conn.close()

    # the same seed samples the same responses again: nothing new is added
    assert main(argv) == 0
    assert "0 pairs added" in capsys.readouterr().out


def test_pairs_per_prompt_limits_the_pairs(tiny, prompts, tmp_path):
    db = tmp_path / "pairs.db"
    assert main(["label", "generate", "--model", str(tiny), "--prompts", str(prompts), "--n", "4",
                 "--out", str(db), "generation.max_new_tokens=8", "pairs_per_prompt=2"]) == 0
    conn = labeldb.connect(db)
    counts = [n for (n,) in conn.execute("SELECT COUNT(*) FROM pairs GROUP BY prompt_id")]
    assert counts and all(n <= 2 for n in counts)
    conn.close()


def test_bad_model_path_is_a_user_error(prompts, tmp_path, capsys):
    assert main(["label", "generate", "--model", str(tmp_path / "nope"), "--prompts", str(prompts),
                 "--out", str(tmp_path / "x.db")]) == 2
    assert "error: " in capsys.readouterr().err
    assert main(["label", "generate", "--model", "x", "--prompts", str(prompts), "--n", "1",
                 "--out", str(tmp_path / "x.db")]) == 2
    assert "n: must be >= 2" in capsys.readouterr().err


def test_seeded_sampling_makes_the_samples_independent_of_batch_size(tiny, prompts, tmp_path):
    """generation.seeded_sampling keys each row's noise by (seed, its index in the run):
    3 prompts one at a time or all in one call give the same responses."""
    texts = {}
    for batch in (1, 3):
        db = tmp_path / f"b{batch}.db"
        assert main(["label", "generate", "--model", str(tiny), "--prompts", str(prompts), "--n", "3",
                     "--out", str(db), "generation.max_new_tokens=8", "generation.seeded_sampling=true",
                     f"batch_size={batch}"]) == 0
        conn = labeldb.connect(db)
        texts[batch] = sorted(t for (t,) in conn.execute("SELECT text FROM responses"))
        conn.close()
    assert len(texts[1]) >= 6 and texts[1] == texts[3]
