"""`rlhflab learn`: PPO exercises, their grader, a training run with them, the solutions.

    rlhflab learn init DIR                     write the five exercise stubs into DIR
    rlhflab learn check [N ...] [--dir DIR]    grade them (exit 1 when a check fails)
    rlhflab learn run [--dir DIR] [--compare] [key=value ...]
                                               train the debug PPO config with them
    rlhflab learn solution N                   the library's implementation, with comments
"""

from __future__ import annotations

import argparse
import sys

from rlhflab.errors import UserError


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = ("start with `rlhflab learn init my-ppo`, then open my-ppo/ex1_policy_loss.py; "
                     "docs/learner_mode.md explains the mode")
    sub = parser.add_subparsers(dest="action", required=True, metavar="{init,check,run,solution}")

    p = sub.add_parser("init", help="write a workspace: one stub per exercise, with its contract")
    p.add_argument("dir", help="folder to create (or an empty one)")
    p.add_argument("--force", action="store_true", help="overwrite exercise files that already exist")

    p = sub.add_parser("check", help="grade your exercises against the library")
    p.add_argument("numbers", nargs="*", type=int, metavar="N", help="exercise numbers 1-5 (default: all)")
    p.add_argument("--dir", default=".", help="the workspace (default: the current folder)")

    p = sub.add_parser("run", help="train the debug PPO config with your functions plugged in")
    p.add_argument("--dir", default=".", help="the workspace (default: the current folder)")
    p.add_argument("--compare", action="store_true",
                   help="then train again with the library's functions and compare step 1")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")
    p.add_argument("--cold", action="store_true",
                   help="start from the untrained tiny model (fast, but its reward stays 0) instead of "
                        "the quickstart's SFT warm start")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. training.total_steps=10")

    p = sub.add_parser("solution", help="print the library's implementation of exercise N, with comments")
    p.add_argument("number", type=int, metavar="N", help="exercise number 1-5")


def _check_numbers(numbers: list[int]) -> None:
    bad = [n for n in numbers if n not in range(1, 6)]
    if bad:
        raise UserError(f"exercise {bad[0]} does not exist; the exercises are numbered 1 to 5")


def run(args: argparse.Namespace) -> int:
    if args.action == "init":
        from rlhflab.learn.workspace import init_workspace
        written = init_workspace(args.dir, force=args.force)
        print(f"wrote {len(written)} files to {args.dir}:")
        for path in written:
            print(f"  {path.name}")
        print(f"\nnext: open {args.dir}/ex1_policy_loss.py, fill the gap, then "
              f"`rlhflab learn check 1 --dir {args.dir}`")
        return 0
    if args.action == "check":
        _check_numbers(args.numbers)
        from rlhflab.learn.grader import format_report, grade
        report = grade(args.dir, args.numbers)
        print(format_report(report))
        return 0 if report.ok else 1
    if args.action == "run":
        from rlhflab.learn.runner import run_learner
        run_learner(args.dir, args.overrides, compare=args.compare, quiet=args.quiet, warm=not args.cold)
        return 0
    if args.action == "solution":
        _check_numbers([args.number])
        from rlhflab.learn.solution import solution_text
        sys.stdout.write(solution_text(args.number))
        return 0
    raise UserError(f"unknown learn action {args.action!r}")  # argparse prevents this
