"""The benches' real-model options (issue 27), checked on tiny models: FLOP counts by hand,
the sides run one at a time, the per-phase MFU lines, the large-vocabulary bench's logits
recorder, and LoRA's default targets on a Gemma-3-architecture model. No number of a
benchmark is asserted (they are benchmarks, not timed tests)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def benches():
    sys.path.insert(0, str(BENCH))  # spawned workers inherit sys.path and import by name
    try:
        import _mfu
        import grpo_throughput
        import large_vocab
        import ppo_throughput
        import rollout_backends
        yield {"mfu": _mfu, "ppo": ppo_throughput, "grpo": grpo_throughput, "large": large_vocab,
               "rollout": rollout_backends}
    finally:
        sys.path.remove(str(BENCH))


# --------------------------------------------------------------------------------------
# FLOP counting
# --------------------------------------------------------------------------------------
def test_linear_params_of_the_tiny_llama_by_hand(benches, tiny_model_dir):
    n = benches["mfu"].linear_params(tiny_model_dir)
    # conftest's tiny Llama: hidden 64, 2 layers, 2 heads and 2 KV heads, MLP 4 x 64 = 256,
    # vocabulary 512, no biases. Per layer: q, k, v, o 4 x 64 x 64 = 16,384; gate, up, down
    # 3 x 64 x 256 = 49,152; together 65,536, x 2 layers = 131,072. Head: 512 x 64 = 32,768
    # (tied to the embedding: counted as the head, the lookup costs nothing).
    assert (n.body, n.head) == (131_072, 32_768)


def test_pass_flops_by_hand(benches):
    mfu = benches["mfu"]
    n = mfu.LinearParams(body=10, head=3)
    # forward: 2 x (10 x 5 tokens + 3 x 2 logit rows) = 2 x 56 = 112; forward + backward 3x: 336
    assert mfu.pass_flops(n, 5, 2) == 112
    assert mfu.pass_flops(n, 5, 2, backward=True) == 336
    # MFU: 112 FLOPs in 2 s against a 28 FLOP/s peak = 2.0; a phase that took no time reads nan
    cells = mfu.mfu_cells({"generate": 112.0, "update": 336.0}, {"generate": 2.0, "update": 0.0}, 28.0)
    assert cells["generate"] == 2.0 and math.isnan(cells["update"])


def test_cpu_peak_is_measured_in_the_runs_precision(benches, monkeypatch):
    """A bf16 run's MFU divides by a bfloat16 matmul rate: the timed product is bfloat16,
    and the rate is 2 n^3 FLOPs over its time."""
    import time

    mfu, seen = benches["mfu"], []
    real_matmul = torch.Tensor.__matmul__
    ticks = iter(range(100))  # every timed product takes one "second"
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: seen.append(a.dtype) or real_matmul(a, b))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(ticks)))
    peak, what = mfu.device_peak("cpu", 1, (8,), "bfloat16")
    assert set(seen) == {torch.bfloat16}
    assert peak == 2 * 8 ** 3
    assert what.startswith("the bfloat16 matmul peak measured here")


def test_ppo_phase_flops_by_hand(benches):
    ppo, mfu = benches["ppo"], benches["mfu"]
    n = mfu.LinearParams(body=10, head=3)
    # 4 prompt + 2 response tokens: a policy forward = 2 x (10 x 6 + 3 x 2) = 132,
    # a critic forward (no LM head) = 2 x 10 x 6 = 120.
    head = ppo.phase_flops("rlhflab", n, 4, 2, epochs=3)
    # value head: generate 132; forward: policy (+values) and reference = 264;
    # update: 3 epochs x 3 x 132 = 1188
    assert head == {"generate": 132, "forward": 264, "update": 1188}
    for side in ("rlhflab-critic", "rlhflab-critic-torchmm"):
        # with a critic: forward 264 + 120 = 384; update 3 x 3 x (132 + 120) = 2268
        assert ppo.phase_flops(side, n, 4, 2, epochs=3) == {"generate": 132, "forward": 384, "update": 2268}
    # TRL reads the old log-probs from the sampling logits: forward = reference 132 + critic 120 = 252
    assert ppo.phase_flops("trl", n, 4, 2, epochs=3) == {"generate": 132, "forward": 252, "update": 2268}


def test_grpo_phase_flops_by_hand(benches):
    import argparse

    grpo, mfu = benches["grpo"], benches["mfu"]
    n = mfu.LinearParams(body=10, head=3)
    a = argparse.Namespace(completions=8, group_size=4, beta=0.04)
    # 2 prompts of 5 tokens counted once per group = 10, 8 responses x 3 tokens = 24:
    # a forward = 2 x (10 x 34 + 3 x 24) = 2 x 412 = 824; the update 3 x 824 = 2472
    assert grpo.phase_flops(a, n, 5, 3) == {"generate": 824, "score": 0.0, "forward": 824, "update": 2472}
    a.beta = 0.0  # no reference pass, and one optimizer step per rollout: no old log-probs either
    assert grpo.phase_flops(a, n, 5, 3)["forward"] == 0.0


# --------------------------------------------------------------------------------------
# The large-vocabulary bench's recorder
# --------------------------------------------------------------------------------------
def test_logits_recorder_sees_the_full_logits_and_chunked_ops_stay_within_a_chunk(benches):
    from rlhflab import ops

    rec_cls = benches["large"].LogitsRecorder
    rows, hidden, vocab, chunk = 64, 16, 1000, 8
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g, requires_grad=True)          # (N, H)
    w = (torch.randn(vocab, hidden, generator=g) * 0.1).requires_grad_()    # (V, H)
    targets = torch.randint(0, vocab, (rows,), generator=g)

    with rec_cls(vocab, hidden) as full:
        logits = h @ w.t()                                                   # (N, V)
        ops.logprobs_from_logits(logits[None], targets[None]).sum().backward()
    # the whole (N, V) float32 logits: 64 x 1000 x 4 = 256,000 bytes
    assert full.max_bytes == rows * vocab * 4 and full.max_shape[-1] == vocab

    h.grad = w.grad = None
    with rec_cls(vocab, hidden) as chunked:
        lp, ent = ops.chunked_logprobs(h, w, None, targets, temperature=0.7, chunk_size=chunk, with_entropy=True)
        (lp.sum() + 0.01 * ent.sum()).backward()
    # forward and backward (the weight's (V, H) gradient is not logits-shaped): at most one chunk,
    # 8 x 1000 x 4 = 32,000 bytes, 8x less than the full logits
    assert 0 < chunked.max_bytes <= chunk * vocab * 4
    assert w.grad is not None and w.grad.shape == (vocab, hidden)


def test_logits_recorder_ignores_the_head_weight(benches):
    rec = benches["large"].LogitsRecorder(vocab=1000, hidden=16)
    rec.see((16, 1000), 4)           # the head's weight transposed, H x V: a weight, not logits
    rec.see((1000, 16), 4)           # the weight itself (last dimension H)
    assert rec.max_bytes == 0
    rec.see((2, 3, 1000), 4)         # (B, T, V) logits: 2 x 3 x 1000 x 4 = 24,000 bytes
    assert rec.max_bytes == 24_000 and rec.max_shape == (2, 3, 1000)


# --------------------------------------------------------------------------------------
# LoRA on a Gemma-3-architecture model
# --------------------------------------------------------------------------------------
def _tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           max_position_embeddings=64, sliding_window=16)
    return Gemma3ForCausalLM(cfg).eval()


def test_lora_default_targets_find_gemma3_projections():
    from rlhflab.models.load import add_lora, default_lora_targets

    model = _tiny_gemma3()
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    # Gemma-3's projection names, as the issue expects them
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= names
    assert default_lora_targets(model) == ["q_proj", "v_proj"]

    peft_model = add_lora(model, r=4, alpha=8.0)
    adapted = sorted({n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in peft_model.named_parameters()
                      if "lora_A" in n})
    assert adapted == ["q_proj", "v_proj"]
    # 2 layers x 2 targets, each with an A and a B; the base weights frozen
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 * 2 and all("lora_" in n for n in trainable)

    ids = torch.randint(0, 300, (2, 7))
    out = peft_model(input_ids=ids).logits                                   # (B, L, V)
    out.float().logsumexp(-1).sum().backward()
    grads = [p.grad for n, p in peft_model.named_parameters() if "lora_A" in n]
    # LoRA B starts at zero, so A's gradient is zero at step 0; B's is not
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for n, p in peft_model.named_parameters() if "lora_B" in n)
    assert len(grads) == 4


def test_lora_every_gemma3_projection_by_name():
    from rlhflab.models.load import add_lora

    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = add_lora(_tiny_gemma3(), r=2, alpha=4.0, target_modules=every)
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert adapted == set(every)


# --------------------------------------------------------------------------------------
# Refusals before anything heavy runs
# --------------------------------------------------------------------------------------
def test_a_missing_model_folder_is_refused_in_one_line(benches, tmp_path, capsys):
    missing = str(tmp_path / "no-model")
    for main, args in ((benches["ppo"].main, ["--model-dir", missing, "--sides", "rlhflab"]),
                       (benches["grpo"].main, ["--model-dir", missing, "--sides", "rlhflab",
                                               "--out", str(tmp_path / "out")]),
                       (benches["rollout"].main, ["--model-dir", missing]),
                       (benches["large"].main, ["--model-dir", missing])):
        with pytest.raises(SystemExit) as exc:
            main(args)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "no config.json there" in err and ("make models" in err or "fetch-model gemma3" in err)
    assert not (tmp_path / "no-model").exists()  # never built a tiny model in the user's path


def test_rollout_refuses_a_folder_saved_from_a_gguf_load(benches, tiny_model_dir, tmp_path, capsys):
    import shutil

    folder = tmp_path / "saved-gguf"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gguf", "gguf_file": "x.gguf", "dequantize": False}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as exc:
        benches["rollout"].main(["--model-dir", str(folder)])
    assert exc.value.code == 2 and "import-gguf" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# Small runs (spawned workers: slow)
# --------------------------------------------------------------------------------------
MFU_CELL = re.compile(r"(generate|forward|update) (\S+) s (\S+) GFLOP MFU (\S+)%")


@pytest.mark.slow
def test_ppo_sides_one_at_a_time_with_mfu_per_phase(benches, tiny_model_dir, tmp_path, capsys):
    raw = tmp_path / "raw.json"
    assert benches["ppo"].main(["--sides", "rlhflab,rlhflab-critic", "--sequential", "--repeats", "1",
                                "--warmup", "0", "--episodes", "4", "--response-length", "4", "--epochs", "1",
                                "--threads", "1", "--model-dir", str(tiny_model_dir), "--peak-sizes", "256",
                                "--no-tensor-memory", "--json", str(raw)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("ppo_throughput: rlhflab ")
    assert any("sides run one after the other (--sequential)" in line for line in lines)
    for label in ("rlhflab (value head)", "rlhflab (separate critic)"):
        (line,) = [x for x in lines if x.startswith(f"  {label}: ")]
        cells = MFU_CELL.findall(line)
        assert [c[0] for c in cells] == ["generate", "forward", "update"]
        assert all(float(c[3]) > 0 for c in cells)
    result = json.loads(raw.read_text())
    assert result["sequential"] is True and result["peak_flops"] > 0
    assert set(result["steps"]) == {"rlhflab", "rlhflab-critic"}
    # the critic side's forward and update count the critic's passes too
    assert result["summary"]["rlhflab-critic"]["mfu"]["update"] > 0


@pytest.mark.slow
def test_grpo_sizes_and_phase_line(benches, tiny_model_dir, arith_dir, tmp_path, capsys):
    assert benches["grpo"].main(["--sides", "rlhflab", "--repeats", "1", "--steps", "2", "--completions", "8",
                                 "--group-size", "4", "--max-new-tokens", "4", "--beta", "0.04",
                                 "--peak-sizes", "256", "--model-dir", str(tiny_model_dir),
                                 "--data", str(arith_dir), "--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"grpo_throughput: rlhflab \S+ completions/s, trl nan completions/s, .*", lines[-1])
    assert any("group 4, 8 completions/step, <= 4 new tokens" in x for x in lines)
    (line,) = [x for x in lines if x.startswith("  rlhflab: ")]
    cells = dict((c[0], float(c[3])) for c in MFU_CELL.findall(line))
    assert set(cells) == {"generate", "forward", "update"} and all(v > 0 for v in cells.values())


@pytest.mark.slow
def test_large_vocab_bench_runs_both_methods(benches, tiny_model_dir, tmp_path, capsys):
    raw = tmp_path / "lv.json"
    assert benches["large"].main(["--model-dir", str(tiny_model_dir), "--prompts", "2", "--group-size", "2",
                                  "--max-new-tokens", "4", "--threads", "1", "--json", str(raw)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"large_vocab: V 512 grpo peak_mib \S+ step_s \S+ max_logits_mib \S+, "
                        r"ppo peak_mib \S+ step_s \S+ max_logits_mib \S+, full_logits_mib \S+ chunk_mib 64", last)
    res = json.loads(raw.read_text())
    for m in ("grpo", "ppo"):
        # 2 x 2 responses of 4 tokens: the trainers' logits are (16, 512) rows at most, every
        # step; the recorder saw them (not zero) and nothing larger
        assert res[m]["max_logits_shape"][-1] == 512
        assert 0 < res[m]["max_logits_mib"] <= 16 * 512 * 4 / 2**20 + 1e-9
        assert res[m]["step_s"] > 0


def test_real_model_script_is_valid_bash_and_runs_every_bench():
    import subprocess

    script = BENCH / "real_model.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    # both modes run the three SmolLM2 benches with their real-model option, then Gemma's
    for bench in ("ppo_throughput", "grpo_throughput", "rollout_backends"):
        assert text.count(f"run {bench} bench/{bench}.py --model-dir \"$SMOL\"") == 2, bench
    assert 'run large_vocab bench/large_vocab.py --model-dir "$GEMMA"' in text


FAKE_PY = r'''#!/usr/bin/env bash
# Stands in for python in bench/real_model_gpu.sh: logs each stage's start and end (epoch
# seconds) and prints what the summary greps; rollout_backends fails with exit 3.
[ "$1" = -c ] && { echo "torch fake | transformers fake | cuda None"; exit 0; }
log="$FAKE_LOG"; name=$(basename "$1" .py); seed=none
for a in "$@"; do case $prev in --seed) seed=$a;; esac; prev=$a; done
echo "start $name $seed $(date +%s.%N)" >> "$log"
sleep 1
echo "end $name $seed $(date +%s.%N)" >> "$log"
case $name in
  real_model_recipes) echo "| grpo | $seed | 50 | fake | 31.5% -> 40.0% | +8.5 | 3.0 | 3.6 | 1.0 |";;
  grpo_throughput) echo "grpo_throughput: rlhflab 1 completions/s, trl 1 completions/s, speed ratio 1.00, memory ratio 1.00";;
  rollout_backends) echo "boom" >&2; exit 3;;
esac
exit 0
'''


def test_gpu_script_runs_its_stages_in_order_with_the_two_seeds_side_by_side(tmp_path):
    """bench/real_model_gpu.sh (the GPU session's one prepared script), with a stand-in for
    python: grpo_throughput first, then the recipe's seeds 0 and 1 at the same time, then
    grpo_throughput with the shared prompt, packed_prompt, rollout_backends and
    ppo_throughput; every stage's exit code (a failing one's too, with
    its stderr) reaches the summary, and both seeds' rows are in paste.txt."""
    import os
    import subprocess

    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    log, out = tmp_path / "stages.log", tmp_path / "out"
    env = {**os.environ, "PY": str(fake), "OUT": str(out), "SMOL": "unused", "BUDGET": "120",
           "FAKE_LOG": str(log)}
    res = subprocess.run(["bash", str(BENCH / "real_model_gpu.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    events = [line.split() for line in log.read_text().splitlines()]
    t: dict = {}
    for kind, name, seed, at in events:  # a stage run twice (grpo_throughput): its first run
        t.setdefault((kind, name, seed), float(at))
    starts = [(name, seed) for kind, name, seed, _ in events if kind == "start"]
    assert starts[0] == ("grpo_throughput", "none") and starts[-2:] == [("rollout_backends", "none"),
                                                                        ("ppo_throughput", "none")]
    assert sorted(starts[1:3]) == [("real_model_recipes", "0"), ("real_model_recipes", "1")]
    assert starts[3] == ("grpo_throughput", "none") and starts[4] == ("packed_prompt", "none")  # shared prompt
    assert len(starts) == 7
    s0, s1 = ("real_model_recipes", "0"), ("real_model_recipes", "1")
    assert t[("start",) + s1] < t[("end",) + s0] and t[("start",) + s0] < t[("end",) + s1]  # side by side
    assert t[("end", "grpo_throughput", "none")] <= min(t[("start",) + s0], t[("start",) + s1])
    assert max(t[("end",) + s0], t[("end",) + s1]) <= t[("start", "rollout_backends", "none")]
    paste = (out / "paste.txt").read_text()
    assert "| grpo | 0 | 50 |" in paste and "| grpo | 1 | 50 |" in paste
    assert "-- grpo_recipe_s0 (exit 0)" in paste and "-- grpo_recipe_s1 (exit 0)" in paste
    assert "-- rollout_backends (exit 3)" in paste and "boom" in paste
    assert "-- grpo_throughput_shared (exit 0)" in paste and paste.count("grpo_throughput: rlhflab 1") == 2
    assert "-- grpo_throughput (exit 0)" in paste and "-- ppo_throughput (exit 0)" in paste
    assert "-- packed_prompt (exit 0)" in paste


def test_gpu_script_runs_the_stages_named_in_stages_in_that_order(tmp_path):
    """STAGES names the stages of bench/real_model_gpu.sh to run (a lease too short for all):
    those alone, in the order given, grpo_throughput_static with the static KV cache and
    without the priming run, the rest as in the full run; an unknown name stops the script
    before any stage runs."""
    import os
    import subprocess

    fake = tmp_path / "fakepy"  # the stand-in, also keeping each call's arguments
    fake.write_text(FAKE_PY.replace('log="$FAKE_LOG";', 'log="$FAKE_LOG"; echo "$*" >> "$FAKE_ARGV";'))
    fake.chmod(0o755)
    log, out, argv = tmp_path / "stages.log", tmp_path / "out", tmp_path / "argv"
    env = {**os.environ, "PY": str(fake), "OUT": str(out), "SMOL": "unused", "BUDGET": "120",
           "FAKE_LOG": str(log), "FAKE_ARGV": str(argv), "GRPO_REPEATS": "1", "SHARED_SIDES": "rlhflab",
           "STAGES": "grpo_throughput_static grpo_throughput_shared grpo_throughput"}
    res = subprocess.run(["bash", str(BENCH / "real_model_gpu.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    calls = argv.read_text().splitlines()
    assert len(calls) == 3 and all(c.startswith("bench/grpo_throughput.py") for c in calls)
    static, shared, plain = calls
    assert "--hf-cache static" in static and "--no-prime" in static and "--sides rlhflab " in static
    assert "--share-prompt true" in shared and "--sides rlhflab " in shared and "--hf-cache" not in shared
    assert "--repeats 1" in plain and "--sides rlhflab,trl " in plain
    assert not any(flag in plain for flag in ("--hf-cache", "--no-prime", "--share-prompt"))  # the defaults
    paste = (out / "paste.txt").read_text()
    assert "-- grpo_throughput_static (exit 0)" in paste and paste.count("grpo_throughput: rlhflab 1") == 3
    argv.unlink()
    res = subprocess.run(["bash", str(BENCH / "real_model_gpu.sh")], capture_output=True, text=True, timeout=60,
                         env={**env, "OUT": str(tmp_path / "out2"), "STAGES": "grpo_throughput grpo_thruput"})
    assert res.returncode == 2 and "unknown stage grpo_thruput" in res.stderr
    assert not argv.exists()  # refused before the first stage ran
    res = subprocess.run(["bash", str(BENCH / "real_model_gpu.sh")], capture_output=True, text=True, timeout=60,
                         env={**env, "OUT": str(tmp_path / "out3"), "STAGES": "grpo_recipe",
                              "RECIPE_EXTRA": "generation.hf_cache=static training.total_steps=60"})
    recipes = argv.read_text().splitlines()
    assert res.returncode == 0 and len(recipes) == 2  # the two seeds, each with the extra overrides last
    assert all(c.endswith("generation.hf_cache=static training.total_steps=60 training.eval_interval=25")
               for c in recipes)
    argv.unlink()
    res = subprocess.run(["bash", str(BENCH / "real_model_gpu.sh")], capture_output=True, text=True, timeout=60,
                         env={**env, "OUT": str(tmp_path / "out4"), "STAGES": "ppo_throughput",
                              "PPO_EXTRA": "--hf-cache static"})
    (ppo,) = argv.read_text().splitlines()
    assert res.returncode == 0 and ppo.startswith("bench/ppo_throughput.py") and ppo.endswith("--hf-cache static")
    argv.unlink()
    res = subprocess.run(["bash", str(BENCH / "real_model_gpu.sh")], capture_output=True, text=True, timeout=60,
                         env={**env, "OUT": str(tmp_path / "out5"), "STAGES": "compile_layers"})
    plain, lean = argv.read_text().splitlines()  # both eager baselines: transformers' MLP, rlhflab's lean one
    assert res.returncode == 0 and plain.startswith("bench/compile_layers.py") and "--lean-mlp" not in plain
    assert lean.startswith("bench/compile_layers.py") and lean.endswith("--lean-mlp")
    paste = (tmp_path / "out5" / "paste.txt").read_text()
    assert "-- compile_layers (exit 0)" in paste and "-- compile_layers_lean (exit 0)" in paste


def test_op_counts_sees_the_shared_prompts_extra_pass(tiny_model_dir, arith_dir, tmp_path, capsys):
    """bench/op_counts.py counts the aten ops of one GRPO step's scoring and update. With
    grpo.share_prompt the prompt is a pass of its own before the responses' pass (on its
    cache), so both phases dispatch more ops than with each prompt repeated in its rows; the
    same step counted twice gives the same numbers."""
    sys.path.insert(0, str(BENCH))
    try:
        import op_counts
    finally:
        sys.path.remove(str(BENCH))

    def count(share: str, out: str) -> dict:
        c = op_counts.count_step(str(BENCH.parent / "configs" / "grpo_debug.yaml"), [
            f"model.name_or_path={tiny_model_dir}", f"dataset.path={arith_dir}/train.jsonl", "dataset.eval_path=null",
            "generation.backend=hf", "generation.max_new_tokens=6", "grpo.prompts_per_step=2", "grpo.group_size=2",
            "grpo.batch_size=4", "grpo.mini_batch_size=4", "grpo.gradient_accumulation_steps=1", "grpo.epochs=1",
            f"grpo.share_prompt={share}", "training.total_steps=1", "training.eval_interval=0",
            "training.save_interval=0", f"training.output_dir={tmp_path / out}", "model.cpu_matmul=torch",
            "logging.progress_bar=false", "logging.plots=false", "logging.doctor=false", "logging.report_to=[]"])
        return {name: sum(c[name].values()) for name in op_counts.PHASES}

    shared, again, plain = count("true", "a"), count("true", "b"), count("false", "c")
    assert shared == again
    assert all(plain[name] > 0 for name in op_counts.PHASES)
    assert shared["score_rollout"] > plain["score_rollout"] and shared["run_update"] > plain["run_update"]


def test_packed_prompt_pass_equals_the_plain_pass_with_one_pass(tiny_model_dir):
    """bench/packed_prompt.py's packed pass (a group in one row, a 4-D mask, positions that
    restart after the prompt) gives the plain pass's hidden states on every real response
    position, and gradients, within float32 rounding, on left-padded prompts and
    right-padded responses; and it dispatches about the plain pass's number of ops, not the
    shared pass's two passes' worth."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(BENCH))
    try:
        import packed_prompt
    finally:
        sys.path.remove(str(BENCH))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    inputs = packed_prompt.batch(3, 4, 10, 7, model.config.vocab_size, seed=1)
    real = inputs[3].bool()
    assert not real.all() and not inputs[1].bool().all()  # padding on both sides
    fns = packed_prompt.ways(model, *inputs, 4)
    results = {}
    for name, fn in fns.items():
        model.zero_grad(set_to_none=True)
        h = fn()[real]
        h.square().mean().backward()
        results[name] = (h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (h0, g0), (h1, g1) = results["plain"], results["packed"]
    assert (h1 - h0).abs().max() <= 1e-5 * h0.abs().max()
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        assert (g1[n] - g0[n]).abs().max() <= 1e-4 * g0[n].abs().max() + 1e-7, n
    ops = {name: packed_prompt.count_ops(fn) for name, fn in fns.items()}
    assert ops["packed"] < 0.7 * ops["shared"] and ops["packed"] < 1.3 * ops["plain"]


LEASE_PY = r'''#!/usr/bin/env bash
# Stands in for python on the GPU machine in bench/gpu_lease.sh: logs each call; the import
# writes a config.json and keeps a copy of the GGUF it was given; benches print a summary line;
# a recipe writes a results file and a trained model, as the real one does under its --out.
echo "$*" >> "$FAKE_LOG"
case "$1 $2" in
  "-m pip") exit 0;;
  "-m rlhflab") out=$(for a in "$@"; do [ "$prev" = --out ] && echo "$a"; prev=$a; done)
               mkdir -p "$out" && echo '{}' > "$out/config.json" && cp "$4" "$FAKE_GGUF_COPY"; exit 0;;
  "-c "*) echo "torch fake | transformers fake | cuda None"; exit 0;;
esac
case $(basename "$1" .py) in
  grpo_throughput) echo "grpo_throughput: rlhflab 1 completions/s, trl 1 completions/s, speed ratio 1.00, memory ratio 1.00";;
  real_model_recipes) out=$(for a in "$@"; do [ "$prev" = --out ] && echo "$a"; prev=$a; done)
                      mkdir -p "$out/grpo/final" && echo '{}' > "$out/results.json"
                      for f in model.safetensors trainer_state.pt; do echo weights > "$out/grpo/final/$f"; done;;
esac
exit 0
'''


def _lease_tree(tmp_path, gguf: bytes, sha: str):
    """A repository stand-in holding the two scripts and what bench/gpu_carry.sh packs."""
    import hashlib
    import io
    import shutil
    import tarfile

    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    for name in ("gpu_lease.sh", "real_model_gpu.sh"):
        shutil.copy(BENCH / name, repo / "bench" / name)
    carry, b = tmp_path / "carry", repo / ".gpu" / "b"
    (b / "whl").mkdir(parents=True)
    carry.mkdir()
    (carry / "part00").write_bytes(gguf[:7])
    (b / "part01").write_bytes(gguf[7:])
    (b / "gguf.sha256").write_text((sha or hashlib.sha256(gguf).hexdigest()) + "\n")
    (b / "whl" / "transformers-5.19.0-py3-none-any.whl").write_bytes(b"wheel")
    with tarfile.open(b / "trl.tgz", "w:gz") as tar:
        data = b"# trl\n"
        info = tarfile.TarInfo("trl/trl/__init__.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    fake = tmp_path / "py"
    fake.write_text(LEASE_PY)
    fake.chmod(0o755)
    return repo, carry, fake


@pytest.mark.parametrize("sha, part00", [(None, True), ("0" * 64, True), (None, False)])
def test_gpu_lease_joins_checks_installs_imports_then_runs_the_stages(tmp_path, sha, part00):
    """bench/gpu_lease.sh (the second call of a GPU lease): the GGUF joined from the first
    call's part and the carried one, its SHA-256 checked before anything is installed or
    imported, then the wheels, TRL, the import and real_model_gpu.sh with the caller's STAGES,
    the reports packed into $OUT/reports.tgz; parts from another pack, or a missing first
    part, stop it with a message that says what to do."""
    import os
    import subprocess
    import tarfile

    gguf = b"GGUF" + bytes(range(60))
    repo, carry, fake = _lease_tree(tmp_path, gguf, sha)
    if not part00:
        (carry / "part00").unlink()
    log, out, copy = tmp_path / "calls.log", tmp_path / "out", tmp_path / "gguf.copy"
    out.mkdir()
    env = {**os.environ, "PY": str(fake), "FAKE_LOG": str(log), "FAKE_GGUF_COPY": str(copy), "OUT": str(out),
           "CARRY": str(carry), "REPORTS": str(tmp_path / "reports"), "STAGES": "grpo_throughput_static grpo_recipe",
           "BUDGET": "60"}
    res = subprocess.run(["bash", str(repo / "bench" / "gpu_lease.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    if sha is not None or not part00:
        assert res.returncode == 3 and not log.exists()  # nothing installed, imported or run
        assert ("different packs" if part00 else "the first call copies .gpu/a/part00") in res.stderr
        return
    assert res.returncode == 0, res.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("-m pip install") and calls[0].endswith("transformers-5.19.0-py3-none-any.whl")
    assert calls[1].startswith("-m rlhflab import-gguf") and copy.read_bytes() == gguf  # the joined file
    assert [c.split()[0] for c in calls[3:]] == ["bench/grpo_throughput.py"] + ["scripts/real_model_recipes.py"] * 2
    assert "--hf-cache static" in calls[3]  # (calls[2] is real_model_gpu.sh's -c)
    assert (repo / ".bench" / "trl" / "trl" / "__init__.py").is_file()
    with tarfile.open(out / "reports.tgz") as tar:
        names = tar.getnames()
    assert "reports/paste.txt" in names and "reports/grpo_throughput_static.txt" in names
    assert "reports/recipes_s0/results.json" in names  # the trained models stay behind (1.6 GB a recipe on
    assert not [n for n in names if n.endswith((".safetensors", ".pt"))]  # the GPU: the call ran out packing them)


def test_gpu_carry_without_the_gguf_says_how_to_get_it(tmp_path):
    import os
    import subprocess

    res = subprocess.run(["bash", str(BENCH / "gpu_carry.sh")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "GGUF": str(tmp_path / "missing.gguf")})
    assert res.returncode == 2 and "run make models, or set GGUF=FILE" in res.stderr  # before touching .gpu/
