"""Reading the user's files and writing ours, with errors that say where.

Every text file rlhflab reads from a user (jsonl datasets, preference exports, prompt
files, `label import` rows, reward-normalisation references, config YAML, a reward
model's metadata) goes through `read_text` or `iter_lines`: the bytes are decoded as
UTF-8 line by line, and a byte that is not UTF-8 (a Latin-1 `é` saved by an old editor)
becomes a `UserError` naming the file, the line and the byte offset, not a
`UnicodeDecodeError` traceback from deep inside a loader.

Writes that can fail for reasons outside the program (a full disk, a read-only folder)
are turned into one line naming the folder by `disk_error`.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any, Iterator

from rlhflab.errors import UserError

# errno values that mean "the disk or the permissions", not a bug: reported as one line.
DISK_ERRNOS = {errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EROFS, errno.EDQUOT, errno.EFBIG}


def _not_utf8(path: Path, lineno: int, line_start: int, exc: UnicodeDecodeError) -> UserError:
    bad = exc.object[exc.start]
    offset = line_start + exc.start  # from the start of the file, counting from 0
    return UserError(
        f"{path}: line {lineno}, byte {offset} (0x{bad:02x}, column {exc.start + 1} of the line) is not "
        f"UTF-8; the file is in another encoding (Latin-1?): re-save it as UTF-8, e.g. "
        f"`iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}`")


def iter_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number from 1, text without the line ending) for every line of a UTF-8 file.

    A UTF-8 byte-order mark at the start is dropped. Raises `UserError` at the first
    line holding a byte that is not UTF-8, naming the line and the byte offset.
    """
    path = Path(path)
    offset = 0
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            skip = 3 if lineno == 1 and raw.startswith(b"\xef\xbb\xbf") else 0  # a byte-order mark
            try:
                text = raw[skip:].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, lineno, offset + skip, exc) from None
            offset += len(raw)
            yield lineno, text.rstrip("\r\n")


def read_text(path: str | Path) -> str:
    """The whole of a UTF-8 text file; a non-UTF-8 byte is a `UserError` (file, line, byte)."""
    return "\n".join(text for _, text in iter_lines(path))


def iter_jsonl(path: str | Path, what: str = "one JSON object per line") -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for every non-blank line of a jsonl file.

    A line that is not UTF-8 or not JSON is a `UserError` naming the file and the line.
    The value may be any JSON type; callers check the shape they need.
    """
    for lineno, line in iter_lines(path):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} line {lineno}: not valid JSON ({exc.msg}, column {exc.colno}); "
                            f"{what}") from None


def read_json(path: str | Path) -> Any:
    """A whole JSON file; bad UTF-8 or bad JSON is a `UserError` naming the line."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg}) at line {exc.lineno}, column {exc.colno}") from None


def check_utf8(path: str | Path) -> None:
    """Raise the `UserError` of `iter_lines` when `path` holds a byte that is not UTF-8
    (for files another library parses: a CSV read by `datasets`)."""
    for _ in iter_lines(path):
        pass


def is_disk_error(exc: BaseException) -> bool:
    """A full disk, a quota, or no permission to write: the user's machine, not a bug."""
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def disk_error(exc: OSError, folder: str | Path, what: str = "write", kept: str | None = None) -> UserError:
    """One line for an OSError met while writing `folder`: the folder, the cause, the fix,
    and (`kept`) what is still intact."""
    cause = exc.strerror or type(exc).__name__
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        fix = "free some disk space (or point training.output_dir at a larger disk) and run again"
    else:
        fix = "make the folder writable (or choose another training.output_dir) and run again"
    tail = f"; {kept} is intact" if kept else ""
    return UserError(f"cannot {what} {folder}: {cause}; {fix}{tail}")
