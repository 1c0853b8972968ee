"""TPO: rounds of feedback from a reward, best-so-far never worse, best-of-N at equal samples
beside it, the templates checked at load, and the command."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rlhflab.config import load_config
from rlhflab.errors import ConfigError
from rlhflab.rewards import RuleScorer
from rlhflab.tpo import Pool, TPORunConfig, TPOSection, fill, tpo_search

ROOT = Path(__file__).resolve().parents[1]


def a_count(prompt, response, example):
    """The hand-made reward: how many times the letter a appears."""
    return float(response.count("a"))


def test_pool_best_worst_and_the_filled_template():
    pool = Pool()
    pool.add([" ab", " aaa", " b", " aaa"], [1.0, 3.0, 0.0, 3.0])
    assert (pool.best, pool.worst) == (1, 2)  # the earliest of two equal bests
    text = fill("{prompt}|{best}|{worst}|{best_score:.1f}|{worst_score:.1f}|{critique}", "Q", pool, " c ")
    assert text == "Q|aaa|b|3.0|0.0|c"


def test_feedback_that_helps_beats_best_of_n():
    """A hand-made sampler: plain prompts get 0-2 random a's; a refine prompt gets the best
    answer it shows plus one more a. So each round TPO's best grows by one a, while
    best-of-N only draws more random answers."""
    rng = random.Random(0)
    seen = []

    def sampler(prompts, n, max_new_tokens):
        seen.append(list(prompts))
        out = []
        for p in prompts:
            if p.startswith("BEST="):
                best = p.split("|")[0][len("BEST="):]
                out.append([" " + best + "a"] * n)
            else:
                out.append([" " + "a" * rng.randint(0, 2) + "b" for _ in range(n)])
        return out

    sec = TPOSection(num_candidates=3, rounds=3, refine_template="BEST={best}|WORST={worst}|{prompt}")
    res = tpo_search(sampler, ["q1", "q2"], [{}, {}], RuleScorer(a_count), sec, 8)
    best = [r.best_reward for r in res.rounds]
    bon = [r.bon_reward for r in res.rounds]
    assert [r.samples_per_prompt for r in res.rounds] == [3, 6, 9, 12]
    assert best[0] == bon[0]                          # round 0 is the same N plain samples
    assert best[1:] == [best[0] + 1, best[0] + 2, best[0] + 3]  # one more a per round
    assert all(b <= 2 for b in bon) and best[-1] > bon[-1]
    # The first call is the baseline's N*(T+1) plain samples; then one refine call per round,
    # whose prompts show that prompt's best and worst so far.
    assert len(seen) == 1 + 3 and all(p.startswith("BEST=") for p in seen[1])
    pool = res.pools[0]
    first = Pool(pool.responses[:3], pool.scores[:3])  # what round 1 was shown: round 0's candidates
    assert len(pool.responses) == 12 and res.refine_prompts[0][0] == (
        f"BEST={first.responses[first.best].strip()}|WORST={first.responses[first.worst].strip()}|q1")
    assert all(r.best_accuracy is None for r in res.rounds)  # no checker given: no accuracy
    # Each new candidate is the best plus an "a": never a verbatim copy of what was shown.
    assert [(r.copied_best, r.copied_worst) for r in res.rounds] == [(None, None)] + [(0.0, 0.0)] * 3


def test_a_model_that_copies_what_it_is_shown_gains_nothing():
    """A sampler that, given a refine prompt, repeats the first answer in it (the worst, in
    the default template): copies_worst is 1 and TPO's best never moves past round 0."""
    rng = random.Random(1)

    def sampler(prompts, n, max_new_tokens):
        out = []
        for p in prompts:
            if "Score:" in p:  # the default refine template: worst first
                first = p.split("\n")[1].removeprefix("Answer:")  # the worst answer, after the first question
                out.append([" " + first.strip()] * n)
            else:
                out.append([" " + "a" * rng.randint(0, 3) for _ in range(n)])
        return out

    prompts = [f"Q{i}\nAnswer:" for i in range(5)]
    res = tpo_search(sampler, prompts, [{}] * 5, RuleScorer(a_count), TPOSection(num_candidates=2, rounds=2), 8)
    assert [r.copied_worst for r in res.rounds[1:]] == [1.0, 1.0]
    assert res.rounds[2].best_reward == res.rounds[0].best_reward <= res.rounds[2].bon_reward


def test_tpo_on_a_tiny_model_best_so_far_never_worse(tiny_model_dir):
    from rlhflab.config.schema import GenerationConfig
    from rlhflab.models.load import load_model
    from rlhflab.tpo import hf_sampler

    model, tok = load_model(str(tiny_model_dir))
    sampler = hf_sampler(model, tok, GenerationConfig(max_new_tokens=6), max_prompt_length=64, batch_size=64)
    prompts = [f"Question: what is {i} + 1?\nAnswer:" for i in range(6)]
    sec = TPOSection(num_candidates=3, rounds=3)  # the default refine template
    correct = lambda p, r, e: ["a" in x for x in r]  # noqa: E731
    res = tpo_search(sampler, prompts, [{}] * 6, RuleScorer(a_count), sec, 6, correct)
    for t in range(1, len(res.rounds)):
        assert res.rounds[t].best_reward >= res.rounds[t - 1].best_reward
        assert res.rounds[t].best_accuracy >= res.rounds[t - 1].best_accuracy
        assert res.rounds[t].bon_reward >= res.rounds[t - 1].bon_reward
    for pool in res.pools:  # every candidate scored by the reward, against the original prompt
        assert len(pool.responses) == 12 and pool.scores == [a_count("", r, {}) for r in pool.responses]
        for t in range(4):  # per prompt too: the best of the first 3(t+1) candidates only grows
            assert max(pool.scores[: 3 * (t + 1)]) >= max(pool.scores[: 3 * t] or [0.0])
    assert res.rounds[-1].best_reward == pytest.approx(sum(max(p.scores) for p in res.pools) / 6)
    # The refine prompt holds the question, the best and the worst answers with their scores.
    assert res.refine_prompts[0][0].endswith(prompts[0]) and "Score:" in res.refine_prompts[0][0]


@pytest.mark.parametrize("override, message", [
    ("tpo.refine_template='{prompt} {bets}'", r"tpo.refine_template: unknown field \{bets\}; use \{prompt\}"),
    ("tpo.refine_template='{best} again'", r"tpo.refine_template: must contain \{prompt\}"),
    ("tpo.critique_template='{prompt} {critique}'", r"tpo.critique_template: unknown field \{critique\}"),
    ("tpo.refine_template='{prompt} {'", r"tpo.refine_template: not a valid format string"),
    ("tpo.num_candidates=0", r"tpo.num_candidates: must be > 0"),
])
def test_templates_and_sizes_are_checked_at_load(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "configs" / "tpo_quickstart.yaml", TPORunConfig, [override])


def test_tpo_command(tiny_model_dir, arith_dir, tmp_path, capsys):
    from rlhflab.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["tpo", "--help"])
    assert exit_.value.code == 0 and "best-of-N" in capsys.readouterr().out
    rc = main(["tpo", "--config", str(ROOT / "configs" / "tpo_quickstart.yaml"),
               f"model.name_or_path={tiny_model_dir}", f"dataset.eval_path={arith_dir / 'test.jsonl'}",
               "dataset.num_eval_samples=4", "generation.max_new_tokens=4", "tpo.rounds=1", "tpo.num_candidates=2",
               f"run.output_dir={tmp_path / 'tpo'}", "run.num_threads=1"])
    out = capsys.readouterr().out
    assert rc == 0 and "accuracy by the GSM8K checker" in out
    assert "round  samples" in out and (tmp_path / "tpo" / "tpo_rounds.jsonl").is_file()
    assert len((tmp_path / "tpo" / "samples.jsonl").read_text().splitlines()) == 4


# The command runs in a process of its own: vLLM's engine runs in the calling process
# (generation.backend=vllm keeps its core in-process), and whatever it does to that
# process's streams must not reach the test runner's output capture.
VLLM_TPO = """
import sys
from rlhflab.cli import main
from rlhflab.rollout.vllm import VLLMEngine
started, real = [], VLLMEngine.create.__func__
VLLMEngine.create = classmethod(lambda cls, *a, **k: started.append(1) or real(cls, *a, **k))
rc = main(sys.argv[1:])
print(f"engines started: {len(started)}")
sys.exit(rc)
"""


@pytest.mark.slow
def test_tpo_command_with_the_vllm_backend(tiny_model_dir, arith_dir, tmp_path):
    # `rlhflab tpo` samples through the configured backend: vLLM on the folder (eager, to
    # start in seconds; tiny_model_dir's head_dim 32 has a CPU kernel), one engine, no hf
    # model loaded.
    from test_vllm_backend import HAVE_VLLM

    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    args = ["tpo", "--config", str(ROOT / "configs" / "tpo_quickstart.yaml"),
            f"model.name_or_path={tiny_model_dir}", f"dataset.eval_path={arith_dir / 'test.jsonl'}",
            "dataset.num_eval_samples=4", "generation.max_new_tokens=4", "tpo.rounds=1",
            "tpo.num_candidates=2", f"run.output_dir={tmp_path / 'tpo'}", "run.num_threads=1",
            "generation.backend=vllm", "generation.vllm.enforce_eager=true"]
    proc = subprocess.run([sys.executable, "-c", VLLM_TPO, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "round  samples" in proc.stdout and proc.stdout.rstrip().endswith("engines started: 1")
    assert len((tmp_path / "tpo" / "samples.jsonl").read_text().splitlines()) == 4
