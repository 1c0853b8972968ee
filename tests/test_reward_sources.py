"""Reward sources for PPO: classifier probabilities, reward models with their own
tokenizer, normalisation on reference samples, weighted sums, config checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhflab.config.schema import RewardConfig, RewardSource
from rlhflab.errors import ConfigError, UserError
from rlhflab.rewards import build_reward, build_source


def _tokenizer(model_dir: Path):
    """The tiny tokenizer (the session's `tiny_sft_rm_dir`, shared with test_sft/test_rm)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


def _seqcls(tok, out: Path, num_labels: int, id2label: dict | None, seed: int = 0) -> Path:
    """A tiny LlamaForSequenceClassification saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, num_labels=num_labels,
                      **({"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}} if id2label else {}))
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(cfg)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # visible differences between texts
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok(tiny_sft_rm_dir):
    return _tokenizer(tiny_sft_rm_dir)


@pytest.fixture(scope="module")
def sentiment(tok, tmp_path_factory) -> Path:
    return _seqcls(tok, tmp_path_factory.mktemp("sentiment"), 2, {0: "NEGATIVE", 1: "POSITIVE"})


PROMPTS = ["This movie was", "The film is", "I think it"]
RESPONSES = [" great, I love it", " terrible", " a good film"]


def test_classifier_returns_the_named_labels_probability(sentiment):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    scorer = build_source(RewardSource(type="classifier", path=str(sentiment), label="POSITIVE"))
    got = scorer.score(PROMPTS, RESPONSES, [{}] * 3)
    assert got.shape == (3,) and got.dtype == torch.float32 and got.device.type == "cpu"
    # The reference: the model's own forward, one text at a time (no padding), softmax, column 1.
    model = AutoModelForSequenceClassification.from_pretrained(str(sentiment)).eval()
    t = AutoTokenizer.from_pretrained(str(sentiment))
    with torch.no_grad():
        want = torch.stack([torch.softmax(model(**t(p + r, return_tensors="pt")).logits[0], -1)[1]
                            for p, r in zip(PROMPTS, RESPONSES)])
    assert torch.allclose(got, want, atol=1e-5)
    assert len(set(got.tolist())) == 3  # the texts are told apart
    # NEGATIVE is the complement; the label name is matched case-insensitively.
    neg = build_source(RewardSource(type="classifier", path=str(sentiment), label="negative"))
    assert torch.allclose(neg.score(PROMPTS, RESPONSES, [{}] * 3), 1 - got, atol=1e-5)


def test_classifier_can_read_the_response_alone(sentiment):
    both = build_source(RewardSource(type="classifier", path=str(sentiment), label="POSITIVE"))
    alone = build_source(RewardSource(type="classifier", path=str(sentiment), label="POSITIVE", text="response"))
    assert torch.allclose(alone.score(PROMPTS, RESPONSES, [{}] * 3), both.score([""] * 3, RESPONSES, [{}] * 3))


def test_unknown_or_missing_label_lists_the_labels(sentiment):
    with pytest.raises(UserError, match=r"no label 'HAPPY'; its labels are \['NEGATIVE', 'POSITIVE'\]"):
        build_source(RewardSource(type="classifier", path=str(sentiment), label="HAPPY"))
    with pytest.raises(UserError, match=r"set label .* its labels are \['NEGATIVE', 'POSITIVE'\]"):
        build_source(RewardSource(type="classifier", path=str(sentiment)))


def test_missing_model_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="nope"):
        build_source(RewardSource(type="classifier", path=str(tmp_path / "nope"), label="POSITIVE"))
    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPORunConfig
    with pytest.raises(ConfigError, match=r"reward.sources\[0\].path: a model source needs path"):
        load_config(None, PPORunConfig, ["reward.sources=[{type: model}]"])


def test_weighted_sum_of_rule_and_classifier(sentiment):
    src = [RewardSource(type="rule", name="gsm8k", weight=2.0),
           RewardSource(type="classifier", path=str(sentiment), label="POSITIVE", weight=0.5)]
    scorer = build_reward(RewardConfig(sources=src))
    examples = [{"answer": "#### 4"}, {"answer": "#### 4"}, {"answer": "#### 4"}]
    responses = [" #### 4", " #### 5", " no answer"]
    probs = build_source(src[1]).score(PROMPTS, responses, examples)
    # gsm8k: 1.0 right, 0.1 formatted but wrong, 0.0 missing.
    want = 2.0 * torch.tensor([1.0, 0.1, 0.0]) + 0.5 * probs
    assert torch.allclose(scorer.score(PROMPTS, responses, examples), want, atol=1e-6)


def test_classifier_normalisation_on_reference_samples(sentiment, tmp_path):
    ref = tmp_path / "ref.jsonl"
    ref.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in zip(PROMPTS, RESPONSES)))
    scorer = build_source(RewardSource(type="classifier", path=str(sentiment), label="POSITIVE",
                                       normalize=True, reference_path=str(ref)))
    out = scorer.score(PROMPTS, RESPONSES, [{}] * 3)
    assert out.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert out.std().item() == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(UserError, match="normalize needs reference_path"):
        build_source(RewardSource(type="classifier", path=str(sentiment), label="POSITIVE", normalize=True))


@pytest.fixture(scope="module")
def other_tokenizer_rm(tok, tmp_path_factory) -> Path:
    """A one-output reward model whose tokenizer differs from the policy's (vocab 300)."""
    from rlhflab.models.tiny import build_tokenizer
    other = build_tokenizer(vocab_size=300, seed=1)
    assert len(other) != len(tok)
    return _seqcls(other, tmp_path_factory.mktemp("rm_other_tok"), 1, None, seed=1)


def test_reward_model_with_its_own_tokenizer_reads_decoded_text(tok, other_tokenizer_rm):
    from rlhflab.rewards.model import RMMeta, load_reward_model, sequence_scores

    # The policy's tokens -> text (what PPO hands over) -> the reward model's tokens.
    policy_ids = tok(RESPONSES, add_special_tokens=False)["input_ids"]
    responses = tok.batch_decode(policy_ids, skip_special_tokens=True)
    scorer = build_source(RewardSource(type="model", path=str(other_tokenizer_rm), batch_size=2))
    got = scorer.score(PROMPTS, responses, [{}] * 3)
    model, rm_tok, meta = load_reward_model(str(other_tokenizer_rm))
    assert meta == RMMeta(append_eos=False, add_special_tokens=True)  # not made by rlhflab: HF conventions
    with torch.no_grad():
        want = torch.cat([sequence_scores(model, **rm_tok([p + r], return_tensors="pt"))
                          for p, r in zip(PROMPTS, responses)])
    assert torch.allclose(got, want, atol=1e-5)


def test_reward_model_normalisation_from_a_reference_file(other_tokenizer_rm, tmp_path):
    ref = tmp_path / "ref.jsonl"
    ref.write_text("".join(json.dumps({"prompt": p, "chosen": r, "rejected": r + "!"}) + "\n"
                           for p, r in zip(PROMPTS, RESPONSES)))  # preference rows: both sides count
    scorer = build_source(RewardSource(type="model", path=str(other_tokenizer_rm), normalize=True,
                                       reference_path=str(ref)))
    prompts, responses = PROMPTS * 2, RESPONSES + [r + "!" for r in RESPONSES]
    out = scorer.score(prompts, responses, [{}] * 6)
    assert out.mean().item() == pytest.approx(0.0, abs=1e-5) and out.std().item() == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(UserError, match="normalize needs reference samples"):
        build_source(RewardSource(type="model", path=str(other_tokenizer_rm), normalize=True))


def test_reference_rows_are_shown_through_the_runs_template(tok, tmp_path):
    """Files hold raw prompts, the run applies the template: a reference row's prompt goes
    through dataset.prompt_template, then the chat template, as the run's prompts do."""
    import copy

    from rlhflab.data.prompts import PromptFormat
    from rlhflab.rewards.model import reference_texts

    ref = tmp_path / "ref.jsonl"
    ref.write_text(json.dumps({"prompt": "2 + 3", "response": " 5"}) + "\n"
                   + json.dumps({"prompt": "1 + 1", "chosen": " 2", "rejected": " 3"}) + "\n")
    plain = PromptFormat("Q: {prompt}\nA:", use_chat=False)
    assert reference_texts(str(ref), "prompt_response", plain, tok) == [
        "Q: 2 + 3\nA: 5", "Q: 1 + 1\nA: 2", "Q: 1 + 1\nA: 3"]
    assert reference_texts(str(ref), "response", plain, tok) == [" 5", " 2", " 3"]  # text: response reads no prompt
    assert reference_texts(str(ref)) == ["2 + 3 5", "1 + 1 2", "1 + 1 3"]  # no format: as the file has them
    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                              "{% if add_generation_prompt %}<assistant>{% endif %}")
    chat = PromptFormat("Q: {prompt}", use_chat=True)
    assert reference_texts(str(ref), "prompt_response", chat, chat_tok)[0] == "<user>Q: 2 + 3\n<assistant> 5"
    # A prompt the template was already applied to would get it twice: refused, naming the row.
    ref.write_text(json.dumps({"prompt": "Q: 2 + 3\nA:", "response": " 5"}) + "\n"
                   + json.dumps({"prompt": "Q: 1 + 1\nA:", "response": " 2"}) + "\n")
    with pytest.raises(UserError, match=r"ref.jsonl: row 0 field 'prompt' already begins with the prompt template"):
        reference_texts(str(ref), "prompt_response", plain, tok)


def test_normalisation_is_measured_on_the_texts_the_run_scores(other_tokenizer_rm, tok, tmp_path):
    from rlhflab.data.prompts import PromptFormat

    ref = tmp_path / "ref.jsonl"
    ref.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in zip(PROMPTS, RESPONSES)))
    fmt = PromptFormat("Review: {prompt}", use_chat=False)
    source = RewardSource(type="model", path=str(other_tokenizer_rm), normalize=True, reference_path=str(ref))
    scorer = build_reward(RewardConfig(sources=[source]), "cpu", fmt, tok)
    # The run hands the scorer its rendered prompts: on the reference rows, so shown, mean 0 and
    # std 1 (float32 sums of 3 scores: 1e-5).
    out = scorer.score([fmt.render(p, tok) for p in PROMPTS], RESPONSES, [{}] * 3)
    assert out.mean().item() == pytest.approx(0.0, abs=1e-5) and out.std().item() == pytest.approx(1.0, abs=1e-4)
    # Calibrated on the raw prompts (what it did before) the shift is another one: measured
    # 3.17 raw against 3.30 templated (scale about 6), far above float rounding (1e-6).
    raw = build_source(source)
    assert abs(raw.shift - scorer.shift) > 0.01


def test_a_classifier_is_not_a_reward_model(sentiment):
    with pytest.raises(UserError, match="has 2 outputs, not 1; for a classifier use type: classifier"):
        build_source(RewardSource(type="model", path=str(sentiment)))
