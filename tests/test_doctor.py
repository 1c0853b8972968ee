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
from rlhflab.doctor import RULE_NAMES, Doctor, DoctorConfig, Finding, check_finite, diagnose, format_report
from rlhflab.errors import TrainingDiverged
from rlhflab.metrics import read_metrics


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
            "rollout/logprob_gap": 3e-7 * (1 + 0.1 * (t % 3)),  # a vLLM sampler in float32 (no rng draw)
            "rollout/is_capped_frac": 0.01 * (t % 3),  # an asynchronous run's importance weights (no rng draw)
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
    # value_flat_early judges the first 8 rollouts (tests/test_doctor_seed_rules.py), then
    # value_loss the 20th value (value_window)
    assert rules_fired(found) == ["value_flat_early", "value_loss"]
    assert [f.step for f in found] == [7, 19]
    assert "vf_coeff" in found[1].message


def test_value_loss_rising_fires_and_short_runs_are_not_judged():
    rows = healthy_history()
    for t, row in enumerate(rows):
        row["loss/value"] = 0.1 * (1 + t)
    doctor, found = replay(rows)
    assert rules_fired(found) == ["value_flat_early", "value_loss"]  # rising from the first rollouts
    doctor, found = replay(rows[:7])
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
    """GRPO's KL weight is grpo.kl_coeff: the advice must name it, not ppo.kl_coeff."""
    rows = healthy_history()
    for t, row in enumerate(rows):
        row["params/kl_to_ref"] = 0.05 * 1.15 ** t
    _, found = replay(rows, DoctorConfig(kl_knob="grpo.kl_coeff"))
    assert "grpo.kl_coeff" in found[0].message and "ppo.kl_coeff" not in found[0].message


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
    assert "loss/value is" in found[0].message and found[0].stop
    assert "training diverged" in found[0].message and "lower ppo.learning_rate (now 1e-05)" in found[0].message
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
    assert doctor.state["non_finite"] == "" and doctor.state["nan_metric"] == ""
    assert all(doctor.state[n] is None for n in RULE_NAMES if n not in ("non_finite", "nan_metric"))


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
    with pytest.raises(TrainingDiverged, match=r"^step 7: training diverged \(loss/value is nan\); lower "
                                               r"ppo.learning_rate \(now 0.1\)"):
        check_finite("loss/value", torch.tensor(float("nan")), step=7, knob="ppo.learning_rate", lr=0.1)
    x = torch.zeros(2, 3)
    x[1, 2] = float("inf")
    with pytest.raises(TrainingDiverged, match=r"advantages has 1 non-finite of 6 values .*index \(1, 2\)"):
        check_finite("advantages", x)
    with pytest.raises(TrainingDiverged, match="score is inf"):
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


# ------------------------------------------------------------- SFT, reward model, DPO
# Streams worked by hand: each rule fires on the row the arithmetic in the comment names,
# and stays quiet on a healthy stream of the same method.

def sft_history(n: int = 30) -> list[dict]:
    """An SFT run that learns, logged every 10 steps: the loss falls from 2.0 towards
    0.3, grad norms near 1, a held-out evaluation every 50 steps that falls too."""
    rows = []
    for i in range(n):
        step = 10 * (i + 1)
        rows.append({"step": step, "train/loss": 0.3 + 1.7 * math.exp(-i / 6),
                     "params/grad_norm": 1.0 + 0.1 * (i % 3), "params/grad_norm_max": 1.5 + 0.2 * (i % 4),
                     "lr": 1e-3})
        if step % 50 == 0:
            rows[-1]["eval/loss"] = 0.35 + 1.7 * math.exp(-i / 6)
    return rows


def replay_as(method: str, rows, **thresholds) -> tuple[Doctor, list[Finding]]:
    doctor = Doctor(method=method, **thresholds)
    found = []
    for row in rows:
        found += doctor.observe(row["step"], row)
    return doctor, found


def test_each_method_has_its_rule_set():
    names = lambda m: [r.name for r in Doctor(method=m).rules]  # noqa: E731
    assert names("sft") == ["non_finite", "nan_metric", "grad_norm_spike", "loss_flat", "overfitting"]
    assert names("rm") == ["non_finite", "nan_metric", "grad_norm_spike", "accuracy_at_chance", "margin_growth",
                           "overfitting"]
    assert names("dpo") == ["non_finite", "nan_metric", "grad_norm_spike", "accuracy_at_chance", "margin_growth",
                            "logps_falling", "overfitting"]
    assert names("grpo") == names("rl") == list(RULE_NAMES)   # every RL method shares the RL rules


def test_healthy_sft_stream_is_quiet_and_judged():
    doctor, found = replay_as("sft", sft_history())
    assert found == [], [str(f) for f in found]
    assert all(v == "" for v in doctor.state.values()), doctor.state


def test_sft_loss_not_falling():
    # six logged losses; start = mean(2.00, 2.00) = 2.0, last two mean(1.97, 1.96) = 1.965,
    # and 1.965 is not below 0.95 * 2.0 = 1.9: fires on the 6th value (step 60)
    rows = [{"step": 10 * (i + 1), "train/loss": v} for i, v in enumerate([2.0, 2.0, 1.98, 1.99, 1.97, 1.96])]
    _, found = replay_as("sft", rows)
    assert [(f.rule, f.step) for f in found] == [("loss_flat", 60)]
    assert "1.96" in found[0].message and "sft.learning_rate" in found[0].message
    # 1.88 instead of 1.96: mean(1.97, 1.88) = 1.925 is still not below 1.9; 1.80 makes it 1.885: quiet
    rows[-1]["train/loss"] = 1.80
    assert replay_as("sft", rows)[1] == []


def test_overfitting_needs_two_evaluations_above_the_best_while_training_loss_falls():
    # eval/loss 1.0, 0.8 (best, step 100), 0.9, 0.95: 0.9 is 12.5% and 0.95 18.75% above
    # 0.8, both > 10%, two in a row; train loss 0.77 at step 100 -> 0.51 at step 300: fires at 300
    train = [{"step": s, "train/loss": 0.9 - 0.0013 * s} for s in range(10, 310, 10)]
    evals = {0: 1.0, 100: 0.8, 200: 0.9, 300: 0.95}
    rows = sorted(train + [{"step": 0}], key=lambda r: r["step"])
    for r in rows:
        if r["step"] in evals:
            r["eval/loss"] = evals[r["step"]]
    _, found = replay_as("sft", rows)
    assert [(f.rule, f.step) for f in found] == [("overfitting", 300)]
    assert "0.8 at step 100" in found[0].message and "Prefer the model of step 100" in found[0].message
    assert "sft.epochs" in found[0].message
    # one high evaluation then back down (0.9, then 0.78): a bump, not overfitting
    for r in rows:
        if r["step"] == 300:
            r["eval/loss"] = 0.78
    assert replay_as("sft", rows)[1] == []
    # the training loss rising too (both worse): a different problem, not overfitting
    for r in rows:
        if r["step"] == 300:
            r["eval/loss"] = 0.95
        if "train/loss" in r:
            r["train/loss"] = 0.5 + 0.001 * r["step"]
    assert "overfitting" not in [f.rule for f in replay_as("sft", rows)[1]]


def test_grad_norm_spike_against_the_median_before_it():
    # norms 1.0 1.2 0.8 1.1 0.9: median 1.0; 12.0 > 10 x 1.0 fires, 9.0 does not
    rows = [{"step": s + 1, "params/grad_norm": v} for s, v in enumerate([1.0, 1.2, 0.8, 1.1, 0.9, 12.0, 1.0])]
    _, found = replay_as("dpo", rows)
    assert [(f.rule, f.step) for f in found] == [("grad_norm_spike", 6)]
    assert "12 at step 6 is 12x the median (1)" in found[0].message
    rows[5]["params/grad_norm"] = 9.0
    assert replay_as("dpo", rows)[1] == []
    # SFT/RM log a window's mean and max: the spike is read from the max, which the mean hides
    window = [{"step": 10 * (s + 1), "params/grad_norm": 1.0, "params/grad_norm_max": m}
              for s, m in enumerate([2.0, 2.0, 2.0, 2.0, 2.0, 25.0])]  # 25 > 10 x 2
    assert [(f.rule, f.step) for f in replay_as("sft", window)[1]] == [("grad_norm_spike", 60)]


def test_rm_accuracy_stuck_at_chance():
    # 20 logged accuracies alternating 0.48, 0.54: mean 0.51 <= 0.5 + 0.03: fires on the 20th
    stuck = [{"step": 10 * (i + 1), "train/accuracy": 0.48 if i % 2 == 0 else 0.54} for i in range(24)]
    doctor, found = replay_as("rm", stuck)
    assert [(f.rule, f.step) for f in found] == [("accuracy_at_chance", 200)]
    assert "0.51" in found[0].message and "rm.learning_rate" in found[0].message
    assert doctor.state["accuracy_at_chance"]                    # still firing at the end
    # a reward model that learns slowly (0.55 -> 0.9 over 24 logs) is left alone
    learning = [{"step": 10 * (i + 1), "train/accuracy": 0.55 + 0.35 * i / 23} for i in range(24)]
    doctor, found = replay_as("rm", learning)
    assert found == [] and doctor.state["accuracy_at_chance"] == ""


def test_dpo_implicit_reward_accuracy_at_chance_names_dpo_knobs():
    rows = [{"step": s, "rewards/accuracies": 0.5} for s in range(1, 21)]
    _, found = replay_as("dpo", rows)
    assert [(f.rule, f.step) for f in found] == [("accuracy_at_chance", 20)]
    assert "implicit-reward accuracy 0.50" in found[0].message and "dpo.beta" in found[0].message


def test_margin_growth_fires_when_above_the_limit_and_still_rising():
    # RM held-out gap 1, 4, 11 (> 10 and > 4: fires), 10.5 (falling: clears), 12 (fires again)
    rows = [{"step": 50 * i, "eval/score_gap": v} for i, v in enumerate([1.0, 4.0, 11.0, 10.5, 12.0])]
    doctor, found = replay_as("rm", rows)
    assert [(f.rule, f.step) for f in found] == [("margin_growth", 100), ("margin_growth", 200)]
    assert "reward.score_clip" in found[0].message
    # DPO's rewards/margins with its own limit
    rows = [{"step": s, "rewards/margins": m} for s, m in enumerate([0.5, 1.0, 2.0, 3.0], start=1)]
    _, found = replay_as("dpo", rows, dpo_margin_max=2.5)
    assert [(f.rule, f.step) for f in found] == [("margin_growth", 4)]
    assert "dpo.beta" in found[0].message and "ipo" in found[0].message


def test_dpo_chosen_and_rejected_logps_both_falling():
    # chosen: five at -10.0, five at -12.5: mean drop 2.5 > 2 nats; rejected -12 -> -16: fires at step 10
    chosen = [-10.0] * 5 + [-12.5] * 5
    rejected = [-12.0] * 5 + [-16.0] * 5
    rows = [{"step": s + 1, "logps/chosen": c, "logps/rejected": r} for s, (c, r) in enumerate(zip(chosen, rejected))]
    _, found = replay_as("dpo", rows)
    assert [(f.rule, f.step) for f in found] == [("logps_falling", 10)]
    assert "-10 to -12.5" in found[0].message and "dpo.sft_coeff" in found[0].message
    # the chosen falling by 1.5 nats only, or the rejected not falling: quiet
    assert replay_as("dpo", [{**r, "logps/chosen": r["logps/chosen"] + (1.0 if i >= 5 else 0)}
                             for i, r in enumerate(rows)])[1] == []
    assert replay_as("dpo", [{**r, "logps/rejected": -12.0} for r in rows])[1] == []


def test_nan_in_a_metric_that_is_not_a_loss_warns_without_stopping():
    doctor, found = replay_as("rm", [{"step": 0, "eval/accuracy": float("nan"), "eval/loss": 0.7}])
    assert [(f.rule, f.severity) for f in found] == [("nan_metric", "warn")] and not doctor.should_stop


def test_the_stop_rule_and_check_finite_step_say_the_same_thing():
    # one decision, one wording: the live doctor's finding and the trainers' pre-step check
    from rlhflab.trainers.common import check_finite_step

    _, found = replay_as("sft", [{"step": 3, "train/loss": 2.0}, {"step": 4, "loss": float("nan"), "lr": 1e9}])
    assert [(f.rule, f.severity, f.step) for f in found] == [("non_finite", "stop", 4)]
    with pytest.raises(TrainingDiverged) as exc:
        check_finite_step(4, loss=float("nan"), knob="sft.learning_rate", lr=1e9)
    assert str(exc.value) == f"step 4: {found[0].message}"
    assert str(exc.value).startswith("step 4: training diverged (the loss is nan); lower sft.learning_rate (now 1e+09)")


def test_log_step_writes_the_row_then_stops_on_a_stop_finding(tmp_path, capsys):
    from rlhflab.metrics import MetricsLogger
    from rlhflab.trainers.common import log_step, make_doctor

    logger = MetricsLogger(tmp_path)
    doctor = make_doctor(True, 1.0, method="rm")
    rows = [{"train/loss": 0.7, "params/grad_norm": 1.0, "params/grad_norm_max": 1.0 + 0.1 * i} for i in range(5)]
    for step, row in enumerate(rows, start=1):
        log_step(logger, doctor, step, row)
    log_step(logger, doctor, 6, {"train/loss": 0.7, "params/grad_norm": 2.0, "params/grad_norm_max": 30.0})
    assert "doctor [warn] step 6 grad_norm_spike" in capsys.readouterr().out   # a warning is printed
    with pytest.raises(TrainingDiverged, match=r"^step 7: training diverged \(train/loss is inf\); lower "
                                               r"rm.learning_rate \(now 0.001\)"):
        log_step(logger, doctor, 7, {"train/loss": float("inf"), "lr": 1e-3})
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6, 7]  # the row is kept
    assert make_doctor(False, 1.0, method="sft") is None


def test_cli_picks_the_rules_from_the_effective_config(tmp_path, capsys):
    run_dir = write_run(tmp_path, sft_history(), config_text="sft:\n  max_grad_norm: 1.0\n  learning_rate: 0.001\n")
    assert main(["doctor", str(run_dir), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "sft rules (method sft)" in out and " loss_flat " in out and " value_loss " not in out
    # --method overrides; without a config the metrics decide (train/accuracy: the RM)
    assert main(["doctor", str(run_dir), "--no-plot", "--method", "ppo"]) == 0
    assert "rl rules (method ppo)" in capsys.readouterr().out
    (run_dir / "effective_config.yaml").unlink()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "train/accuracy": 0.5, "train/loss": 0.69})
                                                   + "\n" for i in range(25)))
    assert main(["doctor", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert "rm rules (method rm)" in out and "WARN  accuracy_at_chance" in out
    assert (run_dir / "doctor.png").is_file()   # the SFT/RM/DPO panels are drawn


# ------------------------------------------------------------------ multi-turn episodes

def multiturn_history(n: int = 20) -> list[dict]:
    rows = healthy_history(n)
    for r in rows:
        r.update({"episode/turns_mean": 2.5, "episode/hit_max_turns_frac": 0.1, "episode/tool_error_rate": 0.1,
                  "episode/early_turn_tokens_mean": 12.0, "episode/env_reward_mean": 0.0})
    return rows


def test_multiturn_rules_quiet_on_a_healthy_episode_run():
    doctor, found = replay(multiturn_history())
    assert found == [], [str(f) for f in found]
    assert all(doctor.state[n] == "" for n in ("max_turns", "tool_errors", "early_turns_collapse"))


def test_episodes_hitting_max_turns_fire_after_patience():
    rows = multiturn_history()
    for t in range(8, 11):                       # three steps in a row at 60-80% (patience 3)
        rows[t]["episode/hit_max_turns_frac"] = 0.6 + 0.1 * (t - 8)
    rows[15]["episode/hit_max_turns_frac"] = 0.9  # one step alone: below the patience
    _, found = replay(rows)
    assert rules_fired(found) == ["max_turns"] and found[0].step == 10
    assert "80% of episodes stopped at env.max_turns for 3 steps" in found[0].message


def test_tool_error_rate_rising_fires():
    rows = multiturn_history()
    for t in range(12, 20):
        rows[t]["episode/tool_error_rate"] = 0.5
    _, found = replay(rows)
    # first 3 steps 0.1; at step 13 the last three are 0.1, 0.5, 0.5 (mean 0.367): up 0.267 >= 0.2,
    # and 0.367 >= 0.3 (at step 12 the mean 0.233 is under 0.3)
    assert rules_fired(found) == ["tool_errors"] and found[0].step == 13
    assert "from 10% to 37%" in found[0].message


def test_earlier_turns_collapsing_under_a_final_only_reward_fires_and_not_with_turn_rewards():
    rows = multiturn_history()
    for t, r in enumerate(rows):                 # 12 tokens per earlier turn falling to 2
        r["episode/early_turn_tokens_mean"] = max(2.0, 12.0 - t)
    _, found = replay(rows)
    # start mean 12 (steps 0-2: 12, 11, 10 -> 11); recent under 0.3 * 11 = 3.3 once steps 8-10 average 3
    assert rules_fired(found) == ["early_turns_collapse"] and found[0].step == 10
    for r in rows:                               # the environment rewards the turns: not this failure
        r["episode/env_reward_mean"] = 0.2
    _, found = replay(rows)
    assert found == []


def test_stale_sampler_fires_on_capped_importance_weights_and_mutes_the_gap_rule():
    from rlhflab.doctor import IS_CAPPED, LOGPROB_GAP, VERSION_GAP, Doctor

    doctor = Doctor(method="grpo")
    # one step off: the gap grows with the policy's move (0.001 -> 0.05, 50x: the sync rule's
    # jump), but the version gap says why; 0.05 and 0.15 capped are within the 0.2 limit
    for step, (gap, capped) in enumerate([(0.001, 0.0), (0.001, 0.05), (0.002, 0.15), (0.05, 0.15)], 1):
        doctor.observe(step, {LOGPROB_GAP: gap, VERSION_GAP: 1.0 if step > 1 else 0.0, IS_CAPPED: capped,
                              "rollout/reward_mean": 0.5})
    assert doctor.state["logprob_gap"] == "" and doctor.state["stale_sampler"] == ""
    doctor.observe(5, {LOGPROB_GAP: 0.05, VERSION_GAP: 1.0, IS_CAPPED: 0.31, "rollout/reward_mean": 0.5})
    (finding,) = [f for f in doctor.findings if f.rule == "stale_sampler"]
    assert finding.step == 5 and "0.31 at step 5 (episodes 1 versions old)" in finding.message
    assert "generation.max_staleness" in finding.message


def test_a_short_grpo_run_whose_groups_mostly_have_no_spread_is_flagged():
    # The 3-step GRPO run: zero_spread_frac 0.75-0.875 once said "healthy (no rule fired)".
    rows = [{"step": s, "rollout/reward_mean": 0.1, "rollout/reward_std": 0.2, "rollout/zero_spread_frac": z}
            for s, z in ((1, 0.75), (2, 0.875), (3, 0.8125))]
    doctor = diagnose(rows, DoctorConfig(method="grpo"))
    # 2 of 2 steps >= 50% at step 2: more than half of the steps
    assert doctor.first_fired == {"reward_constant": 2}
    assert "in 2 of 2 steps at least 50% of groups had identical rewards (75%-88% of them)" in \
        doctor.findings[0].message
    report = format_report(doctor, "metrics.jsonl", 3)
    assert "verdict: 1 rule(s) fired" in report
    # No critic, single-turn: value_loss, value_flat_early, max_turns, tool_errors, early_turns_collapse left out.
    for name in ("value_loss", "value_flat_early", "max_turns", "tool_errors", "early_turns_collapse"):
        assert f" {name} " not in report, name
    assert "(5 that cannot apply to this run left out)" in report
    # Half the steps or fewer: quiet (1 of 2 steps).
    quiet = diagnose([{**rows[0], "rollout/zero_spread_frac": 0.2}, rows[1]], DoctorConfig(method="grpo"))
    assert "reward_constant" not in quiet.first_fired


def test_the_rules_of_a_ppo_run_with_a_critic_stay_listed():
    rows = [{"step": s, "rollout/reward_mean": 0.1, "rollout/reward_std": 0.2, "loss/value": 1.0 / s}
            for s in (1, 2, 3)]
    report = format_report(diagnose(rows, DoctorConfig(method="ppo")), "metrics.jsonl", 3)
    assert " value_loss " in report and " max_turns " not in report
