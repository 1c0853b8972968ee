"""The training loop's held-out evaluation and `rlhflab eval` on the same model, rows and
settings (tests/test_sampler.py on a tiny chat model, tests/test_real_model_eval.py on
SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class BothSides(NamedTuple):
    trainer: dict           # the metrics the loop logs (eval/reward_mean, eval/accuracy)
    trainer_samples: list   # its eval/step_0.jsonl
    cli_lines: list         # what `rlhflab eval` printed
    cli_samples: list       # its --samples file


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def trainer_and_cli_eval(model_dir: Path, data: Path, out: Path, *, template: str, rows: int,
                         max_new_tokens: int, max_prompt_length: int, batch_size: int, capsys,
                         reward: str = "gsm8k", correct: str | None = None,
                         use_chat_template: str = "auto") -> BothSides:
    """The loop's `evaluate` at step 0 of a GRPO run (`build_run`, its models and reward, as
    `rlhflab grpo` builds them) and `rlhflab eval` in this process, with the same settings."""
    from rlhflab.cli import main
    from rlhflab.config import load_config
    from rlhflab.data.prompts import load_prompts
    from rlhflab.trainers.grpo import GRPORunConfig, method
    from rlhflab.trainers.loop import build_run, evaluate

    overrides = [f"model.name_or_path={model_dir}", f"dataset.path={data}", f"dataset.eval_path={data}",
                 f"dataset.prompt_template={json.dumps(template)}", f"dataset.use_chat_template={use_chat_template}",
                 f"dataset.num_eval_samples={rows}", f"dataset.max_prompt_length={max_prompt_length}",
                 f"generation.max_new_tokens={max_new_tokens}", f"training.eval_batch_size={batch_size}",
                 f"training.output_dir={out / 'run'}", "training.eval_interval=1", "grpo.kl_coeff=0",
                 f"reward.sources=[{{type: rule, name: '{reward}'}}]", "training.num_threads=1"]
    if correct is not None:
        overrides.append(f"eval.correct={correct}")
    cfg = load_config(ROOT / "configs" / "grpo_debug.yaml", GRPORunConfig, overrides)[0]
    run = build_run(cfg, method(cfg))
    examples = load_prompts(cfg.dataset, run.models.tokenizer, "eval")
    trainer = evaluate(run, examples, out / "run", 0)
    trainer_samples = rows_of(out / "run" / "eval" / "step_0.jsonl")
    del run

    argv = ["eval", "--model", str(model_dir), "--data", str(data), "--template", template,
            "--use-chat-template", use_chat_template, "--limit", str(rows),
            "--max-new-tokens", str(max_new_tokens), "--max-prompt-length", str(max_prompt_length),
            "--batch-size", str(batch_size), "--reward", reward, "--device", "cpu",
            "--samples", str(out / "cli.jsonl")]
    if correct is not None:
        argv += ["--correct", correct]
    capsys.readouterr()
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    return BothSides(trainer, trainer_samples, lines, rows_of(out / "cli.jsonl"))


def assert_same_evaluation(both: BothSides) -> None:
    """Identical texts, scores and verdicts, hence identical metrics, and `rlhflab eval`
    prints the numbers the loop logs."""
    from rlhflab.evaluate import EvalResult

    assert both.cli_samples == both.trainer_samples
    assert EvalResult.from_samples(both.cli_samples).metrics() == both.trainer
    assert both.cli_lines[0].startswith(f"accuracy     {both.trainer['eval/accuracy']:.3f}   by ")
    assert both.cli_lines[1].startswith(f"reward_mean  {both.trainer['eval/reward_mean']:.3f}   "
                                        f"({len(both.trainer_samples)} examples")
