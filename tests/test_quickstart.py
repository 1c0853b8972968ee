"""The quickstart end to end with small settings: every stage runs and summary.json is whole.

(Whether PPO beats the sloppy teacher with the default settings is measured separately;
this run is far too short to learn.)"""

from __future__ import annotations

import json

import pytest

from rlhflab import cli
from rlhflab.quickstart import format_table, quickstart

# sft.max_steps=2: nothing below needs the warm start to have learned (SFT's own learning is
# tests/test_sft.py's); two steps still run the stage, save final/ and hand it to PPO.
SMALL = ["sft.max_steps=2", "sft.batch_size=16", "training.total_steps=1", "ppo.rollout_samples=8",
         "ppo.batch_size=8", "ppo.mini_batch_size=8", "ppo.epochs=1", "dataset.num_eval_samples=10",
         "generation.max_new_tokens=8", "training.eval_interval=1", "logging.progress_bar=false",
         "logging.plots=false"]


@pytest.mark.slow
def test_quickstart_small(tmp_path):
    out = tmp_path / "qs"
    summary = quickstart(out, overrides=SMALL, threads=1, quiet=True)
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    for key in ("accuracy_before", "accuracy_after", "reward_before", "reward_after"):
        assert isinstance(summary[key], float) and 0.0 <= summary[key] <= 1.0, key
    # Accuracy is a fraction of the 10 held-out problems.
    for key in ("accuracy_before", "accuracy_after"):
        assert summary[key] * 10 == pytest.approx(round(summary[key] * 10)), key
    assert summary["seconds"] > 0 and summary["ppo_episodes_per_s"] > 0
    assert summary["ppo_steps"] == 1 and summary["ppo_episodes"] == 8
    # The stages left their outputs: the tiny model, the task, the SFT and PPO runs.
    assert (out / "tiny-model" / "config.json").exists() and (out / "data" / "sft.jsonl").exists()
    assert (out / "sft" / "final" / "config.json").exists()
    assert (out / "ppo" / "final" / "value_head.safetensors").exists()
    assert summary["final_model"] == str(out / "ppo" / "final")
    table = format_table(summary)
    assert "accuracy (greedy)" in table and "mean reward" in table


def test_quickstart_rejects_a_bad_override_before_any_work(tmp_path, capsys):
    rc = cli.main(["quickstart", "--out", str(tmp_path / "qs"), "ppo.kl_coef=0.1"])
    assert rc == 2 and "did you mean ppo.kl_coeff?" in capsys.readouterr().err
    assert not (tmp_path / "qs" / "tiny-model").exists()


def test_quickstart_refuses_a_folder_it_did_not_make(tmp_path, capsys):
    """`--out` pointing at someone's folder must not be wiped: exit 2, files intact."""
    from rlhflab.cli import main

    precious = tmp_path / "mine" / "ppo" / "effective_config.yaml"
    precious.parent.mkdir(parents=True)
    precious.write_text("keep me\n")
    assert main(["quickstart", "--out", str(tmp_path / "mine")]) == 2
    assert "not made by `rlhflab quickstart`" in capsys.readouterr().err
    assert precious.read_text() == "keep me\n"


def test_gsm8k_reward_without_answers_is_a_user_error():
    import pytest as _pytest

    from rlhflab.errors import UserError
    from rlhflab.rewards import RuleScorer, resolve_rule

    with _pytest.raises(UserError, match="dataset.answer_field"):
        RuleScorer(resolve_rule("gsm8k")).score(["q"], ["#### 3"], [{"question": "q"}])


def test_a_ppo_stage_stopped_before_its_first_checkpoint_is_started_over(tmp_path, monkeypatch, capsys):
    """The same quickstart run again: its PPO folder (metrics.jsonl, no checkpoint) is let in
    and started over, as `rlhflab ppo` does, not refused. The stages are stubbed: only the
    folder check before the warm start runs."""
    import dataclasses

    from rlhflab import quickstart as qs
    from rlhflab.config import load_config, save_effective_config
    from rlhflab.trainers import ppo

    _, effective = load_config(None, ppo.PPORunConfig, [], base=dataclasses.asdict(qs.ppo_defaults(tmp_path, qs.THREADS)))
    stopped = tmp_path / "ppo"
    stopped.mkdir()
    save_effective_config(effective, stopped)
    (stopped / "metrics.jsonl").write_text('{"step": 1}\n')

    class Reached(Exception):
        pass

    def stop(*a, **k):
        raise Reached

    monkeypatch.setattr(qs, "prepare_warm_start", stop)
    with pytest.raises(Reached):
        quickstart(tmp_path, quiet=True)
    assert "stopped before its first checkpoint: starting it over" in capsys.readouterr().out
    assert not (stopped / "metrics.jsonl").exists() and list(stopped.glob("metrics.stopped-*.jsonl"))
