"""bench/real_scale.py and bench/scaling.py measure what they claim.

Their figures are not asserted (they are benchmarks, run by hand; bench/README.md quotes
them). What is checked: real_scale's logits meter counts vocabulary-sized tensors
exactly (a storage once however many views, freed when its last view dies); a
real_scale run on a small model of the same architecture takes one real PPO step in
each variant and prints a last line a script can parse; scaling's memory table is the
arithmetic it states, and the table in docs/scaling.md is the one it prints.
"""

from __future__ import annotations

import gc
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
FINAL = re.compile(r"real_scale: qwen2-0.5b-shaped full peak_gib (\S+) step_s (\S+), lora peak_gib (\S+)")
MIB = 2**20


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, str(BENCH))  # the bench folder is not a package; workers import by name
    try:
        import real_scale
        import scaling
        yield real_scale, scaling
    finally:
        sys.path.remove(str(BENCH))


# ----------------------------------------------------------------- real_scale: the logits meter

def test_vocab_meter_counts_each_storage_once_until_its_last_view_dies(bench_modules):
    real_scale, _ = bench_modules
    V = 1000
    weight = torch.zeros(V, 8)  # a parameter-like tensor whose storage is excluded
    meter = real_scale.vocab_meter(V, exclude={weight.untyped_storage().data_ptr()})
    with meter:
        a = torch.zeros(4, V)           # 4 * 1000 * 4 B = 16,000 B
        view = a[:2]                     # same storage: not counted again
        b = torch.ones(2, V)            # + 8,000 B -> 24,000 B held
        other = torch.ones(3, 7)        # last dimension is not V: never counted
        w2 = weight.t()                  # (8, V) view of the excluded storage: not counted
        del a
        gc.collect()
        assert meter.now == 24_000      # `view` still holds a's storage
        del view
        gc.collect()
        assert meter.now == 8_000       # a's storage released with its last view
        c = torch.empty(1, V)           # + 4,000 B -> 12,000 B, below the earlier peak
        del b, c, other, w2
        gc.collect()
    assert meter.peak == 24_000
    assert meter.now == 0


# ----------------------------------------------------------------- real_scale: one step, small model

@pytest.mark.slow
def test_real_scale_runs_both_variants_on_a_small_qwen2(bench_modules, tmp_path, capsys):
    real_scale, _ = bench_modules
    V = 151_936  # the real vocabulary, so the logits meter sees Qwen2.5's row width
    model = real_scale.build_model(tmp_path / "small", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=64)
    raw = tmp_path / "raw.json"
    rc = real_scale.main(["--model-dir", str(model), "--episodes", "2", "--prompt-len", "16", "--response-len", "4",
                          "--threads", "1", "--min-free-gib", "0", "--json", str(raw)])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    m = FINAL.fullmatch(lines[-1])
    assert m, lines[-1]
    results = json.loads(raw.read_text())
    full, lora = results["full"], results["lora"]
    assert float(m.group(1)) == pytest.approx(full["peak_mb"] / 1024, abs=0.005)
    assert float(m.group(3)) == pytest.approx(lora["peak_mb"] / 1024, abs=0.005)
    for r in (full, lora):
        # min_new_tokens = max_new_tokens: 2 episodes x exactly 4 response tokens, prompts cut to 16
        assert r["response_tokens"] == 2 * 4 and r["prompt_width"] == 16
        assert r["small_tensors_moved"] > 0 and math.isfinite(r["loss_total"])  # a real optimizer step
        assert all(r["phases_s"][p] > 0 for p in ("generate", "forward", "update"))
        assert r["peak_mb"] >= r["phase_peak_mb"]["generate"] > 0
        # generation holds at least one step's next-token logits: 2 rows x V x 4 B
        assert r["logits_peak_mb"] >= 2 * V * 4 / MIB
    # LoRA trains the adapter only; full trains every weight and the value head
    assert lora["trainable_params"] < full["trainable_params"] / 10
    # full holds P more float32 numbers 4 times over (the reference copy, the gradients, Adam's
    # two moments) where LoRA holds the weights once: at least 2 x 4 B x P more at the peak
    weights_mb = 4 * full["trainable_params"] / MIB
    assert full["peak_mb"] - lora["peak_mb"] > 2 * weights_mb


# ----------------------------------------------------------------- scaling: the memory table

def test_scaling_memory_table_is_its_arithmetic_and_is_the_docs_table(bench_modules, capsys):
    _, scaling = bench_modules
    scaling.memory_table([0.5e9, 1.5e9, 7e9, 8e9], ranks=8)
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\| \d", line)]
    assert len(rows) == 4
    # 0.5B on 8 GPUs, GiB = bytes / 2^30:
    #   DDP:           (4 + 4 + 8) B x 0.5e9 trained + 2 B x 0.5e9 bf16 reference = 9.0e9 B  -> 8.4
    #   DDP + critic:  9.0e9 + 16 x 0.5e9 = 17.0e9 B                                          -> 15.8
    #   ZeRO-2:        4 x 0.5e9 + 12 x 0.5e9 / 8 + 1.0e9 = 3.75e9 B                          -> 3.5
    #   FSDP / ZeRO-3: 8.0e9 / 8 + 1.0e9 = 2.0e9 B                                            -> 1.9
    #   FSDP + critic: 2.0e9 + 8.0e9 / 8 = 3.0e9 B                                            -> 2.8
    #   LoRA:          2 x 0.5e9 (bf16 base) = 1.0e9 B                                         -> 0.9
    assert rows[0] == "| 0.5B | 8.4 | 15.8 | 3.5 | 1.9 | 2.8 | 0.9 |"
    docs = (REPO / "docs" / "scaling.md").read_text(encoding="utf-8")
    for row in rows:
        assert row in docs, f"docs/scaling.md no longer prints {row!r} (rerun bench/scaling.py --memory-only)"


def test_scaling_memory_model_takes_hidden_x_layers_and_names_the_form_otherwise(bench_modules):
    import argparse

    _, scaling = bench_modules
    assert scaling._model_spec("512X8") == "512x8"
    for bad in ("512", "512x", "x8", "0x8", "512x8x2", "ax8"):
        with pytest.raises(argparse.ArgumentTypeError, match="give HxL, hidden size H and L layers, e.g. 512x8"):
            scaling._model_spec(bad)


def test_scaling_sides_take_short_names_and_say_what_exists(bench_modules):
    import argparse

    _, scaling = bench_modules
    assert scaling._sides("1,ddp") == ["1", "2 DDP"]
    assert scaling._sides(" FSDP2 , 1,fsdp2") == ["2 FSDP2", "1"]  # order kept, repeats dropped
    for bad in ("", ",", "2", "ddp,zero4"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated, from 1, ddp, fsdp2, zero2, zero3"):
            scaling._sides(bad)


@pytest.mark.slow
def test_scaling_runs_two_rounds_of_a_side_each_in_its_own_folder(bench_modules, tmp_path, monkeypatch, capsys):
    """Every round's run trains in a fresh folder: a second round in the first's folder would
    meet a finished run, which the trainer refuses (the flaw that stopped grpo_throughput)."""
    import _common

    _, scaling = bench_modules
    monkeypatch.setattr(_common, "BENCH_DIR", tmp_path)  # the tiny model is built here, not in .bench/
    assert scaling.main(["--sides", "1", "--repeats", "2", "--steps", "1", "--episodes", "8", "--params", "1e9"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out if line.startswith("run ")] == ["run 1/2, 1 process(es)",
                                                                               "run 2/2, 1 process(es)"]
    m = re.fullmatch(r"scaling: 1 process (\S+) eps/s, 2 processes (\S+) eps/s, ratio (\S+) \(tiny model, "
                     r"8 episodes/step\); FSDP2 2 processes (\S+) eps/s, ratio (\S+)", out[-1])
    assert m, out[-1]
    assert float(m.group(1)) > 0 and all(math.isnan(float(m.group(i))) for i in (2, 3, 4, 5))  # sides not run
