"""PPO-ptx: a language-modelling loss on extra rows mixed into each update minibatch."""

from __future__ import annotations

import json

import pytest
import torch

from rlhflab.data.ptx import PtxData
from rlhflab.data.sft import IGNORE_INDEX
from rlhflab.engine.update import PPOMath, minibatch_loss
from rlhflab.models.actor_critic import lm_loss
from rlhflab.trainers import ppo
from rlhflab.trainers.common import Timer
from rlhflab.trainers.loop import build_run


def _rows(path):
    rows = [{"text": "Question: 1 + 1?\nAnswer: 2"}, {"question": "What is 2 + 3?", "answer": "5"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_ptx_rows_text_trains_every_token_sft_rows_only_the_response(tiny_model_dir, tmp_path):
    from rlhflab.models.load import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    data = PtxData.load(str(_rows(tmp_path / "ptx.jsonl")), tok, prompt_template="Q: {prompt}\nA:",
                        use_chat_template=False, batch_size=2, max_seq_length=64, seed=0, device="cpu")
    text, sft = data.examples
    assert text.labels == text.input_ids                        # plain text: every token is a target
    prompt_ids = tok("Q: What is 2 + 3?\nA:", add_special_tokens=False)["input_ids"]
    assert sft.labels[: len(prompt_ids)] == [IGNORE_INDEX] * len(prompt_ids)  # the prompt is context
    assert sft.labels[-1] == tok.eos_token_id
    # The stream of a step is the same for the same (seed, step), and another step's differs in order.
    a = [next(data.batches(3))["input_ids"].tolist() for _ in range(2)]
    assert a[0] == a[1]
    with pytest.raises(Exception, match=r"ptx_data: .*bad.jsonl: 1 of 1 rows fit no SFT layout.*text"):
        (tmp_path / "bad.jsonl").write_text('{"foo": 1}\n')
        PtxData.load(str(tmp_path / "bad.jsonl"), tok, prompt_template="{prompt}", use_chat_template=False,
                     batch_size=2, max_seq_length=64, seed=0, device="cpu")


def test_minibatch_loss_adds_ptx_coeff_times_the_lm_loss(ppo_cfg, tmp_path):
    cfg = ppo_cfg("ppo.ptx_coeff=0.5", f"ppo.ptx_data={_rows(tmp_path / 'ptx.jsonl')}")
    torch.manual_seed(0)
    run = build_run(cfg, ppo.method(cfg))
    from rlhflab.data.prompts import load_prompts, step_prompts
    examples = step_prompts(load_prompts(cfg.dataset, run.models.tokenizer, "train"), 16, 0, 1)
    roll = ppo.collect_rollout(run, examples, Timer(), 1)
    from rlhflab.engine.minibatch import select
    mb = select(roll, torch.arange(8), roll.response_mask)
    plain, st0 = minibatch_loss(run.models.actor, mb, cfg.ppo, 1.0, PPOMath(), normalizer=10.0)
    mb.lm_batch, mb.lm_weight = next(run.ptx_batches(1)), 0.25
    mixed, st = minibatch_loss(run.models.actor, mb, cfg.ppo, 1.0, PPOMath(), normalizer=10.0)
    lm = lm_loss(run.models.policy, mb.lm_batch)
    # total = the PPO loss + ptx_coeff · weight · LM loss = plain + 0.5 · 0.25 · lm
    assert float(mixed) == pytest.approx(float(plain) + 0.125 * float(lm), rel=1e-5)
    assert st.ptx == pytest.approx(0.25 * float(lm), rel=1e-5) and st0.ptx == 0.0


@pytest.mark.slow
def test_ppo_ptx_logs_loss_ptx_and_lowers_the_lm_loss(ppo_cfg, tmp_path):
    ptx_file = _rows(tmp_path / "ptx.jsonl")
    results = {}
    for coeff in (0.0, 5.0):
        cfg = ppo_cfg(f"ppo.ptx_coeff={coeff}", f"ppo.ptx_data={ptx_file}", "training.total_steps=3",
                      "ppo.learning_rate=1e-3", out_dir=tmp_path / f"run{coeff}")
        res = ppo.train(cfg, quiet=True)
        rows = [json.loads(x) for x in (tmp_path / f"run{coeff}" / "metrics.jsonl").read_text().splitlines()]
        assert ("loss/ptx" in rows[-1]) == (coeff > 0)
        tok = res.models.tokenizer
        data = PtxData.load(str(ptx_file), tok, prompt_template=cfg.dataset.prompt_template, use_chat_template=False,
                            batch_size=2, max_seq_length=64, seed=0, device="cpu")
        with torch.no_grad():
            results[coeff] = float(lm_loss(res.models.policy, next(data.batches(0))))
    # With the LM term the policy's NLL on those rows falls below the run without it.
    assert results[5.0] < results[0.0] - 0.5, results
