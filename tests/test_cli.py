"""`rlhflab ppo` from the command line: a debug run, a resume, and the errors that exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhflab import cli
from rlhflab.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = ROOT / "configs" / "ppo_debug.yaml"


def _args(tiny_model_dir, arith_dir, out, *extra):
    return ["ppo", "--config", str(DEBUG_CONFIG), f"model.name_or_path={tiny_model_dir}",
            f"dataset.path={arith_dir / 'train.jsonl'}", f"dataset.eval_path={arith_dir / 'test.jsonl'}",
            f"training.output_dir={out}", "generation.max_new_tokens=8", "dataset.num_eval_samples=8",
            "ppo.rollout_samples=8", "ppo.batch_size=8", "ppo.mini_batch_size=4", "ppo.epochs=1",
            "logging.progress_bar=false", "logging.plots=false", "training.num_threads=1", *extra]


@pytest.mark.slow
def test_ppo_debug_config_run_resume_and_refusals(tiny_model_dir, arith_dir, tmp_path, capsys):
    out = tmp_path / "run"
    # ppo_debug.yaml itself: 3 steps, step_2/ saved, evaluation at step 3.
    rc = cli.main(_args(tiny_model_dir, arith_dir, out))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert f"done: {out}" in captured.out
    assert {"effective_config.yaml", "metrics.jsonl", "step_2", "final", "train_result.json",
            "peak_memory_mb.txt", "eval"} <= {p.name for p in out.iterdir()}
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]
    result = json.loads((out / "train_result.json").read_text())
    assert set(result["eval_after"]) == {"eval/reward_mean", "eval/accuracy"}
    # cpu.matmul's default, auto: oneDNN on a non-Intel CPU with AVX-512, torch's MKL elsewhere
    from rlhflab.cpu.matmul import resolve
    assert result["cpu_matmul"] == resolve("auto")

    # A second run into the same folder is refused, with the way out.
    rc = cli.main(_args(tiny_model_dir, arith_dir, out))
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "already holds checkpoints" in err
    assert f"--resume {out}/step_N" in err and "Traceback" not in err

    # --resume of a folder without trainer_state.pt.
    rc = cli.main(["ppo", "--config", str(DEBUG_CONFIG), "--resume", str(out / "eval"),
                   *_args(tiny_model_dir, arith_dir, out)[3:]])
    err = capsys.readouterr().err
    assert rc == 2 and f"--resume {out / 'eval'}: no trainer_state.pt there" in err
    assert "step_N/" in err

    # --resume of step_2/ redoes step 3 only; metrics.jsonl keeps one row per step.
    rc = cli.main(["ppo", "--config", str(DEBUG_CONFIG), "--resume", str(out / "step_2"),
                   *_args(tiny_model_dir, arith_dir, out)[3:]])
    assert rc == 0, capsys.readouterr().err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]


def test_unknown_key_exits_2_with_a_suggestion(tiny_model_dir, arith_dir, tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli.main(_args(tiny_model_dir, arith_dir, out, "ppo.kl_coef=0.1"))
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and "ppo.kl_coef: unknown key; did you mean ppo.kl_coeff?" in err
    assert not out.exists()  # nothing was started


def test_bad_value_and_missing_model_exit_2(tiny_model_dir, arith_dir, tmp_path, capsys):
    rc = cli.main(_args(tiny_model_dir, arith_dir, tmp_path / "a", "ppo.clip_eps=2"))
    assert rc == 2 and "ppo.clip_eps" in capsys.readouterr().err
    missing = tmp_path / "no-model"
    rc = cli.main(_args(missing, arith_dir, tmp_path / "b"))
    err = capsys.readouterr().err
    assert rc == 2 and str(missing) in err and "fetch-model" in err


def test_console_script_exit_code_and_no_traceback(tmp_path):
    # The real entry point in a fresh process: `python -m rlhflab ppo ...` with a typo.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "rlhflab", "ppo", "--config", str(DEBUG_CONFIG),
                           "training.totl_ppo_steps=3", f"training.output_dir={tmp_path / 'x'}"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 2
    assert "error: " in proc.stderr and "did you mean training.total_steps?" in proc.stderr
    assert "Traceback" not in proc.stderr
