"""The weight-sync canary (generation.vllm.sync_check) and the doctor's logprob_gap rule.

The pure parts (`rlhflab.doctor.gap_baseline`, `sync_gap_limit`, `sync_gap_tripped`, the
`SyncCanary` that holds the baseline, the doctor rule) are checked by hand and run
without vLLM. Two PPO runs on the tiny Llama sample with a vLLM engine (eager, to start
in seconds): one whose weight push silently leaves a tensor out after the start-up push,
which must stop at the first rollout after the first real push with the previous
checkpoint intact; one healthy run that must finish without tripping.
"""

from __future__ import annotations

import json
import math

import pytest

from rlhflab.config.schema import GenerationConfig
from rlhflab.doctor import (Doctor, DoctorConfig, LOGPROB_GAP, gap_baseline, sync_gap_limit,
                            sync_gap_tripped)
from rlhflab.errors import UserError
from rlhflab.rollout.vllm import BASELINE_ROLLOUTS, SyncCanary
from test_vllm_backend import needs_vllm


# --------------------------------------------------------------------------------------
# The trip function, by hand
# --------------------------------------------------------------------------------------
def test_baseline_is_the_median_of_the_first_gaps():
    assert gap_baseline([3e-7, 1e-7, 2e-7, 0.5]) == 2e-7      # sorted first 3: 1e-7, 2e-7, 3e-7
    assert gap_baseline([0.02, 0.04]) == pytest.approx(0.03)  # two values: their mean
    assert gap_baseline([0.9]) == 0.9
    with pytest.raises(ValueError):
        gap_baseline([])


def test_limit_is_the_larger_of_factor_times_baseline_and_baseline_plus_floor():
    # float32: 10 x 3e-7 = 3e-6 < 3e-7 + 1e-3 = 0.0010003 -> the floor decides
    assert sync_gap_limit(3e-7, 10.0, 1e-3) == pytest.approx(0.0010003)
    # bfloat16-like: 10 x 0.015 = 0.15 > 0.015 + 1e-3 = 0.016 -> the factor decides
    assert sync_gap_limit(0.015, 10.0, 1e-3) == pytest.approx(0.15)
    assert sync_gap_limit(0.0, 10.0, 1e-3) == 1e-3


@pytest.mark.parametrize("baseline, gap, tripped", [
    (3e-7, 9e-7, False),     # a float32 wobble: 3x the baseline, but 6e-7 << the 1e-3 floor
    (3e-7, 9e-4, False),     # 3000x, still under 0.0010003
    (3e-7, 4.5e-3, True),    # one stale MLP matrix of the tiny test model after one update
    (0.015, 0.06, False),    # bfloat16 noise: 4x, under 0.15
    (0.015, 0.201, True),    # TRL #5312's gap after its broken sync: 13x, over 0.15
    (0.015, 0.15, False),    # exactly at the limit is still healthy
    (0.015, math.inf, True),
    (0.015, math.nan, True),  # a NaN gap means the log-probs broke
])
def test_trip_by_hand(baseline, gap, tripped):
    assert sync_gap_tripped(baseline, gap, 10.0, 1e-3) is tripped


def test_the_doctor_and_the_config_share_the_defaults():
    gen, doc = GenerationConfig(), DoctorConfig()
    assert gen.vllm.sync_check and (gen.vllm.sync_check_factor, gen.vllm.sync_check_floor) == (doc.gap_factor, doc.gap_floor)
    assert (doc.gap_factor, doc.gap_floor) == (10.0, 1e-3)  # the values the tests below work by hand
    assert BASELINE_ROLLOUTS == doc.gap_baseline_steps == 3


def test_canary_judges_each_gap_against_the_median_of_the_first_three():
    canary = SyncCanary(factor=10.0, floor=1e-3)
    canary.check(3.0e-7, step=1)   # no baseline yet: kept
    canary.check(3.2e-7, step=2)   # vs 3.0e-7: kept
    canary.check(2.9e-7, step=3)   # vs median(3.0e-7, 3.2e-7) = 3.1e-7: kept
    canary.check(9e-4, step=4)     # vs median(2.9, 3.0, 3.2)e-7 = 3.0e-7, limit 0.0010003: passes, not kept
    assert canary.gaps == [3.0e-7, 3.2e-7, 2.9e-7]
    with pytest.raises(UserError) as err:
        canary.check(0.0015, step=5)  # over 0.0010003
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("step 5: generation.backend=vllm: the weight sync")
    assert "0.0015" in msg and "3e-07" in msg and "generation.vllm.sync_check=false" in msg


def test_a_broken_sync_from_the_first_push_trips_against_the_start_up_gap():
    canary = SyncCanary(factor=10.0, floor=1e-3)
    canary.check(2.2e-7, step=1)   # sampled from the weights pushed at start-up
    with pytest.raises(UserError, match="step 2: "):
        canary.check(0.0045, step=2)  # the first push went wrong: 0.0045 > 2.2e-7 + 1e-3


# --------------------------------------------------------------------------------------
# The doctor's rule, on synthetic metrics
# --------------------------------------------------------------------------------------
def _replay(gaps):
    doctor = Doctor(method="grpo")
    for step, gap in enumerate(gaps, 1):
        doctor.observe(step, {LOGPROB_GAP: gap, "rollout/reward_mean": 0.5})
    return doctor


def test_doctor_is_quiet_on_a_healthy_float32_and_bfloat16_gap():
    assert _replay([3.1e-7, 2.9e-7, 3.3e-7, 9e-7, 2.8e-7, 4e-6]).state["logprob_gap"] == ""
    assert _replay([0.021, 0.018, 0.025, 0.04, 0.03, 0.12]).state["logprob_gap"] == ""  # limit 10 x 0.021
    assert _replay([3e-7]).state["logprob_gap"] is None  # one value: nothing to compare


def test_doctor_reports_a_jump_after_a_sync_at_its_step():
    doctor = _replay([3.1e-7, 2.9e-7, 3.3e-7, 3.0e-7, 0.2, 0.21])
    (finding,) = [f for f in doctor.findings if f.rule == "logprob_gap"]
    assert finding.step == 5 and finding.severity == "warn"
    assert "jumped from 3e-07 at step 4 to 0.2 at step 5" in finding.message
    assert "weight sync" in finding.message


def test_doctor_reports_a_gap_rising_across_the_run():
    # baseline median(0.01, 0.012, 0.011) = 0.011; limit max(10 x 0.011, 0.011 + 0.001) = 0.11
    gaps = [0.01, 0.012, 0.011, 0.02, 0.04, 0.07, 0.1, 0.12, 0.15, 0.2]
    doctor = _replay(gaps)
    assert doctor.first_fired["logprob_gap"] == 8  # 0.12 is the first gap over 0.11
    assert "rose across the run to 0.12 at step 8" in doctor.active["logprob_gap"].message
    assert "has been above 0.11 since step 8 and is 0.2 at step 10" in doctor.state["logprob_gap"]


# --------------------------------------------------------------------------------------
# PPO with the vLLM backend: a broken push stops the run, a healthy run never trips
# --------------------------------------------------------------------------------------
def _vllm_ppo(ppo_cfg, tmp_path, *extra):
    # tiny_model_dir: head_dim 32 (vLLM's CPU attention has no kernel for 16)
    return ppo_cfg("generation.backend=vllm", "generation.vllm.enforce_eager=true", "training.total_steps=4",
                   "training.save_interval=1", "training.keep_last_checkpoints=null", "ppo.learning_rate=1e-3",
                   *extra, out_dir=tmp_path / "run")


def _gaps(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[LOGPROB_GAP] for r in rows if LOGPROB_GAP in r]


def _break_later_pushes(monkeypatch) -> None:
    """The start-up push is whole; every later push leaves out one MLP matrix, which vLLM then
    keeps from before the update (a stale tensor, not garbage)."""
    from rlhflab.rollout import vllm as vllm_backend

    pushes = []
    real = vllm_backend.policy_weights

    def broken(model):
        pushes.append(1)
        for name, tensor in real(model):
            if len(pushes) == 1 or name != "model.layers.0.mlp.down_proj.weight":
                yield name, tensor

    monkeypatch.setattr(vllm_backend, "policy_weights", broken)


@needs_vllm
@pytest.mark.slow
def test_a_push_that_skips_one_tensor_stops_the_run_at_the_next_rollout(ppo_cfg, tmp_path, monkeypatch):
    from rlhflab.trainers.ppo import train

    _break_later_pushes(monkeypatch)
    cfg = _vllm_ppo(ppo_cfg, tmp_path)
    with pytest.raises(UserError) as err:
        train(cfg, quiet=True)
    msg = str(err.value)
    # step 1 sampled the start-up weights; the first push after an update came before step 2
    assert msg.startswith("step 2: generation.backend=vllm: the weight sync looks broken"), msg
    run = tmp_path / "run"
    assert not (run / "step_2").exists() and not (run / "final").exists()  # nothing saved from step 2
    gaps = _gaps(run)
    print("broken push: rollout/logprob_gap per step:", gaps)
    assert len(gaps) == 2 and gaps[0] < 1e-5 and gaps[1] > 2e-3  # measured: 1.5e-7, then 4.5e-3
    # The last good checkpoint is whole: the run resumes from it (with the hf sampler) and finishes.
    monkeypatch.undo()
    res = train(ppo_cfg("training.total_steps=2", out_dir=run), resume=run / "step_1", quiet=True)
    assert (res.final_dir / "model.safetensors").is_file() and res.history[0]["step"] == 2


@needs_vllm
@pytest.mark.slow
def test_with_the_samplers_old_policy_a_broken_push_still_stops_the_run(ppo_cfg, tmp_path, monkeypatch):
    """generation.old_logprobs=sampler: no pass recomputes the old policy, so the update's passes
    before its first optimizer step measure the gap, and the canary trips on it the same way."""
    from rlhflab.trainers.ppo import train

    _break_later_pushes(monkeypatch)
    with pytest.raises(UserError) as err:
        train(_vllm_ppo(ppo_cfg, tmp_path, "generation.old_logprobs=sampler"), quiet=True)
    assert str(err.value).startswith("step 2: generation.backend=vllm: the weight sync looks broken"), str(err.value)
    gaps = _gaps(tmp_path / "run")
    print("sampler's old policy, broken push: rollout/logprob_gap per step:", gaps)
    assert len(gaps) == 2 and gaps[0] < 1e-5 and gaps[1] > 2e-3


@needs_vllm
@pytest.mark.slow
def test_a_healthy_vllm_run_never_trips_the_canary(ppo_cfg, tmp_path):
    from rlhflab.trainers.ppo import train

    res = train(_vllm_ppo(ppo_cfg, tmp_path), quiet=True)
    gaps = _gaps(tmp_path / "run")
    print("healthy: rollout/logprob_gap per step:", gaps)
    assert (res.final_dir / "config.json").is_file() and len(gaps) == 4
    assert max(gaps) < 1e-4  # float32 on both sides: rounding only


def test_the_docs_state_the_defaults():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    gen, doc = GenerationConfig(), DoctorConfig()
    page = (docs / "rollout_backends.md").read_text()
    assert f"`sync_check_factor` × baseline (default {gen.vllm.sync_check_factor:g})" in page
    assert f"baseline + `sync_check_floor`\n  (default {gen.vllm.sync_check_floor:g} nats per token)" in page
    assert "median of the first 3 judged gaps" in page
    table = (docs / "metrics.md").read_text()
    assert (f"is above both {doc.gap_factor:g} × and {doc.gap_floor:g} nats over the median of the first "
            f"{doc.gap_baseline_steps} logged gaps") in table
