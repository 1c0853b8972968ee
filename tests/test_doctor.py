"""The training doctor: each rule fires on a synthetic sick history and stays quiet on a
healthy one; findings are reported once per stretch; the CLI reads a run folder."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhflab.cli import main
from rlhflab.doctor import (RULE_NAMES, Doctor, DoctorConfig, Finding, NonFiniteError,
                            check_finite, diagnose, read_metrics)


def healthy_history(n: int = 40, seed: int = 0) -> list[dict]:
    """A PPO run that learns: reward up, value loss down, KL small and bounded,
    entropy easing from 1.2 to about 0.8, few clipped tokens, grad norm near the clip."""
    rng = random.Random(seed)
    rows = []
    for t in range(n):
        u = t / max(n - 1, 1)
        rows.append({
            "step": t,
            "rollout/reward_mean": 0.1 + 0.5 * u + rng.uniform(-0.03, 0.03),
            "rollout/reward_std": 0.3 + rng.uniform(-0.05, 0.05),
            "rollout/response_length": 40.0 + rng.uniform(-3, 3),
            "loss/policy": rng.uniform(-0.05, 0.05),
            "loss/value": 1.0 * math.exp(-3 * u) + rng.uniform(0, 0.05),
            "loss/entropy": 1.2 - 0.4 * u + rng.uniform(-0.02, 0.02),
            "params/policy_clip_frac": 0.05 + rng.uniform(-0.02, 0.02),
            "params/value_clip_frac": 0.1 + rng.uniform(-0.02, 0.02),
            "params/approx_kl": 0.01 + rng.uniform(0, 0.005),
            "params/kl_to_ref": 0.2 * (1 - math.exp(-5 * u)) + rng.uniform(0, 0.01),
            "params/grad_norm": 3.0 + rng.uniform(-1, 1),
            "lr": 1e-5,
        })
        if t % 10 == 0:  # a held-out evaluation: the reward and the accuracy rise together
            rows[-1].update({"eval/reward_mean": 0.1 + 0.5 * u, "eval/accuracy": 0.2 + 0.6 * u})
    return rows


def replay(rows, config: DoctorConfig | None = None) -> tuple[Doctor, list[Finding]]:
    doctor = Doctor(config)
    found = []
    for row in rows:
        found += doctor.observe(row["step"], row)
    return doctor, found


def rules_fired(found) -> list[str]:
    return [f.rule for f in found]


# ----------------------------------------------------------------------------- rules

def test_healthy_history_is_quiet():
    for seed in range(5):
        doctor, found = replay(healthy_history(seed=seed))
        assert found == [], [str(f) for f in found]
        assert not doctor.should_stop
        # every rule had enough data to judge: none is left at "not enough data"
        assert all(doctor.state[name] == "" for name in RULE_NAMES), doctor.state


def test_clip_frac_fires_after_patience_and_once_per_stretch():
    rows = healthy_history()
    for t in range(10, 16):                      # six steps in a row above 0.3
        rows[t]["params/policy_clip_frac"] = 0.5
    rows[25]["params/policy_clip_frac"] = 0.6    # a single spike: below the patience of 2
    _, found = replay(rows)
    assert rules_fired(found) == ["policy_clip_frac"]
    f = found[0]
    assert f.step == 11 and f.severity == "warn"  # steps 10 and 11 are the two in a row
    assert "learning_rate" in f.message and "0.50" in f.message


def test_clip_frac_fires_again_after_clearing():
    rows = healthy_history()
    for t in (5, 6, 7, 20, 21):
        rows[t]["params/policy_clip_frac"] = 0.45
    doctor, found = replay(rows)
    assert [(f.rule, f.step) for f in found] == [("policy_clip_frac", 6), ("policy_clip_frac", 21)]
    assert doctor.first_fired["policy_clip_frac"] == 6


def test_grad_norm_far_above_clip_for_several_steps():
    rows = healthy_history()
    for t in range(5, 10):
        rows[t]["params/grad_norm"] = 25.0       # 25 > 10 x max_grad_norm 1.0
    rows[30]["params/grad_norm"] = 80.0          # one spike alone does not fire
    rows[31]["params/grad_norm"] = 80.0
    _, found = replay(rows)
    assert [(f.rule, f.step) for f in found] == [("grad_norm", 7)]   # 3rd step of the stretch
    assert "25" in found[0].message and "max_grad_norm (1)" in found[0].message
    # with a clip of 5 the limit is 50: the stretch of 25s is fine, and the 80s last 2 steps only
    _, found = replay(rows, DoctorConfig(max_grad_norm=5.0))
    assert found == []


def test_value_loss_not_falling():
    rows = healthy_history()
    rng = random.Random(1)
    for row in rows:
        row["loss/value"] = 0.8 + rng.uniform(-0.1, 0.1)   # flat: the critic learns nothing
    _, found = replay(rows)
    assert rules_fired(found) == ["value_loss"]
    assert found[0].step == 19                              # the 20th value (value_window)
    assert "vf_coeff" in found[0].message


def test_value_loss_rising_fires_and_short_runs_are_not_judged():
    rows = healthy_history()
    for t, row in enumerate(rows):
        row["loss/value"] = 0.1 * (1 + t)
    doctor, found = replay(rows)
    assert rules_fired(found) == ["value_loss"]
    doctor, found = replay(rows[:10])
    assert found == [] and doctor.state["value_loss"] is None  # n/a: fewer than 20 steps


def test_kl_growing_without_bound():
    rows = healthy_history()
    for t, row in enumerate(rows):
        row["params/kl_to_ref"] = 0.05 * 1.15 ** t   # 0.05 ... 11.7 nats, rising every step
    _, found = replay(rows)
    assert rules_fired(found) == ["kl_to_ref"]
    # first step above kl_max = 5: 0.05 * 1.15^t > 5 for t > ln(100)/ln(1.15) = 32.9, so 33;
    # its window (steps 24..33) grew 1.15^9 = 3.5x >= kl_growth 1.5
    assert found[0].step == 33
    assert "kl_coeff" in found[0].message


def test_kl_advice_names_the_trainers_own_knob():
    """GRPO's KL weight is grpo.beta: the advice must name it, not ppo.kl_coeff."""
    rows = healthy_history()
    for t, row in enumerate(rows):
        row["params/kl_to_ref"] = 0.05 * 1.15 ** t
    _, found = replay(rows, DoctorConfig(kl_knob="grpo.beta"))
    assert "grpo.beta" in found[0].message and "ppo.kl_coeff" not in found[0].message


def test_kl_high_but_flat_does_not_fire():
    rows = healthy_history()
    for row in rows:
        row["params/kl_to_ref"] = 8.0            # above kl_max but not rising
    _, found = replay(rows)
    assert found == []


def test_entropy_below_floor():
    rows = healthy_history()
    for t in range(20, 40):
        rows[t]["loss/entropy"] = 0.01
    _, found = replay(rows)
    assert rules_fired(found) == ["entropy"]
    # the mean of the last 3 values: step 21 = (1.005 + 0.01 + 0.01) / 3 = 0.34 (entropy at
    # step 19 is 1.2 - 0.4*19/39 = 1.005); step 22 = 0.01 < floor 0.05
    assert found[0].step == 22
    assert "floor" in found[0].message


def test_entropy_fallen_by_a_large_factor():
    rows = healthy_history()
    for t, row in enumerate(rows):
        row["loss/entropy"] = 3.0 * 0.9 ** t     # 3.0 -> 0.05; floor never reached before /10
    _, found = replay(rows)
    assert rules_fired(found) == ["entropy"]
    assert "below its start" in found[0].message


def test_all_rewards_zero_and_all_equal():
    rows = healthy_history()
    for t in range(0, 5):
        rows[t]["rollout/reward_mean"] = 0.0
        rows[t]["rollout/reward_std"] = 0.0
    for t in range(30, 33):
        rows[t]["rollout/reward_mean"] = 1.0
        rows[t]["rollout/reward_std"] = 0.0
    _, found = replay(rows)
    assert [(f.rule, f.step) for f in found] == [("reward_constant", 2), ("reward_constant", 32)]
    assert "every reward has been 0" in found[0].message
    assert "equal (1)" in found[1].message
    assert "max_new_tokens without EOS" not in found[0].message


def test_constant_reward_mentions_cut_off_answers():
    rows = healthy_history()
    for row in rows[:3]:
        row.update({"rollout/reward_mean": 0.0, "rollout/reward_std": 0.0, "rollout/hit_limit_frac": 1.0})
    _, found = replay(rows)
    assert [(f.rule, f.step) for f in found] == [("reward_constant", 2)]
    assert "100% of responses hit max_new_tokens without EOS" in found[0].message


def test_reward_std_zero_for_two_steps_is_quiet():
    rows = healthy_history()
    for t in (8, 9):
        rows[t]["rollout/reward_std"] = 0.0
    assert replay(rows)[1] == []


def test_grpo_groups_without_spread():
    rows = healthy_history()
    for t, row in enumerate(rows):
        row["rollout/zero_spread_frac"] = 0.3 if t < 10 else 1.0
    _, found = replay(rows)
    assert [(f.rule, f.step) for f in found] == [("reward_constant", 12)]
    assert "group" in found[0].message


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "nan", "-inf"])
def test_non_finite_is_a_stop_naming_the_metric(bad):
    rows = healthy_history()
    rows[12]["loss/value"] = bad
    doctor = Doctor()
    found = []
    for row in rows[:13]:
        found += doctor.observe(row["step"], row)
    assert [(f.rule, f.severity, f.step) for f in found] == [("non_finite", "stop", 12)]
    assert "loss/value" in found[0].message and found[0].stop
    assert doctor.should_stop
    # the NaN did not reach the other rules' history, and a finite step clears the stop
    assert all(math.isfinite(v) for _, v in doctor.history["loss/value"])
    doctor.observe(13, rows[13])
    assert not doctor.should_stop


def test_missing_metrics_skip_rules():
    # a DPO-like run logs none of the PPO metrics: nothing fires, nothing is judged
    doctor = Doctor()
    found = []
    for t in range(30):
        found += doctor.observe(t, {"loss/dpo": 0.69 - 0.01 * t, "rewards/margin": 0.1 * t, "lr": 1e-6})
    assert found == []
    assert doctor.state["non_finite"] == ""
    assert all(doctor.state[n] is None for n in RULE_NAMES if n != "non_finite")


def test_thresholds_as_keywords():
    assert Doctor(max_grad_norm=0.5).config.max_grad_norm == 0.5
    assert Doctor(DoctorConfig(kl_max=2.0), entropy_floor=0.1).config.kl_max == 2.0
    with pytest.raises(TypeError, match="clip_frac"):
        Doctor(clip_frac=0.5)


def test_finding_text_and_non_numeric_values_are_ignored():
    doctor = Doctor()
    assert doctor.observe(0, {"note": "hello", "flags": [1, 2], "ok": True, "none": None}) == []
    f = Finding("grad_norm", "warn", 3, "too big")
    assert str(f) == "doctor [warn] step 3 grad_norm: too big" and not f.stop


# ----------------------------------------------------------------------- check_finite

def test_check_finite_passes_finite_values():
    check_finite("loss/total", torch.tensor(1.5))
    check_finite("advantages", torch.randn(4, 6))
    check_finite("reward", 0.0)


def test_check_finite_names_the_tensor():
    with pytest.raises(NonFiniteError, match=r"loss/value is nan at step 7"):
        check_finite("loss/value", torch.tensor(float("nan")), step=7)
    x = torch.zeros(2, 3)
    x[1, 2] = float("inf")
    with pytest.raises(NonFiniteError, match=r"advantages has 1 non-finite of 6 values .*index \(1, 2\)"):
        check_finite("advantages", x)
    with pytest.raises(NonFiniteError, match="score is inf"):
        check_finite("score", float("inf"))
    with pytest.raises(TypeError):
        check_finite("loss", "1.0")


# ------------------------------------------------------------------------------ the CLI

def write_run(tmp_path: Path, rows, partial_tail: bool = False, config_text: str | None = None) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / "metrics.jsonl", "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
        if partial_tail:
            fh.write('{"step": 99, "loss/val')        # the run is still writing this line
    if config_text is not None:
        (run_dir / "effective_config.yaml").write_text(config_text)
    return run_dir


def test_cli_reports_a_sick_run_and_writes_the_plot(tmp_path, capsys):
    rows = healthy_history()
    for t in range(10, 16):
        rows[t]["params/policy_clip_frac"] = 0.5
    run_dir = write_run(tmp_path, rows, partial_tail=True)
    rc = main(["doctor", str(run_dir)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "40 rows (1 malformed or incomplete rows skipped), last step 39" in out
    assert "line 41 is incomplete" in out
    line = next(l for l in out.splitlines() if "policy_clip_frac" in l)
    assert line.strip().startswith("WARN") and "first at step 11 (cleared since)" in line
    for name in ("non_finite", "grad_norm", "value_loss", "kl_to_ref", "entropy", "reward_constant"):
        assert next(l for l in out.splitlines() if f" {name} " in l).strip().startswith("OK"), name
    png = run_dir / "doctor.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png}" in out


def test_cli_healthy_run_exits_0_and_honours_out(tmp_path, capsys):
    run_dir = write_run(tmp_path, healthy_history())
    out_png = tmp_path / "plots" / "health.png"
    assert main(["doctor", str(run_dir), "--out", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert "verdict: healthy" in out and out_png.is_file()
    assert not (run_dir / "doctor.png").exists()


def test_cli_reads_max_grad_norm_from_the_effective_config(tmp_path, capsys):
    rows = healthy_history()
    for row in rows:
        row["params/grad_norm"] = 25.0
    run_dir = write_run(tmp_path, rows, config_text="ppo:\n  max_grad_norm: 5.0\n  kl_coeff: 0.05\n")
    assert main(["doctor", str(run_dir), "--no-plot"]) == 0      # 25 < 10 x 5
    assert not (run_dir / "doctor.png").exists()
    capsys.readouterr()
    (run_dir / "effective_config.yaml").write_text("ppo:\n  max_grad_norm: 1.0\n")
    assert main(["doctor", str(run_dir), "--no-plot"]) == 1
    assert "grad_norm" in capsys.readouterr().out


def test_cli_set_overrides_a_threshold(tmp_path, capsys):
    rows = healthy_history()
    for t in range(10, 16):
        rows[t]["params/policy_clip_frac"] = 0.5
    run_dir = write_run(tmp_path, rows)
    assert main(["doctor", str(run_dir), "--no-plot", "--set", "clip_frac_max=0.6"]) == 0
    capsys.readouterr()
    assert main(["doctor", str(run_dir), "--no-plot", "--set", "clip_frac=0.6"]) == 2
    assert "did you mean clip_frac_max" in capsys.readouterr().err


def test_cli_accepts_the_metrics_file_itself(tmp_path, capsys):
    run_dir = write_run(tmp_path, healthy_history())
    assert main(["doctor", str(run_dir / "metrics.jsonl"), "--no-plot"]) == 0


def test_cli_bad_paths_exit_2_with_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["doctor", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and "output_dir" in err
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    assert main(["doctor", str(empty_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "metrics.jsonl" in err
    (empty_dir / "metrics.jsonl").write_text("")
    assert main(["doctor", str(empty_dir)]) == 2
    assert "no complete step" in capsys.readouterr().err


def test_cli_as_a_process_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlhflab", "doctor", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_read_metrics_skips_broken_lines(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0, "lr": 1}\nnot json\n[1, 2]\n{"lr": 2}\n{"step": 4, "lr"')
    notes: list[str] = []
    records = read_metrics(p, notes)
    assert [r["step"] for r in records] == [0, 1]     # a row without "step" gets its index
    assert notes == ["line 2 is not valid JSON; skipped", "line 3 is not a JSON object; skipped",
                     "line 5 is incomplete (the run may still be writing); skipped"]
    assert diagnose(records).steps == 2
