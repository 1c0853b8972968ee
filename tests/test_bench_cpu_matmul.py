"""bench/cpu_matmul.py's SmolLM2 group: the shapes it times and the rate it weighs from them."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def bench():
    # loaded from its file (the bench folder is not a package; the script finds its own _common)
    spec = importlib.util.spec_from_file_location("bench_cpu_matmul", BENCH / "cpu_matmul.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smollm2_group_is_one_update_pass_of_the_ppo_bench(bench):
    # 30 layers of q, k, v, o, gate, up, down over 32 x 43 rows, the LM head over 32 x 16 rows
    hidden, kv, inter, vocab, layers = 576, 192, 1536, 49_152, 30
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter
    want = 6 * (1376 * per_layer * layers + 512 * hidden * vocab)
    got = sum(6 * n * i * o * count for (n, i, o), count in bench.SMOLLM2.values())
    assert got == want
    assert "smol-head" not in bench.DEFAULT_SHAPES  # the default run stays about a minute


def test_smollm2_line_weighs_each_shape_by_its_flops(bench):
    flops = {name: 6 * n * i * o * count for name, ((n, i, o), count) in bench.SMOLLM2.items()}
    total = sum(flops.values())
    # torch at 100 GFLOP/s on every shape; oneDNN at 400 except the head at 100
    results = {name: {"torch fwd+bwd": 100.0, "onednn fwd+bwd": 100.0 if name == "smol-head" else 400.0}
               for name in bench.SMOLLM2}
    seconds = sum(f / (100.0 if name == "smol-head" else 400.0) for name, f in flops.items())
    line = bench.smollm2_line(results)
    m = re.fullmatch(r"smollm2 update pass \((\d+) GFLOP of linear layers\): torch (\S+), onednn (\S+) "
                     r"GFLOP/s forward\+backward, ratio (\S+)", line)
    assert m, line
    assert int(m[1]) == round(total / 1e9)
    assert float(m[2]) == 100.0
    assert float(m[3]) == pytest.approx(total / seconds, abs=0.05)
    assert 100.0 < float(m[3]) < 400.0


def test_smollm2_shapes_run_and_print_the_weighted_line(bench, monkeypatch, capsys):
    # the real timing on tiny stand-ins of the same five names: the group expands and the line prints
    monkeypatch.setattr(bench, "SMOLLM2", {k: ((8, 16, 32), c) for k, ((_, _, _), c) in bench.SMOLLM2.items()})
    monkeypatch.setattr(bench, "SHAPES", {**bench.SHAPES, **{k: (8, 16, 32) for k in bench.SMOLLM2}})
    from rlhflab.ops import matmul
    if not matmul.onednn_available():
        pytest.skip("this torch build has no oneDNN linear op")
    assert bench.main(["--shapes", "smollm2", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n{name} " in out for name in bench.SMOLLM2)
    assert re.search(r"^smollm2 update pass \(\d+ GFLOP of linear layers\): torch \S+, onednn \S+", out, re.M)
