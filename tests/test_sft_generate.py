"""`rlhflab generate`: prompts from files, models or adapters side by side, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhflab.errors import UserError
from rlhflab.generate import compare, read_prompt_file, render


@pytest.fixture(scope="module")
def tiny(tiny_sft_rm_dir) -> Path:
    return tiny_sft_rm_dir


@pytest.fixture(scope="module")
def adapter(tiny_lora_adapter_dir) -> Path:
    """A LoRA adapter folder on the tiny model, with non-zero B so it changes the outputs."""
    return tiny_lora_adapter_dir


def test_prompts_from_dataset_files_of_any_layout(tmp_path):
    rows = [{"question": "1 + 1?", "answer": "2"}, {"instruction": "Say hi", "response": "hi"},
            {"prompt": "Q", "chosen": "a", "rejected": "b"},
            {"messages": [{"role": "user", "content": "Hey"}, {"role": "assistant", "content": "Yo"}]}]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_prompt_file(f) == ["1 + 1?", "Say hi", "Q", "Hey"]
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\nsecond\n")
    assert read_prompt_file(txt) == ["first", "second"]
    with pytest.raises(UserError, match=r"row 0 has no field 'text' \(it has \['answer', 'question'\]\)"):
        read_prompt_file(f, field="text")


def test_compare_models_and_an_adapter_side_by_side(tiny, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhflab.models.load import load_tokenizer
    from rlhflab.rollout import generate

    prompts = ["Question: 1 + 2\nAnswer:", "Question: 5 - 3\nAnswer:"]
    rows = compare([str(tiny), str(adapter)], prompts, max_new_tokens=6)
    assert [r["prompt"] for r in rows] == prompts
    assert list(rows[0]["responses"]) == [str(tiny), str(adapter)]
    # The adapter folder is its base plus the adapter: the same greedy answers as a PeftModel.
    tok = load_tokenizer(str(tiny))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny)), str(adapter)).eval()
    want = generate(peft_model, tok, prompts, max_new_tokens=6, greedy=True).responses
    assert [r["responses"][str(adapter)] for r in rows] == want
    text = render(rows)
    assert "=== prompt 1" in text and "Question: 5 - 3" in text and text.count(" | ") >= 4


def test_generate_cli(tiny, tmp_path, capsys):
    from rlhflab.cli import main

    out = tmp_path / "side.jsonl"
    assert main(["generate", "--model", str(tiny), "--prompt", "Question: 3 + 4", "--template",
                 "{prompt}\\nAnswer:", "--max-new-tokens", "4", "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Question: 3 + 4" in printed and "wrote 1 rows" in printed
    row = json.loads(out.read_text())
    assert row["prompt"] == "Question: 3 + 4" and str(tiny) in row["responses"]  # the prompt before the template
    assert main(["generate", "--model", str(tiny), "--prompt", "x", "--template", "no slot"]) == 2
    assert "has no {prompt}" in capsys.readouterr().err
