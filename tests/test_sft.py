"""SFT: row layouts, formatting and masking, the response-only loss, and tiny-model runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhflab.data import sft as sftdata
from rlhflab.errors import UserError
from rlhflab.trainers.sft import SFTRunConfig, accumulate_group, response_nll

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(scope="module")
def tiny(tiny_sft_rm_dir) -> Path:
    return tiny_sft_rm_dir


@pytest.fixture(scope="module")
def tok(tiny):
    from rlhflab.models.load import load_tokenizer
    return load_tokenizer(str(tiny))


# --------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("row, layout, prompt, response", [
    ({"instruction": "Name a fruit", "context": "", "response": "Apple"}, "instruction", "Name a fruit", "Apple"),
    ({"instruction": "Sum", "context": "2 and 3", "response": "5"}, "instruction", "Sum\n\n2 and 3", "5"),
    ({"instruction": "Sum", "input": "2 and 3", "output": "5"}, "instruction", "Sum\n\n2 and 3", "5"),
    ({"prompt": "Hi", "completion": "Hello"}, "prompt_completion", "Hi", "Hello"),
    ({"input": "Hi", "output": "Hello"}, "input_output", "Hi", "Hello"),
    ({"question": "1+1?", "answer": "2"}, "question_answer", "1+1?", "2"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
     "messages", "Hi", "Hello"),
])
def test_layouts_are_recognised(row, layout, prompt, response):
    assert sftdata.detect_layout(row) == layout
    ex = sftdata.row_to_example(row, 0)
    assert ex.prompt == prompt and ex.response == response


def test_messages_target_is_the_last_assistant_turn():
    row = {"messages": [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "a"},
                        {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                        {"role": "assistant", "content": "d"}, {"role": "user", "content": "dangling"}]}
    ex = sftdata.row_to_example(row, 3)
    assert ex.response == "d" and ex.prompt == "c" and len(ex.messages) == 5
    # No assistant turn at all: not a demonstration.
    assert sftdata.row_to_example({"messages": [{"role": "user", "content": "a"}]}, 0) is None


def test_bad_rows_are_reported_with_index_and_fields():
    rows = [{"prompt": "a", "completion": "b"}] * 3 + [{"text": "x", "label": 1}]
    seen: list[str] = []
    out = sftdata.parse_rows(rows, "f.jsonl", warn=seen.append)
    assert len(out) == 3 and [e.index for e in out] == [0, 1, 2]
    assert len(seen) == 1 and "row 3" in seen[0] and "['label', 'text']" in seen[0]


def test_mostly_bad_file_stops_with_a_clear_error():
    rows = [{"text": "x"}] * 3 + [{"prompt": "a", "completion": "b"}]
    with pytest.raises(UserError, match=r"f.jsonl: 3 of 4 rows fit no SFT layout \(row 0 has \['text'\]\)"):
        sftdata.parse_rows(rows, "f.jsonl", warn=lambda m: None)


# --------------------------------------------------------------------------------------
# Formatting, masking, truncation
# --------------------------------------------------------------------------------------
def test_default_template_and_prompt_mask(tok):
    ex = sftdata.row_to_example({"prompt": "2 + 3", "completion": "5"}, 0)
    prompt, response, eos = sftdata.format_example(ex, tok, sftdata.Template())
    assert (prompt, response, eos) == ("User: 2 + 3\n\nAssistant:", " 5", True)
    t = sftdata.tokenize_example(prompt, response, eos, tok, max_seq_length=64)
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert t.prompt_len == n_prompt
    assert t.labels[:n_prompt] == [sftdata.IGNORE_INDEX] * n_prompt
    assert t.labels[n_prompt:] == t.input_ids[n_prompt:]
    assert t.input_ids[-1] == tok.eos_token_id  # EOS is a target: the model learns to stop
    assert tok.decode(t.input_ids) == "User: 2 + 3\n\nAssistant: 5" + tok.eos_token


def test_chat_template_is_used_when_the_tokenizer_has_one(tok):
    import copy
    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                              "{% if add_generation_prompt %}<assistant>{% endif %}")
    ex = sftdata.row_to_example({"instruction": "Hi", "response": "Yo"}, 0)
    prompt, response, eos = sftdata.format_example(ex, chat_tok, sftdata.Template())
    assert prompt == "<user>Hi\n<assistant>" and response == "Yo\n" and eos
    # use_chat_template=false falls back to the plain templates.
    plain = sftdata.format_example(ex, chat_tok, sftdata.Template(use_chat_template=False))
    assert plain[0] == "User: Hi\n\nAssistant:"


def test_truncation_keeps_the_prompt_start_and_is_counted(tok):
    long_resp = {"prompt": "a", "completion": " ".join(["word"] * 50)}
    long_prompt = {"prompt": " ".join(["word"] * 50), "completion": "b"}
    short = {"prompt": "a", "completion": "b"}
    exs = [sftdata.row_to_example(r, i) for i, r in enumerate([long_resp, long_prompt, short])]
    rep = sftdata.tokenize_examples(exs, tok, sftdata.Template(), max_seq_length=16)
    assert rep.truncated == 1 and rep.dropped == 1 and len(rep.examples) == 2
    cut = rep.examples[0]
    assert len(cut.input_ids) == 16
    assert tok.decode(cut.input_ids).startswith("User: a\n\nAssistant: word")
    assert "1 rows truncated" in rep.message("f.jsonl", 16) and "1 rows dropped" in rep.message("f.jsonl", 16)


def test_collate_pads_right_and_masks_padding_labels(tok):
    exs = [sftdata.TokenizedExample([5, 6, 7], [-100, 6, 7], 1, False),
           sftdata.TokenizedExample([5, 6], [-100, 6], 1, False)]
    b = sftdata.collate(exs, pad_token_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [5, 6, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert b["labels"].tolist() == [[-100, 6, 7], [-100, 6, -100]]


# --------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------
def test_response_nll_hand_worked():
    # One row, L=3, V=2. Labels [-100, 1, 0]: position 0 predicts token 1, position 1 predicts 0;
    # position 2 predicts nothing (no next token).
    # Position 0 logits [0, 0]       -> log p(1) = log 1/2 = -0.6931
    # Position 1 logits [ln 3, 0]    -> p(0) = 3/4, log = -0.2877
    logits = torch.tensor([[[0.0, 0.0], [torch.log(torch.tensor(3.0)), 0.0], [5.0, -5.0]]])
    labels = torch.tensor([[-100, 1, 0]])
    out = response_nll(logits, labels)
    assert out.tokens == 2
    assert out.total.item() == pytest.approx(0.6931 + 0.2877, abs=1e-4)


def test_masked_prompt_tokens_contribute_nothing():
    # A crafted batch: labels -100 on the prompt (first 3 columns) and on padding.
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11, requires_grad=True)
    labels = torch.tensor([[-100, -100, -100, 4, 2, 9],
                           [-100, -100, -100, 1, -100, -100]])
    out = response_nll(logits, labels)
    out.total.backward()
    # Logits at positions 0 and 1 predict prompt tokens 1 and 2 (masked): no gradient.
    assert logits.grad[:, :2].abs().sum() == 0
    # Row 1 predicts only token 3 (from position 2); positions 3.. see padding labels.
    assert logits.grad[1, 3:].abs().sum() == 0
    # Changing the prompt targets (the labels we mask) or the prompt logits changes nothing.
    other = logits.detach().clone()
    other[:, :2] = torch.randn(2, 2, 11) * 10
    assert torch.allclose(response_nll(other, labels).total, out.total)
    # Loop reference: Σ over unmasked positions of −log softmax(logits[i-1])[label[i]].
    ref = 0.0
    for b in range(2):
        for i in range(1, 6):
            if labels[b, i] != -100:
                ref -= torch.log_softmax(logits[b, i - 1].detach(), -1)[labels[b, i]].item()
    assert out.total.item() == pytest.approx(ref, rel=1e-5)
    assert out.tokens == 4


def _model(tiny):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)


def test_model_loss_ignores_prompt_tokens_and_extra_padding(tiny, tok):
    model = _model(tiny).eval()
    ex = sftdata.tokenize_example("User: 2 + 3\n\nAssistant:", " 5", True, tok, 64)
    b = sftdata.collate([ex], tok.pad_token_id)
    base = response_nll(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
    # Extra right padding changes nothing.
    padded = sftdata.TokenizedExample(ex.input_ids, ex.labels, ex.prompt_len, False)
    longer = sftdata.collate([padded, sftdata.TokenizedExample([1] * (len(ex.input_ids) + 7),
                                                             [-100] * (len(ex.input_ids) + 7), 1, False)],
                             tok.pad_token_id)
    out = model(input_ids=longer["input_ids"][:1], attention_mask=longer["attention_mask"][:1]).logits
    assert torch.allclose(response_nll(out, longer["labels"][:1]).total, base.total, atol=1e-5)
    # With every label masked there is nothing to learn: loss 0, no tokens.
    none = response_nll(model(input_ids=b["input_ids"]).logits, torch.full_like(b["labels"], -100))
    assert none.tokens == 0 and none.total.item() == 0.0


def test_batch_nll_from_hidden_states_equals_the_logits_loss(tiny, tok):
    # The trainer's loss (decoder hidden states + the head's weight, chunked, prompt and
    # padding rows never reach the head) against today's: the model's (B, L, V) logits
    # into response_nll. Same sum, same gradients.
    from rlhflab.trainers.sft import batch_nll

    rows = [("User: 1 + 2\n\nAssistant:", " 3 and some more words"), ("User: 4 + 4\n\nAssistant:", " 8")]
    b = sftdata.collate([sftdata.tokenize_example(p, r, True, tok, 64) for p, r in rows], tok.pad_token_id)
    results = []
    for path in ("hidden", "logits"):
        model = _model(tiny)
        if path == "hidden":
            nll = batch_nll(model, b["input_ids"], b["attention_mask"], b["labels"])
        else:
            nll = response_nll(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
        nll.total.backward()
        results.append((nll, {n: p.grad for n, p in model.named_parameters()}))
    (hid, g_hid), (full, g_full) = results
    assert hid.tokens == full.tokens > 0
    torch.testing.assert_close(hid.total, full.total, rtol=1e-6, atol=1e-6)
    for name in g_full:  # the tied embedding/head weight included
        # float32 rounding of sums taken in another order (chunked rows; and on a CPU where
        # oneDNN computes the Linear layers, the head's weight gradient in the chunked op is
        # torch's addmm): within 1e-5 of the gradient's largest entry
        scale = g_full[name].abs().max().item()
        torch.testing.assert_close(g_hid[name], g_full[name], rtol=1e-5, atol=1e-5 * scale)


def test_gradient_accumulation_1x2_equals_2x1(tiny, tok):
    rows = [("User: 1 + 2\n\nAssistant:", " 3 and some more words"), ("User: 4 + 4\n\nAssistant:", " 8")]
    exs = [sftdata.tokenize_example(p, r, True, tok, 64) for p, r in rows]
    grads = []
    for group in ([sftdata.collate(exs, tok.pad_token_id)],
                  [sftdata.collate([e], tok.pad_token_id) for e in exs]):
        model = _model(tiny)
        nll = accumulate_group(model, group, torch.device("cpu"))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        assert nll.tokens == sum(sum(1 for x in e.labels if x != -100) for e in exs)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sft.yaml", "sft_debug.yaml"])
def test_shipped_configs_validate(name):
    from rlhflab.config import load_config
    cfg, _ = load_config(CONFIGS / name, SFTRunConfig)
    assert "{prompt}" in cfg.data.prompt_template


def test_config_errors_name_the_key():
    from rlhflab.config import load_config
    from rlhflab.errors import ConfigError
    with pytest.raises(ConfigError, match=r"sft.learnig_rate: unknown key; did you mean sft.learning_rate"):
        load_config(None, SFTRunConfig, ["sft.learnig_rate=1"])
    with pytest.raises(ConfigError, match=r"data.response_template: must contain \{response\}"):
        load_config(None, SFTRunConfig, ["data.response_template=x"])


# --------------------------------------------------------------------------------------
# Tiny-model runs
# --------------------------------------------------------------------------------------
def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_generation_metrics_judge_plain_numbers_by_the_eval_rule(tok, monkeypatch):
    """SFT's held-out accuracy is `rlhflab eval`'s numeric rule: a plain-number reference is
    met by the response's last number (or its #### N), a #### N reference only by #### N."""
    from types import SimpleNamespace

    import rlhflab.rollout
    from rlhflab.trainers.sft import generation_metrics

    def answers(responses):  # the greedy responses, fixed: what is judged is the judging
        def generate(model, tokenizer, prompts, **kwargs):
            assert len(prompts) == len(responses)
            return SimpleNamespace(responses=list(responses))  # the one field generation_metrics reads
        return generate

    plain = [sftdata.row_to_example({"question": q, "answer": a}, i)
             for i, (q, a) in enumerate([("2 + 3?", "5"), ("4 + 4?", "8"), ("1 + 1?", "2")])]
    monkeypatch.setattr(rlhflab.rollout, "generate", answers(["2 + 3 = 5", "4 + 4 = 9", "#### 2"]))
    metrics, samples = generation_metrics(None, tok, plain, sftdata.Template(), 8, 4)
    # 5 (last number) right, 9 wrong, "#### 2" right: 2 of 3; no response equals its reference.
    assert [s["correct"] for s in samples] == [True, False, True]
    assert metrics["eval/accuracy"] == pytest.approx(2 / 3) and metrics["eval/exact_match"] == 0.0

    hashed = [sftdata.row_to_example({"question": "3 + 4?", "answer": "3 + 4 = 7\n#### 7"}, 0),
              sftdata.row_to_example({"question": "1 + 2?", "answer": "1 + 2 = 3\n#### 3"}, 1)]
    monkeypatch.setattr(rlhflab.rollout, "generate", answers(["3 + 4 = 7", "1 + 2 = 3\n#### 3"]))
    metrics, samples = generation_metrics(None, tok, hashed, sftdata.Template(), 8, 4)
    # GSM8K references: "3 + 4 = 7" has no #### 7 (its last number does not count); 1 of 2.
    assert [s["correct"] for s in samples] == [False, True] and metrics["eval/accuracy"] == 0.5

    prose = [sftdata.row_to_example({"question": "Name a fruit", "answer": "Apple"}, 0)]
    monkeypatch.setattr(rlhflab.rollout, "generate", answers(["Apple"]))
    metrics, samples = generation_metrics(None, tok, prose, sftdata.Template(), 8, 4)
    assert "eval/accuracy" not in metrics and "correct" not in samples[0] and metrics["eval/exact_match"] == 1.0


def _config(tiny, data: Path, out: Path, *extra: str) -> SFTRunConfig:
    from rlhflab.config import load_config
    cfg, _ = load_config(CONFIGS / "sft_debug.yaml", SFTRunConfig, [
        f"model.name_or_path={tiny}", f"data.path={data}", "data.eval_path=null", "data.eval_fraction=0.1",
        f"training.output_dir={out}", "training.num_threads=1", "logging.progress_bar=false",
        *extra])
    return cfg


@pytest.mark.slow
def test_sft_lowers_heldout_loss_and_raises_exact_match(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhflab.data import arith
    from rlhflab.trainers.sft import train_sft

    # Clean demonstrations (wrong_rate=0): the held-out references are the true answers.
    rows = arith.noisy_demonstrations(arith.make_split(600, seed=3), wrong_rate=0.0, seed=0)
    data = _write(tmp_path / "demo.jsonl", rows)
    cfg = _config(tiny, data, tmp_path / "run", "sft.epochs=10", "sft.batch_size=8", "sft.learning_rate=2e-3",
                  "sft.num_eval_generate=60", "logging.plots=true")
    res = train_sft(cfg, quiet=True)
    before, after = res.eval_before, res.eval_after
    assert after["eval/loss"] < 0.5 * before["eval/loss"]
    # Measured (2 cores, about 25 s): loss 5.8 -> 0.10, exact match 0.00 -> 0.68.
    assert before["eval/exact_match"] == 0.0 and after["eval/exact_match"] >= 0.3
    assert after["eval/rougeL"] > before["eval/rougeL"] + 0.3
    # A plain HF folder, loadable without rlhflab; metrics, plots and samples written.
    AutoModelForCausalLM.from_pretrained(str(res.final_dir))
    assert (res.output_dir / "metrics.jsonl").is_file() and (res.output_dir / "plots" / "loss.png").is_file()
    assert (res.output_dir / "effective_config.yaml").is_file()
    assert (res.output_dir / "eval" / f"step_{res.steps}.jsonl").is_file()


@pytest.mark.slow
def test_lora_sft_saves_adapter_and_a_merged_model(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhflab.data import arith
    from rlhflab.trainers.sft import train_sft

    rows = arith.noisy_demonstrations(arith.make_split(64, seed=4), wrong_rate=0.0, seed=0)
    data = _write(tmp_path / "demo.jsonl", rows)
    cfg = _config(tiny, data, tmp_path / "run", "lora.enabled=true", "lora.r=4", "sft.max_steps=3",
                  "sft.learning_rate=1e-2", "sft.eval_before=false", "sft.num_eval_generate=0",
                  "logging.plots=false")
    res = train_sft(cfg, quiet=True)
    assert (res.adapter_dir / "adapter_config.json").is_file()
    assert json.loads((res.adapter_dir / "adapter_config.json").read_text())["target_modules"] in (
        ["q_proj", "v_proj"], ["v_proj", "q_proj"])
    merged = AutoModelForCausalLM.from_pretrained(str(res.final_dir)).eval()
    base = AutoModelForCausalLM.from_pretrained(str(tiny)).eval()
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny)),
                                             str(res.adapter_dir)).eval()
    ids = torch.tensor([[5, 17, 33, 40, 2]])
    with torch.no_grad():
        m, a, b = merged(ids).logits, with_adapter(ids).logits, base(ids).logits
    assert torch.allclose(m, a, atol=1e-4)       # merged == base + adapter
    assert not torch.allclose(m, b, atol=1e-4)   # and the adapter learned something


@pytest.mark.slow
def test_sft_cli_runs_and_reports_bad_input(tiny, tmp_path, capsys):
    from rlhflab.cli import main

    rows = [{"instruction": f"Say {i}", "response": f"{i}"} for i in range(20)]
    data = _write(tmp_path / "dolly.jsonl", rows)
    common = [f"model.name_or_path={tiny}", f"training.output_dir={tmp_path / 'run'}",
              "data.eval_path=null", "sft.max_steps=2", "sft.num_eval_generate=4",
              "logging.progress_bar=false", "logging.plots=false", "training.num_threads=1"]
    assert main(["sft", "--config", str(CONFIGS / "sft_debug.yaml"), f"data.path={data}", *common]) == 0
    assert "eval/loss" in capsys.readouterr().out
    bad = _write(tmp_path / "bad.jsonl", [{"text": "x"}] * 3)
    assert main(["sft", "--config", str(CONFIGS / "sft_debug.yaml"), f"data.path={bad}", *common,
                 f"training.output_dir={tmp_path / 'run2'}"]) == 2
    assert "3 of 3 rows fit no SFT layout" in capsys.readouterr().err


def test_csv_and_parquet_files_and_a_hub_name(tmp_path, tok, monkeypatch):
    import csv

    from rlhflab.trainers import sft as sft_trainer
    from rlhflab.trainers.sft import SFTDataConfig, load_sft_data

    rows = [{"instruction": f"Say {i}", "context": "", "response": str(i)} for i in range(10)]
    with (tmp_path / "d.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["instruction", "context", "response"])
        writer.writeheader()
        writer.writerows(rows)
    import datasets
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    for name in ("d.csv", "d.parquet"):
        data = load_sft_data(SFTDataConfig(path=str(tmp_path / name), eval_fraction=0.2), tok, warn=lambda m: None)
        assert len(data.train) == 8 and len(data.eval) == 2
    # A hub name goes to `datasets` with its split and subset (faked here: no hub in tests).
    calls = []

    def fake_read_rows(source, split="train", subset=None):
        calls.append((source, split, subset))
        return rows
    monkeypatch.setattr(sft_trainer, "read_rows", fake_read_rows)
    load_sft_data(SFTDataConfig(path=None, name="databricks/databricks-dolly-15k", eval_split="test",
                                subset="x"), tok, warn=lambda m: None)
    assert calls == [("databricks/databricks-dolly-15k", "train", "x"), ("databricks/databricks-dolly-15k", "test", "x")]
