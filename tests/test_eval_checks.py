"""Accuracy you choose: eval.correct drives eval/accuracy, eval.rewards are logged and never
optimised, no misleading accuracy for non-numeric answers, and the doctor's reward-hacking rule."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhflab.data.prompts import PromptExample
from rlhflab.doctor import Doctor, DoctorConfig, diagnose
from rlhflab.evaluate import EvalChecks, accuracy_rule, evaluate_policy, has_numeric_answers
from rlhflab.rewards import RuleScorer, batched

EOS, PAD = 0, 1  # the tiny tokenizer's ids of <|endoftext|> and <|pad|>


class ScriptedLM(torch.nn.Module):
    """Stands in for a causal LM: `generate` appends fixed response rows to the prompts."""

    def __init__(self, responses: list[list[int]]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.responses = torch.tensor(responses)
        self.generation_config = SimpleNamespace(eos_token_id=EOS, pad_token_id=None)

    def generate(self, input_ids, attention_mask, **kwargs):
        return torch.cat([input_ids, self.responses[: input_ids.shape[0]]], 1)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from rlhflab.models.load import load_tokenizer
    return load_tokenizer(str(tiny_model_dir))


def scripted(tok, texts: list[str]) -> ScriptedLM:
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    width = max(len(i) for i in ids) + 1
    return ScriptedLM([i + [EOS] + [PAD] * (width - len(i) - 1) for i in ids])


def reversed_right(prompt, response, example):
    return response.strip() == example["answer"]


@batched
def length(prompts, responses, examples):
    return [len(r.strip()) for r in responses]


def test_eval_correct_drives_accuracy_and_eval_rewards_are_logged(tok):
    responses = [" tac", " god", " dog"]
    examples = [PromptExample(f"Reverse: {w}", {"word": w, "answer": w[::-1]}) for w in ("cat", "dog", "god")]
    checks = EvalChecks(reversed_right, "m:reversed_right", {"length": RuleScorer(length)})
    res = evaluate_policy(scripted(tok, responses), tok, examples, RuleScorer(lambda p, r, e: 0.5),
                          max_new_tokens=8, checks=checks)
    # all three are right: cat -> tac, dog -> god, god -> dog
    assert [s["correct"] for s in res.samples] == [True, True, True]
    assert res.metrics() == {"eval/reward_mean": 0.5, "eval/accuracy": 1.0, "eval/length": 3.0}
    wrong = evaluate_policy(scripted(tok, [" tac", " dgo", " no"]), tok, examples, RuleScorer(lambda p, r, e: 0.5),
                            max_new_tokens=8, checks=checks)
    # 1 of 3 right; lengths 3, 3, 2 -> mean 8/3.
    assert wrong.accuracy == pytest.approx(1 / 3) and wrong.extra["length"] == pytest.approx(8 / 3)
    assert [s["length"] for s in wrong.samples] == [3.0, 3.0, 2.0]


def test_no_accuracy_without_a_checker_for_non_numeric_answers(tok):
    """The reversal run that printed 0.000 -> 0.000: words are not numbers, so without
    eval.correct no accuracy is logged at all."""
    examples = [PromptExample("Reverse: cat", {"answer": "tac"})]
    res = evaluate_policy(scripted(tok, [" tac"]), tok, examples, RuleScorer(lambda p, r, e: 1.0), max_new_tokens=4)
    assert res.accuracy is None and "eval/accuracy" not in res.metrics()
    assert accuracy_rule(None, [e.row for e in examples]) is None
    # Numeric answers (GSM8K's "#### N", or a bare number) keep the GSM8K checker.
    assert has_numeric_answers([{"answer": "3 + 4 = 7\n#### 7"}, {"answer": "12"}])
    assert not has_numeric_answers([{"answer": "#### 7"}, {"answer": "seven"}])  # every row must be
    assert not has_numeric_answers([{"question": "no answer field"}])
    numeric = [PromptExample("Q: 3 + 4?", {"answer": "3 + 4 = 7\n#### 7"})]
    res = evaluate_policy(scripted(tok, [" #### 7"]), tok, numeric, RuleScorer(lambda p, r, e: 1.0), max_new_tokens=8)
    assert res.accuracy == 1.0 and "GSM8K" in accuracy_rule(None, [e.row for e in numeric])


# --------------------------------------------------------------------------------------
# In a PPO run: metrics.jsonl
# --------------------------------------------------------------------------------------
CHECKS = """
def vowels(prompt, response, example):
    return sum(c in "aeiou" for c in response) / max(len(response), 1)

def even(prompt, response, example):
    return sum(map(ord, prompt + response)) % 2 == 0

def code_mod7(prompt, response, example):
    return float(sum(map(ord, prompt + response)) % 7)
"""


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_ppo_logs_the_chosen_accuracy_and_eval_only_rewards_without_optimising_them(ppo_cfg, tmp_path, monkeypatch):
    from rlhflab.trainers.ppo import train

    (tmp_path / "checks_ppo.py").write_text(CHECKS)
    monkeypatch.chdir(tmp_path)
    common = ["training.total_steps=2", "training.eval_interval=1", "eval.correct=checks_ppo.py:even",
              "reward.sources=[{type: rule, name: 'checks_ppo.py:vowels'}]"]
    plain = train(ppo_cfg(*common, out_dir=tmp_path / "plain"), quiet=True)
    extra = train(ppo_cfg(*common, "eval.rewards=[{type: rule, name: 'checks_ppo.py:code_mod7', metric: mod7}]",
                          out_dir=tmp_path / "extra"), quiet=True)
    plain_rows, extra_rows = _rows(plain.output_dir / "metrics.jsonl"), _rows(extra.output_dir / "metrics.jsonl")
    # eval/accuracy is the function's: recomputed from every saved held-out response.
    assert [r["step"] for r in extra_rows] == [0, 1, 2]
    for row in extra_rows:
        samples = _rows(extra.output_dir / "eval" / f"step_{row['step']}.jsonl")
        even = [sum(map(ord, s["prompt"] + s["response"])) % 2 == 0 for s in samples]
        assert 0 < sum(even) < len(samples)  # a real mix, so the equality below means something
        assert row["eval/accuracy"] == pytest.approx(sum(even) / len(samples))
        assert [s["correct"] for s in samples] == even
        mod7 = [sum(map(ord, s["prompt"] + s["response"])) % 7 for s in samples]
        assert row["eval/mod7"] == pytest.approx(sum(mod7) / len(samples))
    # Not optimised: the same seed with and without the eval-only reward trains identically.
    for a, b in zip(plain_rows, extra_rows):
        for key in ("rollout/reward_mean", "loss/policy", "loss/value", "eval/reward_mean", "eval/accuracy"):
            assert a.get(key) == b.get(key), key
    assert "eval/mod7" not in plain_rows[0] and "eval/mod7" in extra_rows[0]
    assert plain_rows[1]["loss/policy"] != 0.0 and plain_rows[1]["rollout/reward_std"] > 0  # it did train


# --------------------------------------------------------------------------------------
# The doctor's reward-hacking rule, on hand-made metrics rows
# --------------------------------------------------------------------------------------
def _eval_rows(rewards, checks, key="eval/accuracy", every=10):
    return [{"step": i * every, "eval/reward_mean": r, key: c} for i, (r, c) in enumerate(zip(rewards, checks))]


def test_reward_hacking_fires_when_the_reward_rises_and_the_check_falls():
    # The run: a learned reward climbs while the true accuracy collapses.
    doctor = diagnose(_eval_rows([0.20, 0.50, 0.80], [0.235, 0.30, 0.00]))
    assert doctor.first_fired == {"reward_hacking": 20}
    msg = doctor.active["reward_hacking"].message
    # best check 0.30 at step 10; the reward 0.2 at the start, 0.5 then, 0.8 now
    assert "eval/accuracy fell from 0.3 at step 10 to 0 while" in msg
    assert "(0.2 at step 0, 0.5 at step 10, 0.8 now)" in msg and "prefer the model of step 10" in msg


def test_reward_hacking_with_a_saturated_reward():
    """The sentiment run with ppo.kl_coeff=0 (docs/sentiment.md): the classifier reward is at
    its ceiling from step 10 on while the lexicon's positive-rate collapses; the reward did
    not rise after the check's best, it stayed up."""
    rows = _eval_rows([0.002, 0.999, 0.999, 0.995, 0.999], [0.0, 0.995, 0.0, 0.080, 0.030])
    doctor = diagnose(rows)
    assert doctor.first_fired == {"reward_hacking": 20}
    assert "fell from 0.995 at step 10 to 0 while" in doctor.findings[0].message


@pytest.mark.parametrize("rewards, checks, why", [
    ([0.2, 0.5, 0.8], [0.2, 0.5, 0.8], "both rise"),
    ([0.8, 0.5, 0.3], [0.8, 0.5, 0.3], "both fall: a bad run, not hacking"),
    ([0.2, 0.5, 0.8], [0.80, 0.90, 0.80], "a drop of 11% of the best (0.1 / 0.9) is within the 15% threshold"),
    ([0.5, 0.5, 0.5], [0.9, 0.9, 0.1], "the check falls but the reward never rose"),
    ([0.2, 0.9, 0.6], [0.2, 0.9, 0.5], "the reward falls with the check (by a third): a bad run, not hacking"),
])
def test_reward_hacking_stays_quiet(rewards, checks, why):
    assert "reward_hacking" not in diagnose(_eval_rows(rewards, checks)).first_fired, why


def test_reward_hacking_reads_eval_rewards_and_needs_two_evaluations():
    # An eval.rewards metric (a lexicon check beside a learned classifier): 0.6 -> 0.4 is a
    # 33% drop while the reward rose 0.5 -> 0.9 (80%).
    doctor = diagnose(_eval_rows([0.5, 0.9], [0.6, 0.4], key="eval/lexicon"))
    assert "eval/lexicon fell from 0.6 at step 0 to 0.4" in doctor.active["reward_hacking"].message
    single = Doctor()
    single.observe(10, {"eval/reward_mean": 0.9, "eval/accuracy": 0.0, "rollout/reward_mean": 0.9})
    assert single.state["reward_hacking"] is None  # one evaluation: not enough to judge
    # Threshold from the config: 0.2 -> 0.18 is a 10% drop, caught at hack_check_drop=0.05.
    rows = _eval_rows([0.5, 0.9], [0.2, 0.18])
    assert "reward_hacking" not in diagnose(rows).first_fired
    assert "reward_hacking" in diagnose(rows, DoctorConfig(hack_check_drop=0.05)).first_fired


# --------------------------------------------------------------------------------------
# rlhflab eval --correct
# --------------------------------------------------------------------------------------
def test_cli_eval_correct(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from rlhflab.cli import main

    rows = [{"question": w, "answer": w[::-1]} for w in ("cat", "dog", "bird")]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "cli_checks.py").write_text(CHECKS)
    monkeypatch.chdir(tmp_path)
    args = ["eval", "--model", str(tiny_model_dir), "--data", "test.jsonl", "--max-new-tokens", "4",
            "--template", "Reverse: {prompt}\nAnswer:", "--samples", "s.jsonl"]
    assert main(args) == 0
    assert "accuracy     n/a   (the answers are not numbers; give --correct" in capsys.readouterr().out
    assert main([*args, "--correct", "cli_checks:even", "--reward", "cli_checks.py:vowels"]) == 0
    out = capsys.readouterr().out
    samples = _rows(tmp_path / "s.jsonl")
    acc = sum(sum(map(ord, s["prompt"] + s["response"])) % 2 == 0 for s in samples) / 3
    assert f"accuracy     {acc:.3f}   by eval.correct (cli_checks:even)" in out
    assert "reward cli_checks.py:vowels" in out


def test_cli_eval_checks_the_plugins_before_loading_the_model(tmp_path, monkeypatch, capsys):
    from rlhflab.cli import main
    from rlhflab.models import load

    monkeypatch.setattr(load, "load_model", lambda *a, **k: pytest.fail("the model was loaded first"))
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "cat", "answer": "tac"}) + "\n")
    (tmp_path / "cli_bad.py").write_text("def right(prompt, response, example):\n    return example['target']\n")
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--model", "m", "--data", "test.jsonl", "--correct", "cli_bad.py:right"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: plug-in 'cli_bad.py:right' raised KeyError: 'target' at cli_bad.py:2") \
        and err.count("\n") == 1


HACKED = """
CALLS = {"reward": 0, "check": 0}

def rising(prompt, response, example):
    CALLS["reward"] += 1
    return CALLS["reward"] / 1000      # every later call scores higher: the reward "rises"

def falling(prompt, response, example):
    CALLS["check"] += 1
    return CALLS["check"] <= 9         # right in the preflight and the first evaluation (8 prompts)
"""


def test_the_live_doctor_sees_step_0_and_warns_of_reward_hacking(ppo_cfg, tmp_path, monkeypatch, capsys):
    """Two evaluations (steps 0 and 1): the reward rises and the check falls from 1.0 to 0.0.
    The doctor can only fire at step 1 if the loop showed it step 0's evaluation."""
    from rlhflab.trainers.ppo import train

    (tmp_path / "hacked.py").write_text(HACKED)
    monkeypatch.chdir(tmp_path)
    train(ppo_cfg("training.total_steps=1", "training.eval_interval=1", "logging.doctor=true",
                  "reward.sources=[{type: rule, name: 'hacked.py:rising'}]", "eval.correct=hacked.py:falling"),
          quiet=False)
    out = capsys.readouterr().out
    assert "doctor [warn] step 1 reward_hacking: the held-out check eval/accuracy fell from 1 at step 0 to 0" in out
