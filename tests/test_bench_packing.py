"""bench/packing.py measures what it says, on the tiny model (--tiny): the sampled lengths
are cached and reused, the three layouts run the same rollout through `policy_update` (the
packed side really packs, the shared side shares each group's prompt), and the last two lines
parse and match the recorded runs. Its
numbers are not asserted (a benchmark, not a timed test)."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
FINAL = re.compile(r"packing(?: \(shared prompt\))?: padded (\S+) s, packed (\S+) s, ratio (\S+), memory (\S+) "
                   r"\(lengths p50 (\d+) / max (\d+)\)")


@pytest.fixture()
def bench():
    sys.path.insert(0, str(BENCH))  # the bench folder is not a package
    try:
        import packing
        yield packing
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.slow
def test_tiny_run_measures_every_layout_and_prints_its_lines(bench, tiny_model_dir, tmp_path, capsys, monkeypatch):
    from rlhflab.models import layout as layouts

    plans, shared = [], []
    real_plan, real_shared = layouts.plan, layouts.shared_plan
    monkeypatch.setattr(layouts, "plan", lambda *a, **k: plans.append(a[3].sum().item()) or real_plan(*a, **k))
    monkeypatch.setattr(layouts, "shared_plan",
                        lambda *a, **k: shared.append((a[0].shape[0], a[3].sum().item())) or real_shared(*a, **k))
    args = ["--tiny", "--repeats", "1", "--out", str(tmp_path), "--model-dir", str(tiny_model_dir)]
    assert bench.main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("packing: ") and lines[-1].startswith("packing (shared prompt): ")
    cache = json.loads((tmp_path / f"lengths-{tiny_model_dir.name}.json").read_text())
    long = cache["long-tailed"]["response_lengths"]
    assert len(long) == 8 and len(cache["recipe"]["response_lengths"]) == 16
    res = json.loads((tmp_path / "results.json").read_text())["long-tailed"]
    pad = statistics.median(res["times"]["padded"])
    peak = res["peak_mib"]
    for line, side in zip(lines[-2:], ("packed", "shared")):
        m = FINAL.fullmatch(line)
        assert m, line
        assert (int(m.group(5)), int(m.group(6))) == (int(statistics.median(long)), max(long))
        pack = statistics.median(res["times"][side])
        assert float(m.group(1)) == pytest.approx(pad, abs=0.006)
        assert float(m.group(2)) == pytest.approx(pack, abs=0.006)
        assert float(m.group(3)) == pytest.approx(pad / pack, rel=0.02)
        assert peak["padded"] > 0 and peak[side] > 0
        assert float(m.group(4)) == pytest.approx(peak[side] / peak["padded"], abs=0.006)
    # packed passes ran: per case warm-up + 1 repeat + the memory step, one plan per minibatch
    # (8 rows a minibatch: 1 for the long-tailed case, 2 for the recipe's 16), each of a
    # minibatch's real response tokens; the shared side the same, one prompt per minibatch
    # (a group of 8)
    assert len(plans) == 3 * 1 + 3 * 2 and len(shared) == 3 * 1 + 3 * 2
    assert sum(plans[:3]) == 3 * sum(long)
    assert [g for g, _ in shared] == [1] * 9 and sum(n for _, n in shared[:3]) == 3 * sum(long)
    # a second run reads the cached lengths (no sampling): the same lengths
    stamp = (tmp_path / f"lengths-{tiny_model_dir.name}.json").stat().st_mtime_ns
    assert bench.main(args + ["--repeats", "1"]) == 0
    assert (tmp_path / f"lengths-{tiny_model_dir.name}.json").stat().st_mtime_ns == stamp
