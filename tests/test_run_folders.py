"""A failed or new run never modifies an existing run; a full disk is one line with the
previous checkpoint intact; a diverging run stops with one line and never keeps a
checkpoint whose forward pass is not finite; a resumed run logs each step once."""

from __future__ import annotations

import errno
import json
import math
from pathlib import Path

import pytest
import torch

from rlhflab import cli
from rlhflab.errors import TrainingDiverged, UserError
from rlhflab.metrics import MetricsLogger, read_metrics
from rlhflab.models import checkpoint
from rlhflab.models.checkpoint import checkpoint_steps, latest_checkpoint, prune_checkpoints, save_checkpoint
from rlhflab.trainers import ppo
from rlhflab.trainers.common import (check_finite_model, check_finite_step, check_output_dir,
                                     make_probe_batch, prepare_output_dir)

ROOT = Path(__file__).resolve().parents[1]


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (folders show through their files)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def sft_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["sft", "--config", str(ROOT / "configs" / "sft_debug.yaml"), f"model.name_or_path={model}",
            f"data.path={data / 'sft.jsonl'}", f"data.eval_path={data / 'test.jsonl'}", f"training.output_dir={out}",
            "sft.max_steps=2", "sft.batch_size=8", "data.num_eval_samples=8", "sft.num_eval_generate=2",
            "sft.eval_max_new_tokens=4", "sft.eval_before=false", "logging.progress_bar=false",
            "logging.plots=false", "training.num_threads=1", *extra]


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


# --------------------------------------------------------------------------------------
# The output folder
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("marker", ["final", "metrics.jsonl", "train_result.json", "step_3"])
def test_a_folder_holding_a_run_is_refused(tmp_path, marker):
    out = tmp_path / "run"
    out.mkdir()
    (out / marker).mkdir() if marker in ("final", "step_3") else (out / marker).write_text("{}\n")
    with pytest.raises(UserError) as err:
        check_output_dir(out, resumable=False)
    msg = str(err.value)
    assert str(out) in msg and "training.overwrite=true" in msg and "--resume" not in msg  # SFT/RM: no --resume
    if marker == "step_3":
        with pytest.raises(UserError, match=rf"--resume {out}/step_N \(newest: step_3\)"):
            check_output_dir(out)
    assert check_output_dir(out, overwrite=True) == out
    assert check_output_dir(out, resume=True) == out


def test_a_leftover_tmp_folder_is_debris_not_a_checkpoint(tmp_path):
    # A run killed during its very first save leaves step_1.tmp/ (and its config).
    out = tmp_path / "run"
    (out / "step_1.tmp").mkdir(parents=True)
    (out / "step_1.tmp" / "config.json").write_text("{}")
    (out / "effective_config.yaml").write_text("x: 1\n")
    assert checkpoint_steps(out) == [] and latest_checkpoint(out) is None
    prune_checkpoints(out, keep=1)
    assert (out / "step_1.tmp").exists()  # pruning leaves debris alone ...
    assert check_output_dir(out) == out   # ... a new run is not refused ...
    prepare_output_dir(out)
    assert sorted(p.name for p in out.iterdir()) == ["effective_config.yaml"]  # ... and it is cleaned


def test_overwrite_replaces_only_the_previous_runs_outputs(tmp_path):
    out = tmp_path / "run"
    for name in ("final", "step_2", "step_4", "eval", "plots"):
        (out / name).mkdir(parents=True)
    for name in ("metrics.jsonl", "train_result.json", "effective_config.yaml", "notes.txt"):
        (out / name).write_text("old\n")
    prepare_output_dir(out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # not ours: kept


@pytest.mark.slow
def test_second_sft_run_is_refused_and_a_failed_one_touches_nothing(tiny_sft_rm_dir, arith_dir, tmp_path, capsys):
    out = tmp_path / "sft"
    assert cli.main(sft_args(tiny_sft_rm_dir, arith_dir, out)) == 0
    capsys.readouterr()
    first = tree(out)
    assert {"final/config.json", "metrics.jsonl", "train_result.json", "effective_config.yaml"} <= set(first)

    # Today a second SFT run into the same folder silently trains over the first.
    assert cli.main(sft_args(tiny_sft_rm_dir, arith_dir, out, "sft.learning_rate=5e-4")) == 2
    err = capsys.readouterr().err
    assert "already holds another run" in err and "training.overwrite=true" in err
    assert tree(out) == first

    # overwrite=true with a model that does not load: the old run is not touched, byte for
    # byte (today effective_config.yaml is rewritten before the model load fails).
    assert cli.main(sft_args(tmp_path / "no-model", arith_dir, out, "training.overwrite=true")) == 2
    assert "does not exist" in capsys.readouterr().err
    assert tree(out) == first
    # ... nor with a data file that does not parse.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "sft.jsonl").write_text("{not json\n")
    (bad / "test.jsonl").write_text((arith_dir / "test.jsonl").read_text())
    assert cli.main(sft_args(tiny_sft_rm_dir, bad, out, "training.overwrite=true")) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert tree(out) == first

    # A fresh folder and a failing run: nothing is created at all.
    fresh = tmp_path / "fresh"
    assert cli.main(sft_args(tmp_path / "no-model", arith_dir, fresh)) == 2
    assert not fresh.exists()

    # overwrite=true that works replaces the run.
    assert cli.main(sft_args(tiny_sft_rm_dir, arith_dir, out, "training.overwrite=true", "sft.max_steps=1")) == 0
    assert json.loads((out / "train_result.json").read_text())["steps"] == 1
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]


# --------------------------------------------------------------------------------------
# A full disk, a read-only folder
# --------------------------------------------------------------------------------------
def test_disk_full_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(ppo_cfg, tmp_path, monkeypatch):
    models = ppo.build_models(ppo_cfg())
    run = tmp_path / "run"
    save_checkpoint(run / "step_2", models.actor, models.tokenizer, step=2, method="ppo")
    before = tree(run)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_value_head", full)  # after the policy was written
    for target, kept in ((run / "step_4", f"the previous checkpoint {run / 'step_2'} is intact"),
                         (run / "step_2", "the previous step_2/ is intact")):
        with pytest.raises(UserError) as err:
            save_checkpoint(target, models.actor, models.tokenizer, step=4, method="ppo")
        msg = str(err.value)
        assert msg.startswith(f"cannot save the checkpoint {target}: No space left on device; free some disk space")
        assert kept in msg and "\n" not in msg
        assert tree(run) == before  # nothing half-written, the old checkpoint byte for byte


@pytest.mark.slow
def test_sft_cli_permission_denied_on_the_final_save(tiny_sft_rm_dir, arith_dir, tmp_path, capsys, monkeypatch):
    from rlhflab.trainers import sft

    def denied(model, tokenizer, folder, state=None):
        raise PermissionError(errno.EACCES, "Permission denied", str(folder))

    monkeypatch.setattr(sft, "save_policy", denied)
    out = tmp_path / "sft"
    assert cli.main(sft_args(tiny_sft_rm_dir, arith_dir, out)) == 2
    line = last_line(capsys.readouterr().err)
    assert line.startswith(f"error: cannot save the model to {out / 'final'}: Permission denied; make the folder")
    assert not (out / "final").exists() and not (out / "final.tmp").exists()


def test_a_disk_error_anywhere_else_is_one_line_from_the_cli(tmp_path, capsys, monkeypatch):
    from rlhflab.data import arith

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x" / "train.jsonl.tmp"))

    monkeypatch.setattr(arith, "write_jsonl", full)
    assert cli.main(["make-data", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'x' / 'train.jsonl.tmp'}: No space left on device; free some")
    assert err.count("\n") == 1


# --------------------------------------------------------------------------------------
# Divergence
# --------------------------------------------------------------------------------------
def test_check_finite_step_and_model(tiny_model_dir):
    from rlhflab.models.load import load_model

    check_finite_step(3, loss=1.5, grad_norm=0.2)
    with pytest.raises(TrainingDiverged, match=r"^step 3: training diverged \(the loss is nan\); lower "
                                               r"sft.learning_rate \(now 1e\+09\)"):
        check_finite_step(3, loss=float("nan"), knob="sft.learning_rate", lr=1e9)
    with pytest.raises(TrainingDiverged, match="the gradient norm is inf"):
        check_finite_step(3, grad_norm=float("inf"))
    model, tok = load_model(str(tiny_model_dir))
    model.train()
    probe = make_probe_batch(tok, ["Question: 1 + 2?\nAnswer:", "Hi"], "cpu")
    check_finite_model(model, probe, step=1)
    with torch.no_grad():
        model.model.norm.weight.mul_(1e30).mul_(1e30)  # overflows float32: inf, then inf*0 = nan in the head
    with pytest.raises(TrainingDiverged, match="non-finite logits on a probe batch, so this step is not saved"):
        check_finite_model(model, probe, step=7)
    assert model.training  # its mode is restored


def _finite_forward(folder: Path) -> bool:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return bool(torch.isfinite(model(torch.tensor([[1, 2, 3, 4]])).logits).all())


@pytest.mark.slow
def test_sft_with_learning_rate_1e9_stops_with_one_line(tiny_sft_rm_dir, arith_dir, tmp_path, capsys):
    out = tmp_path / "sft"
    rc = cli.main(sft_args(tiny_sft_rm_dir, arith_dir, out, "sft.learning_rate=1e9", "sft.max_steps=4",
                           "training.save_interval=1", "sft.warmup_ratio=0"))
    err = capsys.readouterr().err
    line = last_line(err)
    assert rc == 2 and "Traceback" not in err
    assert line.startswith("error: step ") and "training diverged" in line and "lower sft.learning_rate" in line
    assert not (out / "final").exists()
    for folder in checkpoint_steps(out):  # whatever was kept still computes finite logits
        assert _finite_forward(folder), folder


def test_sft_whose_learning_rate_blows_up_mid_run_stops_and_keeps_the_good_checkpoints(
        tiny_sft_rm_dir, arith_dir, tmp_path, capsys, monkeypatch):
    # Steps 1-2 train at sft.learning_rate (1e-3); from step 3 the schedule multiplies it
    # by 1e12 (1e9): that update ruins the weights (here step 4's gradient norm is nan).
    # The run stops in one line naming sft.learning_rate; step_1/ and step_2/ stay as they
    # were saved, every checkpoint kept computes finite logits, no final/ is written.
    from rlhflab.trainers import sft

    def blow_up(optimizer, total_steps, *args, **kwargs):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 if i < 2 else 1e12)

    monkeypatch.setattr(sft, "make_scheduler", blow_up)
    out = tmp_path / "sft"
    rc = cli.main(sft_args(tiny_sft_rm_dir, arith_dir, out, "sft.max_steps=6", "training.save_interval=1",
                           "sft.logging_steps=1", "training.keep_last_checkpoints=10"))
    err = capsys.readouterr().err
    line = last_line(err)
    assert rc == 2 and "Traceback" not in err
    assert line.startswith("error: step ") and "training diverged" in line and "lower sft.learning_rate" in line
    kept = [p.name for p in checkpoint_steps(out)]
    assert kept[:2] == ["step_1", "step_2"] and not (out / "final").exists()
    for folder in checkpoint_steps(out):
        assert _finite_forward(folder), folder
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows][:2] == [1, 2] and all(math.isfinite(r["train/loss"]) for r in rows[:2])


def test_sft_rm_and_dpo_feed_every_logged_row_to_the_doctor(tiny_sft_rm_dir, arith_dir, tmp_path, monkeypatch):
    # Each trainer makes its method's doctor and passes it every row it logs (the same rows
    # metrics.jsonl gets), so the rules run live as they do in the RL loop.
    from rlhflab.data.preferences import write_arith_pairs, write_off_by_one_pairs
    from rlhflab.doctor import Doctor
    from rlhflab.run import context

    seen: dict[str, list[int]] = {}

    class Recorder(Doctor):
        def observe(self, step, metrics):
            seen.setdefault(self.config.method, []).append(step)
            return super().observe(step, metrics)

    def recording_doctor(enabled, max_grad_norm, kl_knob="ppo.kl_coeff", *, method="rl", lr_knob=None):
        assert enabled and max_grad_norm == 1.0
        return Recorder(max_grad_norm=max_grad_norm, method=method, lr_knob=lr_knob)

    monkeypatch.setattr(context, "make_doctor", recording_doctor)  # the run context makes every trainer's doctor
    assert cli.main(sft_args(tiny_sft_rm_dir, arith_dir, tmp_path / "sft", "sft.logging_steps=1")) == 0
    prefs = write_arith_pairs(tmp_path / "prefs", n_train=32, n_test=8)
    assert cli.main(["rm", "--config", str(ROOT / "configs" / "rm_debug.yaml"), f"model.name_or_path={tiny_sft_rm_dir}",
                     f"data.path={prefs['train']}", f"data.eval_path={prefs['test']}", "rm.max_steps=2",
                     "rm.logging_steps=1", f"training.output_dir={tmp_path / 'rm'}", "logging.progress_bar=false",
                     "logging.plots=false", "training.num_threads=1"]) == 0
    task = tmp_path / "task"
    task.mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        (task / name).write_bytes((arith_dir / name).read_bytes())
    write_off_by_one_pairs(task)
    assert cli.main(["dpo", "--config", str(ROOT / "configs" / "dpo_debug.yaml"), f"model.name_or_path={tiny_sft_rm_dir}",
                     f"dataset.path={task / 'pairs_train.jsonl'}", f"dataset.eval_path={task / 'pairs_test.jsonl'}",
                     f"training.output_dir={tmp_path / 'dpo'}", "dataset.num_samples=16", "dataset.num_eval_samples=4",
                     "dpo.batch_size=4", "dpo.mini_batch_size=4", "dpo.max_steps=2", "training.save_interval=0",
                     "training.eval_interval=0", "dpo.task_eval_path=null", "logging.progress_bar=false",
                     "logging.plots=false", "training.num_threads=1"]) == 0
    for method in ("sft", "rm", "dpo"):
        logged = [r["step"] for r in read_metrics(tmp_path / method / "metrics.jsonl")]
        assert seen[method] == logged and logged[-2:] == [1, 2], (method, seen)


@pytest.mark.slow
def test_dpo_with_learning_rate_1e9_stops_with_one_line(tiny_model_dir, arith_dir, tmp_path, capsys):
    import shutil

    from rlhflab.data.preferences import write_off_by_one_pairs

    task = tmp_path / "task"
    shutil.copytree(arith_dir, task)
    write_off_by_one_pairs(task)
    out = tmp_path / "dpo"
    rc = cli.main(["dpo", "--config", "configs/dpo_debug.yaml", f"model.name_or_path={tiny_model_dir}",
                   f"dataset.path={task / 'pairs_train.jsonl'}", f"dataset.eval_path={task / 'pairs_test.jsonl'}",
                   f"training.output_dir={out}", "dataset.num_samples=16", "dataset.num_eval_samples=4",
                   "dpo.batch_size=4", "dpo.mini_batch_size=4", "dpo.max_steps=4", "training.save_interval=1",
                   "training.eval_interval=0", "dpo.learning_rate=1e9", "logging.progress_bar=false",
                   "logging.plots=false", "training.num_threads=1"])
    err = capsys.readouterr().err
    line = last_line(err)
    assert rc == 2 and line.startswith("error: step ") and "lower dpo.learning_rate" in line
    assert "Traceback" not in err and not (out / "final").exists()
    for folder in checkpoint_steps(out):
        assert _finite_forward(folder), folder


# --------------------------------------------------------------------------------------
# A resumed run logs each step once
# --------------------------------------------------------------------------------------
def test_resumed_logger_without_resume_step_drops_the_steps_it_redoes(tmp_path):
    # GRPO's loop resumes from step_2/ without telling the logger the step: the rows of
    # steps 3 and 4 (logged before the crash) must go when step 3 is logged again.
    first = MetricsLogger(tmp_path)
    for step in range(5):
        first.log(step, {"x": float(step)})
    first._fh.write('{"step": 5, "x"')  # a line cut by the kill
    first.close()
    resumed = MetricsLogger(tmp_path, resume=True)
    resumed.log(3, {"x": 30.0})
    resumed.log(4, {"x": 40.0})
    resumed.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["x"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    # With resume_step (PPO's way) the same result, decided at once.
    again = MetricsLogger(tmp_path, resume=True, resume_step=2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    again.close()


@pytest.mark.slow
def test_ppo_with_learning_rate_1e9_is_one_line(tiny_model_dir, arith_dir, tmp_path, capsys):
    # Today: a FloatingPointError traceback. The CLI prints it as one line naming the step;
    # the loop's own check_finite_* calls (see the report to the lead) make it name the knob.
    out = tmp_path / "ppo"
    rc = cli.main(["ppo", "--config", str(ROOT / "configs" / "ppo_debug.yaml"), f"model.name_or_path={tiny_model_dir}",
                   f"dataset.path={arith_dir / 'train.jsonl'}", f"dataset.eval_path={arith_dir / 'test.jsonl'}",
                   f"training.output_dir={out}", "generation.max_new_tokens=8", "ppo.rollout_samples=8",
                   "ppo.batch_size=8", "ppo.mini_batch_size=4", "ppo.learning_rate=1e9", "training.eval_interval=0",
                   "training.save_interval=1", "logging.progress_bar=false", "logging.plots=false",
                   "training.num_threads=1"])
    err = capsys.readouterr().err
    line = last_line(err)
    assert rc == 2 and "Traceback" not in err
    # (FloatingPointError caught by the CLI today; TrainingDiverged once the loop calls check_finite_*)
    assert line.startswith("error: ") and "training diverged" in line and "step 1" in line
    assert "lower ppo.learning_rate" in line
    for folder in checkpoint_steps(out):
        assert _finite_forward(folder), folder


@pytest.mark.slow
def test_grpo_with_learning_rate_1e9_is_one_line_and_keeps_no_exploded_checkpoint(tiny_model_dir, arith_dir,
                                                                                   tmp_path, capsys):
    # Before: `probability tensor contains either inf, nan` inside sampling at step 2, and a
    # step_1/ of exploded weights. Now the weights are checked after every update.
    out = tmp_path / "grpo"
    rc = cli.main(["grpo", "--config", str(ROOT / "configs" / "grpo_debug.yaml"), f"model.name_or_path={tiny_model_dir}",
                   f"dataset.path={arith_dir / 'train.jsonl'}", f"dataset.eval_path={arith_dir / 'test.jsonl'}",
                   f"training.output_dir={out}", "generation.max_new_tokens=8", "grpo.prompts_per_step=4",
                   "grpo.mini_batch_size=8", "grpo.learning_rate=1e9", "training.eval_interval=0",
                   "training.save_interval=1", "logging.progress_bar=false", "logging.plots=false",
                   "reward.sources=[{type: rule, name: gsm8k_lenient}]", "training.num_threads=1"])
    err = capsys.readouterr().err
    line = last_line(err)
    assert rc == 2 and "Traceback" not in err
    assert line.startswith("error: step ") and "training diverged" in line and "lower grpo.learning_rate" in line
    for folder in checkpoint_steps(out):
        assert _finite_forward(folder), folder
