"""The OpenMP wait setting the CLI applies before torch loads (rlhflab/openmp.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from rlhflab import openmp


def test_short_spin_by_default():
    env = {"PATH": "/bin"}
    assert openmp.apply_default_wait(env) == {"GOMP_SPINCOUNT": "1000"}
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": "1000"}


def test_the_users_setting_wins():
    for given in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(given)
        assert openmp.apply_default_wait(env) == {}
        assert env == given


def test_passive_when_ranks_share_the_host():
    env = {"LOCAL_WORLD_SIZE": "2"}
    assert openmp.apply_default_wait(env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp.default_wait({"LOCAL_WORLD_SIZE": "1"}) == {"GOMP_SPINCOUNT": "1000"}
    assert openmp.default_wait({"LOCAL_WORLD_SIZE": "two"}) == {"GOMP_SPINCOUNT": "1000"}  # unreadable: one


def test_describe():
    assert openmp.describe({"GOMP_SPINCOUNT": "1000"}) == "OMP_WAIT_POLICY=unset, GOMP_SPINCOUNT=1000"


def test_the_cli_sets_it_before_torch_loads():
    """`rlhflab` in a fresh process: the variable is in the environment by the time the
    command's module (which imports torch) runs, and torch was not loaded before."""
    probe = ("import os, sys\n"
             "from rlhflab import cli\n"
             "assert 'torch' not in sys.modules\n"
             "cli.main(['--version'])\n"
             "before = os.environ.get('GOMP_SPINCOUNT')\n"
             "try:\n"
             "    cli.main(['config', 'show', 'ppo'])\n"
             "except SystemExit:\n"
             "    pass\n"
             "print('SPIN', before, os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LOCAL_WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("SPIN")][-1]
    # --version returns before the setting; a command applies it; the policy stays unset.
    assert line == "SPIN None 1000 None"
