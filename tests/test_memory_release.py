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
if sys.argv[1] == "reuse":
    from rlhflab.cpu import reuse_freed_blocks
    assert reuse_freed_blocks(torch.device("cpu"))
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


FAULTS = """
import resource, sys, torch
from rlhflab.cpu import set_allocator
assert set_allocator(sys.argv[1], torch.device("cpu"))
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def one_pass():                                 # a step's activations: made, written, all freed
    blocks = [torch.ones(4 << 20) for _ in range(8)]   # 8 x 16 MiB
    del blocks
for _ in range(3):                              # warm-up passes
    one_pass()
before = faults()
for _ in range(2):
    one_pass()
print(faults() - before)
"""


def page_faults(mode: str) -> int:
    return int(last_number(FAULTS, mode))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and getrusage's page-fault count")
def test_reuse_writes_freed_blocks_again_without_faulting_in_fresh_pages():
    # Two passes of 8 blocks of 16 MiB (4,096 pages of 4 KiB each) after three warm-up
    # passes. Released, every block is a fresh mapping: 2 x 8 x 4,096 = 65,536 faults
    # (fewer if the kernel maps huge pages). Reused, the freed blocks (coalesced in the
    # heap: a single freed block between two live ones is too small for torch's 64-byte
    # aligned request of the same size) give their pages again: none fresh.
    released, reused = page_faults("release"), page_faults("reuse")
    assert released > 8 * 4096, (released, reused)
    assert reused < released / 16, (reused, released)                # measured: 0 against 65,552
    # the trade: freed buffers between live small ones stay resident, as with glibc's default
    assert retained_mib("reuse") > 256


NO_TRIM = RSS_MIB + """
import torch
from rlhflab.cpu import reuse_freed_blocks
assert reuse_freed_blocks(torch.device("cpu"))
blocks = [torch.ones(4 << 20) for _ in range(24)]   # 24 x 16 MiB, at the heap's top
live = rss_mib()
del blocks                                          # 384 MiB freed there at once
print(live - rss_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_reuse_keeps_the_heap_after_a_large_pass_is_freed():
    # A step's passes free gigabytes at the heap's top at once. glibc trims that space back
    # to the system above its trim threshold (with a 256 MiB threshold this drops 256 MiB
    # here), and the next pass faults it in again; reuse turns trimming off, so nothing
    # leaves the resident set (the peak is the same: the pages were resident already).
    assert last_number(NO_TRIM, "") < 16
