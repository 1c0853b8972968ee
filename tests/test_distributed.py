"""Several processes equal one: 2 CPU processes (gloo, `accelerate launch` with
configs/accelerate/cpu_2proc.yaml for DDP, fsdp_cpu.yaml for FSDP2, zero2_cpu.yaml and
zero3_cpu.yaml for DeepSpeed) against 1 process, from the same seed and prompts.

Starting 2 processes costs more than the tiny model's steps, so each strategy's cases run
one after another in ONE accelerate launch (tests/dist_jobs.py runs `rlhflab.cli.main` for
each, with its own output folder and logs), and every 1-process reference runs in one
plain process, shared by the strategies compared with it. A resume is a launch of its own:
what it proves is that a fresh process continues from the checkpoint alone.

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
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dist_jobs import Launch, run_jobs, run_jobs_on_two_machines

ROOT = Path(__file__).resolve().parents[1]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NEEDS_DEEPSPEED = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is an optional extra (rlhflab[deepspeed])")


def strategies(*names: str):
    """The strategies a test runs under; DeepSpeed's only where it is installed (make venv does)."""
    return pytest.mark.parametrize("strategy", [pytest.param(n, marks=NEEDS_DEEPSPEED) if n.startswith("zero") else n
                                                for n in names])


STRATEGIES = strategies("ddp")  # SFT, DPO and RM of rows, padded; packed by tokens: TOKEN_BUDGETS
REWARD = "def length_mod3(prompt, response, example):\n    return float(len(response) % 3)\n"

pytestmark = pytest.mark.slow


def _env(tmp_path: Path) -> dict:
    (tmp_path / "dist_rewards.py").write_text(REWARD)  # a reward that differs inside a group
    # the reward module, then this checkout (not whatever rlhflab the venv installed)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("WORLD_SIZE", None)
    return env


def _common(model: Path, task: Path) -> list[str]:
    return [f"model.name_or_path={model}", f"dataset.path={task / 'train.jsonl'}",
            f"dataset.eval_path={task / 'test.jsonl'}", "generation.seeded_sampling=true",
            "generation.max_new_tokens=6", "training.eval_interval=0", "training.save_interval=0",
            "logging.progress_bar=false", "logging.plots=false", "reward.sources=[{type: rule, name: 'dist_rewards:length_mod3'}]"]


def _once(run) -> Launch | str:
    """`run()`, or the failure it ended in: a launch that failed is not started again by
    each test that asks for it."""
    try:
        return run()
    except (AssertionError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"


def _result(done: Launch | str) -> Launch:
    if isinstance(done, str):
        pytest.fail(done, pytrace=False)
    return done


@pytest.fixture(scope="module")
def cases(tiny_model_dir, arith_dir, arith_pairs) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """name -> (the rlhflab argv without its output folder, the strategies it runs under)."""
    rl = {"ppo": ("ppo", PPO_STEP, ("ddp", "fsdp", "zero3")),
          "ppo_critic": ("ppo", CRITIC, ("fsdp", "zero3")),
          "ppo_lora": ("ppo", LORA, ("ddp", "fsdp")),
          "grpo": ("grpo", GRPO_STEP, ("ddp", "fsdp")),
          # the packed layout: PPO with whole parameters in the forward (DDP, ZeRO-2), GRPO with
          # each layer gathered in its forward (FSDP2, ZeRO-3); PPO under ZeRO-2 and GRPO under
          # ZeRO-3 run packed only
          "ppo_packed": ("ppo", [*PPO_STEP, "ppo.layout=packed"], ("ddp", "zero2")),
          "grpo_packed": ("grpo", [*GRPO_STEP, "grpo.layout=packed"], ("fsdp", "zero3")),
          # one step off (generation.max_staleness=1): each rank's producer samples its rows
          "grpo_s1": ("grpo", [*GRPO_STEP, "generation.max_staleness=1", "training.num_threads=1"], ("ddp",))}
    out = {name: ([method, "--config", str(ROOT / "configs" / f"{method}_debug.yaml"),
                   *_common(tiny_model_dir, arith_dir), "training.total_steps=1" if name != "grpo_s1" else "training.total_steps=3", *settings], where)
           for name, (method, settings, where) in rl.items()}
    # SFT: each rank takes its half of every micro-batch of the one shuffle, so every
    # optimizer step sees the rows one process would, whatever the accumulation.
    out["sft"] = (["sft", "--config", str(ROOT / "configs" / "sft_debug.yaml"), f"model.name_or_path={tiny_model_dir}",
                   f"data.path={arith_dir / 'sft.jsonl'}", f"data.eval_path={arith_dir / 'test.jsonl'}",
                   "sft.max_steps=3", "sft.batch_size=8", "sft.gradient_accumulation_steps=2",
                   "sft.eval_before=false", "training.eval_interval=0", "data.num_eval_samples=8",
                   "logging.progress_bar=false", "logging.plots=false", "sft.num_eval_generate=4"],
                  ("ddp",))
    # adam_eps 1e-6 (DPO, RM): Adam divides each gradient by its own size, so an element
    # whose gradient is float noise around 0 (in both runs) would get a step of ~lr in a
    # random direction; a larger epsilon keeps the comparison about the gradients themselves.
    out["dpo"] = (["dpo", "--config", str(ROOT / "configs" / "dpo_debug.yaml"), f"model.name_or_path={tiny_model_dir}",
                   f"dataset.path={arith_pairs['train']}", f"dataset.eval_path={arith_pairs['test']}",
                   "dpo.max_steps=3", "dpo.batch_size=8", "dpo.mini_batch_size=4", "dpo.learning_rate=1e-3",
                   "dpo.adam_eps=1e-6", "dpo.task_eval_path=null", "training.eval_interval=0",
                   "logging.progress_bar=false", "logging.plots=false"], ("ddp",))
    out["rm"] = (["rm", "--config", str(ROOT / "configs" / "rm_debug.yaml"), f"model.name_or_path={tiny_model_dir}",
                  f"data.path={arith_pairs['train']}", f"data.eval_path={arith_pairs['test']}", "rm.max_steps=3",
                  "rm.batch_size=8", "rm.gradient_accumulation_steps=2", "rm.eval_before=false",
                  "rm.learning_rate=1e-3", "rm.adam_eps=1e-6", "training.eval_interval=0",
                  "logging.progress_bar=false", "logging.plots=false"], ("ddp",))
    # The same three packed in token-budget micro-batches (each rank cuts its own share, as
    # many micro-batches on every rank) under FSDP2 and ZeRO-2, where they run only so:
    # compared with the 1-process runs of rows, padded.
    budgets = {"sft": ["sft.layout=packed", "sft.mini_batch_tokens=80"],
               "dpo": ["dpo.layout=packed", "dpo.mini_batch_tokens=160"],
               "rm": ["rm.layout=packed", "rm.mini_batch_tokens=160"]}
    for name, extra in budgets.items():
        out[f"{name}_tokens"] = ([*out[name][0], *extra], ("fsdp", "zero2"))
    # PPO end to end: 3 steps, a checkpoint after each, evaluations at steps 0 and 3.
    out["e2e"] = (["ppo", "--config", str(ROOT / "configs" / "ppo_debug.yaml"), *_common(tiny_model_dir, arith_dir),
                   "training.total_steps=3", "training.save_interval=1", "training.eval_interval=3",
                   "dataset.num_eval_samples=8"], ("ddp", "fsdp", "zero3"))
    # What a strategy cannot run: refused before models load. Each goes first in its
    # launch, so that nothing before it has loaded a model either.
    out["trpo_refused"] = (["trpo", "--config", str(ROOT / "configs" / "trpo_debug.yaml"),
                            *_common(tiny_model_dir, arith_dir)], ("ddp",))
    out["sft_refused"] = (["sft", "--config", str(ROOT / "configs" / "sft_debug.yaml"),
                           f"model.name_or_path={tiny_model_dir}", f"data.path={arith_dir / 'sft.jsonl'}"], ("zero3",))
    return out


# The 1-process runs compared with the 2-process ones (the end-to-end one by ZeRO-3's test).
REFERENCES = ("ppo", "ppo_critic", "ppo_lora", "grpo", "grpo_s1", "ppo_packed", "grpo_packed", "sft", "dpo", "rm",
              "e2e")


@pytest.fixture(scope="module")
def one_process(cases, tmp_path_factory) -> Launch:
    """Every 1-process reference run, one after another in one process. The 1-process
    command does not depend on the strategy it is compared with (no accelerate launch),
    so the strategies of one case share it."""
    base = tmp_path_factory.mktemp("one-process")
    return run_jobs(base, {name: cases[name][0] for name in REFERENCES}, _env(base), 1)


@pytest.fixture(scope="module")
def launched(cases, tmp_path_factory):
    """`launched(strategy)` -> the `Launch` of every case that runs under `strategy`: one
    accelerate launch of 2 processes per strategy, made the first time a test asks for it."""
    done: dict[str, Launch] = {}

    def get(strategy: str) -> Launch:
        if strategy not in done:
            base = tmp_path_factory.mktemp(f"two-{strategy}")
            jobs = {n: argv for n, (argv, where) in sorted(cases.items(), key=lambda c: not c[0].endswith("_refused"))
                    if strategy in where}
            done[strategy] = _once(lambda: run_jobs(base, jobs, _env(base), 2, strategy))
        return _result(done[strategy])

    return get


E2E_STRATEGIES = ("ddp", "fsdp", "zero3") if HAS_DEEPSPEED else ("ddp", "fsdp")


@pytest.fixture(scope="module")
def resumed(cases, launched, tmp_path_factory):
    """`resumed(strategy)` -> the `Launch` (2 processes under `strategy`; "one": 1 process)
    of what starts from the end-to-end runs' step_2/ checkpoints, made once:

    - under each strategy, `resume`: the strategy's own run resumed at 2 processes;
    - under DDP also `fsdp_under_ddp` and `zero3_under_ddp`: the FSDP and DeepSpeed
      checkpoints, refused (they go first: nothing has loaded a model before them);
    - "one": `ddp_at_1` and `fsdp_at_1`, the 2-process checkpoints resumed by 1 process, refused.
    """
    done: dict[str, Launch] = {}
    args = cases["e2e"][0]

    def from_ckpt(strategy: str) -> list[str]:
        return [*args, "--resume", str(launched(strategy).ok("e2e") / "step_2")]

    def get(strategy: str) -> Launch:
        if strategy not in done:
            if strategy == "one":
                jobs = {f"{s}_at_1": from_ckpt(s) for s in ("ddp", "fsdp")}
            else:
                jobs = {f"{s}_under_ddp": from_ckpt(s) for s in E2E_STRATEGIES if strategy == "ddp" and s != "ddp"}
                jobs["resume"] = from_ckpt(strategy)
            base = tmp_path_factory.mktemp(f"resumed-{strategy}")
            done[strategy] = _once(lambda: run_jobs(base, jobs, _env(base), 1 if strategy == "one" else 2,
                                                    "ddp" if strategy == "one" else strategy))
        return _result(done[strategy])

    return get


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
    print(f"{two.parent.name}/{two.name}: 1 process vs 2 processes differ by {gap:.2e} where training moved the "
          f"weights {moved:.2e}")
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


def _case(strategy: str, name: str):
    marks = [NEEDS_DEEPSPEED] if strategy.startswith("zero") else []
    return pytest.param(strategy, name, id=f"{name}-{strategy}", marks=marks)


# PPO under every strategy (ZeRO-2's packed); the separate critic where it is sharded on its
# own; GRPO under DDP and FSDP2, and packed where a layer is gathered per forward (FSDP2,
# ZeRO-3). The packed layout under each strategy: PPO where whole parameters are in the
# forward (DDP, ZeRO-2), GRPO where a layer is gathered per forward (FSDP2, ZeRO-3).
@pytest.mark.parametrize("strategy, name", [
    *(_case(s, "ppo") for s in ("ddp", "fsdp", "zero3")),
    *(_case(s, "ppo_critic") for s in ("fsdp", "zero3")),
    *(_case(s, "ppo_lora") for s in ("ddp", "fsdp")),
    *(_case(s, "grpo") for s in ("ddp", "fsdp")),
    _case("ddp", "grpo_s1"),
    *(_case(s, "ppo_packed") for s in ("ddp", "zero2")),
    *(_case(s, "grpo_packed") for s in ("fsdp", "zero3")),
])
def test_two_processes_equal_one(strategy, name, cases, tiny_model_dir, one_process, launched):
    settings = cases[name][0]
    one_dir, two_dir = one_process.ok(name), launched(strategy).ok(name)
    _assert_equal_and_moved(one_dir, two_dir, tiny_model_dir)
    if "lora.enabled=true" in settings:  # the adapter beside the merged weights, gathered as well
        a, b = (load_file(str(run / "final" / "adapter" / "adapter_model.safetensors")) for run in (one_dir, two_dir))
        assert a.keys() == b.keys() and a and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    if "model.critic=separate" in settings:  # the critic's own weights and head, gathered as well
        for file in ("model.safetensors", "value_head.safetensors"):
            a, b = (load_file(str(run / "final" / "critic" / file)) for run in (one_dir, two_dir))
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
    if name.endswith("_packed"):  # every pass packed (no batch fell back), and the update is the padded one's
        assert "runs padded" not in launched(strategy).text(name, "err") + one_process.text(name, "err")
        padded = _weights(one_process.ok(name.removesuffix("_packed")) / "final")
        packed = _weights(one_dir / "final")
        assert max(float((padded[k] - packed[k]).abs().max()) for k in padded) <= 1e-5


def test_two_machines_equal_two_processes_on_one(cases, tiny_model_dir, launched, tmp_path_factory):
    # Two machines of one process each (accelerate launch --num_machines 2, machine ranks 0
    # and 1, on loopback) against the DDP launch of 2 processes on one machine: the same
    # global ranks hold the same shards, so every tensor of every rank has the same shape and
    # the same values in both runs, and gloo sums the same two numbers: the final weights are
    # equal exactly. The threads are pinned to what each rank of the one-machine launch gets
    # (its cores shared among its 2 local ranks, engine.dist.default_threads); one machine of
    # one process would otherwise take every core, and another thread count sums in another order.
    threads = f"training.num_threads={max(1, (os.cpu_count() or 1) // 2)}"
    # The output folder is a relative path and each machine runs in its own folder: the two
    # machines see different folders there, as machines without a shared disk do. Machine 1's
    # "ppo" holds an old run, which rank 0 (whose folder it is not) must not be refused for.
    base = tmp_path_factory.mktemp("two-machines")
    stale = base / "machine1" / "ppo"
    (stale / "final").mkdir(parents=True)
    (stale / "metrics.jsonl").write_text('{"step": 1}\n')
    two = run_jobs_on_two_machines(base, {n: [*cases[n][0], threads] for n in ("ppo", "grpo")}, _env(base))
    # Rank 1 wrote nothing into its output folders: its machine holds only the old run, untouched.
    assert sorted(p.relative_to(base / "machine1").as_posix() for p in (base / "machine1").rglob("*")) == [
        "ppo", "ppo/final", "ppo/metrics.jsonl"]
    assert (stale / "metrics.jsonl").read_text() == '{"step": 1}\n'
    one = launched("ddp")
    for name in ("ppo", "grpo"):
        here, there = one.ok(name), two.ok(name)
        a, b, start = _weights(here / "final"), _weights(there / "final"), _weights(tiny_model_dir)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
        assert max(float((a[k] - start[k]).abs().max()) for k in start) > 1e-4  # and training moved them
        rows = [json.loads(x) for x in (there / "metrics.jsonl").read_text().splitlines()]
        ref = [json.loads(x) for x in (here / "metrics.jsonl").read_text().splitlines()]
        assert [r["loss/total"] for r in rows] == [r["loss/total"] for r in ref]
        assert json.loads((there / "train_result.json").read_text())["world_size"] == 2
        # Rank 0 (machine 0) alone wrote the folder and printed the result.
        assert two.text(name, "out").count("done: ") == 1 and "done: " in (base / "machine0" / "logs" /
                                                                             f"{name}.rank0.out").read_text()


@strategies("ddp", "fsdp")
def test_ppo_debug_end_to_end_on_two_processes_and_resume(strategy, launched, resumed):
    # Under FSDP this also checks what a sharded run gathers: the evaluation (rank 0's
    # batch of 8 against nothing on rank 1: whole weights, no collective), the full weights
    # and the name-keyed optimizer state in step_N/, and an exact resume from them.
    two = launched(strategy)
    out = two.ok("e2e")
    assert two.text("e2e", "out").count("done: ") == 1           # one process reports
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
    # Resume from step_2/ at 2 processes (a launch of its own) into a fresh folder: the
    # final weights equal the uninterrupted run's, and the metrics continue from step 3.
    again = resumed(strategy).ok("resume")
    a, b = _weights(out / "final"), _weights(again / "final")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
    assert [json.loads(x)["step"] for x in (again / "metrics.jsonl").read_text().splitlines()] == [3]
    # At another world size the resume is refused before anything is written.
    one = resumed("one")
    assert one.rc(f"{strategy}_at_1") == [2] and not one.folder(f"{strategy}_at_1").exists()
    err = one.text(f"{strategy}_at_1", "err")
    assert "saved by a run of 2 processes and this run has 1" in err and "Traceback" not in err
    if strategy == "fsdp":  # an FSDP checkpoint under the DDP config: refused before anything is written
        ddp = resumed("ddp")
        assert ddp.rc("fsdp_under_ddp") == [2, 2] and not ddp.folder("fsdp_under_ddp").exists()
        assert "saved under an FSDP accelerate config" in ddp.text("fsdp_under_ddp", "err")


@NEEDS_DEEPSPEED
def test_ppo_debug_end_to_end_under_zero3_and_resume(one_process, launched, resumed):
    # ZeRO-3 gathers each layer in its forward: the evaluation's 8 prompts are one batch on
    # rank 0, which rank 1 decodes too (and drops) to stay in step; checkpoints hold the
    # gathered weights and DeepSpeed's own state (deepspeed/), from which a resume at 2
    # processes ends where the uninterrupted run did.
    one, out = one_process.ok("e2e"), launched("zero3").ok("e2e")
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
    again = resumed("zero3").ok("resume")
    a, b = _weights(out / "final"), _weights(again / "final")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
    # A DeepSpeed checkpoint under DDP: refused before anything is written.
    ddp = resumed("ddp")
    assert ddp.rc("zero3_under_ddp") == [2, 2] and not ddp.folder("zero3_under_ddp").exists()
    assert "saved under a DeepSpeed accelerate config" in ddp.text("zero3_under_ddp", "err")


def test_what_a_strategy_cannot_run_is_refused_before_models_load(launched):
    # Each is its launch's first job, so no model had loaded in that process before it.
    two = launched("ddp")
    assert two.rc("trpo_refused") == [2, 2]  # `rlhflab` exits 2 on a one-line error: both ranks refuse
    err = two.text("trpo_refused", "err")
    assert "error: trpo: the teaching TRPO runs in one process" in err and "Traceback" not in err
    assert "Loading weights" not in err and not two.folder("trpo_refused").exists()
    if HAS_DEEPSPEED:  # SFT evaluates on rank 0 alone, which ZeRO-3's gathering forward cannot
        two = launched("zero3")
        assert two.rc("sft_refused") == [2, 2]
        assert "error: sft (its evaluation runs on rank 0 alone) under ZeRO-3 is not supported" in two.text(
            "sft_refused", "err")
        assert not two.folder("sft_refused").exists()


@STRATEGIES
def test_sft_two_processes_equal_one(strategy, tiny_model_dir, one_process, launched):
    two = launched(strategy).ok("sft")
    _assert_equal_and_moved(one_process.ok("sft"), two, tiny_model_dir)
    assert json.loads((two / "train_result.json").read_text())["world_size"] == 2


# Token budgets under several processes: packed, cut by tokens on each rank, equal to one
# process of rows.
TOKEN_BUDGETS = strategies("fsdp", "zero2")


@TOKEN_BUDGETS
@pytest.mark.parametrize("name", ["sft", "dpo", "rm"])
def test_token_budget_micro_batches_on_two_processes_equal_rows_on_one(strategy, name, tiny_model_dir, one_process,
                                                                        launched):
    one_dir, two_dir = one_process.ok(name), launched(strategy).ok(f"{name}_tokens")
    if name == "rm":  # the reward model's score head is new: compare the weights both runs have
        a, b, start = _weights(one_dir / "final"), _weights(two_dir / "final"), _weights(tiny_model_dir)
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
        assert max(float((a[k] - start[k]).abs().max()) for k in start if k in a) > 1e-4
    else:
        _assert_equal_and_moved(one_dir, two_dir, tiny_model_dir)
    if name == "dpo":  # the logged loss of every step is the batch's, however it was cut
        _assert_dpo_metrics_equal(one_dir, two_dir)
    assert json.loads((two_dir / "train_result.json").read_text())["world_size"] == 2


def _assert_dpo_metrics_equal(one_dir: Path, two_dir: Path) -> None:
    """Every step's loss and reward margin within 1e-5; the reward accuracy equal from step 2
    on. At step 1 the policy is the reference, so each implicit reward is float noise around
    0 (about 1e-7, of either sign by how the pass was shaped) and the accuracy counts those
    signs: 0.125 in one process, 0 under FSDP2 and ZeRO-2 packed by tokens, when measured."""
    one = [json.loads(x) for x in (one_dir / "metrics.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (two_dir / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(one, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], abs=1e-5)
        if a["step"] > 1:
            assert a["rewards/accuracies"] == b["rewards/accuracies"]
    assert one[-1]["rewards/margins"] > 1e-2  # the margins grew past the noise


@STRATEGIES
def test_dpo_two_processes_equal_one(strategy, tiny_model_dir, one_process, launched):
    one_dir, two_dir = one_process.ok("dpo"), launched(strategy).ok("dpo")
    _assert_equal_and_moved(one_dir, two_dir, tiny_model_dir)
    _assert_dpo_metrics_equal(one_dir, two_dir)


@STRATEGIES
def test_reward_model_two_processes_equal_one(strategy, tiny_model_dir, one_process, launched):
    one_dir, two_dir = one_process.ok("rm"), launched(strategy).ok("rm")
    a, b = _weights(one_dir / "final"), _weights(two_dir / "final")
    start = _weights(tiny_model_dir)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    assert max(float((a[k] - start[k]).abs().max()) for k in start if k in a) > 1e-4
    assert json.loads((two_dir / "train_result.json").read_text())["world_size"] == 2
