"""`rlhflab quickstart`: the whole idea of RLHF, offline, on a laptop CPU, in minutes.

1. build a tiny causal LM and a tokenizer locally (`rlhflab.models.tiny`);
2. generate a GSM8K-format arithmetic task with train and held-out test splits;
3. warm-start the policy with SFT on *sloppy* demonstrations (most answers off by one):
   the model learns the format and the arithmetic, and also the teacher's slip;
4. run PPO with the GSM8K reward, which pays for the right answer, not for imitation;
5. print a before/after table of held-out greedy accuracy and mean reward, draw the
   plots, and write `summary.json`.

Every PPO setting can be overridden on the command line (`ppo.kl_coeff=0.05`,
`training.total_steps=20`); keys under `sft.` set the warm start
(`sft.max_steps=200`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from rlhflab.config import load_config
from rlhflab.config.schema import (DatasetConfig, GenerationConfig, LoggingConfig, LoRAConfig, ModelConfig,
                                   TrainingConfig)
from rlhflab.data.arith import PROMPT_TEMPLATE  # the task's template; eval and generate default to it

# torch threads of every stage. Fixed, not the machine's core count (nor OMP_NUM_THREADS): a
# matrix product can sum in an order that depends on the thread count, and 400 SFT steps turn
# that rounding into another model (held-out accuracy after SFT on an Intel Xeon with torch's
# MKL: 30.5% with 2 threads, 28.5% with 1; scripts/measure_readme.py). With a fixed count the
# figures do not move between runs on one machine; another CPU's kernels round differently
# (21.5% on an AMD EPYC with oneDNN, docs/cpu_matmul.md).
THREADS = 2


def ppo_defaults(out: Path, threads: int | None):
    """The quickstart's PPO settings (tuned on a 2-core CPU; see docs/quickstart.md)."""
    from rlhflab.trainers.ppo import PPORunConfig, PPOSection

    return PPORunConfig(
        model=ModelConfig(name_or_path=str(out / "sft" / "final"), torch_dtype="float32", reference="copy"),
        dataset=DatasetConfig(path=str(out / "data" / "train.jsonl"), eval_path=str(out / "data" / "test.jsonl"),
                              prompt_template=PROMPT_TEMPLATE, num_eval_samples=200,
                              max_prompt_length=64, max_gen_length=16),
        generation=GenerationConfig(max_new_tokens=16, temperature=1.0),
        ppo=PPOSection(rollout_samples=64, batch_size=64, mini_batch_size=16, epochs=2,
                       learning_rate=5e-5, kl_coeff=0.02, vf_coeff=0.1, clip_eps=0.2,
                       value_clip=0.2, gamma=1.0, lam=0.95, max_grad_norm=1.0),
        training=TrainingConfig(output_dir=str(out / "ppo"), device="cpu", seed=0, total_steps=20,
                                save_interval=0, eval_interval=10, eval_batch_size=100,
                                num_threads=threads),
        logging=LoggingConfig(report_to=[], progress_bar=True, plots=True, doctor=True),
    )


def sft_defaults(out: Path, threads: int | None):
    from rlhflab.trainers.sft import SFTDataConfig, SFTRunConfig, SFTSection

    return SFTRunConfig(
        model=ModelConfig(name_or_path=str(out / "tiny-model"), torch_dtype="float32"),
        lora=LoRAConfig(enabled=False),
        data=SFTDataConfig(path=str(out / "data" / "sft.jsonl"), eval_path=str(out / "data" / "test.jsonl"),
                           prompt_template=PROMPT_TEMPLATE, response_template=" {response}",
                           use_chat_template=False, max_seq_length=128, num_eval_samples=200),
        sft=SFTSection(max_steps=400, batch_size=32, learning_rate=2e-3, warmup_ratio=0.05,
                       lr_schedule="cosine", min_learning_rate=1e-4, eval_before=False,
                       num_eval_generate=0),
        # overwrite: the warm start is remade whole each time (tiny model and task too), also
        # over one that a crash cut short (`rlhflab learn run` makes it when sft/final is missing).
        training=TrainingConfig(output_dir=str(out / "sft"), device="cpu", seed=0, eval_interval=0,
                                save_interval=0, num_threads=threads, overwrite=True),
        logging=LoggingConfig(report_to=[], progress_bar=True, plots=True, doctor=False),
    )


def _split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """`sft.`-prefixed keys go to the warm start (as `sft.*` of its config), the rest to PPO."""
    sft = [o for o in overrides if o.startswith("sft.")]
    return sft, [o for o in overrides if not o.startswith("sft.")]


def prepare_warm_start(out: Path, sft_cfg=None, sft_eff=None, threads: int | None = THREADS,
                       quiet: bool = False):
    """Stages 1-3: tiny model, arithmetic task, SFT on sloppy demonstrations.

    Writes `out/tiny-model`, `out/data` and `out/sft/final`; returns the SFT result.
    `rlhflab learn run` calls this too, so learners train a policy that can learn.
    """
    from rlhflab.data.arith import write_task
    from rlhflab.models.tiny import make_tiny_model
    from rlhflab.trainers.sft import train_sft

    say = (lambda *a: None) if quiet else print
    if sft_cfg is None:
        sft_cfg = sft_defaults(out, threads)
    say("[1/5] building a tiny causal LM and tokenizer ...")
    make_tiny_model(out / "tiny-model", seed=0)
    say("[2/5] generating the arithmetic task (GSM8K format) ...")
    write_task(out / "data", n_train=2000, n_test=200, seed=0, wrong_rate=0.6)
    say(f"[3/5] SFT warm start on sloppy demonstrations ({sft_cfg.sft.max_steps} steps) ...")
    return train_sft(sft_cfg, effective=sft_eff, quiet=quiet)


def quickstart(out_dir: str | Path = "outputs/quickstart", overrides: list[str] | None = None,
               threads: int | None = THREADS, quiet: bool = False) -> dict:
    """Run the five stages; returns the summary written to `summary.json`."""
    from rlhflab.trainers.common import prepare_output_dir
    from rlhflab.trainers.ppo import PPORunConfig, train
    from rlhflab.trainers.sft import SFTRunConfig

    out = Path(out_dir)
    sft_over, ppo_over = _split_overrides(overrides or [])
    # Validate every override before any work starts.
    sft_cfg, sft_eff = load_config(None, SFTRunConfig, sft_over, base=dataclasses.asdict(sft_defaults(out, threads)))
    ppo_cfg, ppo_eff = load_config(None, PPORunConfig, ppo_over, base=dataclasses.asdict(ppo_defaults(out, threads)))
    prepare_output_dir(ppo_cfg.training.output_dir, config=ppo_eff)  # a PPO stage stopped early: started over
    start = time.perf_counter()
    say = (lambda *a: None) if quiet else print

    sft_res = prepare_warm_start(out, sft_cfg, sft_eff, threads, quiet)
    say("[4/5] PPO with the GSM8K reward ...")
    ppo_res = train(ppo_cfg, effective=ppo_eff, quiet=quiet)
    seconds = time.perf_counter() - start

    before, after = ppo_res.eval_before or {}, ppo_res.eval_after or {}
    summary = {
        "accuracy_before": before.get("eval/accuracy"),
        "accuracy_after": after.get("eval/accuracy"),
        "reward_before": before.get("eval/reward_mean"),
        "reward_after": after.get("eval/reward_mean"),
        "seconds": round(seconds, 1),
        "ppo_episodes_per_s": round(ppo_res.samples_per_s, 3),
        "sft_seconds": round(sft_res.seconds, 1),
        "ppo_steps": ppo_cfg.training.total_steps,
        "ppo_episodes": ppo_cfg.training.total_steps * ppo_cfg.ppo.rollout_samples,
        "final_model": str(ppo_res.final_dir),
        "plots": str(ppo_res.output_dir / "plots"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    say("[5/5] held-out greedy evaluation (200 problems)")
    say(format_table(summary))
    say(f"summary: {out / 'summary.json'}   plots: {summary['plots']}   model: {summary['final_model']}")
    return summary


def format_table(s: dict) -> str:
    def pct(v):
        return "  n/a" if v is None else f"{100 * v:5.1f}%"

    def num(v):
        return "  n/a" if v is None else f"{v:6.3f}"

    gain = None if s["accuracy_after"] is None or s["accuracy_before"] is None else \
        s["accuracy_after"] - s["accuracy_before"]
    rows = [
        "                      after SFT   after PPO",
        f"  accuracy (greedy)   {pct(s['accuracy_before']):>9}   {pct(s['accuracy_after']):>9}"
        + ("" if gain is None else f"   ({100 * gain:+.1f} points)"),
        f"  mean reward         {num(s['reward_before']):>9}   {num(s['reward_after']):>9}",
        f"  wall time {s['seconds']:.0f} s, PPO {s['ppo_episodes_per_s']:.2f} episodes/s",
    ]
    return "\n".join(rows)


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="outputs/quickstart", help="output folder")
    from rlhflab.cliargs import count

    parser.add_argument("--threads", type=count(), default=THREADS,
                        help="torch CPU threads of every stage (default: %(default)s on every machine, so the "
                             "results are the same on every run of a machine; another count can train a slightly "
                             "different model)")
    parser.add_argument("overrides", nargs="*",
                        help="dotted overrides: PPO keys (ppo.kl_coeff=0.05) or sft.* for the warm start; "
                             "`rlhflab config show ppo` and `rlhflab config show sft` list the keys")


MARKER = ".rlhflab-quickstart"


def run(args: argparse.Namespace) -> int:
    from rlhflab.errors import UserError

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise UserError(f"{out} exists and was not made by `rlhflab quickstart`; "
                            "choose another --out or remove it yourself")
        import shutil
        shutil.rmtree(out)  # ours (it holds the marker): a fresh demo each time
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("made by rlhflab quickstart; the next quickstart run replaces this folder\n")
    quickstart(out, args.overrides, args.threads)
    return 0
