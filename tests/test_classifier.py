"""`rlhflab classifier`: labels from a jsonl, a classifier that learns a generated task, and a
saved folder that the `type: classifier` reward reads with the same numbers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from rlhflab.config import load_config
from rlhflab.errors import UserError
from rlhflab.trainers.classifier import (ClassifierRunConfig, evaluate_classifier, load_classifier_data,
                                         train_classifier)

ROOT = Path(__file__).resolve().parents[1]
GOOD, BAD = ("great", "lovely", "superb"), ("awful", "dull", "boring")
FILLER = ("the", "film", "plot", "was", "and", "it", "really", "music", "a", "very")


def labelled(n: int, seed: int) -> list[dict]:
    """Sentences of filler words with one sentiment word at a random place: the label is
    which list that word came from. Chance is 50%; only the sentiment word tells."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        positive = rng.random() < 0.5
        words = [rng.choice(FILLER) for _ in range(rng.randint(3, 6))]
        words.insert(rng.randrange(len(words) + 1), rng.choice(GOOD if positive else BAD))
        rows.append({"sentence": " ".join(words), "sentiment": "POSITIVE" if positive else "NEGATIVE"})
    return rows


def write(rows, path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(model_dir, train, test, out, *extra):
    over = [f"model.name_or_path={model_dir}", f"data.path={train}", f"data.eval_path={test}",
            "data.text_field=sentence", "data.label_field=sentiment", f"training.output_dir={out}",
            "classifier.max_steps=60", "classifier.batch_size=32", "classifier.learning_rate=3e-3",
            "training.eval_interval=0", "training.num_threads=1", "logging.progress_bar=false",
            "logging.plots=false", *extra]
    return load_config(ROOT / "configs" / "classifier_debug.yaml", ClassifierRunConfig, over)[0]


def test_classifier_learns_and_the_reward_reads_it(tiny_sft_rm_dir, tmp_path):
    from rlhflab.config.schema import RewardSource
    from rlhflab.rewards import build_source

    train = write(labelled(1200, seed=1), tmp_path / "train.jsonl")
    test_rows = labelled(200, seed=2)
    test = write(test_rows, tmp_path / "test.jsonl")
    res = train_classifier(_cfg(tiny_sft_rm_dir, train, test, tmp_path / "out"), quiet=True)
    assert res.labels == ["NEGATIVE", "POSITIVE"]
    before, after = res.eval_before["eval/accuracy"], res.eval_after["eval/accuracy"]
    assert 0.3 < before < 0.7          # a fresh head: chance on a balanced task
    assert after >= 0.9, res.history   # it learned which words carry the label
    assert res.eval_after["eval/loss"] < res.eval_before["eval/loss"]
    # The saved folder is a type: classifier reward source; its POSITIVE probability, thresholded
    # at 1/2, reproduces the trainer's held-out accuracy exactly.
    scorer = build_source(RewardSource(type="classifier", path=str(res.final_dir), label="POSITIVE", text="response"))
    probs = scorer.score([""] * len(test_rows), [r["sentence"] for r in test_rows], [{}] * len(test_rows))
    agree = [(p > 0.5) == (r["sentiment"] == "POSITIVE") for p, r in zip(probs.tolist(), test_rows)]
    assert sum(agree) / len(agree) == pytest.approx(after)
    assert (res.output_dir / "metrics.jsonl").is_file() and (res.output_dir / "train_result.json").is_file()


def test_labels_ints_and_names(tmp_path):
    from rlhflab.trainers.classifier import ClassifierDataConfig

    ints = write([{"text": f"t{i}", "label": i % 3} for i in range(20)], tmp_path / "ints.jsonl")
    data = load_classifier_data(ClassifierDataConfig(path=str(ints), eval_fraction=0.2))
    assert data.labels == ["0", "1", "2"] and len(data.eval) == 4 and len(data.train) == 16
    assert all(r.label == int(r.text[1:]) % 3 for r in data.train + data.eval)  # the integer is the id
    names = write([{"text": "x", "label": "b"}, {"text": "y", "label": "a"}] * 5, tmp_path / "names.jsonl")
    data = load_classifier_data(ClassifierDataConfig(path=str(names), eval_fraction=0.2))
    assert data.labels == ["a", "b"]  # sorted: ids do not depend on row order
    assert {(r.text, r.label) for r in data.train} == {("x", 1), ("y", 0)}


@pytest.mark.parametrize("rows, message", [
    ([{"text": "x", "label": "A"}] * 4, r"every row has label 'A'; a classifier needs at least two labels"),
    ([{"text": "x", "label": [1]}, {"text": "y", "label": "B"}], r"label \[1\] is a list; labels must be names"),
    ([{"text": "x"}, {"text": "y", "label": "B"}], r"row 0 lacks field\(s\) \['label'\]"),
])
def test_bad_label_files_are_one_line_errors(tmp_path, rows, message):
    from rlhflab.trainers.classifier import ClassifierDataConfig

    path = write(rows, tmp_path / "bad.jsonl")
    with pytest.raises(UserError, match=message):
        load_classifier_data(ClassifierDataConfig(path=str(path), eval_fraction=0.5))


def test_cli_reports_a_bad_file_before_loading_a_model(tmp_path, capsys, monkeypatch):
    from rlhflab.cli import main
    from rlhflab.trainers import classifier

    monkeypatch.setattr(classifier, "build_classifier", lambda *a, **k: pytest.fail("model loaded first"))
    rc = main(["classifier", "--config", str(ROOT / "configs" / "classifier_debug.yaml"),
               f"data.path={tmp_path / 'missing.jsonl'}", f"training.output_dir={tmp_path / 'out'}"])
    assert rc == 2 and "missing.jsonl not found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_evaluate_classifier_counts_by_hand():
    """A stand-in model whose logits are given: argmax accuracy and mean cross-entropy."""
    from types import SimpleNamespace

    from rlhflab.trainers.classifier import LabelledText

    class Fixed(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            # rows: [2, 0] -> class 0, [0, 2] -> class 1, [1, 1] -> a tie, argmax picks 0
            table = torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
            return SimpleNamespace(logits=table[input_ids[:, 0]])

    def tokenizer(texts, **kw):
        ids = torch.tensor([[int(t)] for t in texts])
        return SimpleNamespace(to=lambda d: {"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    rows = [LabelledText("0", 0), LabelledText("1", 0), LabelledText("2", 1)]
    got = evaluate_classifier(Fixed(), tokenizer, rows, 8, 2, "cpu")
    # right, wrong, wrong -> 1/3. CE: -log softmax = log(1 + e^-2) = 0.1269, log(1 + e^2) = 2.1269, log 2 = 0.6931
    assert got["eval/accuracy"] == pytest.approx(1 / 3)
    assert got["eval/loss"] == pytest.approx((0.126928 + 2.126928 + 0.693147) / 3, abs=1e-5)
