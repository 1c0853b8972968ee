"""The guess-the-number example's task design (examples/guess_the_number): the claims its
docs rest on, checked by playing the demonstrator against the environment in plain Python
(no model). The learning run itself is examples/guess_the_number/run.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from file_modules import load_file

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "guess_the_number"


def _load(name: str, file: str):
    return load_file(name, EXAMPLE / file)


@pytest.fixture(scope="module")
def example():
    return _load("guess_example_run", "run.py"), _load("guess_example_env", "guess_env.py")


def play(run, env_mod, secret: int, halve: bool) -> tuple[bool, int, float]:
    """One game of the demonstrator against the environment, played by halving or by counting
    up throughout (the row's `_halve`, as run.demonstrations marks it): (solved, turns, return)."""
    env, row = env_mod.GuessTheNumber(high=run.HIGH), {"secret": secret, "_halve": halve}
    messages = env.reset(row)
    total = 0.0
    for turn in range(1, run.MAX_TURNS + 1):
        text = run.counting_player(row, messages)
        result = env.step(messages, text)
        total += result.reward
        if result.done:
            return True, turn, total
        messages = messages + [{"role": "assistant", "content": text}] + result.messages
    return False, run.MAX_TURNS, total


def test_interval_follows_the_feedback(example):
    run, _ = example
    msgs = [{"role": "user", "content": "start"}, {"role": "assistant", "content": "My guess is 5."},
            {"role": "user", "content": "higher"}, {"role": "assistant", "content": "My guess is 8."},
            {"role": "user", "content": "lower"}]
    assert run.interval(msgs) == (6, 7)     # above 5, below 8
    assert run.interval(msgs[:1]) == (1, run.HIGH)


def test_counting_up_solves_only_the_low_secrets(example):
    """Counting up: guesses 1, 2, 3, 4 -> solves secrets 1-4 in `secret` turns; 5-10 are lost."""
    run, env_mod = example
    assert run.MAX_TURNS == 4
    results = {s: play(run, env_mod, s, halve=False) for s in range(1, run.HIGH + 1)}
    assert [s for s, (ok, _, _) in results.items() if ok] == [1, 2, 3, 4]
    assert results[3][1:] == (3, pytest.approx(0.8))   # two wrong guesses (-0.1 each), then +1
    assert results[7][1:] == (4, pytest.approx(-0.4))  # four wrong guesses


def test_halving_solves_every_secret_within_max_turns(example):
    """Halving (bisection from 5): every secret 1-10 within 4 turns; e.g. 7: 5, 8, 6, 7."""
    run, env_mod = example
    results = {s: play(run, env_mod, s, halve=True) for s in range(1, run.HIGH + 1)}
    assert all(ok for ok, _, _ in results.values())
    assert max(t for _, t, _ in results.values()) == 4
    assert results[5][1] == 1 and results[7][1] == 4 and results[2][1] == 2   # 5 | 5, 2 | 5, 8, 6, 7
    # So the shipped max_turns leaves room for RL: halving wins all ten, counting up four.


def test_model_option_plays_a_chat_model_folder(example, tmp_path, monkeypatch):
    """run.py --model DIR (the options of examples/real_chat.py): a chat model's folder in
    place of the tiny model built by the script; measured zero-shot and after the SFT on the
    held-out games, the SFT model saved, no RL with --rl-steps 0. A 1-layer model keeps it
    to seconds; what is checked is the path, the defaults --model brings, and that the SFT
    ran on the demonstrator's games as the tiny example lays them out."""
    import json
    import random

    import torch

    run, env_mod = example
    base = run.make_base(tmp_path / "base", seed=0, hidden_size=32, num_layers=1)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["run.py", "--model", str(base), "--sft-steps", "2", "--rl-steps", "0",
                                      "--threads", "1", "--out", str(out)])
    assert run.main() == 0
    res = json.loads((out / "results.json").read_text())
    assert res["args"]["sft_lr"] == 3e-5 and res["args"]["device"] == "cpu"   # --model's SFT default
    assert "grpo" not in res and set(res) >= {"zero_shot", "sft"}
    for key in ("zero_shot", "sft"):
        assert 0.0 <= res[key]["solved"] <= 1.0 and 1.0 <= res[key]["turns"] <= run.MAX_TURNS
    # The SFT's games are the demonstrator's on the 2,000 training games, 30% halving
    # (drawn with the seed); the GPU run of seed 0 printed 3.21 turns on average.
    rng = random.Random(0)
    turns = [play(run, env_mod, g["secret"], rng.random() < run.HALVE)[1] for g in run.games(2000, 0)]
    assert res["demo_turns"] == pytest.approx(sum(turns) / len(turns))
    assert res["demo_turns"] == pytest.approx(3.21, abs=0.005)
    from safetensors.torch import load_file

    w0, w1 = load_file(str(base / "model.safetensors")), load_file(str(out / "sft" / "model.safetensors"))
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)   # two SFT steps moved the weights
