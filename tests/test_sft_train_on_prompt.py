"""`sft.train_on_prompt`: the prompt's tokens in the SFT loss too (the notebook seed's
`labels = input_ids`); off (the default) they are -100."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhflab.data import sft as sftdata
from rlhflab.trainers.sft import SFTRunConfig, response_nll

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PROMPT, RESPONSE = "User: 2 + 3\n\nAssistant:", " 5"


@pytest.fixture(scope="module")
def tok(tiny_sft_rm_dir):
    from rlhflab.models.load import load_tokenizer
    return load_tokenizer(str(tiny_sft_rm_dir))


def test_prompt_labels_are_the_ids_when_on_and_ignored_when_off(tok):
    off = sftdata.tokenize_example(PROMPT, RESPONSE, True, tok, 64)
    on = sftdata.tokenize_example(PROMPT, RESPONSE, True, tok, 64, train_on_prompt=True)
    n = off.prompt_len
    assert n > 1 and on.prompt_len == n and on.input_ids == off.input_ids
    assert off.labels[:n] == [sftdata.IGNORE_INDEX] * n
    assert on.labels == on.input_ids  # every position, the prompt's included
    assert on.labels[n:] == off.labels[n:]
    # Padding stays out of the loss either way.
    b = sftdata.collate([on, sftdata.tokenize_example("User: 1\n\nAssistant:", " a longer answer here", True,
                                                      tok, 64, train_on_prompt=True)], tok.pad_token_id)
    pad = b["attention_mask"] == 0
    assert pad.any() and (b["labels"][pad] == sftdata.IGNORE_INDEX).all()
    assert torch.equal(b["labels"][~pad], b["input_ids"][~pad])


def test_the_loss_adds_exactly_the_prompts_next_token_nll(tiny_sft_rm_dir, tok):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_sft_rm_dir), dtype=torch.float32).eval()
    off = sftdata.collate([sftdata.tokenize_example(PROMPT, RESPONSE, True, tok, 64)], tok.pad_token_id)
    on = sftdata.collate([sftdata.tokenize_example(PROMPT, RESPONSE, True, tok, 64, train_on_prompt=True)],
                         tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=off["input_ids"]).logits  # (1, L, V)
    n = int((off["labels"][0] == sftdata.IGNORE_INDEX).sum())  # prompt length
    nll_off, nll_on = response_nll(logits, off["labels"]), response_nll(logits, on["labels"])
    # Position 0 is never a target (nothing precedes it): n - 1 more targets, tokens 1..n-1.
    assert nll_on.tokens == nll_off.tokens + n - 1
    logp = logits[0].log_softmax(-1)
    ids = off["input_ids"][0]
    prompt_nll = -sum(logp[i - 1, ids[i]] for i in range(1, n))  # by a plain loop
    torch.testing.assert_close(nll_on.total, nll_off.total + prompt_nll)
    assert float(prompt_nll) > 0


def test_load_sft_data_labels_train_prompts_and_keeps_eval_on_the_response(tmp_path, tok):
    from rlhflab.trainers.sft import SFTDataConfig, load_sft_data

    rows = [{"prompt": f"{i} + 1", "completion": str(i + 1)} for i in range(10)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = SFTDataConfig(path=str(tmp_path / "d.jsonl"), eval_fraction=0.2)
    data = load_sft_data(d, tok, warn=lambda m: None, train_on_prompt=True)
    assert all(ex.labels == ex.input_ids for ex in data.train)
    assert all(ex.labels[:ex.prompt_len] == [sftdata.IGNORE_INDEX] * ex.prompt_len for ex in data.eval)
    default = load_sft_data(d, tok, warn=lambda m: None)
    assert all(ex.labels[0] == sftdata.IGNORE_INDEX for ex in default.train)


def test_config_switch_and_axolotls_name():
    from rlhflab.config import load_config
    from rlhflab.errors import ConfigError

    assert load_config(CONFIGS / "sft_debug.yaml", SFTRunConfig)[0].sft.train_on_prompt is False
    cfg, _ = load_config(CONFIGS / "sft_debug.yaml", SFTRunConfig, ["sft.train_on_prompt=true"])
    assert cfg.sft.train_on_prompt is True
    with pytest.raises(ConfigError, match="did you mean sft.train_on_prompt"):
        load_config(CONFIGS / "sft_debug.yaml", SFTRunConfig, ["sft.train_on_inputs=true"])


def test_the_switch_reaches_the_training_loss_not_the_eval_loss(tiny_sft_rm_dir, tmp_path):
    from rlhflab.config import load_config
    from rlhflab.data import arith
    from rlhflab.trainers.sft import train_sft

    rows = arith.noisy_demonstrations(arith.make_split(32, seed=4), wrong_rate=0.0, seed=0)
    data = tmp_path / "demo.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    firsts = {}
    for on in (False, True):
        cfg, _ = load_config(CONFIGS / "sft_debug.yaml", SFTRunConfig, [
            f"model.name_or_path={tiny_sft_rm_dir}", f"data.path={data}", "data.eval_path=null",
            "data.eval_fraction=0.25", f"training.output_dir={tmp_path / str(on)}", "training.num_threads=1",
            "logging.progress_bar=false", "logging.plots=false", "sft.max_steps=1", "sft.logging_steps=1",
            "sft.num_eval_generate=0", "training.eval_interval=0", f"sft.train_on_prompt={str(on).lower()}"])
        res = train_sft(cfg, quiet=True)
        lines = [json.loads(x) for x in (res.output_dir / "metrics.jsonl").read_text().splitlines()]
        firsts[on] = next(x["train/loss"] for x in lines if "train/loss" in x)
        firsts[on, "eval"] = res.eval_before["eval/loss"]
    # The same starting model and held-out rows: the same response-only eval/loss ...
    assert firsts[False, "eval"] == firsts[True, "eval"]
    # ... while the training loss now averages over the prompt tokens too.
    assert firsts[False] != pytest.approx(firsts[True], rel=1e-3)
