"""What a run prints is rlhflab's own and true: no third-party warnings that do not concern
the user (DeepSpeed's "Setting accelerator to CPU" in runs without DeepSpeed), and the
step-0 evaluation shows the greedy held-out responses its heading announces."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DEBUG_CONFIG, ROOT, small_overrides
from rlhflab.evaluate import EvalResult
from rlhflab.trainers.loop import format_eval

DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# Lines a run must not print: DeepSpeed's import-time warning, transformers' save/load bars
# and deprecation notes (rlhflab passes `dtype`, not `torch_dtype`).
NOISE = re.compile(r"real_accelerator|Setting accelerator to CPU|\[WARNING\]|Writing model shards|Loading weights"
                   r"|deprecated", re.IGNORECASE)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_DEEPSPEED"}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


def _python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          env=_env(**env), timeout=600)


# ----------------------------------------------------------------- deepspeed stays unimported

UNWRAP = """
import sys
from rlhflab.thirdparty import defer_deepspeed
defer_deepspeed()
import torch
from transformers.modeling_utils import unwrap_model  # what save_pretrained calls on every save
m = torch.nn.Linear(2, 2)
assert unwrap_model(m) is m
print("deepspeed imported:", "deepspeed" in sys.modules)
"""


@pytest.mark.skipif(not DEEPSPEED, reason="deepspeed not installed (make venv installs the extra)")
def test_defer_deepspeed_keeps_a_save_from_importing_it_unless_deepspeed_runs():
    quiet = _python(UNWRAP)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "deepspeed imported: False" in quiet.stdout
    assert not NOISE.search(quiet.stdout + quiet.stderr), quiet.stdout + quiet.stderr
    # Under a DeepSpeed launch nothing is changed: accelerate imports deepspeed as before
    # (which is also what every process did before defer_deepspeed existed).
    launched = _python(UNWRAP, ACCELERATE_USE_DEEPSPEED="true")
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert "deepspeed imported: True" in launched.stdout


# ----------------------------------------------------------------- the step-0 printout

def test_format_eval_names_what_it_shows():
    res = EvalResult(0.5, 0.55, [
        {"prompt": "Q: 1+1?\nA:", "response": " 2\n#### 2\n#### 2", "score": 1.0, "correct": True},
        {"prompt": "Q: 2+2?\nA:", "response": " 5", "score": 0.1, "correct": False},
        {"prompt": "Q: 3+3?\nA:", "response": " 6", "score": 1.0, "correct": True},
        {"prompt": "Q: 4+4?\nA:", "response": " 9", "score": 0.1, "correct": False},
    ])
    # accuracy 2 of 4 = 0.500; mean reward (1.0 + 0.1 + 1.0 + 0.1) / 4 = 0.550, as given
    assert format_eval(0, res, Path("out/eval/step_0.jsonl")).splitlines() == [
        "eval at step 0 (before training): eval/reward_mean=0.550, eval/accuracy=0.500 over 4 held-out "
        "prompts, greedy (all samples: out/eval/step_0.jsonl); the first 2:",
        "  'Q: 1+1?\\nA:'",
        "    -> ' 2\\n#### 2\\n#### 2'  score 1.00, correct",   # one response that runs on, not three
        "  'Q: 2+2?\\nA:'",
        "    -> ' 5'  score 0.10, wrong",
    ]
    # a later step names the step only; no verdict where no correctness rule applies
    plain = EvalResult(None, 0.3, [{"prompt": "p", "response": "r", "score": 0.3}])
    assert format_eval(7, plain, Path("e.jsonl"), n_show=2).splitlines() == [
        "eval at step 7: eval/reward_mean=0.300 over 1 held-out prompts, greedy (all samples: e.jsonl); the first 1:",
        "  'p'", "    -> 'r'  score 0.30"]


# ----------------------------------------------------------------- a trainer run, end to end

RUN = """
import json
import sys
from rlhflab.cli import main
# argv[1:]: one command; or --each JSON: several, one after another in this process
for argv in (json.loads(sys.argv[2]) if sys.argv[1:2] == ["--each"] else [sys.argv[1:]]):
    rc = main(argv)
    print("deepspeed imported:", "deepspeed" in sys.modules, flush=True)
    print("=== the run ended", flush=True)
    if rc:
        sys.exit(rc)
"""
STEP0 = re.compile(r"^eval at step 0 \(before training\): .* over 4 held-out prompts, greedy "
                   r"\(all samples: (\S+)\); the first 2:$", re.MULTILINE)


QUICKSTART_SMALL = ["sft.max_steps=2", "sft.batch_size=8", "training.total_steps=1", "ppo.rollout_samples=8",
                    "ppo.batch_size=8", "ppo.mini_batch_size=8", "ppo.epochs=1", "dataset.num_eval_samples=4",
                    "generation.max_new_tokens=4", "logging.plots=false"]


@pytest.fixture(scope="module")
def fresh_process(tiny_model_dir, arith_dir, tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[str]]:
    """The quickstart, then two PPO runs (seed 0, then seed 1), one after another in ONE fresh
    process (RUN --each): (what it printed and its exit code, the text of each command).
    The process starts fresh, so whatever a library prints on its first import or load is
    in its text; the NOISE checks read all of it."""
    base = tmp_path_factory.mktemp("quiet")
    quick = ["quickstart", "--out", str(base / "qs"), "--threads", "1", *QUICKSTART_SMALL]
    runs = [["ppo", "--config", str(DEBUG_CONFIG), *small_overrides(tiny_model_dir, arith_dir, base / f"seed{seed}"),
             "training.total_steps=1", "training.eval_interval=1", "dataset.num_eval_samples=4",
             f"training.seed={seed}"] for seed in (0, 1)]
    done = _python(RUN, "--each", json.dumps([quick, *runs]))
    return done, done.stdout.split("=== the run ended")[:-1]


def _ppo_runs(fresh_process) -> tuple[str, list]:
    """The two PPO runs of `fresh_process`: (all the process printed, each run's step-0
    samples as shown, checked against the ones it saved)."""
    done, printed = fresh_process
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert len(printed) == 3, done.stdout[-3000:]
    shown_per_run = []
    for stdout in printed[1:]:
        m = STEP0.search(stdout)
        assert m, stdout
        lines = stdout[m.end():].lstrip("\n").splitlines()[:4]
        shown = [(ast.literal_eval(lines[i].strip()),
                  ast.literal_eval(lines[i + 1].split("->", 1)[1].split("  score")[0])) for i in (0, 2)]
        saved = [json.loads(line) for line in Path(m.group(1)).read_text().splitlines()]
        assert len(saved) == 4 and shown == [(s["prompt"], s["response"]) for s in saved[:2]]
        shown_per_run.append(shown)
    return text, shown_per_run


@pytest.mark.slow
def test_a_trainer_run_is_quiet_and_its_step0_samples_are_the_greedy_held_out_ones(arith_dir, fresh_process):
    text, (shown, again) = _ppo_runs(fresh_process)
    assert not NOISE.search(text), NOISE.search(text).group(0) + "\n" + text[-3000:]
    assert "deepspeed imported: True" not in text and "deepspeed imported: False" in text
    # the samples shown are the first held-out rows
    held_out = [json.loads(line)["question"] for line in (arith_dir / "test.jsonl").read_text().splitlines()[:2]]
    assert all(q in prompt for q, (prompt, _) in zip(held_out, shown, strict=True))
    # greedy: another seed (which draws every sampled token differently) shows the same responses
    assert again == shown


@pytest.mark.slow
def test_the_quickstart_prints_no_third_party_warning(fresh_process):
    done, printed = fresh_process
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    # the quickstart is the process's first command: its own text is a fresh process's
    assert "[5/5]" in printed[0] and "deepspeed imported: False" in printed[0]
    assert not NOISE.search(text), text[-3000:]
