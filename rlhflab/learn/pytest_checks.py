"""The checks of `rlhflab learn check`, as pytest tests.

Not part of rlhflab's own test suite: `rlhflab.learn.grader.grade` runs this file with
pytest against a learner's workspace, one test per check in `rlhflab.learn.checks.CHECKS`.
Run by hand it skips (there is no workspace to grade).
"""

from __future__ import annotations

import pytest

from rlhflab.learn.checks import CHECKS
from rlhflab.learn.grader import SESSION_KEY


def pytest_generate_tests(metafunc):
    if "check" not in metafunc.fixturenames:
        return
    session = metafunc.config.stash.get(SESSION_KEY, None)
    numbers = session.numbers if session is not None else ()
    selected = [c for c in CHECKS if c.exercise in numbers]
    metafunc.parametrize("check", selected, ids=[c.id for c in selected])


@pytest.fixture
def workspace(request):
    session = request.config.stash.get(SESSION_KEY, None)
    if session is None:
        pytest.skip("run through `rlhflab learn check`")
    return session.workspace


def test_exercise(check, workspace):
    check.run(workspace)
