"""models.setup.map_large_allocations: freed large blocks leave the resident set.

Each case runs in a fresh process (glibc's setting is process-wide). The pattern is a
training step's: a large block freed (glibc's default then serves smaller large blocks
from its heap), many 16 MiB buffers written and freed, and a small allocation made
after each that outlives it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RSS_MIB = """
def rss_mib():
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith("VmRSS:")) / 1024
"""
SCRIPT = """
import sys, torch
from rlhflab.cpu import map_large_allocations
if sys.argv[1] == "mapped":
    assert map_large_allocations(torch.device("cpu"))
if sys.argv[1] == "gpu-run":  # a run on another device leaves the allocator as it is
    assert not map_large_allocations(torch.device("meta"))
RSS_MIB
big = torch.ones(6 << 20); del big   # a 24 MiB mapped block freed: the default threshold rises to it
before = rss_mib()
blocks, pins = [], []
for _ in range(32):                             # 32 x 16 MiB = 512 MiB, written, each followed
    blocks.append(torch.ones(4 << 20))          # by a 256 KiB buffer that outlives it (as
    pins.append(torch.ones(64 << 10))           # a step's small tensors outlive its big ones)
del blocks
print(rss_mib() - before)
""".replace("RSS_MIB", RSS_MIB)


def last_number(script: str, mode: str) -> float:
    """The last line `script` prints, run in a fresh process with `mode` as its argument."""
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def retained_mib(mode: str) -> float:
    return last_number(SCRIPT, mode)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_freed_16mib_blocks_leave_the_resident_set():
    # glibc's default: the 512 MiB of freed buffers stay resident (holes between the pins)
    assert retained_mib("default") > 256
    # with each block mapped on its own, freeing unmaps it: the 8 MiB of pins and noise remain
    assert retained_mib("mapped") < 64
    # asked for a run whose tensors live on another device, nothing is set: as the default
    assert retained_mib("gpu-run") > 256
