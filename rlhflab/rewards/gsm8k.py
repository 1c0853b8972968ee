"""The GSM8K checker: a verifiable reward for math answers.

The answer is the number after ``####`` (signs, decimals and thousands separators such
as ``1,200`` accepted); optionally the last number in the response is used when there
is no ``####``. Scores:

- 1.0  the extracted number equals the ground truth (numerically: 100 == 100.0)
- 0.1  a number is given in the expected format but it is wrong
- 0.0  no answer can be found

The ground truth is the part after ``####`` in the dataset's answer field. Only the
response is scored, never the prompt (a prompt that contains ``#### 5`` earns nothing).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

CORRECT, FORMATTED, MISSING = 1.0, 0.1, 0.0

# A number: optional sign, optional "$" (a space may follow the "$" only: "10 - 3" ends
# in 3, not -3), digits with optional thousands commas, optional decimals.
_NUMBER = r"[-+]?(?:\$\s?)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_HASH_ANSWER = re.compile(r"####\s*(" + _NUMBER + r")")
_ANY_NUMBER = re.compile(_NUMBER)


def parse_number(text: str) -> Decimal | None:
    """'1,200' -> 1200, '-3.50' -> -3.5, '$12' -> 12; None when it is not a number."""
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def extract_answer(response: str, fallback_last_number: bool = False) -> str | None:
    """The answer string after the first '####', else (optionally) the last number."""
    match = _HASH_ANSWER.search(response)
    if match:
        return match.group(1)
    if fallback_last_number:
        numbers = _ANY_NUMBER.findall(response)
        if numbers:
            return numbers[-1]
    return None


def ground_truth(answer_field: str) -> str:
    """The reference answer: the text after '####' in a GSM8K answer, else the whole field."""
    return answer_field.split("####")[-1].strip()


def gsm8k_reward(response: str, answer: str, fallback_last_number: bool = False) -> float:
    """Score one response against the dataset answer field (see the module docstring)."""
    found = extract_answer(response, fallback_last_number)
    if found is None:
        return MISSING
    got, want = parse_number(found), parse_number(ground_truth(answer))
    if got is None:
        return MISSING
    if want is not None and got == want:
        return CORRECT
    return FORMATTED


def is_correct(response: str, answer: str) -> bool:
    return gsm8k_reward(response, answer) == CORRECT
