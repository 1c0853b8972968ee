"""`rlhflab learn check`: run the checks with pytest and print what differs and why.

pytest runs rlhflab/learn/pytest_checks.py (one test per check) in this process with
its terminal output switched off; a small plugin collects each outcome and the
`CheckFailed` finding, and `format_report` prints them grouped by exercise: what
differs, the mistake recognised, a hint, and the docs page to read. The exit status
is 0 when every selected check passes, 1 otherwise.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlhflab.learn.exercises import BY_NUMBER, EXERCISES
from rlhflab.learn.workspace import Workspace

SESSION_KEY = pytest.StashKey["GradingSession"]()
MAX_OUTPUT_LINES = 15


@dataclass
class CheckResult:
    check_id: str
    exercise: int
    name: str
    passed: bool
    finding: object | None = None    # checks.Finding when the check failed
    output: str = ""                 # what the learner's code printed


@dataclass
class GradingSession:
    """What the pytest run needs (the workspace, the exercises) and what it found."""

    workspace: Workspace
    numbers: tuple[int, ...]
    results: list[CheckResult] = field(default_factory=list)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        rep = outcome.get_result()
        check = getattr(item, "callspec", None) and item.callspec.params.get("check")
        if check is None or not (rep.when == "call" or (rep.when == "setup" and rep.outcome != "passed")):
            return
        finding = None
        if rep.outcome == "failed":
            from rlhflab.learn.checks import CheckFailed, Finding
            exc = call.excinfo.value if call.excinfo is not None else None
            if isinstance(exc, CheckFailed):
                finding = exc.finding
            else:  # a bug of the grader itself, not of the learner
                finding = Finding(f"internal error in the grader: {type(exc).__name__}: {exc}",
                                  hint="this is rlhflab's fault, not yours; please report it")
        self.results.append(CheckResult(check.id, check.exercise, check.name, rep.outcome == "passed",
                                        finding, rep.capstdout + rep.capstderr))

    def pytest_configure(self, config):
        config.stash[SESSION_KEY] = self


@dataclass
class Report:
    workspace: Path
    numbers: tuple[int, ...]
    results: list[CheckResult]
    pytest_status: int

    def of(self, number: int) -> list[CheckResult]:
        return [r for r in self.results if r.exercise == number]

    @property
    def ok(self) -> bool:
        return self.pytest_status == 0 and all(r.passed for r in self.results) and bool(self.results)


def grade(path: str | Path, numbers: list[int] | tuple[int, ...] | None = None) -> Report:
    """Grade the exercises `numbers` (default all) of the workspace at `path`."""
    numbers = tuple(sorted(set(numbers))) if numbers else tuple(e.number for e in EXERCISES)
    with Workspace(path) as ws:
        session = GradingSession(ws, numbers)
        module = Path(__file__).with_name("pytest_checks.py")
        args = [str(module), "-p", "no:terminal", "-p", "no:cacheprovider", "-o", "addopts=",
                "-o", "python_files=pytest_checks.py", "--rootdir", str(module.parent),
                "-W", "ignore::DeprecationWarning"]
        status = int(pytest.main(args, plugins=[session]))
    return Report(ws.path, numbers, session.results, status)


def _indent(text: str, pad: str) -> str:
    return "\n".join(pad + line if line else line for line in text.splitlines())


def _finding_lines(f, width: int = 96) -> list[str]:
    lines = textwrap.wrap(f.what, width, subsequent_indent="  ")
    for label, text in (("diagnosis", f.diagnosis), ("hint", f.hint), ("read", f.docs)):
        if text:
            lines += textwrap.wrap(f"{label}: {text}", width, subsequent_indent="  ")
    return lines


def format_report(report: Report) -> str:
    out = [f"Grading {report.workspace} (pytest, {len(report.results)} checks)", ""]
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
    if report.pytest_status not in (0, 1):
        out.append(f"(pytest itself exited with status {report.pytest_status}: the grader could not run "
                   "every check)")
    return "\n".join(out)
