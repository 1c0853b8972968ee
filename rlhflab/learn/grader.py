"""`rlhflab learn check`: run the checks and print what differs and why.

Each check of `rlhflab.learn.checks.CHECKS` for the selected exercises runs in this
process against the learner's workspace, with what the learner's code prints captured;
a `CheckFailed` carries the finding (what differs, the mistake recognised, a hint, the
docs page). `format_report` prints them grouped by exercise. The exit status is 0 when
every selected check passes, 1 otherwise.

No test framework is involved, so the grader works from a plain `pip install rlhflab`
(pytest comes only with the [test] extra).
"""

from __future__ import annotations

import contextlib
import io
import textwrap
from dataclasses import dataclass
from pathlib import Path

from rlhflab.learn.exercises import BY_NUMBER, EXERCISES
from rlhflab.learn.workspace import Workspace

MAX_OUTPUT_LINES = 15


@dataclass
class CheckResult:
    check_id: str
    exercise: int
    name: str
    passed: bool
    finding: object | None = None    # checks.CheckFinding when the check failed
    output: str = ""                 # what the learner's code printed


@dataclass
class Report:
    workspace: Path
    numbers: tuple[int, ...]
    results: list[CheckResult]
    internal_errors: int = 0         # checks that failed by a fault of the grader itself

    def of(self, number: int) -> list[CheckResult]:
        return [r for r in self.results if r.exercise == number]

    @property
    def ok(self) -> bool:
        return self.internal_errors == 0 and all(r.passed for r in self.results) and bool(self.results)


def run_check(check, workspace) -> tuple[CheckResult, bool]:
    """Run one check; (its result, whether it failed by an error of the grader itself)."""
    from rlhflab.learn.checks import CheckFailed, CheckFinding

    printed = io.StringIO()
    finding, internal = None, False
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            check.run(workspace)
        except CheckFailed as exc:
            finding = exc.finding
        except Exception as exc:  # a bug of the grader itself, not of the learner
            finding = CheckFinding(f"internal error in the grader: {type(exc).__name__}: {exc}",
                              hint="this is rlhflab's fault, not yours; please report it")
            internal = True
    return CheckResult(check.id, check.exercise, check.name, finding is None, finding, printed.getvalue()), internal


def grade(path: str | Path, numbers: list[int] | tuple[int, ...] | None = None) -> Report:
    """Grade the exercises `numbers` (default all) of the workspace at `path`."""
    from rlhflab.learn.checks import CHECKS

    numbers = tuple(sorted(set(numbers))) if numbers else tuple(e.number for e in EXERCISES)
    results, internal = [], 0
    with Workspace(path) as ws:
        for check in CHECKS:
            if check.exercise in numbers:
                result, failed_inside = run_check(check, ws)
                results.append(result)
                internal += failed_inside
    return Report(ws.path, numbers, results, internal)


def _indent(text: str, pad: str) -> str:
    return "\n".join(pad + line if line else line for line in text.splitlines())


def _finding_lines(f, width: int = 96) -> list[str]:
    lines = textwrap.wrap(f.what, width, subsequent_indent="  ")
    for label, text in (("diagnosis", f.diagnosis), ("hint", f.hint), ("read", f.docs)):
        if text:
            lines += textwrap.wrap(f"{label}: {text}", width, subsequent_indent="  ")
    return lines


def format_report(report: Report) -> str:
    out = [f"Grading {report.workspace} ({len(report.results)} checks)", ""]
    passed_ex = 0
    first_failing = None
    for n in report.numbers:
        ex, results = BY_NUMBER[n], report.of(n)
        good = sum(r.passed for r in results)
        verdict = "pass" if results and good == len(results) else "FAIL"
        passed_ex += verdict == "pass"
        out.append(f"Exercise {n}  {ex.title:<42} {verdict}  ({good}/{len(results)} checks)")
        seen: set[tuple] = set()      # findings shown in full
        explained: set[tuple] = set()  # (diagnosis, hint, docs) shown in full
        repeats: list[str] = []
        for r in results:
            if r.passed:
                continue
            first_failing = first_failing or n
            key, why = tuple(r.finding), tuple(r.finding[1:])
            if key in seen:
                repeats.append(r.name)
                continue
            seen.add(key)
            out.append(f"  FAIL {r.name}")
            if why in explained and any(why):
                lines = textwrap.wrap(r.finding.what, 96, subsequent_indent="  ") + ["(the same diagnosis as above)"]
            else:
                explained.add(why)
                lines = _finding_lines(r.finding)
            out.append(_indent("\n".join(lines), "       "))
            if r.output.strip():
                lines = r.output.strip().splitlines()
                more = f"\n... {len(lines) - MAX_OUTPUT_LINES} more lines" if len(lines) > MAX_OUTPUT_LINES else ""
                out.append("       your code printed:")
                out.append(_indent("\n".join(lines[:MAX_OUTPUT_LINES]) + more, "         | "))
        if repeats:
            out.append(_indent(textwrap.fill("FAIL, with a finding shown above: " + "; ".join(repeats), 96,
                                             subsequent_indent="  "), "  "))
        if seen:
            out.append("")
    n_pass = sum(r.passed for r in report.results)
    if out[-1]:
        out.append("")
    out.append(f"Exercises passed: {passed_ex} of {len(report.numbers)} (checks: {n_pass} of {len(report.results)}).")
    if first_failing is not None:
        out.append(f"Next: fix exercise {first_failing} ({BY_NUMBER[first_failing].filename}) and run "
                   f"`rlhflab learn check {first_failing} --dir {report.workspace}`.")
    elif len(report.numbers) == len(EXERCISES):
        out.append(f"All done. Watch your code train: `rlhflab learn run --dir {report.workspace}`.")
    if report.internal_errors:
        out.append(f"({report.internal_errors} check(s) failed by an error of the grader itself: please report it)")
    return "\n".join(out)
