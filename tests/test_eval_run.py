"""`rlhflab eval --run RUN_DIR` takes the run's settings, and a numeric answer without
`eval.correct` is judged by a rule that fits plain numbers as well as GSM8K's `#### N`."""

from __future__ import annotations

import json
from pathlib import Path

from rlhflab.data.prompts import PromptExample
from rlhflab.evaluate import accuracy_rule, evaluate_policy
from rlhflab.rewards import RuleScorer
from rlhflab.rewards.checks import judge, read_number

ROOT = Path(__file__).resolve().parents[1]


def test_plain_number_answers_are_judged_by_the_last_number_and_gsm8k_stays_strict():
    plain = [{"answer": 97}] * 4
    responses = [" 97", " The largest is 97.", " #### 53 (not 97)", " no idea"]
    # 97 == 97; the last number of "The largest is 97." is 97; "#### 53" wins over a later 97; no number.
    assert judge(None, [""] * 4, responses, plain) == [True, True, False, False]
    assert [read_number(r, 97) for r in responses] == ["97", "97", "53", None]
    assert "plain-number checker" in accuracy_rule(None, plain)
    gsm = [{"answer": "3 + 4 = 7\n#### 7"}] * 2
    # A GSM8K answer wants '#### N': a bare 7 is not read, as the GSM8K checker always did.
    assert judge(None, ["", ""], [" 7", " #### 7"], gsm) == [False, True]
    assert "GSM8K checker" in accuracy_rule(None, gsm)
    assert "1 '#### N' answers" in accuracy_rule(None, [gsm[0], plain[0]])


def test_the_samples_hold_the_answer_and_the_unparsed_count(tiny_model_dir):
    from rlhflab.models.load import load_tokenizer
    from test_eval_checks import scripted

    tok = load_tokenizer(str(tiny_model_dir))
    examples = [PromptExample(f"Largest of {a} {b}", {"answer": str(max(a, b))}) for a, b in ((49, 97), (3, 8), (5, 1))]
    res = evaluate_policy(scripted(tok, [" 97", " eight", " 5"]), tok, examples, RuleScorer(lambda p, r, e: 0.0),
                          max_new_tokens=8)
    # right, unparsed, right: 2 of 3, one response without a number
    assert res.accuracy == 2 / 3 and res.unparsed == 1
    assert [(s["answer"], s["parsed"], s["correct"]) for s in res.samples] == [
        ("97", "97", True), ("8", None, False), ("5", "5", True)]


CHECKS = """
def quarter(prompt, response, example):
    return 0.25

def starts_q(prompt, response, example):
    return prompt.startswith("Q:")

def never(prompt, response, example):
    return False
"""


def _run_folder(tmp_path: Path, model_dir: Path) -> Path:
    """A run folder as a trainer leaves it: effective_config.yaml (written by the trainers'
    own save_effective_config from grpo_debug.yaml) and final/."""
    import shutil

    from rlhflab.config import load_config, save_effective_config
    from rlhflab.trainers.grpo import GRPORunConfig

    rows = [{"text": f"Largest of {a} {b}", "biggest": max(a, b)} for a, b in ((3, 9), (12, 4), (5, 7), (1, 2), (8, 6))]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run_checks.py").write_text(CHECKS)
    run = tmp_path / "run"
    cfg, effective = load_config(ROOT / "configs" / "grpo_debug.yaml", GRPORunConfig, [
        f"dataset.eval_path={tmp_path / 'held.jsonl'}", "dataset.prompt_field=text", "dataset.answer_field=biggest",
        "dataset.prompt_template='Q: {prompt} A:'", "dataset.num_eval_samples=4", "generation.max_new_tokens=3",
        f"reward.sources=[{{type: rule, name: '{tmp_path / 'run_checks.py'}:quarter'}}]",
        f"eval.correct={tmp_path / 'run_checks.py'}:starts_q", f"training.output_dir={run}"])
    save_effective_config(effective, run)
    shutil.copytree(model_dir, run / "final")
    return run


def test_cli_eval_run_takes_the_runs_settings_and_flags_win(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from rlhflab.cli import main

    run = _run_folder(tmp_path, tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--run", str(run), "--samples", "s.jsonl"]) == 0
    out = capsys.readouterr().out
    samples = [json.loads(line) for line in Path("s.jsonl").read_text().splitlines()]
    # The run's template, fields, limit (4 of 5 rows), reward (0.25 each) and check (every prompt starts "Q:").
    assert len(samples) == 4 and samples[0]["prompt"] == "Q: Largest of 3 9 A:" and samples[0]["answer"] == 9
    assert "accuracy     1.000   by eval.correct" in out and "reward_mean  0.250" in out
    assert f"model {run / 'final'}" in out
    # Flags still win: another template, no run check but a named one, two rows.
    assert main(["eval", "--run", str(run), "--template", "{prompt} =", "--correct", "run_checks:never",
                 "--limit", "2", "--samples", "s.jsonl"]) == 0
    out = capsys.readouterr().out
    samples = [json.loads(line) for line in Path("s.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and samples[1]["prompt"] == "Largest of 12 4 ="
    assert "accuracy     0.000   by eval.correct (run_checks:never)" in out


def test_cli_eval_run_errors_name_the_folder(tmp_path, capsys):
    from rlhflab.cli import main

    assert main(["eval", "--run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no effective_config.yaml there" in err and err.count("\n") == 1
    assert main(["eval", "--data", "x.jsonl"]) == 2
    assert "give --model PATH" in capsys.readouterr().err
