"""TRL's dataset formats read natively (RL prompts as message lists, SFT prompt/completion
and messages, the four preference layouts in rm, dpo and label import), TRL-form reward
plug-ins, the one rule for templated prompts (raw prompts in the files, the run applies
the template, a prompt that already holds it refused), and the rows checked at load
(fields a plug-in reads, a held-out file from elsewhere, too few pairs).

Tokenizers only (`build_tokenizer`, a ChatML template where a case needs one): no model
is built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhflab.config import load_config
from rlhflab.config.schema import DatasetConfig
from rlhflab.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
USER = {"role": "user", "content": "2 + 2?"}
SYSTEM = {"role": "system", "content": "Be brief."}
CHATML_PROMPT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: 2 + 2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def chat_tok():
    from rlhflab.models.tiny import build_tokenizer

    return build_tokenizer(chat_template="chatml")


@pytest.fixture(scope="module")
def plain_tok():
    from rlhflab.models.tiny import build_tokenizer

    return build_tokenizer()


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------------------
# RL prompts: a string or a list of messages
# --------------------------------------------------------------------------------------
def test_message_list_prompts_go_through_the_chat_template(tmp_path, chat_tok, plain_tok):
    from rlhflab.data.prompts import load_prompts

    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": [SYSTEM, USER], "answer": "4"}, {"prompt": "3 + 1?", "answer": "4"}])
    d = DatasetConfig(path=str(path), prompt_field="prompt", prompt_template="Q: {prompt}")
    chat, text = load_prompts(d, chat_tok, "train")
    # The template goes around the last user turn; the system turn is the template's own block.
    assert chat.prompt == CHATML_PROMPT
    assert text.prompt == "<|im_start|>user\nQ: 3 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert chat.row["prompt"] == [SYSTEM, USER]  # the reward sees the row as it is
    # Never the Python text of the list.
    assert "{'role'" not in chat.prompt and "[{" not in chat.prompt
    with pytest.raises(UserError, match=r"p.jsonl: row 0 field 'prompt' is a list of messages, .* "
                                        r"dataset.use_chat_template is false; set it to auto"):
        load_prompts(DatasetConfig(path=str(path), prompt_field="prompt", use_chat_template=False), chat_tok, "train")
    with pytest.raises(UserError, match=r"row 0 field 'prompt' is a list of messages, but the tokenizer .* no chat "
                                        r"template"):
        load_prompts(DatasetConfig(path=str(path), prompt_field="prompt"), plain_tok, "train")


@pytest.mark.parametrize("value, fragment", [
    (7, r"is a int \(7\), not a string or a list"),
    ({"text": "hi"}, r"is a dict"),
    ([{"role": "user", "content": ["a", "b"]}], r"is a list whose item 0 is not a \{role, content\} message"),
])
def test_a_non_string_prompt_is_a_one_line_error(tmp_path, value, fragment):
    from rlhflab.data.prompts import load_prompts

    path = _jsonl(tmp_path / "p.jsonl", [{"question": "1 + 1?"}, {"question": "2 + 2?"}, {"question": value}])
    with pytest.raises(UserError, match=r"p.jsonl: row 2 field 'question' " + fragment) as err:
        load_prompts(DatasetConfig(path=str(path)), None, "train")
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------
# One rule: raw prompts in the files, the run applies the template, never twice
# --------------------------------------------------------------------------------------
def test_a_prompt_already_templated_is_refused(tmp_path, chat_tok):
    from rlhflab.data.prompts import load_prompts

    path = _jsonl(tmp_path / "p.jsonl", [{"question": "1 + 1?"}, {"question": "Question: 2 + 2?\nAnswer:"}])
    d = DatasetConfig(path=str(path), prompt_template="Question: {prompt}\nAnswer:", use_chat_template=False)
    with pytest.raises(UserError, match=r"row 1 field 'question' already begins with the prompt template's opening "
                                        r"\('Question: '\), which the run adds again; write raw prompts .* or set "
                                        r'dataset.prompt_template="\{prompt\}"'):
        load_prompts(d, None, "train")
    # A prompt rendered by a chat template already, on a tokenizer with that template.
    _jsonl(path, [{"question": CHATML_PROMPT}])
    with pytest.raises(UserError, match=r"already begins with the chat template's opening \('<\|im_start\|>'\).* "
                                        r"set dataset.use_chat_template=false"):
        load_prompts(DatasetConfig(path=str(path)), chat_tok, "train")
    # The template "{prompt}" adds nothing in front: no text is refused for it.
    assert load_prompts(DatasetConfig(path=str(path), use_chat_template=False), chat_tok, "train")[0].prompt == \
        CHATML_PROMPT


def test_make_prefs_pairs_are_templated_once_by_the_dpo_debug_config(tmp_path, plain_tok):
    from rlhflab import cli
    from rlhflab.trainers.dpo import DPORunConfig, read_preference_pairs

    assert cli.main(["make-prefs", "--out", str(tmp_path / "prefs"), "--n-train", "8", "--n-test", "4"]) == 0
    row = json.loads((tmp_path / "prefs" / "train.jsonl").read_text().splitlines()[0])
    assert not row["prompt"].startswith("Question:")  # raw: the bare question
    cfg, _ = load_config(str(CONFIGS / "dpo_debug.yaml"), DPORunConfig, [f"dataset.path={tmp_path / 'prefs/train.jsonl'}"])
    (first, *_) = read_preference_pairs(cfg.dataset.path, cfg.dataset, plain_tok, warn=lambda m: None)
    assert first.prompt == f"Question: {row['prompt']}\nAnswer:"  # once, not 'Question: Question: ...'
    # A file written the old way (prompts rendered already) stops with one line.
    old = _jsonl(tmp_path / "old.jsonl", [{**row, "prompt": f"Question: {row['prompt']}\nAnswer:"}])
    with pytest.raises(UserError, match=r"old.jsonl: row 0 field 'prompt' already begins with the prompt template's "
                                        r"opening .* set dataset.prompt_template="):
        read_preference_pairs(str(old), cfg.dataset, plain_tok, warn=lambda m: None)


def test_rm_renders_raw_prompts_as_the_policy_run_does(tmp_path, chat_tok):
    from rlhflab.data.prompts import format_prompt
    from rlhflab.trainers.rm import RMRunConfig, load_rm_data

    path = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"{i} + 1?", "chosen": f" {i + 1}", "rejected": f" {i}"}
                                             for i in range(10)])
    cfg, _ = load_config(str(CONFIGS / "rm_debug.yaml"), RMRunConfig, [f"data.path={path}", "data.eval_path=null"])
    data = load_rm_data(cfg.data, chat_tok, warn=lambda m: None)
    # The text PPO hands the reward model: its rendered prompt (template, then chat template) + the response.
    rendered = format_prompt("0 + 1?", "Question: {prompt}\nAnswer:", chat_tok, True)
    assert rendered == "<|im_start|>user\nQuestion: 0 + 1?\nAnswer:<|im_end|>\n<|im_start|>assistant\n"
    assert rendered + " 1" in {p.chosen for p in data.train + data.eval}


# --------------------------------------------------------------------------------------
# SFT: prompt/completion, plain or conversational, and messages
# --------------------------------------------------------------------------------------
def test_sft_conversational_prompt_completion_equals_messages(chat_tok):
    from rlhflab.data import sft as sftdata

    answer = {"role": "assistant", "content": "4"}
    rows = [{"messages": [SYSTEM, USER, answer]},
            {"prompt": [SYSTEM, USER], "completion": [answer]},
            {"prompt": [SYSTEM, USER], "completion": "4"}]
    examples = sftdata.parse_rows(rows, "sft.jsonl")
    assert [e.messages for e in examples] == [[SYSTEM, USER, answer]] * 3
    texts = {sftdata.format_example(e, chat_tok, sftdata.Template()) for e in examples}
    assert texts == {("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 2?<|im_end|>\n"
                      "<|im_start|>assistant\n", "4<|im_end|>", False)}
    with pytest.raises(UserError, match=r"sft.jsonl: row 1 field 'completion' is a dict"):
        sftdata.parse_rows([rows[0], {"prompt": "2 + 2?", "completion": {"text": "4"}}], "sft.jsonl")
    with pytest.raises(UserError, match=r"row 0 field 'messages' is a list whose item 1 is not"):
        sftdata.parse_rows([{"messages": [USER, {"role": "assistant", "content": None}]}], "sft.jsonl")


# --------------------------------------------------------------------------------------
# Preferences: TRL's four layouts read alike by dpo and rm, and by label import
# --------------------------------------------------------------------------------------
TRL_PAIRS = {
    "standard, explicit": {"prompt": "2 + 2?", "chosen": " 4", "rejected": " 5"},
    "standard, implicit": {"chosen": "2 + 2? 4", "rejected": "2 + 2? 5"},
    "conversational, explicit": {"prompt": [USER], "chosen": [{"role": "assistant", "content": "4"}],
                                 "rejected": [{"role": "assistant", "content": "5"}]},
    "conversational, implicit": {"chosen": [USER, {"role": "assistant", "content": "4"}],
                                 "rejected": [USER, {"role": "assistant", "content": "5"}]},
}


def test_the_four_preference_layouts(tmp_path, chat_tok):
    from rlhflab.trainers.dpo import read_preference_pairs

    texts = {}
    for name, row in TRL_PAIRS.items():
        path = _jsonl(tmp_path / "p.jsonl", [row])
        (texts[name],) = read_preference_pairs(str(path), DatasetConfig(prompt_field="prompt"), chat_tok)
    # The implicit prompt is the shared text cut at its last space ("2 + 2?"), the space
    # going with the completions, so both standard rows read the same.
    assert texts["standard, explicit"] == texts["standard, implicit"] == (
        "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n", " 4", " 5")
    assert texts["conversational, explicit"] == texts["conversational, implicit"] == (
        "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n", "4<|im_end|>", "5<|im_end|>")


@pytest.mark.parametrize("row, field", [({"prompt": 3, "chosen": "a", "rejected": "b"}, "prompt"),
                                        ({"prompt": "p", "chosen": {"text": "a"}, "rejected": "b"}, "chosen"),
                                        ({"prompt": "p", "chosen": "a", "rejected": None}, "rejected")])
def test_a_non_string_in_a_pair_names_the_row_and_field(row, field):
    from rlhflab.data.preferences import parse_pairs

    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    with pytest.raises(UserError, match=rf"f.jsonl: row 1 field '{field}' is a "):
        parse_pairs([good, row], "f.jsonl", warn=lambda m: None)


def test_label_import_reads_the_preference_layouts(tmp_path):
    from rlhflab.label import db as labeldb
    from rlhflab.label.export import export_rows

    rows = [{**row, "pair_id": i} for i, row in enumerate(TRL_PAIRS.values())]
    rows.append({"prompt": "3 + 3?", "response_a": " 6", "response_b": " 7"})
    path = _jsonl(tmp_path / "in.jsonl", rows)
    conn = labeldb.connect(tmp_path / "l.db", create=True)
    result = labeldb.import_jsonl(conn, path)
    # The four TRL rows are one pair (the same prompt and responses once whitespace is the
    # text's own: " 4" and "4" differ, so standard and conversational make two pairs).
    assert (result.rows, result.pairs_added, result.pairs_existing) == (5, 3, 2)
    prompts = [r[0] for r in conn.execute("SELECT text FROM prompts ORDER BY id")]
    assert prompts == ["2 + 2?", "3 + 3?"]  # raw prompts, as the export gives them back
    for pid in (1, 2, 3):  # label every pair "A much better" (level 1 as shown, 5 when the sides are shown flipped)
        level = 5 if labeldb.is_flipped(conn, pid, "ann") else 1
        labeldb.submit_label(conn, labeldb.LabelIn(f"s{pid}", "ann", pid, level))
    exported, _ = export_rows(conn)
    assert {(r["prompt"], r["chosen"], r["rejected"]) for r in exported} == {
        ("2 + 2?", " 4", " 5"), ("2 + 2?", "4", "5"), ("3 + 3?", " 6", " 7")}
    conn.close()
    bad = _jsonl(tmp_path / "bad.jsonl", [{"chosen": [USER, {"role": "assistant", "content": "4"}, USER,
                                                      {"role": "assistant", "content": "x"}],
                                           "rejected": [USER, {"role": "assistant", "content": "5"}]}])
    conn = labeldb.connect(tmp_path / "l2.db", create=True)
    with pytest.raises(UserError, match=r"bad.jsonl line 1: field 'chosen' is a conversation of 3 messages"):
        labeldb.import_jsonl(conn, bad)
    conn.close()


# --------------------------------------------------------------------------------------
# Reward plug-ins written TRL's way
# --------------------------------------------------------------------------------------
def test_trl_form_reward_gets_prompts_completions_and_columns():
    from rlhflab.rewards.plugins import call_plugin, is_trl_form, load_function  # noqa: F401

    seen = {}

    def exact(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, **kwargs)
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    assert is_trl_form(exact)
    rows = [{"question": "2 + 2?", "answer": "4", "level": 1}, {"question": "3 + 3?", "answer": "6", "level": 2}]
    assert call_plugin(exact, "t:exact", ["Q: 2 + 2?", "Q: 3 + 3?"], [" 4", " 7"], rows) == [1.0, 0.0]
    assert seen == {"prompts": ["Q: 2 + 2?", "Q: 3 + 3?"], "completions": [" 4", " 7"], "answer": ["4", "6"],
                    "question": ["2 + 2?", "3 + 3?"], "level": [1, 2]}

    # Conversational rows (a `prompt` column of messages): TRL's message lists both ways;
    # a function without **kwargs gets only the columns it names.
    def length(completions, prompts):
        seen["chat"] = (prompts, completions)
        return [float(len(c[0]["content"])) for c in completions]

    chat = [{"prompt": [USER], "answer": "4"}]
    assert call_plugin(length, "t:length", ["<rendered>"], ["four"], chat) == [4.0]
    assert seen["chat"] == ([[USER]], [[{"role": "assistant", "content": "four"}]])
    with pytest.raises(UserError, match=r"plug-in 't:bad' is written TRL's way but returned a float"):
        call_plugin(lambda completions, **kw: 1.0, "t:bad", ["p"], ["r"], [{}])


# --------------------------------------------------------------------------------------
# Rows checked at load
# --------------------------------------------------------------------------------------
def test_a_row_missing_the_field_a_reward_reads_fails_before_any_model(tmp_path, monkeypatch, capsys):
    from rlhflab import cli

    (tmp_path / "maxrew.py").write_text("def score(prompt, response, example):\n"
                                        "    return float(response.strip() == str(max(example['nums'])))\n")
    rows = [{"question": f"Largest of {i} 9", "nums": [i, 9]} for i in range(5)]
    rows.insert(3, {"question": "Largest of 1 2"})
    data = _jsonl(tmp_path / "train.jsonl", rows)
    monkeypatch.chdir(tmp_path)
    # No model exists at model.name_or_path: the row error must come first, as one line.
    code = cli.main(["grpo", "--config", str(CONFIGS / "grpo_debug.yaml"), f"dataset.path={data}",
                     f"dataset.eval_path={data}", "reward.sources=[{type: rule, name: maxrew:score}]",
                     f"model.name_or_path={tmp_path / 'no-model'}", f"training.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.startswith(f"error: preflight of reward.sources[0]: {data}: row 3 lacks field(s) ['nums'] that "
                          "'maxrew:score' reads")
    assert not (tmp_path / "out").exists()
    # The same for a reward written TRL's way, whose columns come as named parameters.
    (tmp_path / "trlrew.py").write_text("def score(prompts, completions, nums, **kwargs):\n"
                                        "    return [float(c.strip() == str(max(n))) for c, n in zip(completions, nums)]\n")
    code = cli.main(["grpo", "--config", str(CONFIGS / "grpo_debug.yaml"), f"dataset.path={data}",
                     f"dataset.eval_path={data}", "reward.sources=[{type: rule, name: trlrew:score}]",
                     f"model.name_or_path={tmp_path / 'no-model'}", f"training.output_dir={tmp_path / 'out'}"])
    assert code == 2 and "row 3 lacks field(s) ['nums'] that 'trlrew:score' reads" in capsys.readouterr().err


def test_held_out_file_from_elsewhere_and_few_pairs_warn(tmp_path, plain_tok):
    from rlhflab.data.preferences import write_arith_pairs
    from rlhflab.trainers.rm import RMRunConfig, load_rm_data

    prefs = write_arith_pairs(tmp_path / "prefs", n_train=16, n_test=8)
    mine = _jsonl(tmp_path / "my_pairs.jsonl", [{"prompt": "1 + 1?", "chosen": " 2", "rejected": " 3"}])
    # The trap: the config's held-out file left in place when data.path is overridden.
    cfg, _ = load_config(str(CONFIGS / "rm_debug.yaml"), RMRunConfig,
                         [f"data.path={mine}", f"data.eval_path={prefs['test']}"])
    said: list[str] = []
    data = load_rm_data(cfg.data, plain_tok, warn=said.append)
    assert (len(data.train), len(data.eval)) == (1, 8)
    assert any(s.startswith(f"warning: data.eval_path {prefs['test']} is not beside data.path {mine}") for s in said)
    assert any("only 1 training pair(s)" in s for s in said)
    # The config's own pair of files, side by side and large enough: no warning.
    cfg, _ = load_config(str(CONFIGS / "rm_debug.yaml"), RMRunConfig,
                         [f"data.path={prefs['train']}", f"data.eval_path={prefs['test']}"])
    said.clear()
    load_rm_data(cfg.data, plain_tok, warn=said.append)
    assert not [s for s in said if s.startswith("warning")]
