"""Smoke tests of bench/ppo_throughput.py on its rlhflab side; TRL is never needed here.

The benchmark's numbers are not asserted (it is a benchmark, not a timed test); what is
checked is that it measures the work it claims: fixed-length responses, every phase
timed, memory counted, the policy updated, and a last line a script can parse.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
FINAL = re.compile(r"ppo_throughput: rlhflab (\S+) eps/s, trl (\S+) eps/s, "
                   r"speed ratio (\S+), memory ratio (\S+), critic speed ratio (\S+), critic memory ratio (\S+)")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # spawned workers inherit sys.path and import it by name
    try:
        import ppo_throughput
        yield ppo_throughput
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def tiny_model(bench, tmp_path_factory):
    import _common
    return _common.ensure_tiny_model(tmp_path_factory.mktemp("bench") / "tiny-model")


def test_rlhflab_only_run_prints_table_and_parsable_final_line(bench, tiny_model, tmp_path, capsys):
    raw = tmp_path / "raw.json"
    # --peak-sizes 256: the MFU's matmul peak on tiny matrices (not checked here; the default
    # 2048 and 4096 took most of this test's time on 2 cores)
    rc = bench.main(["--sides", "rlhflab", "--repeats", "2", "--warmup", "0", "--episodes", "4",
                     "--response-length", "4", "--epochs", "1", "--threads", "1", "--peak-sizes", "256",
                     "--model-dir", str(tiny_model), "--json", str(raw)])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    m = FINAL.fullmatch(lines[-1])
    assert m, lines[-1]
    assert float(m.group(1)) > 0
    assert all(math.isnan(float(m.group(i))) for i in (2, 3, 4, 5, 6))  # no TRL side: nan, still parsable
    assert any(line.startswith("rlhflab (value head)") for line in lines)
    # the kernel's share: one line per side, from the step's own getrusage counters
    kernel = [line for line in lines if line.startswith("rlhflab (value head)") and " sys " in line]
    assert len(kernel) == 1 and re.search(r"sys +\d+\.\d\d s, +\d+\.\d\d M page faults \(of ", kernel[0])

    result = json.loads(raw.read_text())
    steps = result["steps"]["rlhflab"]
    assert len(steps) == 2
    for st in steps:
        # min_new_tokens = max_new_tokens: every response is exactly 4 tokens, none cut by EOS
        assert st["response_width"] == 4 and st["tokens"] == 4 * 4 and st["episodes"] == 4
        for phase in ("generate", "forward", "update"):
            assert st[phase] > 0, phase
        assert st["total"] >= st["generate"] + st["forward"] + st["update"]
        assert 0 <= st["sys"] <= st["cpu"] and st["faults"] > 0  # a step touches fresh pages
    mem = result["memory"]["rlhflab"]
    # The run holds at least the weights of policy + reference and the Adam state (2 x weights).
    assert mem["held_tensor_mb"] > 0 and mem["step_tensor_peak_mb"] > 0
    assert mem["ppo_peak_mb"] > 0 and mem["process_peak_rss_mb"] > mem["ppo_peak_mb"]


def test_rlhflab_side_step_updates_the_policy(bench, tiny_model):
    import torch

    s = bench.BenchSettings(model_dir=str(tiny_model), episodes=4, response_length=4, epochs=2)
    side = bench.RlhflabSide(s, "value_head")
    torch.manual_seed(0)
    side.build()
    cfg = side.cfg
    assert cfg.generation.min_new_tokens == cfg.generation.max_new_tokens == 4
    assert cfg.ppo.mini_batch_size == cfg.ppo.rollout_samples == 4 and cfg.ppo.epochs == 2
    assert side.models.reference is not None  # KL on: the reference forward is part of the step
    before = [p.detach().clone() for p in side.models.actor.trainable_parameters()]
    out = side.step()
    after = side.models.actor.trainable_parameters()
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert all(torch.isfinite(p).all() for p in after)
    assert out["tokens"] == 16 and out["update"] > 0


def test_torchmm_side_runs_torchs_own_matmul(bench, tiny_model, monkeypatch):
    """The like-for-like-kernels row: rlhflab's critic with cpu.matmul=torch has no
    oneDNN Linear layer; the default critic row follows `auto` (oneDNN where it picks it)."""
    from rlhflab import cpu
    from rlhflab.cpu import matmul
    from rlhflab.ops import matmul as ops_matmul

    if not ops_matmul.onednn_available():
        pytest.skip("this torch build has no oneDNN linear op")
    monkeypatch.setattr(cpu, "_matmul", None)
    monkeypatch.setattr(matmul, "resolve", lambda mode, cpuinfo=None: "torch" if mode == "torch" else "onednn")
    s = bench.BenchSettings(model_dir=str(tiny_model), episodes=4, response_length=4, epochs=1)
    for name, want in (("rlhflab-critic-torchmm", False), ("rlhflab-critic", True),
                       ("rlhflab-critic-torchmm-samplerlp", False), ("rlhflab-critic-samplerlp", True)):
        side = bench.make_side(name, s)
        side.build()
        assert side.cfg.model.critic == "separate"
        assert side.cfg.generation.old_logprobs == ("sampler" if name.endswith("-samplerlp") else "recompute")
        fast = [type(m) is matmul.FastLinear for m in side.models.actor.modules()]
        assert any(fast) == want, name
        side.release()


def test_attn_implementation_flag_reaches_every_side_and_the_header(bench, tiny_model):
    for attn in (None, "eager", "sdpa"):
        s = bench.BenchSettings(model_dir=str(tiny_model), attn=attn)
        for name in ("rlhflab", "rlhflab-critic-samplerlp"):
            assert bench.make_side(name, s).config().model.attn_implementation == attn
        result = {"settings": bench.asdict(s), "repeats": 1, "warmup": 0, "info": {}}
        header = bench.format_report(result, {}).splitlines()[0]
        assert (f"attention {attn} on every side" in header) is (attn is not None)
    for attn in (None, "eager"):  # TRL's side loads its policy and value model with the same attention
        policy, value = bench.load_trl_models(bench.BenchSettings(model_dir=str(tiny_model), attn=attn))
        assert policy.config._attn_implementation == value.config._attn_implementation == (attn or "sdpa")
    # a side named for eager attention keeps it
    assert bench.make_side("rlhflab-bf16-eager", bench.BenchSettings(model_dir=str(tiny_model), attn="sdpa")
                           ).config().model.attn_implementation == "eager"


def test_hf_cache_flag_reaches_every_rlhflab_side_and_the_header(bench, tiny_model):
    for cache in ("dynamic", "static"):
        s = bench.BenchSettings(model_dir=str(tiny_model), hf_cache=cache)
        for name in ("rlhflab", "rlhflab-critic", "rlhflab-critic-samplerlp"):
            assert bench.make_side(name, s).config().generation.hf.cache == cache
    for cache, said in (("static", True), ("dynamic", False)):
        result = {"settings": bench.asdict(bench.BenchSettings(model_dir=str(tiny_model), hf_cache=cache)),
                  "repeats": 1, "warmup": 0, "info": {}}
        header = bench.format_report(result, {}).splitlines()[0]
        assert ("rlhflab's generation.hf.cache=static" in header) is said


def test_compile_layers_flag_reaches_every_rlhflab_side_and_the_header(bench, tiny_model):
    for on in (False, True):
        s = bench.BenchSettings(model_dir=str(tiny_model), compile_layers=on)
        for name in ("rlhflab", "rlhflab-critic", "rlhflab-critic-torchmm-samplerlp"):
            assert bench.make_side(name, s).config().model.compile_layers is on
        result = {"settings": bench.asdict(s), "repeats": 1, "warmup": 0, "info": {}}
        header = bench.format_report(result, {}).splitlines()[0]
        assert ("rlhflab's model.compile_layers=true" in header) is on


def test_a_worker_killed_for_memory_is_named_with_the_way_out(bench):
    """A worker the kernel kills (SIGKILL) is reported as killed, with the flag that skips
    the profiled tensor count when it died there, after its timed steps."""
    import multiprocessing as mp
    import os
    import signal
    import time

    ctx = mp.get_context("fork")
    w = bench.Worker.__new__(bench.Worker)
    w.name, w.tensor_memory = "rlhflab-critic", True
    w.conn, child = ctx.Pipe()
    w.proc = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    w.proc.start()
    child.close()  # the parent's recv() sees EOF, as when the worker's end goes with it
    os.kill(w.proc.pid, signal.SIGKILL)
    with pytest.raises(SystemExit) as died:
        w.expect("memory")
    msg = str(died.value)
    assert "rlhflab-critic worker died (exit code -9: killed, most likely by the kernel for memory)" in msg
    assert "--no-tensor-memory" in msg and "--sides rlhflab-critic" in msg
    w.conn, child = ctx.Pipe()
    w.proc = ctx.Process(target=os._exit, args=(3,), daemon=True)
    w.proc.start()
    child.close()
    plain = "ppo_throughput: the rlhflab-critic worker died (exit code 3); run it alone with --sides rlhflab-critic"
    with pytest.raises(SystemExit) as died:
        w.expect("step")
    assert str(died.value) == plain
    w.tensor_memory = False  # --no-tensor-memory: no profiled step to blame at the finish
    w.conn, child = ctx.Pipe()
    w.proc = ctx.Process(target=os._exit, args=(3,), daemon=True)
    w.proc.start()
    child.close()
    with pytest.raises(SystemExit) as died:
        w.expect("memory")
    assert str(died.value) == plain


def test_rule_reward_module_answers_trls_reward_protocol(bench, tiny_model):
    """Called the way a reward model is read (backbone by prefix, `score`, value at the
    last real token), the wrapper returns the GSM8K rule's score of each response."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = "Question: Ann has 3 pens and buys 4. How many pens?\nAnswer:"
    answers = {prompt: "3 + 4 = 7\n#### 7"}
    responses = [" 3 + 4 = 7\n#### 7", " #### 8", " no idea"]  # rule: 1.0, 0.1 (formatted, wrong), 0.0
    model = bench.make_rule_reward_module(tok, answers)
    rows = [tok(prompt + r, add_special_tokens=False)["input_ids"] for r in responses]
    width, pad = max(map(len, rows)) + 2, tok.pad_token_id
    right = [0, 1, 0]  # prompts are padded on the left; a response cut short, on the right
    ids = torch.tensor([[pad] * (width - len(r) - k) + r + [pad] * k for r, k in zip(rows, right, strict=True)])
    mask = ids != pad
    ids = ids.masked_fill(~mask, 0)  # a reader fills padding with id 0 (EOS here): must be ignored
    backbone = getattr(model, model.base_model_prefix)
    out = backbone(input_ids=ids, attention_mask=mask, position_ids=mask.long().cumsum(1) - 1,
                   return_dict=True, output_hidden_states=True, use_cache=False)
    logits = model.score(out.hidden_states[-1])                         # (B, L, 1)
    last = torch.tensor([int(m.nonzero().max()) for m in mask])
    scores = logits[torch.arange(len(rows)), last].squeeze(-1)
    assert scores.tolist() == pytest.approx([1.0, 0.1, 0.0])


def test_trl_side_without_trl_says_how_to_install(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "TRL_DIR", tmp_path / "no-trl-here")
    assert bench.main(["--sides", "trl", "--repeats", "1"]) == 3
    err = capsys.readouterr().err
    assert "pip install --no-deps --target" in err and "trl==1.12.0" in err
    assert "--sides rlhflab" in err


def test_phase_flops_count_the_passes_each_side_runs(bench):
    """By hand: N = 100 body + 10 head weights, 20 prompt + 5 response tokens, 4 epochs.
    A policy pass 2 x (100 x 25 + 10 x 5) = 5,100; a critic pass (no head) 2 x 100 x 25 = 5,000.
    Scoring: rlhflab's critic side runs policy + reference + critic (15,200); with the sampler's
    old log-probs, reference + critic (10,100), TRL's passes; update 4 x 3 x (5,100 + 5,000)."""
    import _common

    n = _common.LinearParams(100, 10)
    recompute = bench.phase_flops("rlhflab-critic", n, 20, 5, 4)
    sampler = bench.phase_flops("rlhflab-critic-samplerlp", n, 20, 5, 4)
    trl = bench.phase_flops("trl", n, 20, 5, 4)
    assert recompute["forward"] == 15_200 and sampler["forward"] == trl["forward"] == 10_100
    assert recompute["update"] == sampler["update"] == trl["update"] == 121_200
    assert bench.phase_flops("rlhflab", n, 20, 5, 4)["forward"] == 10_200  # value head: policy + reference


def test_interleaved_steps_a_real_size_model_side_by_side(bench, tiny_model, tmp_path, monkeypatch):
    """A model above SEQUENTIAL_ABOVE runs its sides one at a time; --interleaved keeps them
    alive together and steps them in turn; with --sequential it is refused."""
    monkeypatch.setattr(bench, "SEQUENTIAL_ABOVE", 0)  # the tiny model counts as a real one
    small = ["--sides", "rlhflab,rlhflab-critic-samplerlp", "--repeats", "2", "--warmup", "0", "--episodes", "4",
             "--response-length", "4", "--epochs", "1", "--threads", "1", "--peak-sizes", "256",
             "--model-dir", str(tiny_model), "--no-tensor-memory"]
    for extra, want in (([], True), (["--interleaved"], False)):
        raw = tmp_path / f"raw{len(extra)}.json"
        assert bench.main(small + extra + ["--json", str(raw)]) == 0
        result = json.loads(raw.read_text())
        assert result["sequential"] is want and len(result["steps"]["rlhflab-critic-samplerlp"]) == 2
    with pytest.raises(SystemExit) as err:
        bench.main(small + ["--interleaved", "--sequential"])
    assert err.value.code == 2
