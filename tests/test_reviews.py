"""The offline sentiment task: the lexicon check by hand, and what make-reviews writes."""

from __future__ import annotations

import json

import pytest

from rlhflab.data.reviews import (NEGATIVE, POSITIVE, is_positive, lexicon_score, sentiment_counts,
                                  write_reviews)


@pytest.mark.parametrize("response, counts, score, positive", [
    (" the film was great.", (1, 0), 1.0, True),
    (" the plot was dull and the music was awful.", (0, 2), -1.0, False),
    (" the acting was superb but the ending felt weak.", (1, 1), 0.0, False),           # a tie is not positive
    (" Great, GREAT and lovely, but boring.", (3, 1), 0.5, True),                      # (3 - 1) / (3 + 1)
    (" the camera work.", (0, 0), 0.0, False),                                          # no sentiment words
    (" greatest ungreat", (0, 0), 0.0, False),                                          # whole words only
])
def test_lexicon_by_hand(response, counts, score, positive):
    assert sentiment_counts(response) == counts
    assert lexicon_score("ignored prompt", response, {}) == pytest.approx(score)
    assert is_positive("ignored prompt", response, {}) is positive


def test_the_word_lists_do_not_overlap():
    assert not set(POSITIVE) & set(NEGATIVE)


def test_write_reviews(tmp_path):
    out = write_reviews(tmp_path, n_prompts=400, n_test=50, n_labelled=400, seed=3, positive_share=0.3)
    read = lambda name: [json.loads(l) for l in (out / name).read_text().splitlines()]  # noqa: E731
    train, test, sft = read("prompts_train.jsonl"), read("prompts_test.jsonl"), read("sft.jsonl")
    assert len(train) == 400 and len(test) == 50 and [r["prompt"] for r in sft] == [r["prompt"] for r in train]
    # No film title of the test openings appears in a training opening.
    from rlhflab.data.reviews import TITLE_WORDS
    def titles(rows):
        return {" ".join(w for w in r["prompt"].replace(",", "").replace(":", "").split() if w in TITLE_WORDS)
                for r in rows}
    assert not titles(train) & titles(test)
    # A grumpy critic: the first clause is positive about 30% of the time (400 draws: ±7 points).
    first_positive = sum(sentiment_counts(r["completion"].split(" and ")[0].split(" but ")[0]
                                          .split(" while ")[0].split(" although ")[0])[0] > 0 for r in sft)
    assert 0.23 < first_positive / 400 < 0.37
    # The classifier's sentences: labels agree with the lexicon, no ties, roughly balanced.
    labelled = read("labelled_train.jsonl") + read("labelled_test.jsonl")
    assert len(labelled) == 400 and len(read("labelled_test.jsonl")) == 40
    assert all((r["label"] == "POSITIVE") == is_positive("", r["text"], {}) for r in labelled)
    assert all(lexicon_score("", r["text"], {}) != 0 for r in labelled)
    assert 0.4 < sum(r["label"] == "POSITIVE" for r in labelled) / 400 < 0.6
