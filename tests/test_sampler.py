"""The one sampler for a model folder (`rlhflab.rollout.sampler`): `rlhflab eval` prints
what the training loop's held-out evaluation logs on the same model, rows and settings,
and `eval`, `generate` and `label generate` follow the trainers' `use_chat_template` rule
(auto: a tokenizer with a chat template is asked as a chat model; false: the raw
template), each saying which template it used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sampler_helpers import assert_same_evaluation, rows_of, trainer_and_cli_eval

from rlhflab.cli import main
from rlhflab.models.tiny import make_tiny_model
from rlhflab.rollout import sampler as sampler_mod

TEMPLATE = "Q: {prompt}"
# The ChatML rendering of "Q: 2 + 2?" with the generation prompt (tests/test_chat_templates.py).
CHAT = "<|im_start|>user\nQ: {q}<|im_end|>\n<|im_start|>assistant\n"

# Plug-ins with a real mix of values on an untrained model's text, so equal metrics mean something.
PLUGINS = """
def vowels(prompt, response, example):
    return float(sum(c in "aeiou" for c in response))

def even(prompt, response, example):
    return sum(map(ord, prompt + response)) % 2 == 0
"""


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    """A tiny ChatML model whose weights got noise (std 0.3) on top of the small initial
    ones, so greedy answers differ from prompt to prompt instead of one repeated token."""
    import torch
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp("sampler-chat"), hidden_size=64, num_layers=2, num_heads=2,
                           chat_template="chatml")
    model = AutoModelForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture
def questions(tmp_path) -> Path:
    path = tmp_path / "rows.jsonl"
    rows = [{"question": f"{a} + {b}?", "answer": str(a + b)} for a, b in ((2, 2), (3, 5), (7, 1), (4, 4), (6, 2))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def spy_sample(monkeypatch) -> list[list[str]]:
    """The rendered prompts every `Sampler.sample` call receives."""
    seen, real = [], sampler_mod.Sampler.sample

    def sample(self, prompts, *args, **kwargs):
        seen.append(list(prompts))
        return real(self, prompts, *args, **kwargs)

    monkeypatch.setattr(sampler_mod.Sampler, "sample", sample)
    return seen


# --------------------------------------------------------------------------------------
# rlhflab eval == the training loop's evaluation
# --------------------------------------------------------------------------------------
def test_eval_prints_what_the_trainer_logs_on_a_chat_model(chat_dir, questions, tmp_path, monkeypatch, capsys):
    (tmp_path / "sampler_checks.py").write_text(PLUGINS)
    monkeypatch.chdir(tmp_path)
    # 5 rows in batches of 2 (2 + 2 + 1), prompts cut at 64 tokens, 12 new tokens: the
    # loop's training.eval_batch_size, dataset.max_prompt_length, generation.max_new_tokens.
    both = trainer_and_cli_eval(chat_dir, questions, tmp_path, template=TEMPLATE, rows=5, max_new_tokens=12,
                                max_prompt_length=64, batch_size=2, capsys=capsys,
                                reward="sampler_checks.py:vowels", correct="sampler_checks.py:even")
    assert_same_evaluation(both)
    # Both asked the model as a chat model (auto on a tokenizer with a template) ...
    assert both.cli_samples[0]["prompt"] == CHAT.format(q="2 + 2?")
    assert both.cli_lines[2] == f'prompts: chat template of {chat_dir} (auto) around "Q: {{prompt}}"'
    # ... and the numbers are not constants: scores and verdicts vary across the 5 rows.
    assert len({s["score"] for s in both.cli_samples}) > 1
    assert 0 < sum(s["correct"] for s in both.cli_samples) < 5


def test_eval_use_chat_template_false_sends_the_raw_template(chat_dir, questions, tmp_path, capsys):
    base = ["eval", "--model", str(chat_dir), "--data", str(questions), "--template", TEMPLATE,
            "--max-new-tokens", "4", "--device", "cpu", "--limit", "2"]
    prompts = {}
    for setting in ("auto", "false", "true"):
        assert main([*base, "--use-chat-template", setting, "--samples", str(tmp_path / f"{setting}.jsonl")]) == 0
        prompts[setting] = [s["prompt"] for s in rows_of(tmp_path / f"{setting}.jsonl")]
        printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prompts: ")]
        assert len(printed) == 1
        if setting == "false":
            assert printed[0] == 'prompts: raw template "Q: {prompt}" (false: no chat template)'
    assert prompts["false"] == ["Q: 2 + 2?", "Q: 3 + 5?"]
    assert prompts["auto"] == prompts["true"] == [CHAT.format(q="2 + 2?"), CHAT.format(q="3 + 5?")]


def test_eval_on_a_model_without_a_chat_template(tiny_model_dir, questions, tmp_path, monkeypatch, capsys):
    from rlhflab.models import load

    base = ["eval", "--model", str(tiny_model_dir), "--data", str(questions), "--template", TEMPLATE,
            "--max-new-tokens", "2", "--device", "cpu", "--limit", "1", "--samples", str(tmp_path / "s.jsonl")]
    assert main(base) == 0  # auto: the raw template, said so
    assert 'prompts: raw template "Q: {prompt}" (auto: the tokenizer has no chat template)' in capsys.readouterr().out
    assert rows_of(tmp_path / "s.jsonl")[0]["prompt"] == "Q: 2 + 2?"
    # true insists: a one-line error naming the option, before any weights load
    monkeypatch.setattr(load, "load_model", lambda *a, **k: pytest.fail("the model was loaded first"))
    assert main([*base, "--use-chat-template", "true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --use-chat-template: true, but the tokenizer") and err.count("\n") == 1
    assert "set --use-chat-template auto" in err


# --------------------------------------------------------------------------------------
# rlhflab generate
# --------------------------------------------------------------------------------------
def test_generate_renders_by_the_rule_and_chat_is_a_deprecated_alias(chat_dir, tmp_path, spy_sample, capsys):
    base = ["generate", "--model", str(chat_dir), "--prompt", "2 + 2?", "--template", TEMPLATE,
            "--max-new-tokens", "3", "--device", "cpu"]
    assert main(base) == 0  # auto, the default
    assert f'prompts: chat template of {chat_dir} (auto) around "Q: {{prompt}}"' in capsys.readouterr().out
    assert main([*base, "--use-chat-template", "false", "--out", str(tmp_path / "raw.jsonl")]) == 0
    assert 'prompts: raw template "Q: {prompt}" (false: no chat template)' in capsys.readouterr().out
    assert main([*base, "--chat"]) == 0
    captured = capsys.readouterr()
    assert "--chat is deprecated; it means --use-chat-template true" in captured.err
    assert f"prompts: chat template of {chat_dir} (true)" in captured.out
    assert spy_sample == [[CHAT.format(q="2 + 2?")], ["Q: 2 + 2?"], [CHAT.format(q="2 + 2?")]]
    assert rows_of(tmp_path / "raw.jsonl")[0]["prompt"] == "2 + 2?"  # the --out rows keep the prompt as given
    assert main([*base, "--chat", "--use-chat-template", "false"]) == 2
    assert "--chat and --use-chat-template false disagree" in capsys.readouterr().err


def test_generate_each_model_by_its_own_tokenizer(chat_dir, tiny_model_dir, spy_sample, capsys):
    """Two models side by side: the chat model gets its template, the plain one the raw text."""
    assert main(["generate", "--model", str(chat_dir), "--model", str(tiny_model_dir), "--prompt", "7 + 1?",
                 "--template", TEMPLATE, "--max-new-tokens", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("prompts: ") == 2 and "(auto: the tokenizer has no chat template)" in out
    assert spy_sample == [[CHAT.format(q="7 + 1?")], ["Q: 7 + 1?"]]


# --------------------------------------------------------------------------------------
# rlhflab label generate
# --------------------------------------------------------------------------------------
def test_label_generate_renders_by_the_rule_and_stores_the_prompt_as_written(chat_dir, tmp_path, spy_sample,
                                                                            capsys):
    from rlhflab.label import db as labeldb

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "2 + 2?"}) + "\n")
    stored = {}
    for setting in ("auto", "false"):
        db = tmp_path / f"{setting}.db"
        assert main(["label", "generate", "--model", str(chat_dir), "--prompts", str(prompts), "--n", "2",
                     "--out", str(db), "--use-chat-template", setting, f"prompt_template='{TEMPLATE}'",
                     "generation.max_new_tokens=3"]) == 0
        out = capsys.readouterr().out
        want = (f'prompts: chat template of {chat_dir} (auto) around "Q: {{prompt}}"' if setting == "auto"
                else 'prompts: raw template "Q: {prompt}" (false: no chat template)')
        assert want in out.splitlines()
        conn = labeldb.connect(db)
        stored[setting] = [t for (t,) in conn.execute("SELECT text FROM prompts")]
        conn.close()
    assert spy_sample == [[CHAT.format(q="2 + 2?")], ["Q: 2 + 2?"]]
    assert stored == {"auto": ["2 + 2?"], "false": ["2 + 2?"]}  # as the file has it: rm/dpo render it again


def test_label_generate_true_without_a_template_is_a_user_error(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    db = tmp_path / "x.db"
    assert main(["label", "generate", "--model", str(tiny_model_dir), "--prompts", str(prompts),
                 "--out", str(db), "use_chat_template=true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: use_chat_template: true, but the tokenizer") and "use_chat_template=auto" in err
    assert not db.exists()


# --------------------------------------------------------------------------------------
# The sampler itself
# --------------------------------------------------------------------------------------
def test_sampler_on_a_loaded_model_is_generate(chat_dir):
    """`Sampler.sample` adds nothing to `rlhflab.rollout.generate` on the hf backend: the
    same token ids, greedy or seeded-sampled."""
    import torch

    from rlhflab.models.load import load_model
    from rlhflab.rollout import generate
    from rlhflab.rollout.sampler import Sampler, Sampling

    model, tok = load_model(str(chat_dir))
    s = Sampler.from_folder(str(chat_dir), template=TEMPLATE, device="cpu")
    prompts = s.render(["2 + 2?", "3 + 5?"])
    assert prompts == [CHAT.format(q="2 + 2?"), CHAT.format(q="3 + 5?")]
    greedy = s.sample(prompts, Sampling(6), batch_size=1)
    want = generate(model, tok, prompts, max_new_tokens=6, greedy=True, batch_size=1)
    assert torch.equal(greedy.response_ids, want.response_ids) and greedy.responses == want.responses
    hot = Sampling(6, greedy=False, temperature=1.5)
    a = s.sample(prompts, hot, n=2, seed=3)
    b = generate(model, tok, prompts, n=2, max_new_tokens=6, temperature=1.5, seed=3)
    assert torch.equal(a.response_ids, b.response_ids)
    # seeded by (seed, row): the second prompt alone, numbered 1, draws what it drew beside the first
    alone = s.sample(prompts[1:], hot, n=2, seed=3, first_prompt=1)
    assert alone.responses == a.responses[2:]
