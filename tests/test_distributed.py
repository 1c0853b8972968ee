"""Several processes equal one: 2 CPU processes (gloo, `accelerate launch` with
configs/accelerate/cpu_2proc.yaml for DDP, fsdp_cpu.yaml for FSDP2, zero2_cpu.yaml and
zero3_cpu.yaml for DeepSpeed) against 1 process, from the same seed and prompts. Each
1-process run is made once per module and shared by the strategies compared with it.

The runs use seeded sampling (`generation.seeded_sampling`), so each response is the same
whichever process samples it, and settings where every optimizer step sees the whole
batch (mini_batch_size x gradient_accumulation_steps = the rollout), so the minibatches
hold the same rows in both runs; what is left to differ is float summation order. The
parameters after training must agree within 1e-5 while the step moved them by far more.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
# RLHFLAB_ACCELERATE_CONFIG=configs/accelerate/ddp.yaml (or fsdp.yaml) runs the "ddp" cases under
# that config on a machine that has it (docs/scaling.md); CI uses the 2-process CPU configs.
CONFIGS = {"ddp": os.environ.get("RLHFLAB_ACCELERATE_CONFIG", str(ROOT / "configs" / "accelerate" / "cpu_2proc.yaml")),
           **{name: str(ROOT / "configs" / "accelerate" / f"{name}_cpu.yaml") for name in ("fsdp", "zero2", "zero3")}}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NEEDS_DEEPSPEED = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is an optional extra (rlhflab[deepspeed])")


def strategies(*names: str):
    """The strategies a test runs under; DeepSpeed's only where it is installed (make venv does)."""
    return pytest.mark.parametrize("strategy", [pytest.param(n, marks=NEEDS_DEEPSPEED) if n.startswith("zero") else n
                                                for n in names])


STRATEGIES = strategies("ddp", "fsdp", "zero2")
REWARD = "def length_mod3(prompt, response, example):\n    return float(len(response) % 3)\n"

pytestmark = pytest.mark.slow


def _env(tmp_path: Path) -> dict:
    (tmp_path / "dist_rewards.py").write_text(REWARD)  # a reward that differs inside a group
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(tmp_path),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("WORLD_SIZE", None)
    return env


def _launch(strategy: str) -> list[str]:
    return [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", CONFIGS[strategy],
            "-m", "rlhflab"]


def _run(args: list[str], env: dict, processes: int, strategy: str = "ddp",
         expect: int = 0) -> subprocess.CompletedProcess:
    cmd = (_launch(strategy) if processes == 2 else [sys.executable, "-m", "rlhflab"]) + args
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == expect, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _common(model: Path, task: Path) -> list[str]:
    return [f"model.name_or_path={model}", f"dataset.path={task / 'train.jsonl'}",
            f"dataset.eval_path={task / 'test.jsonl'}", "generation.seeded_sampling=true",
            "generation.max_new_tokens=6", "training.eval_interval=0", "training.save_interval=0",
            "logging.progress_bar=false", "logging.plots=false", "reward.sources=[{type: rule, name: 'dist_rewards:length_mod3'}]"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """`one_process(args)` -> the folder of a 1-process run of `args`, made once per module.

    The 1-process command does not depend on the strategy it is compared with (no accelerate
    launch), so the strategies of one case share it instead of each training it again."""
    base = tmp_path_factory.mktemp("one-process")
    env = _env(base)
    done: dict[tuple[str, ...], Path] = {}

    def run(args: list[str]) -> Path:
        if tuple(args) not in done:
            out = base / f"run{len(done)}"
            _run([*args, f"training.output_dir={out}"], env, 1)
            done[tuple(args)] = out
        return done[tuple(args)]

    return run


@pytest.fixture(scope="module")
def arith_pairs(tmp_path_factory) -> dict:
    """The preference pairs of the DPO and reward-model cases (64 train, 16 held out)."""
    from rlhflab.data.preferences import write_arith_pairs

    return write_arith_pairs(tmp_path_factory.mktemp("pairs"), n_train=64, n_test=16)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = load_file(str(folder / "model.safetensors"))
    if (folder / "value_head.safetensors").exists():
        out.update({f"value_head.{k}": v for k, v in load_file(str(folder / "value_head.safetensors")).items()})
    return out


def _assert_equal_and_moved(one: Path, two: Path, start: Path) -> None:
    a, b, s = _weights(one / "final"), _weights(two / "final"), _weights(start)
    assert a.keys() == b.keys()
    gap = max(float((a[k] - b[k]).abs().max()) for k in a)
    moved = max(float((a[k] - s[k]).abs().max()) for k in s)
    print(f"{two.name}: 1 process vs 2 processes differ by {gap:.2e} where training moved the weights {moved:.2e}")
    assert gap <= 1e-5, f"1 process and 2 processes differ by {gap}"
    assert moved > 20 * max(gap, 1e-6), f"training moved the weights by only {moved}"
    assert "value_head.summary.weight" not in a or (one / "final" / "value_head.safetensors").exists()


PPO_STEP = ["ppo.rollout_samples=32", "ppo.batch_size=16", "ppo.mini_batch_size=8",
            "ppo.gradient_accumulation_steps=4", "ppo.epochs=2", "ppo.kl_coeff=0.1"]


GRPO_STEP = ["grpo.prompts_per_step=8", "grpo.group_size=4", "grpo.batch_size=16", "grpo.mini_batch_size=8",
             "grpo.gradient_accumulation_steps=4", "grpo.epochs=2", "grpo.kl_coeff=0.1", "grpo.advantage_scale=batch"]
CRITIC = [*PPO_STEP, "model.critic=separate"]
# LoRA: the reference is the policy with its adapter off; final/ holds the merged weights.
LORA = [*PPO_STEP, "lora.enabled=true", "lora.r=4", "model.reference=lora_disabled", "ppo.learning_rate=1e-3"]


def _case(strategy: str, method: str, settings: list[str], name: str):
    marks = [NEEDS_DEEPSPEED] if strategy.startswith("zero") else []
    return pytest.param(strategy, method, settings, id=f"{name}-{strategy}", marks=marks)


# PPO under every strategy; the separate critic where it is sharded on its own, and GRPO
# (prompt-sharing forward passes) where forward passes gather: FSDP and ZeRO-3.
@pytest.mark.parametrize("strategy, method, settings", [
    *(_case(s, "ppo", PPO_STEP, "ppo") for s in ("ddp", "fsdp", "zero2", "zero3")),
    *(_case(s, "ppo", CRITIC, "ppo_critic") for s in ("fsdp", "zero3")),
    *(_case(s, "ppo", LORA, "ppo_lora") for s in ("ddp", "fsdp")),
    *(_case(s, "grpo", GRPO_STEP, "grpo") for s in ("ddp", "fsdp", "zero3")),
])
def test_two_processes_equal_one(strategy, method, settings, tiny_model_dir, arith_dir, tmp_path, one_process):
    env = _env(tmp_path)
    args = [method, "--config", str(ROOT / "configs" / f"{method}_debug.yaml"), *_common(tiny_model_dir, arith_dir),
            "training.total_steps=1", *settings]
    one_dir, two_dir = one_process(args), tmp_path / "two"
    _run([*args, f"training.output_dir={two_dir}"], env, 2, strategy)
    _assert_equal_and_moved(one_dir, two_dir, tiny_model_dir)
    if "lora.enabled=true" in settings:  # the adapter beside the merged weights, gathered as well
        a, b = (load_file(str(run / "final" / "adapter" / "adapter_model.safetensors")) for run in (one_dir, two_dir))
        assert a.keys() == b.keys() and a and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    if "model.critic=separate" in settings:  # the critic's own weights and head, gathered as well
        for name in ("model.safetensors", "value_head.safetensors"):
            a, b = (load_file(str(run / "final" / "critic" / name)) for run in (one_dir, two_dir))
            assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    one = [json.loads(x) for x in (one_dir / "metrics.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (two_dir / "metrics.jsonl").read_text().splitlines()]
    # The step's statistics are global: the same rewards, and the same losses up to rounding.
    for key in ("rollout/reward_mean", "rollout/reward_std", "rollout/response_length"):
        assert one[0][key] == pytest.approx(two[0][key], abs=1e-6), key
    for key in ("loss/policy", "loss/total", "loss/entropy", "params/grad_norm"):
        assert one[0][key] == pytest.approx(two[0][key], rel=1e-3, abs=1e-6), key
    assert json.loads((two_dir / "train_result.json").read_text())["world_size"] == 2
    assert json.loads((one_dir / "train_result.json").read_text())["world_size"] == 1


@strategies("ddp", "fsdp")
def test_ppo_debug_end_to_end_on_two_processes_and_resume(strategy, tiny_model_dir, arith_dir, tmp_path):
    # Under FSDP this also checks what a sharded run gathers: the evaluation (rank 0's
    # batch of 8 against nothing on rank 1: whole weights, no collective), the full weights
    # and the name-keyed optimizer state in step_N/, and an exact resume from them.
    env = _env(tmp_path)
    out = tmp_path / "run"
    args = ["ppo", "--config", str(ROOT / "configs" / "ppo_debug.yaml"), *_common(tiny_model_dir, arith_dir),
            "training.total_steps=3", "training.save_interval=1", "training.eval_interval=3",
            "dataset.num_eval_samples=8", f"training.output_dir={out}"]
    res = _run(args, env, 2, strategy)
    assert res.stdout.count("done: ") == 1                       # one process reports
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]             # each row once
    assert json.loads((out / "train_result.json").read_text())["world_size"] == 2
    for name in ("effective_config.yaml", "step_1", "step_2", "final/config.json", "eval/step_0.jsonl",
                 "eval/step_3.jsonl"):
        assert (out / name).exists(), name
    assert len((out / "eval" / "step_3.jsonl").read_text().splitlines()) == 8  # every eval row once
    state = torch.load(out / "step_2" / "trainer_state.pt", weights_only=False)
    assert len(state["rank_rng"]) == 2
    assert json.loads((out / "step_2" / "rlhflab.json").read_text())["fsdp"] == (strategy == "fsdp")
    # Resume from step_2/ at 2 processes into a fresh folder: the final weights equal the
    # uninterrupted run's, and the metrics continue from step 3.
    again = tmp_path / "again"
    _run([*args[:-1], f"training.output_dir={again}", "--resume", str(out / "step_2")], env, 2, strategy)
    a, b = _weights(out / "final"), _weights(again / "final")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
    assert [json.loads(x)["step"] for x in (again / "metrics.jsonl").read_text().splitlines()] == [3]
    # At another world size the resume is refused before anything is written.
    other = tmp_path / "other"
    refused = subprocess.run([sys.executable, "-m", "rlhflab", *args[:-1], f"training.output_dir={other}",
                              "--resume", str(out / "step_2")], env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and not other.exists()
    assert "saved by a run of 2 processes and this run has 1" in refused.stderr and "Traceback" not in refused.stderr
    if strategy == "fsdp":  # an FSDP checkpoint under the DDP config: refused before anything is written
        ddp = tmp_path / "ddp"
        res = _run([*args[:-1], f"training.output_dir={ddp}", "--resume", str(out / "step_2")], env, 2, "ddp",
                   expect=1)
        assert "saved under an FSDP accelerate config" in res.stderr and not ddp.exists()


@NEEDS_DEEPSPEED
def test_ppo_debug_end_to_end_under_zero3_and_resume(tiny_model_dir, arith_dir, tmp_path):
    # ZeRO-3 gathers each layer in its forward: the evaluation's 8 prompts are one batch on
    # rank 0, which rank 1 decodes too (and drops) to stay in step; checkpoints hold the
    # gathered weights and DeepSpeed's own state (deepspeed/), from which a resume at 2
    # processes ends where the uninterrupted run did.
    env = _env(tmp_path)
    out = tmp_path / "run"
    args = ["ppo", "--config", str(ROOT / "configs" / "ppo_debug.yaml"), *_common(tiny_model_dir, arith_dir),
            "training.total_steps=3", "training.save_interval=1", "training.eval_interval=3",
            "dataset.num_eval_samples=8", f"training.output_dir={out}"]
    one = tmp_path / "one"
    _run([*args[:-1], f"training.output_dir={one}"], env, 1)
    _run(args, env, 2, "zero3")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert json.loads((out / "train_result.json").read_text())["world_size"] == 2
    assert json.loads((out / "step_2" / "rlhflab.json").read_text())["deepspeed"] is True
    assert (out / "step_2" / "model.safetensors").exists() and (out / "step_2" / "deepspeed").is_dir()
    assert not list(out.glob(".*"))  # no staging folder left behind
    # The evaluation before training: every prompt once, decoded as one process decodes it.
    samples = [json.loads(x) for x in (out / "eval" / "step_0.jsonl").read_text().splitlines()]
    alone = [json.loads(x) for x in (one / "eval" / "step_0.jsonl").read_text().splitlines()]
    assert [(s["prompt"], s["response"]) for s in samples] == [(s["prompt"], s["response"]) for s in alone]
    assert len((out / "eval" / "step_3.jsonl").read_text().splitlines()) == 8
    again = tmp_path / "again"
    _run([*args[:-1], f"training.output_dir={again}", "--resume", str(out / "step_2")], env, 2, "zero3")
    a, b = _weights(out / "final"), _weights(again / "final")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
    # A DeepSpeed checkpoint under DDP: refused before anything is written.
    ddp = tmp_path / "ddp"
    res = _run([*args[:-1], f"training.output_dir={ddp}", "--resume", str(out / "step_2")], env, 2, "ddp", expect=1)
    assert "saved under a DeepSpeed accelerate config" in res.stderr and not ddp.exists()


def test_what_a_strategy_cannot_run_is_refused_before_models_load(tiny_model_dir, arith_dir, tmp_path):
    env = _env(tmp_path)
    res = _run(["trpo", "--config", str(ROOT / "configs" / "trpo_debug.yaml"), *_common(tiny_model_dir, arith_dir),
                f"training.output_dir={tmp_path / 'trpo'}"], env, 2, "ddp", expect=1)
    assert "error: trpo: the teaching TRPO runs in one process" in res.stderr
    assert "Loading weights" not in res.stderr and not (tmp_path / "trpo").exists()
    if HAS_DEEPSPEED:  # SFT evaluates on rank 0 alone, which ZeRO-3's gathering forward cannot
        res = _run(["sft", "--config", str(ROOT / "configs" / "sft_debug.yaml"), f"model.name_or_path={tiny_model_dir}",
                    f"data.path={arith_dir / 'sft.jsonl'}", f"training.output_dir={tmp_path / 'sft'}"], env, 2, "zero3",
                   expect=1)
        assert "error: sft (its evaluation runs on rank 0 alone) under ZeRO-3 is not supported" in res.stderr
        assert not (tmp_path / "sft").exists()


@STRATEGIES
def test_sft_two_processes_equal_one(strategy, tiny_model_dir, arith_dir, tmp_path, one_process):
    # Each rank takes its half of every micro-batch of the one shuffle: every optimizer
    # step sees the rows one process would, whatever the accumulation.
    env = _env(tmp_path)
    args = ["sft", "--config", str(ROOT / "configs" / "sft_debug.yaml"), f"model.name_or_path={tiny_model_dir}",
            f"data.path={arith_dir / 'sft.jsonl'}", f"data.eval_path={arith_dir / 'test.jsonl'}",
            "sft.max_steps=3", "sft.batch_size=8", "sft.gradient_accumulation_steps=2", "sft.eval_before=false",
            "training.eval_interval=0", "data.num_eval_samples=8", "logging.progress_bar=false", "logging.plots=false",
            "sft.num_eval_generate=4"]
    one_dir = one_process(args)
    _run([*args, f"training.output_dir={tmp_path / 'two'}"], env, 2, strategy)
    _assert_equal_and_moved(one_dir, tmp_path / "two", tiny_model_dir)
    assert json.loads((tmp_path / "two" / "train_result.json").read_text())["world_size"] == 2


@STRATEGIES
def test_dpo_two_processes_equal_one(strategy, tiny_model_dir, arith_pairs, tmp_path, one_process):
    env = _env(tmp_path)
    pairs = arith_pairs
    # adam_eps 1e-6: Adam divides each gradient by its own size, so an element whose
    # gradient is float noise around 0 (in both runs) would get a step of ~lr in a random
    # direction; a larger epsilon keeps the comparison about the gradients themselves.
    args = ["dpo", "--config", str(ROOT / "configs" / "dpo_debug.yaml"), f"model.name_or_path={tiny_model_dir}",
            f"dataset.path={pairs['train']}", f"dataset.eval_path={pairs['test']}", "dpo.max_steps=3",
            "dpo.batch_size=8", "dpo.mini_batch_size=4", "dpo.learning_rate=1e-3", "dpo.adam_eps=1e-6",
            "dpo.task_eval_path=null", "training.eval_interval=0", "logging.progress_bar=false", "logging.plots=false"]
    one_dir = one_process(args)
    _run([*args, f"training.output_dir={tmp_path / 'two'}"], env, 2, strategy)
    _assert_equal_and_moved(one_dir, tmp_path / "two", tiny_model_dir)
    one = [json.loads(x) for x in (one_dir / "metrics.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(one, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["rewards/accuracies"] == b["rewards/accuracies"]


@STRATEGIES
def test_reward_model_two_processes_equal_one(strategy, tiny_model_dir, arith_pairs, tmp_path, one_process):
    env = _env(tmp_path)
    pairs = arith_pairs
    args = ["rm", "--config", str(ROOT / "configs" / "rm_debug.yaml"), f"model.name_or_path={tiny_model_dir}",
            f"data.path={pairs['train']}", f"data.eval_path={pairs['test']}", "rm.max_steps=3", "rm.batch_size=8",
            "rm.gradient_accumulation_steps=2", "rm.eval_before=false", "rm.learning_rate=1e-3",
            "rm.adam_eps=1e-6",  # as in the DPO test: keeps noise-level gradients from lr-sized steps
            "training.eval_interval=0", "logging.progress_bar=false", "logging.plots=false"]
    one_dir = one_process(args)
    _run([*args, f"training.output_dir={tmp_path / 'two'}"], env, 2, strategy)
    a, b = _weights(one_dir / "final"), _weights(tmp_path / "two" / "final")
    start = _weights(tiny_model_dir)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    assert max(float((a[k] - start[k]).abs().max()) for k in start if k in a) > 1e-4
    assert json.loads((tmp_path / "two" / "train_result.json").read_text())["world_size"] == 2
