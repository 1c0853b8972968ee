"""bench/grpo_throughput.py runs as bench/README.md documents it, round after round.

Its numbers are not asserted (a benchmark, not a timed test). What is checked: with
`--out` and `--repeats 2`, every run of every round trains in a folder of its own (the
second round used to die: the priming run's folder was reused, and the trainer refuses a
folder that holds a finished run); a second invocation with the same `--out` runs too;
`--sides rlhflab` needs no TRL; the last line parses.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
FINAL = re.compile(r"grpo_throughput: rlhflab (\S+) completions/s, trl (\S+) completions/s, "
                   r"speed ratio (\S+), memory ratio (\S+)")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # the bench folder is not a package
    try:
        import grpo_throughput
        yield grpo_throughput
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.slow
def test_two_rounds_and_a_second_invocation_with_the_same_out(bench, tiny_model_dir, arith_dir, tmp_path, capsys):
    out = tmp_path / "scratch"
    # --peak-sizes 256: the MFU's matmul peak on tiny matrices (its figures are not checked
    # here; the default 2048 and 4096 took most of this test's minute on 2 cores)
    args = ["--sides", "rlhflab", "--repeats", "2", "--steps", "2", "--out", str(out),
            "--model", str(tiny_model_dir), "--data", str(arith_dir), "--peak-sizes", "256"]
    assert bench.main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    m = FINAL.fullmatch(lines[-1])
    assert m, lines[-1]
    assert float(m.group(1)) > 0
    assert all(math.isnan(float(m.group(i))) for i in (2, 3, 4))  # no TRL side: nan, still parsable
    (row,) = [line for line in lines if line.startswith("| rlhflab |")]
    assert len(row.split("|")[7].split(",")) == 2  # the runs column: one figure per round

    rounds = sorted(out.glob("rlhflab-round*"))
    assert [p.name.split("-")[1] for p in rounds] == ["round1", "round2"]
    for folder in rounds:
        # the measured run finished in its own folder; the priming run's folder is gone
        assert (folder / "run" / "final").is_dir() and (folder / "run" / "metrics.jsonl").is_file()
        assert not (folder / "prime").exists()

    # Run again into the same scratch folder, which now holds two finished runs: new
    # folders, nothing refused, the old rounds untouched.
    assert bench.main(args[:3] + ["1"] + args[4:]) == 0
    assert FINAL.fullmatch(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(list(out.glob("rlhflab-round1-*"))) == 2 and len(list(out.glob("rlhflab-round2-*"))) == 1


def test_trl_side_without_trl_says_how_to_install_and_how_to_skip_it(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "TRL_DIR", tmp_path / "no-trl-here")
    assert bench.main(["--sides", "trl", "--out", str(tmp_path / "out")]) == 1
    said = capsys.readouterr().out
    assert f"trl=={bench.TRL_VERSION}" in said and "--sides rlhflab" in said
    assert not (tmp_path / "out").exists()  # refused before anything was built


@pytest.mark.parametrize("bad, says", [(["--sides", "rlhflab,vllm"], "give rlhflab, trl or rlhflab,trl"),
                                       (["--sides", ","], "give rlhflab, trl or rlhflab,trl"),
                                       (["--steps", "1"], "--steps at least 2"),
                                       (["--repeats", "0"], "--repeats must be at least 1")])
def test_bad_options_are_refused_in_one_line(bench, bad, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--sides", "rlhflab", "--out", str(tmp_path / "out"), *bad])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
