"""The reference pages (docs/reference/) against the code.

- config.md and commands.md are what scripts/make_reference.py writes now: a new key,
  flag or command, or a changed default or help line, fails here until the script is
  rerun;
- the generator reads the schemas and parsers it is given, not a list of its own: a key
  and a flag added on the fly show up on its pages;
- every JSON example of data_formats.md loads through the loader the page names, with the
  fields the page says it has;
- every link of the reference pages resolves, anchors included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sqlite3
from pathlib import Path

import pytest
from file_modules import load_file

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "docs" / "reference"


MAKE = load_file("make_reference", ROOT / "scripts" / "make_reference.py")


# ----------------------------------------------------------------- generated pages

@pytest.fixture(scope="module")
def generated() -> dict[Path, str]:
    return MAKE.pages()


@pytest.mark.parametrize("name", ["config.md", "commands.md"])
def test_generated_pages_are_up_to_date(generated, name):
    path = REF / name
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing; run .venv/bin/python scripts/make_reference.py"
    assert path.read_text(encoding="utf-8") == generated[path], (
        f"{path.relative_to(ROOT)} differs from the code (a key, flag, default or help line changed); "
        "run .venv/bin/python scripts/make_reference.py and commit the page")


def test_config_page_lists_every_key_of_every_command(generated):
    from rlhflab.config.cli import SCHEMAS, schema_for, schema_rows

    text = generated[REF / "config.md"]
    for command in SCHEMAS:
        for key, type_, _, _ in schema_rows(schema_for(command)):
            if type_ != "section":
                assert f"| `{key}` |" in text, f"config.md lacks {command}'s key {key}"
    # a default that one command changes is shown for that command: sft's own output folder
    assert re.search(r"\| `training.output_dir` \| str \| `\"outputs/run\"` \(.*sft: `\"outputs/sft\"`", text)


def test_every_config_help_is_one_line_of_at_most_200_characters():
    # A help string says what a key does; the reason and the figure go to the page it names.
    from rlhflab.config.cli import SCHEMAS, schema_for, schema_rows

    long = {f"{cmd}: {row[0]} ({len(row[-1])})" for cmd in SCHEMAS for row in schema_rows(schema_for(cmd))
            if len(row[-1]) > 200 or "\n" in row[-1]}
    assert not long, sorted(long)


def test_config_show_prints_the_defaults_a_command_starts_from(capsys):
    # `rlhflab sft` builds its training section with its own output folder and intervals;
    # `config show sft` once printed the section class's (outputs/run, 50, 25) instead.
    from rlhflab.cli import main

    assert main(["config", "show", "sft"]) == 0
    rows = {line.split()[0]: line.split()[2] for line in capsys.readouterr().out.splitlines()
            if line.startswith("  training.")}
    assert rows["training.output_dir"] == '"outputs/sft"'
    assert rows["training.save_interval"] == "0" and rows["training.eval_interval"] == "50"
    assert main(["config", "show", "ppo"]) == 0
    assert '"outputs/run"' in capsys.readouterr().out


def test_commands_page_lists_every_command_and_option(generated):
    from rlhflab import cli

    text = generated[REF / "commands.md"]
    for name in cli.COMMANDS:
        assert f"## `rlhflab {name}`" in text
    for flag in ("--use-chat-template", "--correct", "--min-labels", "--backend"):
        assert f"| `{flag}` |" in text
    assert "### `rlhflab label export`" in text and "required. SQLite file" in text


@dataclasses.dataclass
class _Extra:
    """A section added by the test."""

    knob: float = dataclasses.field(default=0.5, metadata={"help": "a key added by the test"})


def _grpo_with_extra() -> type:
    """GRPO's run config with one more section (module-level names: the annotations are strings)."""
    from rlhflab.trainers.grpo import GRPORunConfig

    return dataclasses.make_dataclass("RunConfig", [("extra", _Extra, dataclasses.field(default_factory=_Extra))],
                                      bases=(GRPORunConfig,))


def test_the_generator_reads_what_it_is_given(monkeypatch):
    # A new flag of an existing command and a new config key appear without touching the
    # script: it walks the parsers and the dataclasses, it does not list them.
    from rlhflab.config import cli as config_cli
    from rlhflab.trainers import grpo

    real_add = grpo.add_parser

    def add_parser(parser: argparse.ArgumentParser) -> None:
        real_add(parser)
        parser.add_argument("--brand-new-flag", type=int, default=7, help="a flag added by the test")

    monkeypatch.setattr(grpo, "add_parser", add_parser)
    assert "| `--brand-new-flag` | `BRAND_NEW_FLAG` | `7` | a flag added by the test |" in MAKE.commands_page()

    monkeypatch.setattr(config_cli, "schema_for",
                        lambda c, real=config_cli.schema_for: _grpo_with_extra() if c == "grpo" else real(c))
    text = MAKE.config_page()
    assert "| `extra.knob` | float | `0.5` | a key added by the test |" in text
    assert "Read by: `grpo`." in text


# ----------------------------------------------------------------- data_formats.md

def _examples() -> dict[str, list[dict]]:
    """The JSON lines under each `<!-- example: NAME -->` of data_formats.md."""
    text = (REF / "data_formats.md").read_text(encoding="utf-8")
    out = {}
    for name, body in re.findall(r"<!-- example: ([\w-]+) -->\n```json\n(.*?)```", text, re.S):
        out[name] = [json.loads(line) for line in body.splitlines() if line.strip()]
    return out


EXAMPLES = _examples()


def _write(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in EXAMPLES[name]), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def byte_tokenizer():
    from rlhflab.models.tiny import build_tokenizer

    return build_tokenizer(258, 0, None, True, "none")  # one token a byte, no chat template


def test_every_format_has_an_example():
    assert set(EXAMPLES) == {"sft", "rl", "preferences", "classifier", "ptx", "label-import"}


def test_sft_examples_load_one_layout_each(tmp_path, byte_tokenizer):
    from rlhflab.data import sft as sftdata
    from rlhflab.trainers.sft import SFTDataConfig, load_sft_data

    rows = EXAMPLES["sft"]
    # the page shows every layout, Dolly's and Alpaca's instruction forms both
    assert [sftdata.detect_layout(r) for r in rows] == [
        "messages", "instruction", "instruction", "prompt_completion", "prompt_completion", "input_output",
        "question_answer"]
    warnings = []
    examples = sftdata.parse_rows(rows, "data_formats.md", warn=warnings.append)
    assert not warnings and len(examples) == len(rows)
    assert examples[0].messages[0]["role"] == "system" and examples[0].response.endswith("#### 5")
    assert examples[1].prompt == "Reverse the word.\n\ncat" and examples[1].response == "tac"
    assert examples[2].prompt == "Translate to French.\n\ncheese" and examples[2].response == "fromage"
    path = _write(tmp_path, "sft")
    data = load_sft_data(SFTDataConfig(path=str(path), eval_path=str(path)), byte_tokenizer, warn=warnings.append)
    assert len(data.train) == len(rows) and not warnings


def test_rl_examples_load_with_answer_and_extra_fields(tmp_path):
    from rlhflab.config.schema import DatasetConfig
    from rlhflab.data.prompts import load_prompts
    from rlhflab.rewards.gsm8k import gsm8k_reward

    path = _write(tmp_path, "rl")
    cfg = DatasetConfig(path=str(path), eval_path=str(path), prompt_template="Question: {prompt}\nAnswer:")
    prompts = load_prompts(cfg, tokenizer=None)
    assert prompts[0].prompt == "Question: Ann had 3 apples and got 4 more. How many does she have?\nAnswer:"
    assert prompts[1].row["level"] == 1                         # extra fields reach the plug-ins
    assert gsm8k_reward(" 3 + 4 = 7\n#### 7", prompts[0].row["answer"]) == 1.0
    assert gsm8k_reward(" #### 5", prompts[1].row["answer"]) == 0.1   # formatted but wrong (6 - 2 = 4)
    # the page's own renaming example: answer_field copies the field into "answer"
    word = tmp_path / "words.jsonl"
    word.write_text(json.dumps({"word": "cat", "reversed": "tac"}) + "\n")
    (p,) = load_prompts(DatasetConfig(path=str(word), eval_path=str(word), prompt_field="word",
                                      answer_field="reversed"), tokenizer=None)
    assert p.row == {"word": "cat", "reversed": "tac", "answer": "tac"}


def test_preference_examples_load_as_pairs():
    from rlhflab.data.preferences import parse_pairs

    warnings = []
    report = parse_pairs(EXAMPLES["preferences"], "data_formats.md", warn=warnings.append)
    assert not warnings and report.bad == 0 and len(report.pairs) == 4
    first, second, implicit, conv = report.pairs
    # TRL's implicit prompt: the shared text up to its last space ("What is 5 + 5?")
    assert (implicit.prompt, implicit.chosen, implicit.rejected) == ("What is 5 + 5?", " 10", " 11")
    assert first.margin == 1.0 and first.pair_id == 0 and second.margin == 0.5
    # conversational: the shared leading user turn is the prompt, the rest the completions
    assert conv.prompt == [{"role": "user", "content": "Say hi."}]
    assert conv.chosen == [{"role": "assistant", "content": "Hi!"}]


def test_classifier_examples_load_with_sorted_labels(tmp_path):
    from rlhflab.trainers.classifier import ClassifierDataConfig, load_classifier_data

    path = _write(tmp_path, "classifier")
    data = load_classifier_data(ClassifierDataConfig(path=str(path), eval_path=str(path)))
    assert data.labels == ["NEGATIVE", "POSITIVE"]               # names sorted into id2label
    assert [r.label for r in data.eval] == [1, 0, 1]


def test_ptx_examples_load_text_and_sft_rows(tmp_path, byte_tokenizer):
    from rlhflab.data.ptx import PtxData

    path = _write(tmp_path, "ptx")
    ptx = PtxData.load(str(path), byte_tokenizer, prompt_template="{prompt}", use_chat_template=False,
                       batch_size=2, max_seq_length=128, seed=0, device="cpu")
    assert len(ptx.examples) == 2
    text_row = next(e for e in ptx.examples if e.prompt_len == 0)
    # a text row: every token a target (byte tokenizer: one token a byte)
    assert text_row.labels == text_row.input_ids and len(text_row.input_ids) == len(EXAMPLES["ptx"][0]["text"])


def test_label_import_examples_make_pairs(tmp_path):
    from rlhflab.label.db import connect, count, import_jsonl

    conn = connect(tmp_path / "pairs.db", create=True)
    import_jsonl(conn, _write(tmp_path, "label-import"))
    assert count(conn, "pairs") == 1 + 3 + 1                    # one given pair, 3 from 3 responses, a chosen/rejected row
    assert isinstance(conn, sqlite3.Connection)


# ----------------------------------------------------------------- links

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(md: Path) -> set[str]:
    return {MAKE._slug(line.lstrip("#").strip()) for line in md.read_text(encoding="utf-8").splitlines()
            if line.startswith("#")}


@pytest.mark.parametrize("md", sorted(p.name for p in REF.glob("*.md")))
def test_reference_links_resolve(md):
    page = REF / md
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://")):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part) if path_part else page
        assert dest.exists(), f"docs/reference/{md}: broken link {target!r}"
        if anchor:
            assert anchor in _anchors(dest), f"docs/reference/{md}: no heading #{anchor} in {dest.name}"


# ----------------------------------------------------------------- commands on these pages

def _docs_commands():
    """tests/test_docs_commands.py as a module, loaded once."""
    import sys

    name = "_reference_docs_commands"
    return sys.modules.get(name) or load_file(name, ROOT / "tests" / "test_docs_commands.py")


@pytest.mark.parametrize("md", sorted(p.name for p in REF.glob("*.md")))
def test_reference_commands_resolve(md):
    # tests/test_docs_commands.py reads docs/*.md; the same checks on docs/reference/.
    dc = _docs_commands()
    commands = dc._page_commands(REF / md)
    found = {c.where: dc.problems(c) + dc._launch_problems(c) for c in commands}
    assert not {w: p for w, p in found.items() if p}, found
    if md == "data_formats.md":
        assert any(c.tokens[:2] == ["label", "import"] for c in commands)   # the extraction found them
