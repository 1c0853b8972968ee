"""Asynchronous rollouts (generation.max_staleness, `rlhflab.rollout.service`).

- the schedule by hand: step k samples from version max(0, k - 1 - s);
- the s = 0 guard: one seeded config run twice, the sampler in the trainer's process and in
  a producer process, ends bit-identical (weights and every metric): the transport and the
  weight push lose nothing (both samplers run one thread, on the same shapes);
- at s = 1 every step's episodes carry exactly the version k - 1 - s, the importance
  weights are logged, and a run stopped after a checkpoint and resumed equals the
  uninterrupted one;
- faults end the run in one line within the timeout, and no producer outlives the run:
  a producer killed with SIGKILL, a push that never completes;
- a push that leaves the LoRA adapter out is caught by the canary at the first judged step;
- refusals: TRPO at s >= 1.

The run is GRPO on the tiny model with a reward that varies on its untrained text (the
share of digits), so every update moves the weights.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from rlhflab.config import load_config
from rlhflab.errors import UserError
from rlhflab.metrics import read_metrics
from rlhflab.rollout import service
from rlhflab.rollout.service import version_for
from rlhflab.trainers import grpo

from conftest import ROOT
from crash_helpers import stop_after_logging

VOLATILE = ("time/", "perf/")
PRODUCER_ONLY = ("rollout/version_gap", "rollout/push_gap")

REWARD = '''def digits(prompt, response, example):
    return sum(c.isdigit() for c in response) / max(len(response), 1)
'''


@pytest.fixture
def grpo_cfg(tiny_model_dir, arith_dir, tmp_path):
    (tmp_path / "digits_reward.py").write_text(REWARD)

    def make(*overrides: str, out: str = "run"):
        return load_config(ROOT / "configs" / "grpo_debug.yaml", grpo.GRPORunConfig, [
            f"model.name_or_path={tiny_model_dir}", f"dataset.path={arith_dir / 'train.jsonl'}",
            f"dataset.eval_path={arith_dir / 'test.jsonl'}", f"training.output_dir={tmp_path / out}",
            "reward.sources=[{type: rule, name: 'digits_reward:digits'}]", f"reward.plugin_dir={tmp_path}",
            "generation.max_new_tokens=8", "dataset.num_eval_samples=8", "training.total_steps=3",
            "training.eval_interval=0", "training.save_interval=0", "logging.progress_bar=false",
            "logging.plots=false", "logging.doctor=false", "training.num_threads=1",
            "generation.seeded_sampling=true", "grpo.prompts_per_step=4", "grpo.group_size=4",
            "grpo.batch_size=16", "grpo.mini_batch_size=8", "grpo.gradient_accumulation_steps=1",
            "grpo.learning_rate=1e-3", *overrides])[0]

    return make


def _steady(rows, drop=()):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and k not in drop} for r in rows]


def _no_producer_left():
    alive = [p for p in multiprocessing.active_children() if p.name == "rlhflab-rollout-producer"]
    return not alive


# --------------------------------------------------------------------------------------
# The schedule, by hand
# --------------------------------------------------------------------------------------
def test_version_schedule_by_hand():
    # s = 0: step k from the weights after update k-1 (the synchronous run)
    assert [version_for(k, 0) for k in range(1, 5)] == [0, 1, 2, 3]
    # s = 1: steps 1 and 2 from the initial weights, then step k from update k-2
    assert [version_for(k, 1) for k in range(1, 6)] == [0, 0, 1, 2, 3]
    # s = 2: three steps from the initial weights
    assert [version_for(k, 2) for k in range(1, 6)] == [0, 0, 0, 1, 2]


# --------------------------------------------------------------------------------------
# s = 0: in the trainer's process or in a producer process, the same run bit for bit
# --------------------------------------------------------------------------------------
def test_s0_in_process_and_in_a_producer_process_are_bit_identical(grpo_cfg, tmp_path):
    a = grpo.train(grpo_cfg(out="here"), quiet=True)
    b = grpo.train(grpo_cfg("generation.producer=process", out="producer"), quiet=True)
    assert _no_producer_left()
    weights_a = (tmp_path / "here" / "final" / "model.safetensors").read_bytes()
    weights_b = (tmp_path / "producer" / "final" / "model.safetensors").read_bytes()
    assert weights_a == weights_b
    rows_a, rows_b = read_metrics(tmp_path / "here" / "metrics.jsonl"), read_metrics(tmp_path / "producer" / "metrics.jsonl")
    assert _steady(rows_a) == _steady(rows_b, drop=PRODUCER_ONLY)
    assert [r["rollout/version_gap"] for r in rows_b] == [0.0, 0.0, 0.0]  # s = 0: never stale
    # the pushes were judged: weights sent and weights loaded give the probe the same log-probs
    assert all(r["rollout/push_gap"] == 0.0 for r in rows_b if "rollout/push_gap" in r)
    assert rows_a[0]["params/grad_norm"] > 0 and a.history and b.history  # the updates moved the weights


# --------------------------------------------------------------------------------------
# s = 1: exact versions, importance weights
# --------------------------------------------------------------------------------------
def test_trpo_refuses_staleness_in_one_line(ppo_cfg, tiny_model_dir, arith_dir, tmp_path):
    from rlhflab.trainers import trpo

    with pytest.raises(UserError, match="line search") as err:  # at load, before anything runs
        load_config(ROOT / "configs" / "trpo_debug.yaml", trpo.TRPORunConfig, [
            f"model.name_or_path={tiny_model_dir}", f"training.output_dir={tmp_path / 'trpo'}",
            "generation.max_staleness=1"])
    assert "generation.max_staleness: 0" in str(err.value)


# --------------------------------------------------------------------------------------
# Faults end the run in one line
# --------------------------------------------------------------------------------------
def test_a_killed_producer_ends_the_run_in_one_line(grpo_cfg, tmp_path, monkeypatch):
    import producer_faults

    monkeypatch.setattr(service, "PRODUCER_MAIN", producer_faults.killed_at_second_request)
    # s = 0: step 2 is asked for after update 1, and the producer dies reading it
    cfg = grpo_cfg("generation.producer=process", "generation.producer_timeout_s=60", "training.save_interval=1",
                   out="killed")
    t0 = time.monotonic()
    with pytest.raises(UserError) as err:
        grpo.train(cfg, quiet=True)
    assert time.monotonic() - t0 < 60  # found dead at the next poll, not at the timeout
    msg = str(err.value)
    assert "\n" not in msg and "rollout producer stopped (exit code -9)" in msg and "checkpoint is intact" in msg
    assert (tmp_path / "killed" / "step_1").is_dir() and _no_producer_left()


def test_a_stalled_push_ends_the_run_at_the_timeout(grpo_cfg, tmp_path, monkeypatch):
    import producer_faults

    monkeypatch.setattr(service, "PRODUCER_MAIN", producer_faults.stalls_at_first_push)
    cfg = grpo_cfg("generation.producer=process", "generation.producer_timeout_s=2", out="stalled")
    t0 = time.monotonic()
    with pytest.raises(UserError) as err:
        grpo.train(cfg, quiet=True)
    waited = time.monotonic() - t0
    msg = str(err.value)
    assert "\n" not in msg and "generation.producer_timeout_s=2" in msg and "weights of version 1" in msg
    assert waited < 60 and _no_producer_left()  # closing the run ended the hung producer


# --------------------------------------------------------------------------------------
# The canary: a push that leaves the LoRA adapter out
# --------------------------------------------------------------------------------------
def test_a_push_without_the_lora_adapter_is_caught_at_the_first_judged_step(grpo_cfg, tmp_path, monkeypatch):
    from rlhflab.rollout import weights

    real = weights.policy_weights
    pushes = []

    def without_adapter(model):  # the first push whole; later ones the base weights, unmerged
        pushes.append(1)
        if len(pushes) == 1:
            yield from real(model)
            return
        base = model.get_base_model()
        for name, p in base.named_parameters(remove_duplicate=False):
            if ".lora_" not in name:
                yield name.replace(".base_layer.", "."), p.detach()

    monkeypatch.setattr(weights, "policy_weights", without_adapter)
    cfg = grpo_cfg("lora.enabled=true", "lora.r=8", "lora.alpha=16", "lora.target_modules=[q_proj, v_proj, down_proj]",
                   "model.reference=lora_disabled", "grpo.learning_rate=0.05", "generation.producer=process",
                   "training.total_steps=4", "training.save_interval=1", out="lora")
    with pytest.raises(UserError, match="weight push of version 1 looks broken") as err:
        grpo.train(cfg, quiet=True)
    # s = 0: version 1's ack arrives before step 2's episodes, so step 2 judges it; step 1 stays saved
    assert str(err.value).startswith("step 2: the rollout producer:") and "\n" not in str(err.value)
    assert (tmp_path / "lora" / "step_1").is_dir() and not (tmp_path / "lora" / "step_2").exists()
    assert _no_producer_left()


# --------------------------------------------------------------------------------------
# Resume at s = 1
# --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_s1_versions_are_exact_and_a_resume_equals_the_uninterrupted_run(grpo_cfg, tmp_path, monkeypatch):
    settings = ("generation.max_staleness=1", "training.total_steps=4", "training.save_interval=2")
    seen = []
    real_get = service.ProducerService.get

    def get(self, step):
        roll = real_get(self, step)
        seen.append((step, roll.version))
        return roll

    monkeypatch.setattr(service.ProducerService, "get", get)
    grpo.train(grpo_cfg(*settings, out="a"), quiet=True)
    # A: every step's episodes from exactly version max(0, k - 1 - s)
    assert seen == [(1, 0), (2, 0), (3, 1), (4, 2)]
    rows = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["rollout/version_gap"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    # tis_cap defaults to 2 at s >= 1: the weights' spread and capped share are logged; step 1
    # is on-policy (its sampler is the policy it updates: every weight 1 up to float rounding)
    assert all(0 < r["rollout/is_weight_mean"] <= 2.0 and 0 <= r["rollout/is_capped_frac"] <= 1 for r in rows)
    assert rows[0]["rollout/is_weight_std"] < 1e-4 < rows[2]["rollout/is_weight_std"]

    # B: the same run stopped after step 3 was logged (step_2 saved), then resumed
    stop_after_logging(monkeypatch, 3, lambda: grpo.train(grpo_cfg(*settings, out="b"), quiet=True))
    b = tmp_path / "b"
    # step 3 samples from version 1, older than the checkpoint's own weights: it is kept beside them
    assert [p.name for p in (b / "step_2" / "sampler_weights").iterdir()] == ["v1.safetensors"]
    grpo.train(grpo_cfg(*settings, out="b"), resume=b / "step_2", quiet=True)
    assert (b / "final" / "model.safetensors").read_bytes() == (tmp_path / "a" / "final" / "model.safetensors").read_bytes()
    assert _steady(read_metrics(b / "metrics.jsonl")) == _steady(read_metrics(tmp_path / "a" / "metrics.jsonl"))
    assert _no_producer_left()


# --------------------------------------------------------------------------------------
# s = 1 learns as s = 0 does
# --------------------------------------------------------------------------------------
def _accuracy_at_s0_and_s1(tmp_path_factory, tmp_path, trainer, run_cls, yaml: str, *overrides: str):
    """Held-out greedy accuracy (100 rows) before training, after it at s = 0 and at s = 1:
    the same seeded run from test_grpo's warm start (60 % off by one) on its easy task."""
    from test_grpo_helpers import debug_config, easy_task, warm_model

    def run(s: int):
        cfg = debug_config(run_cls, yaml, warm_model(tmp_path_factory), easy_task(tmp_path_factory),
                           tmp_path / f"s{s}", *overrides, "training.save_interval=0", "dataset.num_eval_samples=100",
                           "generation.seeded_sampling=true", f"generation.max_staleness={s}")
        res = trainer.train(cfg, quiet=True)
        return res.eval_before["eval/accuracy"], res.eval_after["eval/accuracy"]

    (before, sync), (_, stale) = run(0), run(1)
    return before, sync, stale


@pytest.mark.slow
def test_grpo_at_s1_learns_within_5_points_of_s0(tmp_path_factory, tmp_path):
    # As test_grpo.py's learning test (the GSM8K checker as the reward), once synchronous and
    # once one step off.
    before, sync, stale = _accuracy_at_s0_and_s1(
        tmp_path_factory, tmp_path, grpo, grpo.GRPORunConfig, "grpo_debug.yaml",
        "training.total_steps=20", "training.eval_interval=20", "grpo.group_size=8", "grpo.prompts_per_step=4",
        "grpo.batch_size=32", "grpo.mini_batch_size=32", "grpo.gradient_accumulation_steps=1",
        "grpo.learning_rate=1e-4")
    print(f"GRPO held-out accuracy {before:.2f} -> s=0 {sync:.2f}, s=1 {stale:.2f}")
    assert stale >= before + 0.05 and abs(stale - sync) <= 0.05, (before, sync, stale)


@pytest.mark.slow
def test_ppo_at_s1_learns_within_5_points_of_s0(tmp_path_factory, tmp_path):
    # PPO with a value head on the same warm start and reward, two epochs a step (so the
    # old log-probs are recomputed and the weights are pi_old / pi_sampler, capped at 2).
    from rlhflab.trainers import ppo

    before, sync, stale = _accuracy_at_s0_and_s1(
        tmp_path_factory, tmp_path, ppo, ppo.PPORunConfig, "ppo_debug.yaml",
        "training.total_steps=12", "training.eval_interval=12", "ppo.rollout_samples=32", "ppo.batch_size=32",
        "ppo.mini_batch_size=16", "ppo.epochs=2", "ppo.learning_rate=1e-4",
        "reward.sources=[{type: rule, name: gsm8k}]")
    print(f"PPO held-out accuracy {before:.2f} -> s=0 {sync:.2f}, s=1 {stale:.2f}")
    assert stale >= before + 0.05 and abs(stale - sync) <= 0.05, (before, sync, stale)


def _children(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            out.append(int(status.parent.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="ignore")
    except OSError:
        return ""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:\t", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited (nobody reaped it yet)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc")
def test_a_trainer_killed_outright_takes_its_producer_with_it(tiny_model_dir, arith_dir, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    (tmp_path / "digits_reward.py").write_text(REWARD)
    args = [sys.executable, "-m", "rlhflab", "grpo", "--config", str(ROOT / "configs" / "grpo_debug.yaml"),
            f"model.name_or_path={tiny_model_dir}", f"dataset.path={arith_dir / 'train.jsonl'}",
            f"training.output_dir={tmp_path / 'run'}", "training.total_steps=1000", "training.eval_interval=0",
            "training.save_interval=0", "generation.max_staleness=1", "training.num_threads=1",
            "logging.progress_bar=false", "logging.plots=false"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    trainer = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, kids = time.monotonic() + 120, []
        while not kids and time.monotonic() < deadline:  # the producer: a spawned child of the trainer
            time.sleep(0.2)
            kids = [p for p in _children(trainer.pid) if "spawn_main" in _cmdline(p)]
        assert kids, "no producer process found"
        time.sleep(3)  # well into its work
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    deadline = time.monotonic() + 30
    while any(_running(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(p) for p in kids)  # it noticed its trainer was gone and ended


@pytest.mark.slow
def test_a_broken_vllm_push_in_the_producer_is_caught(grpo_cfg, tmp_path, monkeypatch):
    # vLLM in the producer at s = 1: each rollout's sampler log-probs against the producer's
    # copy of the same version (rollout/engine_gap); steps 1 and 2 (version 0, pushed whole)
    # set the baseline, step 3 samples from the first broken push and stops the run.
    # vLLM samples unseeded, so the first update is a draw, and with it the stale matrix's
    # effect: at learning rate 1e-3 step 3's gap was 2.7e-3 in one run and under the
    # canary's 1e-3 floor in another (caught at step 4); at 1e-2, 5.6e-3 and 1.6e-2.
    from test_vllm_backend import HAVE_VLLM

    import producer_faults

    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    monkeypatch.setattr(service, "PRODUCER_MAIN", producer_faults.vllm_push_skips_a_tensor)
    cfg = grpo_cfg("generation.backend=vllm", "generation.vllm.enforce_eager=true", "generation.seeded_sampling=false",
                   "generation.max_staleness=1", "training.total_steps=4", "training.save_interval=1",
                   "grpo.learning_rate=1e-2", out="vllm")
    with pytest.raises(UserError) as err:
        grpo.train(cfg, quiet=True)
    msg = str(err.value)
    assert msg.startswith("step 3: generation.backend=vllm in the rollout producer: the weight sync looks broken")
    rows = read_metrics(tmp_path / "vllm" / "metrics.jsonl")
    assert all(r["rollout/engine_gap"] < 1e-3 for r in rows[:2]) and rows[2]["rollout/engine_gap"] > 1e-3
    assert (tmp_path / "vllm" / "step_2").is_dir() and not (tmp_path / "vllm" / "step_3").exists()
    assert _no_producer_left()
