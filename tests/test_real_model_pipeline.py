"""scripts/real_model_pipeline.py: the pair building of stage 2 on hand-made samples (fast),
and the whole chain with --quick on SmolLM2-135M-Instruct (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from file_modules import load_file

from rlhflab.data.preferences import pairs_from_samples

ROOT = Path(__file__).resolve().parents[1]
pipeline = load_file("real_model_pipeline", ROOT / "scripts" / "real_model_pipeline.py")


def test_pairs_from_samples_pairs_best_with_worst_and_uses_each_response_once():
    # scores 1, 0, 1, 0, 0 -> ranked (stable): a, c | b, d, e; best a with worst e, then c with d
    rows = pairs_from_samples("Q", ["a", "b", "c", "d", "e"], [1, 0, 1, 0, 0], max_pairs=5, pair_id=7)
    assert [(r["chosen"], r["rejected"]) for r in rows] == [("a", "e"), ("c", "d")]
    assert rows[0] == {"prompt": "Q", "chosen": "a", "rejected": "e", "margin": 1.0, "pair_id": "7/0", "n_labels": 1}
    # max_pairs caps it (5 distinct responses make at most 2 pairs anyway)
    assert len(pairs_from_samples("Q", ["a", "b", "c", "d", "e"], [1, 0, 1, 0, 0], max_pairs=1)) == 1
    # all equal: nothing; a duplicate text counts once (its first score), so "x" x3 + "y" gives one pair
    assert pairs_from_samples("Q", ["a", "b"], [1, 1]) == []
    assert pairs_from_samples("Q", ["a", "b"], [0, 0]) == []
    assert [(r["chosen"], r["rejected"]) for r in pairs_from_samples("Q", ["x", "x", "y", "x"], [0, 0, 1, 0],
                                                                      max_pairs=3)] == [("y", "x")]
    with pytest.raises(ValueError):
        pairs_from_samples("Q", ["a"], [1, 0])


def test_build_pairs_counts_the_prompts_without_a_pair():
    prompts = ["p0", "p1", "p2", "p3"]
    samples = [["r", "w", "w2"],      # one right, two wrong -> 1 pair (max_pairs=2, only one right)
               ["r", "r2"],           # all right -> dropped
               ["w", "w"],            # all wrong (one distinct) -> dropped
               ["r", "w", "r2", "w2"]]  # two right, two wrong -> 2 pairs
    labels = [[True, False, False], [True, True], [False, False], [True, False, True, False]]
    got = pipeline.build_pairs(prompts, samples, labels, max_pairs=2)
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in got.pairs] == [
        ("p0", "r", "w2"), ("p3", "r", "w2"), ("p3", "r2", "w")]
    assert (got.prompts, got.all_right, got.all_wrong) == (4, 1, 1)
    assert got.samples_right == pytest.approx(5 / 11)  # 1 + 2 + 0 + 2 right of 3 + 2 + 2 + 4 samples
    with pytest.raises(ValueError):
        pipeline.build_pairs(["p"], [["a", "b"]], [[True]])


def test_split_by_prompt_holds_out_whole_prompts():
    pairs = [{"prompt": f"p{i}", "chosen": "a", "rejected": f"b{j}"} for i in range(10) for j in range(i % 3)]
    train, test = pipeline.split_by_prompt(pairs, 0.2, seed=0)
    assert len(train) + len(test) == len(pairs)
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in test}
    assert len({p["prompt"] for p in test}) == 1  # round(0.2 * 6 prompts with pairs: i % 3 != 0)
    # two prompts: one on each side even for a tiny fraction; one prompt: all training
    two = [{"prompt": "a"}, {"prompt": "b"}]
    assert [len(x) for x in pipeline.split_by_prompt(two, 0.01)] == [1, 1]
    assert [len(x) for x in pipeline.split_by_prompt(two[:1], 0.5)] == [1, 0]
    assert pipeline.split_by_prompt(pairs, 0.2, seed=0) == (train, test)  # the seed fixes it


@pytest.mark.slow
def test_quick_pipeline_on_smollm2(smollm2_dir, tmp_path, capsys):
    from rlhflab.data.wordproblems import write_task

    data, out = tmp_path / "wp", tmp_path / "pipe"
    write_task(data)  # the standard rows: the quick run's pair count (3 pairs at seed 0) was checked on them
    # --threads 2: CI's two cores (the 135M model's matmuls are most of this test's time); the
    # 3 pairs (2 train, 1 held out) at seed 0 were checked at 2 threads as at 1
    assert pipeline.main(["--quick", "--threads", "2", "--model", str(smollm2_dir), "--data", str(data),
                          "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("| stage | measures"):]
    stages = [line.split("|")[1].strip() for line in table.splitlines()[2:] if line.startswith("| ")]
    assert stages == ["base", "sft", "sft", "pairs", "rm", "ppo", "ppo", "dpo", "dpo"]
    for stage in ("sft", "rm", "ppo", "dpo"):
        assert (out / stage / "final" / "config.json").is_file(), stage
    for stage in ("base", "sft", "ppo", "dpo"):
        assert len((out / "eval" / f"{stage}.jsonl").read_text().splitlines()) == 2, stage  # --quick: 2 rows
    train = [json.loads(x) for x in (out / "pairs" / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (out / "pairs" / "test.jsonl").read_text().splitlines()]
    assert train and test and not {p["prompt"] for p in train} & {p["prompt"] for p in test}
    from rlhflab.data.wordproblems import extract_answer
    questions = {r["question"] for r in map(json.loads, (data / "train.jsonl").read_text().splitlines())}
    for p in train + test:  # the raw question (rm and dpo apply the template), right answer chosen over a wrong one
        assert p["prompt"] in questions and "<|im_start|>" not in p["prompt"]
        assert p["chosen"] != p["rejected"] and extract_answer(p["chosen"]) != extract_answer(p["rejected"])
    record = json.loads((out / "results.jsonl").read_text().splitlines()[-1])
    assert record["quick"] and len(record["rows"]) == 9
    steps = record["stages"]["ppo"]["per_step"]
    assert [s["step"] for s in steps] == [0, 1]  # the true check and the reward model's score at every step
    assert all(s["rm_score"] is not None and 0 <= s["accuracy"] <= 1 for s in steps)
    assert 0 <= record["stages"]["rm"]["accuracy_after"] <= 1
