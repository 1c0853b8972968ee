"""Read dataset rows from a local file (jsonl, json, parquet, csv) or a `datasets` hub name.

Rows come back as a list of plain dicts. A missing file, an unreadable line (not JSON,
or not UTF-8: `rlhflab.files`) or a missing field is a `UserError` naming the file, the
row and the fix.
"""

from __future__ import annotations

from pathlib import Path

from rlhflab.errors import UserError
from rlhflab.files import check_utf8, iter_jsonl, read_json

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for lineno, row in iter_jsonl(path, "fix or remove it"):
        if not isinstance(row, dict):
            raise UserError(f"{path}: line {lineno} is a {type(row).__name__}, expected a JSON object")
        rows.append(row)
    return rows


def read_rows(path_or_name: str, split: str = "train", subset: str | None = None) -> list[dict]:
    """All rows of a local file or a hub dataset split."""
    path = Path(path_or_name).expanduser()
    if path.suffix in LOCAL_SUFFIXES or path.exists():
        if not path.is_file():
            raise UserError(f"dataset file {path} not found; check dataset.path (make the demo task "
                            "with `rlhflab make-data`)")
        if path.suffix == ".jsonl":
            return _read_jsonl(path)
        if path.suffix == ".json":
            data = read_json(path)
            if isinstance(data, dict) and "data" in data:
                data = data["data"]
            if not isinstance(data, list):
                raise UserError(f"{path}: expected a JSON list of objects (or jsonl lines)")
            return [dict(r) for r in data]
        if path.suffix in (".parquet", ".csv"):
            import datasets
            kind = "parquet" if path.suffix == ".parquet" else "csv"
            if kind == "csv":
                check_utf8(path)  # else a UnicodeDecodeError from deep inside the csv reader
            return [dict(r) for r in datasets.load_dataset(kind, data_files=str(path), split="train")]
        raise UserError(f"{path}: unknown file type {path.suffix!r}; use .jsonl, .json, .parquet or .csv")
    try:
        import datasets
        ds = datasets.load_dataset(path_or_name, subset, split=split)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"dataset {path_or_name!r} (split {split!r}) could not be loaded ({first}); "
                        "give a local .jsonl/.json/.parquet/.csv path or a reachable hub name") from None
    return [dict(r) for r in ds]


def require_fields(rows: list[dict], fields: list[str], source: str) -> None:
    """Every row has every field, else a UserError naming the first bad row."""
    if not rows:
        raise UserError(f"{source}: no rows; check the file or split")
    for i, row in enumerate(rows):
        missing = [f for f in fields if f not in row]
        if missing:
            raise UserError(f"{source}: row {i} lacks field(s) {missing} (it has {sorted(row)}); "
                            "set dataset.prompt_field / dataset.answer_field to the right names")
