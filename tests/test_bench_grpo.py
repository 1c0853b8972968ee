"""bench/grpo_throughput.py runs as bench/README.md documents it, round after round.

Its numbers are not asserted (a benchmark, not a timed test). What is checked: with
`--out` and `--repeats 2`, every run of every round trains in a folder of its own (the
second round used to die: the priming run's folder was reused, and the trainer refuses a
folder that holds a finished run); a second invocation with the same `--out` runs too;
`--sides rlhflab` needs no TRL; the last line parses.
"""

from __future__ import annotations

import argparse
import ast
import math
import re
import subprocess
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
                                       (["--sides", "trl-hf"], "rlhflab-vllm, trl-vllm"),
                                       (["--steps", "1"], "--steps at least 2"),
                                       (["--repeats", "0"], "--repeats must be at least 1")])
def test_bad_options_are_refused_in_one_line(bench, bad, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--sides", "rlhflab", "--out", str(tmp_path / "out"), *bad])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------
# vLLM generation on both sides (rlhflab-vllm, trl-vllm): what each side is asked to run,
# checked without starting a worker, TRL or vLLM.
# --------------------------------------------------------------------------------------
def _args(tmp_path, generation: str, **kw) -> argparse.Namespace:
    base = dict(model=tmp_path / "model", data=tmp_path / "data", out=tmp_path, steps=4, beta=0.04, lr=1e-5,
                device="cpu", mixed_precision="no", threads=2, group_size=4, completions=32, max_new_tokens=32,
                share_prompt="auto", prime=True, generation=generation, chat_prompts=False, cpu_matmul="torch",
                hf_cache="dynamic", compile_layers=False)
    return argparse.Namespace(**{**base, **kw})


def test_rlhflab_vllm_side_runs_the_vllm_backend_and_the_config_accepts_it(bench, tmp_path):
    from rlhflab.config import load_config
    from rlhflab.trainers.grpo import GRPORunConfig

    for generation in ("hf", "vllm"):
        overrides = bench.rlhflab_overrides(_args(tmp_path, generation), steps=4, out="run")
        assert f"generation.backend={generation}" in overrides
        cfg, _ = load_config(bench.ROOT / "configs" / "grpo_debug.yaml", GRPORunConfig, overrides)
        assert cfg.generation.backend == generation
        # the same GRPO as TRL's side: 32 completions = 8 prompts x 4, one optimizer step per rollout
        assert (cfg.grpo.group_size, cfg.grpo.prompts_per_step, cfg.grpo.batch_size) == (4, 8, 32)
        assert cfg.grpo.mini_batch_size == 32 and cfg.dataset.max_prompt_length == bench.MAX_PROMPT_TOKENS


def test_cpu_matmul_reaches_rlhflabs_config_and_the_worker(bench, tmp_path, monkeypatch):
    from rlhflab.config import load_config
    from rlhflab.trainers.grpo import GRPORunConfig

    for mode in ("torch", "onednn", "auto"):
        a = _args(tmp_path, "hf", cpu_matmul=mode)
        cfg, _ = load_config(bench.ROOT / "configs" / "grpo_debug.yaml", GRPORunConfig,
                             bench.rlhflab_overrides(a, steps=4, out="run"))
        assert cfg.cpu.matmul == mode
    assert bench._matmul_here(_args(tmp_path, "hf", cpu_matmul="auto", device="cuda")) == "torch"
    seen = {}

    def run(cmd, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 0, stdout="{}\n", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", run)
    bench._worker("rlhflab", _args(tmp_path, "hf", cpu_matmul="onednn"), 0)
    assert seen["cmd"][seen["cmd"].index("--cpu-matmul") + 1] == "onednn"


def test_trl_vllm_side_asks_grpoconfig_for_a_colocated_engine(bench, tmp_path):
    hf = bench.trl_config_kwargs(_args(tmp_path, "hf"), "run")
    vl = bench.trl_config_kwargs(_args(tmp_path, "vllm"), "run")
    assert not any(k.startswith("vllm") or k == "use_vllm" for k in hf)  # TRL's own default: HF generate
    extra = {k: v for k, v in vl.items() if k not in hf}
    # one process, no sleep mode, the context rlhflab's engine gets: 64 prompt tokens + 32 new
    assert extra == {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False,
                     "vllm_max_model_length": 64 + 32}
    assert {k: v for k, v in vl.items() if k in hf} == hf  # the GRPO itself unchanged
    grpo_config = bench.TRL_DIR / "trl" / "trainer" / "grpo_config.py"
    if grpo_config.is_file():  # TRL installed for the bench: these are GRPOConfig fields of this version
        fields = {node.target.id for node in ast.walk(ast.parse(grpo_config.read_text()))
                  if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
        assert set(extra) <= fields, set(extra) - fields


def test_compile_layers_reaches_rlhflab_config_and_its_worker(bench, tmp_path, monkeypatch):
    from rlhflab.config import load_config
    from rlhflab.trainers.grpo import GRPORunConfig

    for on in (False, True):
        cfg, _ = load_config(bench.ROOT / "configs" / "grpo_debug.yaml", GRPORunConfig,
                             bench.rlhflab_overrides(_args(tmp_path, "hf", compile_layers=on), 4, "run"))
        assert cfg.model.compile_layers is on
        seen = {}
        monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: seen.update(cmd=cmd)
                            or subprocess.CompletedProcess(cmd, 0, stdout="{}\n", stderr=""))
        bench._worker("rlhflab", _args(tmp_path, "hf", compile_layers=on), 0)
        assert ("--compile-layers" in seen["cmd"]) is on


def test_hf_cache_static_reaches_both_sides_and_the_worker(bench, tmp_path, monkeypatch):
    from rlhflab.config import load_config
    from rlhflab.trainers.grpo import GRPORunConfig

    for generation, expected in (("hf", "static"), ("vllm", "dynamic")):  # vLLM keeps its own cache
        cfg, _ = load_config(bench.ROOT / "configs" / "grpo_debug.yaml", GRPORunConfig,
                             bench.rlhflab_overrides(_args(tmp_path, generation, hf_cache="static"), 4, "run"))
        assert cfg.generation.hf.cache == expected
    static = bench.trl_config_kwargs(_args(tmp_path, "hf", hf_cache="static"), "run")
    plain = bench.trl_config_kwargs(_args(tmp_path, "hf"), "run")
    assert {k: v for k, v in static.items() if k not in plain} == {"cache_implementation": "static"}
    assert "cache_implementation" not in bench.trl_config_kwargs(_args(tmp_path, "vllm", hf_cache="static"), "run")
    grpo_config = bench.TRL_DIR / "trl" / "trainer" / "grpo_config.py"
    if grpo_config.is_file():
        assert "cache_implementation:" in grpo_config.read_text()  # a GRPOConfig field of this version
    seen = {}
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: seen.update(cmd=cmd)
                        or subprocess.CompletedProcess(cmd, 0, stdout="{}\n", stderr=""))
    bench._worker("rlhflab", _args(tmp_path, "hf", hf_cache="static"), 0)
    assert seen["cmd"][seen["cmd"].index("--hf-cache") + 1] == "static"


def test_trl_vllm_on_cpu_gets_a_1_gib_kv_cache_unless_the_user_set_one(bench, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    a = _args(tmp_path, "hf")
    assert bench.worker_env(a, "trl-vllm")["VLLM_CPU_KVCACHE_SPACE"] == "1"
    for side in ("trl", "rlhflab", "rlhflab-vllm"):  # rlhflab sizes its own; TRL's HF generate has none
        assert "VLLM_CPU_KVCACHE_SPACE" not in bench.worker_env(a, side)
    assert "VLLM_CPU_KVCACHE_SPACE" not in bench.worker_env(_args(tmp_path, "hf", device="cuda"), "trl-vllm")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert bench.worker_env(a, "trl-vllm")["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert bench.worker_env(a, "trl-vllm")["OMP_NUM_THREADS"] == "2"


def test_a_failed_trl_vllm_run_is_reported_and_any_other_failure_stops(bench, tmp_path, monkeypatch):
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\n[rank0]: AttributeError: 'Parameter' "
                                                         "object has no attribute 'weight_loader'\n")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    a = _args(tmp_path, "hf")
    assert bench._worker("trl-vllm", a, 1) == {
        "error": "AttributeError: 'Parameter' object has no attribute 'weight_loader'"}
    cmd = seen[-1]
    assert cmd[cmd.index("--worker") + 1] == "trl" and cmd[cmd.index("--generation") + 1] == "vllm"
    with pytest.raises(SystemExit, match="the rlhflab-vllm worker failed"):
        bench._worker("rlhflab-vllm", a, 1)
    cmd = seen[-1]
    assert cmd[cmd.index("--worker") + 1] == "rlhflab" and cmd[cmd.index("--generation") + 1] == "vllm"


@pytest.mark.parametrize("sides, pair", [(["rlhflab", "trl"], ("rlhflab", "trl")),
                                         (["rlhflab", "rlhflab-vllm", "trl"], ("rlhflab", "trl")),
                                         (["rlhflab-vllm", "trl-vllm"], ("rlhflab-vllm", "trl-vllm")),
                                         (["rlhflab-vllm"], ("rlhflab-vllm", "trl-vllm"))])
def test_the_last_line_compares_sides_that_sample_alike(bench, sides, pair):
    assert bench.last_line_pair(sides) == pair


# --------------------------------------------------------------------------------------
# The prompts each side is asked: rlhflab wraps them in the tokenizer's chat template
# (configs/grpo_debug.yaml: use_chat_template auto), so TRL gets them as chat messages,
# which its GRPOTrainer renders with the same template; a model without one gets raw text
# on both sides. The bench compares the two token lists before it runs.
# --------------------------------------------------------------------------------------
ROWS = [{"question": "2 + 3?", "answer": "5"}, {"question": "Ann has 7 pens and gives away 4. How many?",
                                                "answer": "3"}, {"question": "10 - 9?", "answer": "1"}]


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory) -> Path:
    from rlhflab.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("grpo-bench-chatml"), hidden_size=64, num_layers=2,
                           num_heads=2, chat_template="chatml")


@pytest.fixture
def rows_dir(tmp_path) -> Path:
    import json

    folder = tmp_path / "rows"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return folder


def test_a_chat_model_is_asked_the_templated_prompt_on_both_sides(bench, chatml_dir, rows_dir, tmp_path):
    from transformers import AutoTokenizer

    ours, use_chat = bench.rlhflab_prompt_ids(_args(tmp_path, "hf", model=chatml_dir, data=rows_dir), 3)
    assert use_chat
    column = bench.trl_prompts(ROWS, bench.TEMPLATE, use_chat)
    assert column[0] == [{"role": "user", "content": "Question: 2 + 3?\nAnswer:"}]
    # what TRL 1.16's GRPOTrainer does with a conversational prompt (_tokenize_prompts): the
    # tokenizer's chat template with the generation prompt, tokenized by that call
    tok = AutoTokenizer.from_pretrained(chatml_dir)
    theirs = tok.apply_chat_template(column, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ours == [list(r) for r in theirs]
    text = tok.decode(ours[0])
    assert "Question: 2 + 3?\nAnswer:" in text and text.endswith("<|im_start|>assistant\n")
    # the defect this replaced: TRL given the raw string is asked fewer, different tokens
    raw = tok(bench.trl_prompts(ROWS, bench.TEMPLATE, False))["input_ids"]
    assert len(raw[0]) < len(ours[0])
    assert bench.check_same_prompts(ours, raw).startswith("prompt 0 differs: rlhflab feeds ")


def test_a_model_without_a_chat_template_is_asked_the_raw_prompt_on_both_sides(bench, tiny_model_dir, rows_dir,
                                                                                tmp_path):
    from transformers import AutoTokenizer

    ours, use_chat = bench.rlhflab_prompt_ids(_args(tmp_path, "hf", model=tiny_model_dir, data=rows_dir), 3)
    assert not use_chat
    column = bench.trl_prompts(ROWS, bench.TEMPLATE, use_chat)
    assert column[1] == "Question: Ann has 7 pens and gives away 4. How many?\nAnswer:"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert ours == tok(column)["input_ids"]  # TRL's plain call: processing_class(text=prompts)
    assert bench.check_same_prompts(ours, ours) is None


def test_prompts_that_differ_stop_the_bench_and_rlhflab_alone_needs_no_trl(bench, chatml_dir, rows_dir, tmp_path,
                                                                           monkeypatch):
    a = _args(tmp_path, "hf", model=chatml_dir, data=rows_dir)
    monkeypatch.setattr(bench, "trl_prompt_ids", lambda a, limit, use_chat: [[1, 2, 3]] * len(ROWS))
    with pytest.raises(SystemExit, match="would not be asked the same prompts .prompt 0 differs"):
        bench.side_prompt_tokens(a, ["rlhflab", "trl"])

    def no_trl(*args):
        raise AssertionError("TRL's tokenization asked for a run without a TRL side")

    monkeypatch.setattr(bench, "trl_prompt_ids", no_trl)
    counts, use_chat = bench.side_prompt_tokens(a, ["rlhflab", "rlhflab-vllm"])
    ours, _ = bench.rlhflab_prompt_ids(a, 3)
    assert use_chat and counts == {"rlhflab": sum(map(len, ours)) / 3, "rlhflab-vllm": sum(map(len, ours)) / 3}
    assert bench.check_same_prompts(ours, ours[:2]) == "rlhflab reads 3 prompts, TRL 2"


def test_each_sides_mfu_counts_its_own_prompt_tokens(bench, tmp_path):
    import _common

    a = _args(tmp_path, "hf", completions=8, group_size=4)
    n = _common.LinearParams(body=10, head=3)
    run = {"phases_s": {"generate": 1.0, "score": 0.0, "forward": 1.0, "update": 1.0}, "mean_response_length": 3}
    lines = bench.mfu_lines({"rlhflab": [run], "trl": [run]}, a, n, {"rlhflab": 5, "trl": 9}, peak=1e3, peak_what="x")
    # 2 prompts x 5 tokens + 8 x 3 response tokens = 34: 2 x (10 x 34 + 3 x 24) = 824 FLOPs;
    # with 9 prompt tokens 42: 2 x (10 x 42 + 72) = 984
    assert "generate 1.00 s 8.24e-07 GFLOP" in lines[1] and lines[1].endswith("; 5.0 prompt tokens")
    assert "generate 1.00 s 9.84e-07 GFLOP" in lines[2] and lines[2].endswith("; 9.0 prompt tokens")


@pytest.mark.slow
def test_trl_tokenizes_the_column_as_rlhflab_does(bench, chatml_dir, tiny_model_dir, rows_dir, tmp_path):
    """TRL 1.16's own `_tokenize_prompts` (imported from the bench's install) against rlhflab's ids."""
    if not (bench.TRL_DIR / f"trl-{bench.TRL_VERSION}.dist-info").is_dir():
        pytest.skip(f"TRL {bench.TRL_VERSION} is not installed for the bench ({bench.INSTALL_HINT})")
    for model in (chatml_dir, tiny_model_dir):
        a = _args(tmp_path, "hf", model=model, data=rows_dir)
        ours, use_chat = bench.rlhflab_prompt_ids(a, 3)
        assert bench.trl_prompt_ids(a, 3, use_chat) == ours
