"""How idle OpenMP threads wait for work: the setting the CLI applies before torch loads.

PyTorch's CPU kernels run on an OpenMP thread pool (GNU libgomp in the Linux wheels).
Between two parallel regions an idle thread either polls for the next one or sleeps:

- libgomp's default polls about 300,000 times (a few milliseconds) before sleeping. On a
  machine with fewer free cores than threads the pollers take the cores the working
  threads need, and a step can run many times slower.
- ``OMP_WAIT_POLICY=PASSIVE`` sleeps at once. Every parallel region then pays a wake-up,
  and a training or decoding step is thousands of small regions: slower on a machine
  that has its cores to itself.
- ``GOMP_SPINCOUNT=1000`` (rlhflab's default) polls about 10 microseconds, long enough to
  catch the next operator of the same step, then sleeps: close to the default's speed on
  a quiet machine and to PASSIVE's beside a competing process. A probe since removed from bench/
  measures the three; docs/quickstart.md has its figures.

When several ranks share the host (``LOCAL_WORLD_SIZE`` > 1, set by ``accelerate launch``
and ``torchrun``) the pools compete by construction, and PASSIVE is the default. Either
variable set by the user wins; other OpenMP runtimes (LLVM's libomp on macOS) ignore
``GOMP_SPINCOUNT``. Standard library only: it must run before torch is imported.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPINCOUNT = "1000"  # libgomp polls about 100 times a microsecond: ~10 us before sleeping


def default_wait(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The OpenMP variables rlhflab would set in `environ` (default: this process's)."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return {}
    try:
        local_ranks = int(env.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        local_ranks = 1
    if local_ranks > 1:
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {"GOMP_SPINCOUNT": SPINCOUNT}


def apply_default_wait(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set `default_wait`'s variables in `environ` (default: this process's) and return them.
    Takes effect only if torch has not been imported yet."""
    env = os.environ if environ is None else environ
    chosen = default_wait(env)
    env.update(chosen)
    return chosen


def describe(environ: MutableMapping[str, str] | None = None) -> str:
    """The OpenMP wait setting in force, for a run's header: 'OMP_WAIT_POLICY=..., GOMP_SPINCOUNT=...'."""
    env = os.environ if environ is None else environ
    return ", ".join(f"{k}={env.get(k, 'unset')}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))
