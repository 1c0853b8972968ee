"""The GSM8K checker (rlhflab/rewards/gsm8k.py) on many answer formats."""

from __future__ import annotations

import pytest

from rlhflab.rewards import REGISTRY, RuleScorer
from rlhflab.rewards.gsm8k import (CORRECT, FORMATTED, MISSING, extract_answer, ground_truth,
                                   gsm8k_reward, is_correct, parse_number)

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72.\n#### 72"


@pytest.mark.parametrize("response, answer, expected", [
    ("#### 1,200", "1200", CORRECT),           # thousands separator in the response
    ("#### 1200", "1,200", CORRECT),           # ... and in the ground truth
    ("#### 1,234,567", "1234567", CORRECT),
    ("#### -3", "-3", CORRECT),                 # a sign
    ("#### -3", "3", FORMATTED),                # the sign matters
    ("#### +5", "5", CORRECT),
    ("#### 3.50", "3.5", CORRECT),              # numeric, not textual, equality
    ("#### 100.0", "100", CORRECT),
    ("#### .5", "0.5", CORRECT),
    ("#### $12", "12", CORRECT),                # a currency sign
    ("#### $1,200.50", "1200.5", CORRECT),
    ("####7", "7", CORRECT),                    # no space after the marker
    ("#### 12.", "12", CORRECT),                # a sentence's full stop is not a decimal
    ("work: 3 + 4 = 7\n#### 7", "7", CORRECT),
    ("#### 8", "7", FORMATTED),                 # a wrong number in the right format: 0.1
    ("#### 7.01", "7", FORMATTED),
    ("the answer is 7", "7", MISSING),          # no '####': nothing found without the fallback
    ("#### seven", "7", MISSING),               # no number after the marker
    ("", "7", MISSING),
])
def test_formats(response, answer, expected):
    assert gsm8k_reward(response, answer) == expected


def test_scores_are_the_documented_constants():
    assert (CORRECT, FORMATTED, MISSING) == (1.0, 0.1, 0.0)


def test_fallback_last_number():
    # Off: only '####' counts. On: the last number in the response is taken instead.
    assert gsm8k_reward("3 + 4 = 7", "7") == MISSING
    assert gsm8k_reward("3 + 4 = 7", "7", fallback_last_number=True) == CORRECT
    assert gsm8k_reward("3 + 4 = 8", "7", fallback_last_number=True) == FORMATTED  # last is 8
    assert gsm8k_reward("it costs $1,200.", "1200", fallback_last_number=True) == CORRECT
    assert gsm8k_reward("no digits here", "7", fallback_last_number=True) == MISSING
    # A spaced minus is an operator: the last number of "10 - 3" is 3, not -3.
    assert extract_answer("she had 10 and gave 3: 10 - 3", fallback_last_number=True) == "3"
    assert gsm8k_reward("10 - 3", "3", fallback_last_number=True) == CORRECT
    assert gsm8k_reward("#### $ 12", "12") == CORRECT  # a space after "$" is still a price
    # '####' wins over the fallback even when a later number is present.
    assert gsm8k_reward("#### 7 (not 9)", "7", fallback_last_number=True) == CORRECT
    # The registry exposes both: gsm8k (strict) and gsm8k_lenient (fallback on).
    assert REGISTRY["gsm8k"]("", "3 + 4 = 7", {"answer": "7"}) == MISSING
    assert REGISTRY["gsm8k_lenient"]("", "3 + 4 = 7", {"answer": "7"}) == CORRECT


def test_several_markers_first_wins():
    # The module's rule: "the answer string after the first '####'".
    assert extract_answer("#### 5\n#### 6") == "5"
    assert gsm8k_reward("#### 5\n#### 6", "5") == CORRECT
    assert gsm8k_reward("#### 5\n#### 6", "6") == FORMATTED


def test_ground_truth_is_taken_after_the_marker():
    assert ground_truth(GSM8K_ANSWER) == "72"
    # The worked line holds other numbers (48, 24); only 72 is the answer.
    assert gsm8k_reward("#### 72", GSM8K_ANSWER) == CORRECT
    assert gsm8k_reward("#### 24", GSM8K_ANSWER) == FORMATTED
    assert is_correct("#### 72", GSM8K_ANSWER) and not is_correct("#### 48", GSM8K_ANSWER)
    # A field without '####' is the answer itself.
    assert ground_truth(" 15 ") == "15"
    # The arithmetic task's rows use the same format.
    assert gsm8k_reward("#### 3", "1 + 2 = 3\n#### 3") == CORRECT


def test_only_the_response_is_scored():
    # A prompt with '#### 5' in it earns nothing: the scorer reads the response only.
    scorer = RuleScorer(REGISTRY["gsm8k"])
    prompt = "Example:\nQ: 2 + 3?\n#### 5\nQ: 1 + 4?\nAnswer:"
    scores = scorer.score([prompt, prompt], ["", " #### 5"], [{"answer": "5"}, {"answer": "5"}])
    assert scores.tolist() == [MISSING, CORRECT]


def test_parse_number():
    assert parse_number("1,200") == 1200
    assert parse_number("-3.50") == parse_number("-3.5")
    assert parse_number("$12") == 12
    assert parse_number("12.") == 12
    assert parse_number("abc") is None
