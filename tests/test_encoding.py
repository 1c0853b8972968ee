"""Text in another encoding: a Latin-1 byte in any file we read is one line naming the
file, the line and the byte offset, never a UnicodeDecodeError traceback.

Each reader of user text is driven with the same kind of file: a first line of plain
ASCII, then a line holding "café" written in Latin-1 (é is the single byte 0xe9, which
is never valid on its own in UTF-8).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhflab import cli
from rlhflab.errors import UserError
from rlhflab.files import iter_lines, read_text

LATIN1_WORD = "café".encode("latin-1")  # b"caf\xe9"


def write_bad(path: Path, first: dict | str, second_template: str) -> int:
    """Write `first` (a line), then `second_template` with {word} replaced by Latin-1
    "café". Returns the byte offset of 0xe9 from the start of the file."""
    line1 = (json.dumps(first) if isinstance(first, dict) else first).encode() + b"\n"
    head, tail = second_template.split("{word}")
    line2 = head.encode() + LATIN1_WORD + tail.encode() + b"\n"
    path.write_bytes(line1 + line2)
    return len(line1) + len(head.encode()) + 3  # "caf" then the bad byte


def assert_names_line_and_byte(message: str, path: Path, offset: int) -> None:
    assert f"{path}: line 2, byte {offset} (0xe9" in message, message
    assert "UTF-8" in message and "\n" not in message.strip()


def test_iter_lines_offsets_by_hand(tmp_path):
    # line 1 is 6 bytes with its newline ("abcde\n"); "x\xe9" on line 2 puts 0xe9 at byte 6 + 1 = 7.
    path = tmp_path / "t.txt"
    path.write_bytes(b"abcde\nx\xe9y\n")
    with pytest.raises(UserError) as err:
        list(iter_lines(path))
    assert_names_line_and_byte(str(err.value), path, 7)
    assert "column 2 of the line" in str(err.value)
    # A UTF-8 file with a byte-order mark and CRLF endings reads as plain text.
    ok = tmp_path / "ok.txt"
    ok.write_bytes(b"\xef\xbb\xbfcaf\xc3\xa9\r\nb\n")
    assert list(iter_lines(ok)) == [(1, "café"), (2, "b")]
    assert read_text(ok) == "café\nb"


def test_dataset_rows_sft_prompts_and_preferences(tmp_path):
    from rlhflab.data.loading import read_rows

    # SFT rows, prompt rows and preference rows all come through read_rows.
    for name, first, second in [
        ("sft.jsonl", {"prompt": "1+1", "completion": "2"}, '{"prompt": "{word}", "completion": "x"}'),
        ("train.jsonl", {"question": "q", "answer": "#### 1"}, '{"question": "{word}", "answer": "#### 2"}'),
        ("prefs.jsonl", {"prompt": "p", "chosen": "a", "rejected": "b"},
         '{"prompt": "p", "chosen": "{word}", "rejected": "b"}'),
    ]:
        path = tmp_path / name
        offset = write_bad(path, first, second)
        with pytest.raises(UserError) as err:
            read_rows(str(path))
        assert_names_line_and_byte(str(err.value), path, offset)


def test_json_and_csv_files(tmp_path):
    from rlhflab.data.loading import read_rows

    path = tmp_path / "rows.json"
    offset = write_bad(path, "[", '{"prompt": "{word}"}]')
    with pytest.raises(UserError) as err:
        read_rows(str(path))
    assert_names_line_and_byte(str(err.value), path, offset)
    path = tmp_path / "rows.csv"
    offset = write_bad(path, "prompt,completion", "{word},x")
    with pytest.raises(UserError) as err:
        read_rows(str(path))
    assert_names_line_and_byte(str(err.value), path, offset)


def test_label_import_fails_whole_and_creates_no_database(tmp_path, capsys):
    path = tmp_path / "pairs.jsonl"
    offset = write_bad(path, {"prompt": "p", "response_a": "a", "response_b": "b"},
                       '{"prompt": "{word}", "response_a": "a", "response_b": "b"}')
    db = tmp_path / "pairs.db"
    assert cli.main(["label", "import", str(path), "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert_names_line_and_byte(err, path, offset)
    assert not db.exists()  # a failed import leaves nothing behind

    # Into an existing database: the transaction rolls back, the first row is not kept.
    from label_helpers import make_db

    from rlhflab.label import db as labeldb

    existing = make_db(tmp_path / "old.db", n_prompts=2)
    conn = labeldb.connect(existing)
    before = (labeldb.count(conn, "prompts"), labeldb.count(conn, "pairs"))
    conn.close()
    assert cli.main(["label", "import", str(path), "--db", str(existing)]) == 2
    assert "line 2" in capsys.readouterr().err
    conn = labeldb.connect(existing)
    assert (labeldb.count(conn, "prompts"), labeldb.count(conn, "pairs")) == before
    conn.close()


def test_label_generate_prompts_and_generate_txt_prompts(tmp_path):
    from rlhflab.generate import read_prompt_file
    from rlhflab.label.generate import read_prompts

    path = tmp_path / "prompts.jsonl"
    offset = write_bad(path, {"prompt": "a"}, '{"prompt": "{word}"}')
    with pytest.raises(UserError) as err:
        read_prompts(path)
    assert_names_line_and_byte(str(err.value), path, offset)
    txt = tmp_path / "prompts.txt"
    offset = write_bad(txt, "first prompt", "{word} prompt")
    with pytest.raises(UserError) as err:
        read_prompt_file(txt)
    assert_names_line_and_byte(str(err.value), txt, offset)


def test_reward_normalisation_reference_rows(tmp_path):
    from rlhflab.rewards.model import reference_texts

    path = tmp_path / "ref.jsonl"
    offset = write_bad(path, {"prompt": "p", "response": "r"}, '{"prompt": "p", "response": "{word}"}')
    with pytest.raises(UserError) as err:
        reference_texts(str(path))
    assert_names_line_and_byte(str(err.value), path, offset)


def test_config_file(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    offset = write_bad(path, "ppo:", "  note: {word}")
    assert cli.main(["config", "resolve", "ppo", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert_names_line_and_byte(err, path, offset)


@pytest.mark.slow
def test_sft_cli_with_a_latin1_row_touches_nothing(tiny_sft_rm_dir, tmp_path, capsys):
    # The training command itself: one line, exit 2, and no output folder created.
    data = tmp_path / "sft.jsonl"
    offset = write_bad(data, {"prompt": "1+1", "completion": "2"}, '{"prompt": "{word}", "completion": "x"}')
    out = tmp_path / "run"
    rc = cli.main(["sft", "--config", "configs/sft_debug.yaml", f"model.name_or_path={tiny_sft_rm_dir}",
                   f"data.path={data}", "data.eval_path=null", f"training.output_dir={out}",
                   "logging.progress_bar=false"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # (weight-loading bars of the in-process model load come before it)
    assert rc == 2 and last.startswith("error: ") and "Traceback" not in err
    assert_names_line_and_byte(last, data, offset)
    assert not out.exists()
