"""Reward model: preference rows, the pairwise loss, scores read at the last real token,
saving/loading as a reward source, and a tiny-model run on learnable pairs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlhflab.data import preferences as prefdata
from rlhflab.errors import UserError
from rlhflab.trainers.rm import RMRunConfig, pairwise_loss

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(scope="module")
def tiny(tiny_sft_rm_dir) -> Path:
    return tiny_sft_rm_dir


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------
def test_label_app_export_rows_read_as_they_are():
    # Exactly what `rlhflab label export` writes (rlhflab/label/export.py), a tie included.
    rows = [{"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5", "margin": 1.0, "pair_id": 7, "n_labels": 3},
            {"prompt": "Q: 1+1?\nA:", "chosen": " 2", "rejected": " two", "margin": 0.5, "pair_id": "x", "n_labels": 1},
            {"prompt": "Q: 3+0?\nA:", "chosen": " 3", "rejected": " three", "margin": 0.0, "pair_id": 9,
             "n_labels": 2, "tie": True}]
    rep = prefdata.parse_pairs(rows, "export.jsonl", warn=lambda m: None)
    assert [p.margin for p in rep.pairs] == [1.0, 0.5, 0.0]
    assert [p.tie for p in rep.pairs] == [False, False, True] and rep.ties == 1
    assert rep.pairs[0].pair_id == 7 and prefdata.pair_texts(rep.pairs[0]) == ("Q: 2+2?\nA:", " 4", " 5")


def test_strength_is_read_as_margin():
    pair = prefdata.row_to_pair({"prompt": "p", "chosen": "a", "rejected": "b", "strength": 2.0}, 0)
    assert pair.margin == 2.0 and not pair.tie


def test_conversational_rows_share_the_prompt_turns(tiny):
    from rlhflab.models.load import load_tokenizer

    tok = load_tokenizer(str(tiny))  # no chat template: the plain User/Assistant layout
    user = {"role": "user", "content": "Hi there"}
    row = {"chosen": [user, {"role": "assistant", "content": "Hello!"}],
           "rejected": [user, {"role": "assistant", "content": "Go away"}]}
    pair = prefdata.row_to_pair(row, 0)
    assert pair.prompt == [user] and pair.chosen == [{"role": "assistant", "content": "Hello!"}]
    assert prefdata.pair_texts(pair, tok) == ("User: Hi there\n\nAssistant:", " Hello!", " Go away")
    # An explicit prompt (TRL's explicit-prompt form) with completions only.
    explicit = prefdata.row_to_pair({"prompt": [user], "chosen": row["chosen"][1:], "rejected": row["rejected"][1:]}, 1)
    assert prefdata.pair_texts(explicit, tok) == prefdata.pair_texts(pair, tok)


def test_bad_rows_are_reported_and_a_mostly_bad_file_stops():
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    seen: list[str] = []
    rep = prefdata.parse_pairs([good, good, {"prompt": "p", "chosen": "a"}, {"prompt": "p", "chosen": "a", "rejected": "a"}],
                               "f.jsonl", warn=seen.append)
    assert len(rep.pairs) == 2 and rep.bad == 1 and rep.identical == 1
    assert any("row 2 lacks chosen/rejected (it has ['chosen', 'prompt'])" in s for s in seen)
    with pytest.raises(UserError, match=r"f.jsonl: 2 of 3 rows are not preference pairs \(row 0 has string "
                                        r"chosen/rejected, no prompt, and no shared leading text"):
        prefdata.parse_pairs([{"chosen": "a", "rejected": "b"}] * 2 + [good], "f.jsonl", warn=lambda m: None)
    with pytest.raises(UserError, match="non-numeric margin"):
        prefdata.parse_pairs([{**good, "margin": "much"}], "f.jsonl", warn=lambda m: None)


def test_arith_pairs_prefer_the_correct_answer():
    from rlhflab.data import arith
    from rlhflab.rewards.gsm8k import is_correct

    problems = arith.make_split(50, seed=1)
    rows = prefdata.arith_pairs(problems, seed=0)
    assert set(rows[0]) == {"prompt", "chosen", "rejected", "margin", "pair_id", "n_labels"}
    for row, prob in zip(rows, problems):
        assert row["prompt"] == prob["question"]  # raw: the run applies the template (data_formats.md)
        assert is_correct(row["chosen"], prob["answer"]) and row["chosen"].startswith(" ")
        assert not is_correct(row["rejected"], prob["answer"])
    # No "smaller is better" shortcut: wrong results above and below the right one, about equally.
    def final(text: str) -> int:
        return int(text.split("####")[1])
    rows = prefdata.arith_pairs(arith.make_split(400, seed=2), seed=1)
    above = sum(final(r["rejected"]) > final(r["chosen"]) for r in rows) / len(rows)
    assert 0.4 < above < 0.6


# --------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------
def test_pairwise_loss_hand_worked():
    from rlhflab import ops

    c, r = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])
    # Pair 1: −log σ(1) = log(1 + e^-1) = 0.3133; pair 2: −log σ(0) = log 2 = 0.6931. Mean 0.5032.
    out = pairwise_loss(c, r)
    assert out.loss.item() == pytest.approx((0.3133 + 0.6931) / 2, abs=1e-4)
    assert out.accuracy.item() == 0.5
    assert torch.allclose(out.loss, ops.reward_model_loss(c, r).loss)
    # Margin 0.5 on pair 1: −log σ(0.5) = 0.4741.
    m = pairwise_loss(c, r, margin=torch.tensor([0.5, 0.0]))
    assert m.loss.item() == pytest.approx((0.4741 + 0.6931) / 2, abs=1e-4)
    # Pair 2 a tie: −½[log σ(0) + log σ(0)] = log 2 as well; a tie with d = 1 costs
    # −½[log σ(1) + log σ(−1)] = ½(0.3133 + 1.3133) = 0.8133 — ties pull scores together.
    t = pairwise_loss(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]), tie=torch.tensor([False, True]))
    assert t.loss.item() == pytest.approx((0.3133 + 0.8133) / 2, abs=1e-4)
    assert t.accuracy.item() == 1.0  # accuracy over preferred pairs only
    # Centering: + 0.1 · mean((1+0)², (1+0)²) = 0.1.
    ce = pairwise_loss(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]), center_coeff=0.1)
    assert ce.loss.item() == pytest.approx(0.3133 + 0.1, abs=1e-4)


def test_pairwise_loss_matches_a_loop():
    torch.manual_seed(0)
    c, r = torch.randn(9), torch.randn(9)
    margin, tie = torch.rand(9), torch.tensor([i % 3 == 0 for i in range(9)])
    out = pairwise_loss(c, r, margin, tie)
    total = 0.0
    for i in range(9):
        d = float(c[i] - r[i])
        if tie[i]:
            total += -0.5 * (math.log(1 / (1 + math.exp(-d))) + math.log(1 / (1 + math.exp(d))))
        else:
            total += -math.log(1 / (1 + math.exp(-(d - float(margin[i])))))
    assert out.loss.item() == pytest.approx(total / 9, rel=1e-5)


# --------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def seqcls(tiny):
    from transformers import AutoModelForSequenceClassification

    from rlhflab.models.load import load_tokenizer
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny), num_labels=1).eval()
    torch.nn.init.normal_(model.score.weight, std=0.5)
    return model, load_tokenizer(str(tiny), padding_side="right")


def test_score_is_read_at_the_last_real_token_any_padding_side(seqcls):
    from rlhflab.rewards.model import sequence_scores

    model, tok = seqcls
    texts = ["Question: 1 + 2?\nAnswer: 3", "Hi"]
    scores = {}
    for side in ("right", "left"):
        tok.padding_side = side
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            scores[side] = sequence_scores(model, enc["input_ids"], enc["attention_mask"])
    alone = []
    for t in texts:
        enc = tok([t], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            alone.append(sequence_scores(model, enc["input_ids"], enc["attention_mask"]))
    assert scores["right"].shape == (2,) and scores["right"].dtype == torch.float32
    assert torch.allclose(scores["right"], scores["left"], atol=1e-5)
    assert torch.allclose(scores["right"], torch.cat(alone), atol=1e-5)
    # The pad token's id does not matter (it is never read): a pad = EOS tokenizer is fine.
    tok.padding_side = "right"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids = enc["input_ids"].clone()
    ids[enc["attention_mask"] == 0] = tok.eos_token_id
    with torch.no_grad():
        assert torch.allclose(sequence_scores(model, ids, enc["attention_mask"]), scores["right"], atol=1e-5)


def test_encode_appends_eos_and_cuts_from_the_left(seqcls):
    from rlhflab.rewards.model import RMMeta, encode

    _, tok = seqcls
    b = encode(tok, ["one two three four five six seven", "x"], RMMeta(append_eos=True, max_length=4))
    assert b["input_ids"].shape == (2, 4)
    first = b["input_ids"][0].tolist()
    full = tok("one two three four five six seven", add_special_tokens=False)["input_ids"]
    assert first == full[-3:] + [tok.eos_token_id]  # the end kept, EOS last
    assert b["attention_mask"][1].tolist() == [1, 1, 0, 0]  # "x" + EOS, right-padded


def test_a_fresh_head_is_initialised_and_a_trained_one_kept(seqcls, tiny, tmp_path):
    from rlhflab.config import load_config
    from rlhflab.trainers.rm import build_reward_model

    torch.manual_seed(0)
    fresh, _ = build_reward_model(load_config(None, RMRunConfig, [f"model.name_or_path={tiny}"])[0],
                                  torch.device("cpu"))
    hidden = fresh.score.weight.shape[-1]
    # N(0, 1/(H+1)): H = 64 gives std 0.124; 64 weights estimate it within about 20%.
    assert abs(fresh.score.weight.std().item() - (hidden + 1) ** -0.5) < 0.03
    model, tok = seqcls
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    kept, _ = build_reward_model(load_config(None, RMRunConfig, [f"model.name_or_path={tmp_path / 'rm'}"])[0],
                                 torch.device("cpu"))
    assert torch.equal(kept.score.weight, model.score.weight)  # continuing from a reward model


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["rm.yaml", "rm_debug.yaml"])
def test_shipped_configs_validate(name):
    from rlhflab.config import load_config
    cfg, _ = load_config(CONFIGS / name, RMRunConfig)
    assert cfg.rm.head_init_std is None or cfg.rm.head_init_std > 0


# --------------------------------------------------------------------------------------
# Tiny-model runs
# --------------------------------------------------------------------------------------
def _rm_config(tiny, train: Path, test: Path, out: Path, *extra: str) -> RMRunConfig:
    from rlhflab.config import load_config
    cfg, _ = load_config(CONFIGS / "rm_debug.yaml", RMRunConfig, [
        f"model.name_or_path={tiny}", f"data.path={train}", f"data.eval_path={test}",
        f"training.output_dir={out}", "training.num_threads=1", "logging.progress_bar=false", *extra])
    return cfg


@pytest.fixture(scope="module")
def prefs(tmp_path_factory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("prefs")
    paths = prefdata.write_arith_pairs(out, n_train=200, n_test=50, seed=5)
    return paths["train"], paths["test"]


@pytest.mark.slow
def test_lora_reward_model_saves_adapter_and_merged_scores_match(tiny, prefs, tmp_path):
    from rlhflab.rewards.model import load_reward_model, score_texts
    from rlhflab.trainers.rm import build_reward_model, train_rm

    cfg = _rm_config(tiny, *prefs, tmp_path / "rm", "lora.enabled=true", "lora.r=4", "rm.max_steps=4",
                     "rm.learning_rate=1e-2", "rm.eval_before=false", "data.num_eval_samples=16",
                     "logging.plots=false")
    res = train_rm(cfg, quiet=True)
    assert (res.adapter_dir / "adapter_config.json").is_file()
    model, tok, meta = load_reward_model(str(res.final_dir))
    texts = ["Question: 1 + 1?\nAnswer: 1 + 1 = 2\n#### 2", "Question: 2 + 2?\nAnswer: 2 + 2 = 5\n#### 5"]
    merged = score_texts(model, tok, texts, meta)
    # The adapter on a fresh base (with the saved head) gives the same scores as the merged model.
    from peft import PeftModel
    base, _ = build_reward_model(cfg.__class__(model=cfg.model, data=cfg.data, rm=cfg.rm), torch.device("cpu"))
    with_adapter = PeftModel.from_pretrained(base, str(res.adapter_dir)).eval()
    assert torch.allclose(score_texts(with_adapter, tok, texts, meta), merged, atol=1e-4)
    assert res.eval_after["eval/accuracy"] == res.eval_after["eval/accuracy"]  # finite


@pytest.mark.slow
def test_rm_cli_runs_and_reports_bad_input(tiny, prefs, tmp_path, capsys):
    from rlhflab.cli import main

    common = [f"model.name_or_path={tiny}", f"data.eval_path={prefs[1]}", "rm.max_steps=2",
              "data.num_eval_samples=8", "logging.progress_bar=false", "logging.plots=false",
              "training.num_threads=1"]
    assert main(["rm", "--config", str(CONFIGS / "rm_debug.yaml"), f"data.path={prefs[0]}",
                 f"training.output_dir={tmp_path / 'a'}", *common]) == 0
    assert "eval/accuracy" in capsys.readouterr().out
    bad = _write(tmp_path / "bad.jsonl", [{"question": "q", "answer": "a"}] * 3)
    assert main(["rm", "--config", str(CONFIGS / "rm_debug.yaml"), f"data.path={bad}",
                 f"training.output_dir={tmp_path / 'b'}", *common]) == 2
    assert "3 of 3 rows are not preference pairs" in capsys.readouterr().err


def test_policy_pairs_label_the_policys_own_samples(tiny):
    from transformers import AutoModelForCausalLM

    from rlhflab.data import arith
    from rlhflab.label.make_prefs import policy_pairs
    from rlhflab.models.load import load_tokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(str(tiny)).eval(), load_tokenizer(str(tiny))
    rows = arith.make_split(6, seed=0)
    # A stand-in labeller: longer is better. Every pair's chosen outscores its rejected.
    pairs = policy_pairs(model, tok, rows, n=3, max_new_tokens=6, labeller=lambda r, row: len(r))
    assert pairs and all(len(p["chosen"]) > len(p["rejected"]) for p in pairs)
    assert set(pairs[0]) == {"prompt", "chosen", "rejected", "margin", "pair_id", "n_labels"}
    assert all(p["prompt"] == rows[p["pair_id"]]["question"] for p in pairs)  # raw prompts in the file
    # The default labeller is the GSM8K checker: an untrained model is never right, so no pairs.
    assert policy_pairs(model, tok, rows, n=2, max_new_tokens=4) == []
