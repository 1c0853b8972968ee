"""The calculator tool of the example: a plain function, named in the config as
``calc_tools:calculator`` (found beside the config; no PYTHONPATH)."""

import re

_ALLOWED = re.compile(r"^[0-9+\-*/x() .]+$")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - x * / and parentheses.

    Args:
        expression: the expression, e.g. "12 x 7" or "(30 + 5) - 9"
    """
    if not _ALLOWED.match(expression or ""):
        raise ValueError(f"only digits, + - x * / ( ) allowed, got {expression!r}")
    value = eval(expression.replace("x", "*"), {"__builtins__": {}}, {})  # noqa: S307 (checked above)
    return str(int(value)) if float(value) == int(value) else f"{value:.4g}"
