"""Range-checked numbers for command-line options.

`type=count(1)` instead of `type=int`: argparse then rejects `--n-train -1` with
``argument --n-train: must be >= 1, got -1`` and exit status 2, before any work starts,
instead of a traceback from deep inside the command. Every numeric option of every
command uses one of these.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

SEED_MAX = 2**32 - 1  # numpy's seed range; torch and random take it too


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi] (either end may be open)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if lo is not None and value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


def count(lo: int = 1, hi: int | None = None) -> Callable[[str], int]:
    """A count of things: an integer >= `lo` (1 unless said otherwise)."""
    return integer(lo, hi)


def seed() -> Callable[[str], int]:
    return integer(0, SEED_MAX)


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           hi_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float in [lo, hi]; `lo_open`/`hi_open` exclude an end."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if lo is not None and (value <= lo if lo_open else value < lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if lo_open else '>='} {lo:g}, got {value:g}")
        if hi is not None and (value >= hi if hi_open else value > hi):
            raise argparse.ArgumentTypeError(f"must be {'<' if hi_open else '<='} {hi:g}, got {value:g}")
        return value

    parse.__name__ = "number"
    return parse
