"""The word-problem task for a real chat model: the generator's rows and splits, the
answer extractor on a chat model's natural answers, and make-data's --task option."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from rlhflab import cli
from rlhflab.data import wordproblems as wp


def _operands(question: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", question)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_answer_is_the_arithmetic_of_its_question(seed):
    rng = random.Random(seed)
    for _ in range(300):
        row = wp.make_problem(rng)
        nums, r = _operands(row["question"]), row["result"]
        assert isinstance(r, int) and r >= 0
        assert row["answer"].endswith(f"#### {r}")
        if row["kind"] == "add":       # "has 23 and gets 18 more" -> 23 + 18
            assert r == nums[0] + nums[1]
        elif row["kind"] == "sub":     # "has 66 and gives away 59" -> 66 - 59 = 7
            assert r == nums[0] - nums[1]
        elif row["kind"] == "mul":     # "4 bags with 6 in each" -> 24 (the sentence order varies)
            assert r == nums[0] * nums[1]
        elif row["kind"] == "div":     # "shares 24 among 4" -> 6, always exact
            assert nums[0] % nums[1] == 0 and r == nums[0] // nums[1]
        else:                          # "has 12, buys 5 more, gives 7" -> 12 + 5 - 7 = 10
            assert row["kind"] == "two_step" and r == nums[0] + nums[1] - nums[2]


@pytest.mark.parametrize("seed", [0, 1])
def test_easy_level_keeps_every_number_small(seed):
    rng = random.Random(seed)
    rows = [wp.make_problem(rng, "easy") for _ in range(500)]
    assert {r["kind"] for r in rows} == set(wp.KINDS)
    for row in rows:
        nums, r = _operands(row["question"]), row["result"]
        assert max(nums) <= 30 and 0 <= r <= 36 and row["answer"].endswith(f"#### {r}")
        if row["kind"] == "sub":       # "has 15 and gives away 3" -> 12; at least 2 are left
            assert r == nums[0] - nums[1] >= 2
        elif row["kind"] == "mul":     # times tables to 6 x 6
            assert r == nums[0] * nums[1] and max(nums) <= 6
        elif row["kind"] == "two_step":  # "has 7, buys 4 more, gives 9" -> 2; at least 2 are left
            assert r == nums[0] + nums[1] - nums[2] >= 2


def test_standard_level_is_the_default():
    assert [wp.make_problem(random.Random(s)) for s in range(50)] == \
        [wp.make_problem(random.Random(s), "standard") for s in range(50)]


def test_make_data_level(tmp_path, capsys):
    assert cli.main(["make-data", "--task", "word-problems", "--level", "easy", "--out", str(tmp_path),
                     "--n-train", "40", "--n-test", "10"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert max(max(_operands(r["question"])) for r in rows) <= 30
    assert cli.main(["make-data", "--task", "arith", "--level", "easy", "--out", str(tmp_path / "a")]) != 0
    assert "levels belong to --task word-problems" in capsys.readouterr().err and not (tmp_path / "a").exists()


def test_every_kind_is_drawn_and_splits_are_fixed_and_disjoint(tmp_path):
    paths = wp.write_task(tmp_path, n_train=300, n_test=50, seed=0)
    rows = {k: [json.loads(x) for x in p.read_text().splitlines()] for k, p in paths.items()}
    assert len(rows["train"]) == 300 and len(rows["test"]) == 50
    assert {r["kind"] for r in rows["train"]} == set(wp.KINDS)
    assert not {r["question"] for r in rows["train"]} & {r["question"] for r in rows["test"]}
    again = wp.write_task(tmp_path / "again", n_train=300, n_test=50, seed=0)
    assert again["test"].read_text() == paths["test"].read_text()  # the same seed, the same held-out rows
    # a demonstration's own answer passes the checker
    for demo, row in zip(rows["sft"], rows["train"]):
        assert wp.correct(demo["prompt"], demo["completion"], row)


@pytest.mark.parametrize("response, expected", [
    ("7 + 5 = 12", 12),
    ("The answer is 12.", 12),
    ("**12**", 12),
    ("The answer is **12**.", 12),
    ("There are **12 apples** in the box.", 12),
    ("Answer: 12", 12),
    ("\\boxed{12}", 12),
    ("#### 12\nThe answer is: 12", 12),
    ("So Ben has 7 + 5 = 12 apples.", 12),                      # the number after the last "="
    ("The answer is 12. Check: 7 + 5 = 12, and 12 - 5 = 7.", 12),  # an explicit answer beats a later "="
    ("The answer is: 1,200", 1200),                               # thousands separator
    ("Ivy has 66 books. She gives 59 away, so 7 are left", 7),     # no "=": the last number
    ("3 - 6 = -3", -3),                                           # a sign
    ("12.0", 12),
    ("12.5", None),                                               # not an integer
    ("no number here", None),
    ("", None),
])
def test_extract_answer_reads_natural_chat_answers(response, expected):
    assert wp.extract_answer(response) == expected


def test_reward_and_correct_check_the_integer():
    row = {"question": "q", "answer": "5 + 7 = 12\n#### 12", "result": 12}
    assert wp.reward("q", "5 + 7 = 12", row) == 1.0 and wp.correct("q", "The answer is 12.", row)
    assert wp.reward("q", "5 + 7 = 13", row) == 0.0 and not wp.correct("q", "no idea", row)
    # a row read back without `result` uses the text after ####
    assert wp.reward("q", "**12**", {"answer": "5 + 7 = 12\n#### 12"}) == 1.0


def test_make_data_task_word_problems(tmp_path, capsys):
    assert cli.main(["make-data", "--task", "word-problems", "--out", str(tmp_path), "--n-train", "40",
                     "--n-test", "10"]) == 0
    test = [json.loads(x) for x in (tmp_path / "test.jsonl").read_text().splitlines()]
    assert len(test) == 10 and {"question", "answer", "result", "kind"} <= set(test[0])
    assert "train: " in capsys.readouterr().out


@pytest.mark.slow
def test_grpo_smollm2_recipe_runs_two_steps_on_the_real_model(smollm2_dir, tmp_path):
    """configs/grpo_smollm2.yaml resolves as shipped and trains SmolLM2 (tiny budget)."""
    from pathlib import Path

    from safetensors import safe_open

    from rlhflab.config import load_config
    from rlhflab.trainers.grpo import GRPORunConfig, train

    wp.write_task(tmp_path / "data", n_train=16, n_test=4, seed=0, level="easy")  # the recipes' level
    root = Path(__file__).resolve().parents[1]
    cfg, eff = load_config(root / "configs" / "grpo_smollm2.yaml", GRPORunConfig, [
        f"model.name_or_path={smollm2_dir}", f"dataset.path={tmp_path / 'data' / 'train.jsonl'}",
        f"dataset.eval_path={tmp_path / 'data' / 'test.jsonl'}", f"training.output_dir={tmp_path / 'run'}",
        # groups of 4 answers of up to 32 tokens: some groups then hold a right and a wrong answer, so
        # the advantages are not all zero (with 8 tokens every answer could be cut off and score 0,
        # and a step with no advantage and no KL yet moves nothing)
        "training.total_steps=2", "training.eval_interval=0", "grpo.prompts_per_step=2", "grpo.group_size=4",
        "grpo.batch_size=8", "grpo.mini_batch_size=8", "generation.max_new_tokens=32",
        "generation.backend=hf",  # the recipe generates with vLLM; its start-up is tested in test_vllm_backend
        "training.save_only_model=true",  # final/ without AdamW's 1 GB of state: CI's disk
        "logging.progress_bar=false", "logging.plots=false"])
    assert cfg.dataset.use_chat_template == "auto" and cfg.eval.correct == "rlhflab.data.wordproblems:correct"
    res = train(cfg, effective=eff, quiet=True)
    assert [h["step"] for h in res.history] == [1, 2]
    for h in res.history:  # the recipe's reward is 0/1 per response
        assert 0.0 <= h["rollout/reward_mean"] <= 1.0 and h["rollout/response_length"] <= 32
    assert any(h["rollout/advantage_abs_mean"] > 0 for h in res.history)  # something to learn from
    name = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as fh:
        before = fh.get_tensor(name)
    after = dict(res.models.policy.named_parameters())[name].detach()
    assert not torch.equal(before, after)  # the update moved the weights
