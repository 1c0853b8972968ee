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
        import _common as _mfu
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
