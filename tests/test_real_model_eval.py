"""`rlhflab eval` on SmolLM2-135M-Instruct prints the numbers the training loop's held-out
evaluation logs: the same 8 arithmetic word problems, asked through the model's ChatML
template (use_chat_template auto), 16 greedy new tokens, identical texts, scores and
accuracy (tests/sampler_helpers.py runs both sides)."""

from __future__ import annotations

import json

import pytest
from sampler_helpers import assert_same_evaluation, trainer_and_cli_eval

from rlhflab.data.arith import PROMPT_TEMPLATE, write_task

pytestmark = pytest.mark.slow


# The chat model answers in words ("There are 7 - 6 = 1 marble left."), never with GSM8K's
# "#### 1", so the strict checker scores 0 everywhere; its last number is what it means.
LAST_NUMBER = """
from rlhflab.rewards.gsm8k import gsm8k_reward

def last_number(prompt, response, example):
    return gsm8k_reward(response, example["answer"], fallback_last_number=True) == 1.0
"""


def test_eval_equals_the_trainers_evaluation_on_smollm2(smollm2_dir, tmp_path, monkeypatch, capsys):
    task = write_task(tmp_path / "arith", n_train=8, n_test=8)
    (tmp_path / "real_checks.py").write_text(LAST_NUMBER)
    monkeypatch.chdir(tmp_path)
    both = trainer_and_cli_eval(smollm2_dir, task["test"], tmp_path, template=PROMPT_TEMPLATE, rows=8,
                                max_new_tokens=16, max_prompt_length=256, batch_size=64, capsys=capsys,
                                reward="gsm8k_lenient", correct="real_checks.py:last_number")
    assert_same_evaluation(both)
    samples = both.cli_samples
    assert len(samples) == 8
    assert 0 < sum(s["correct"] for s in samples) < 8  # a real mix, so equal accuracy means something
    # Asked as a chat model, and it answers: ChatML around the task's template, text after it.
    assert all(s["prompt"].startswith("<|im_start|>") and s["prompt"].endswith("<|im_start|>assistant\n")
               and "Question: " in s["prompt"] for s in samples)
    assert all(s["response"].strip() and "<|im_end|>" not in s["response"] for s in samples)
    assert both.cli_lines[2] == f"prompts: chat template of {smollm2_dir} (auto) around {json.dumps(PROMPT_TEMPLATE)}"
    print(f"SmolLM2 eval == trainer: accuracy {both.trainer['eval/accuracy']:.3f}, "
          f"reward_mean {both.trainer['eval/reward_mean']:.3f} on 8 rows")
