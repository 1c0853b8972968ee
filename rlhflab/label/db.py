"""The labelling database: SQLite (standard library) in WAL mode.

Tables: `prompts`, `responses` (unique per prompt and text), `pairs` (two responses of
one prompt, A and B), `labels` (one per pair and annotator), `skips` and `reservations`
(the pair each annotator was last offered, held for them until it expires). Every write is
one `BEGIN IMMEDIATE` transaction; a label or skip carries a client-made
`submission_id` (UNIQUE), so a retried POST is stored once. `synchronous=FULL` makes a
commit durable before the server answers: a killed server loses nothing it acknowledged.

Levels: `level` is what the annotator clicked (1 = left much better ... 5 = right much
better); `flipped` records whether the left panel showed response B; `a_level` is the same
judgement in the pair's own terms (1 = A much better ... 5 = B much better).

Reads that report several numbers (`progress`, `export.stats`, `export.export_rows`) run
inside `snapshot()`, one read transaction: in WAL mode every SELECT in it sees the same
committed state, so the figures add up while others write.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import random
import secrets
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from rlhflab.errors import UserError
from rlhflab.files import iter_jsonl

SCHEMA_VERSION = "1"

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS prompts (
    id      INTEGER PRIMARY KEY,
    text    TEXT NOT NULL UNIQUE,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS responses (
    id        INTEGER PRIMARY KEY,
    prompt_id INTEGER NOT NULL REFERENCES prompts(id),
    text      TEXT NOT NULL,
    source    TEXT NOT NULL DEFAULT '',
    created   REAL NOT NULL,
    UNIQUE (prompt_id, text)
);
CREATE TABLE IF NOT EXISTS pairs (
    id         INTEGER PRIMARY KEY,
    prompt_id  INTEGER NOT NULL REFERENCES prompts(id),
    response_a INTEGER NOT NULL REFERENCES responses(id),
    response_b INTEGER NOT NULL REFERENCES responses(id),
    ext_id     TEXT UNIQUE,
    created    REAL NOT NULL,
    CHECK (response_a != response_b)
);
CREATE INDEX IF NOT EXISTS pairs_by_responses ON pairs (response_a, response_b);
CREATE TABLE IF NOT EXISTS labels (
    id            INTEGER PRIMARY KEY,
    submission_id TEXT NOT NULL UNIQUE,
    pair_id       INTEGER NOT NULL REFERENCES pairs(id),
    annotator     TEXT NOT NULL,
    level         INTEGER NOT NULL CHECK (level BETWEEN 1 AND 5),
    flipped       INTEGER NOT NULL CHECK (flipped IN (0, 1)),
    a_level       INTEGER NOT NULL CHECK (a_level BETWEEN 1 AND 5),
    comment       TEXT NOT NULL DEFAULT '',
    criteria      TEXT NOT NULL DEFAULT '[]',
    elapsed_ms    INTEGER,
    created       REAL NOT NULL,
    UNIQUE (pair_id, annotator)
);
CREATE TABLE IF NOT EXISTS skips (
    id            INTEGER PRIMARY KEY,
    submission_id TEXT NOT NULL UNIQUE,
    pair_id       INTEGER NOT NULL REFERENCES pairs(id),
    annotator     TEXT NOT NULL,
    created       REAL NOT NULL,
    UNIQUE (pair_id, annotator)
);
"""

# The pair each annotator was last offered, held for them until `expires` (time.time()):
# /api/next does not offer a pair whose labels plus live reservations reach the limit.
# Added after the first release, so `connect` also creates it in an older database.
RESERVATIONS_SCHEMA = """
CREATE TABLE IF NOT EXISTS reservations (
    annotator TEXT PRIMARY KEY,
    pair_id   INTEGER NOT NULL REFERENCES pairs(id),
    expires   REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS reservations_by_pair ON reservations (pair_id, expires)
"""


class Rejected(UserError):
    """A request the database refuses; `status` is the HTTP status the server answers."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------- connection


def connect(path: str | Path, create: bool = False) -> sqlite3.Connection:
    """Open (or with `create`, create) a labelling database.

    Autocommit mode (`isolation_level=None`): writes go through `transaction()`.
    """
    path = Path(path)
    if not create and not path.is_file():
        raise UserError(f"--db {path}: no such file; create it with `rlhflab label generate` "
                        f"or `rlhflab label import`")
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), timeout=30.0, isolation_level=None,
                           check_same_thread=False)
    conn.row_factory = sqlite3.Row
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise UserError(f"--db {path}: not an SQLite database ({exc}); "
                        f"give a file made by `rlhflab label generate` or `import`") from None
    if mode.lower() != "wal":
        conn.close()
        raise UserError(f"--db {path}: cannot switch to WAL mode (got {mode!r}); "
                        "put the file on a local disk")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=30000")
    if create:
        with transaction(conn):
            for stmt in (SCHEMA + ";" + RESERVATIONS_SCHEMA).split(";"):
                if stmt.strip():
                    conn.execute(stmt)
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
            # Secret per database: the left/right order of a pair for an annotator is
            # HMAC(salt, pair, annotator), random-looking but stable across reloads.
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('flip_salt', ?)", (secrets.token_hex(16),))
    else:
        try:
            row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.DatabaseError:
            row = None
        if row is None:
            conn.close()
            raise UserError(f"--db {path}: not a labelling database (no meta table); "
                            "create one with `rlhflab label generate` or `rlhflab label import`")
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name='reservations'").fetchone() is None:
            with transaction(conn):
                for stmt in RESERVATIONS_SCHEMA.split(";"):
                    if stmt.strip():
                        conn.execute(stmt)
    return conn


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction; `BEGIN IMMEDIATE` takes the write lock up front, so two
    submissions never interleave their check-then-insert steps."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


@contextmanager
def snapshot(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One read transaction: every SELECT inside sees the same committed state (WAL mode
    keeps the snapshot of the first read until the end), so counts taken one after another
    add up while other connections write. Inside a transaction already, it is that one."""
    if conn.in_transaction:
        yield conn
        return
    conn.execute("BEGIN")
    try:
        yield conn
    finally:
        conn.execute("COMMIT")  # a read transaction: nothing to commit, this ends it


def backup(conn: sqlite3.Connection, out: str | Path) -> Path:
    """Copy the open database to a new file `out` with SQLite's online backup API, in one
    step (one read snapshot: the copy is the database as of one commit, while servers keep
    writing). Written under a temporary name, checked, then renamed into place."""
    import os

    out = Path(out)
    if out.exists():
        raise UserError(f"--out {out}: already exists; give a new file name (a backup never "
                        "overwrites a file)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.unlink(missing_ok=True)
    dest = sqlite3.connect(str(tmp))
    try:
        conn.backup(dest)  # pages=-1: every page in one step
        dest.execute("PRAGMA journal_mode=DELETE")  # the copy is one self-contained file
        check = dest.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        dest.close()
    if check != "ok":
        tmp.unlink(missing_ok=True)
        raise UserError(f"backup of the database to {out}: the copy fails integrity_check ({check})")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    tmp.replace(out)
    return out


def _meta(conn: sqlite3.Connection, key: str) -> str:
    return conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()[0]


# ---------------------------------------------------------------- adding pairs


def add_prompt(conn: sqlite3.Connection, text: str) -> int:
    """The id of the prompt with this text, inserted if new (call inside a transaction)."""
    row = conn.execute("SELECT id FROM prompts WHERE text=?", (text,)).fetchone()
    if row:
        return row[0]
    return conn.execute("INSERT INTO prompts (text, created) VALUES (?, ?)",
                        (text, time.time())).lastrowid


def add_response(conn: sqlite3.Connection, prompt_id: int, text: str, source: str = "") -> int:
    """The id of this response to this prompt, inserted if new (identical texts share one)."""
    row = conn.execute("SELECT id FROM responses WHERE prompt_id=? AND text=?",
                       (prompt_id, text)).fetchone()
    if row:
        return row[0]
    return conn.execute(
        "INSERT INTO responses (prompt_id, text, source, created) VALUES (?, ?, ?, ?)",
        (prompt_id, text, source, time.time())).lastrowid


def add_pair(conn: sqlite3.Connection, prompt_id: int, response_a: int, response_b: int,
             ext_id: str | None = None) -> tuple[int, bool]:
    """(pair id, whether it was new). A pair of the same two responses in either order,
    or with the same `ext_id`, already present is returned as it is."""
    if response_a == response_b:
        raise ValueError("a pair needs two different responses")
    if ext_id is not None:
        row = conn.execute("SELECT id, response_a, response_b FROM pairs WHERE ext_id=?",
                           (ext_id,)).fetchone()
        if row:
            if {row[1], row[2]} != {response_a, response_b}:
                raise UserError(f"id {ext_id} already names a different pair in this database; "
                                "give each pair its own id")
            return row[0], False
    row = conn.execute(
        "SELECT id FROM pairs WHERE (response_a=? AND response_b=?) OR (response_a=? AND response_b=?)",
        (response_a, response_b, response_b, response_a)).fetchone()
    if row:
        return row[0], False
    pid = conn.execute(
        "INSERT INTO pairs (prompt_id, response_a, response_b, ext_id, created) VALUES (?, ?, ?, ?, ?)",
        (prompt_id, response_a, response_b, ext_id, time.time())).lastrowid
    return pid, True


@dataclass
class AddResult:
    """What an import or a generate run added."""

    rows: int = 0
    prompts: int = 0
    responses: int = 0
    pairs_added: int = 0
    pairs_existing: int = 0
    identical_skipped: int = 0

    def summary(self) -> str:
        return (f"{self.rows} rows: {self.pairs_added} pairs added, {self.pairs_existing} already "
                f"present, {self.identical_skipped} skipped (identical responses); "
                f"{self.prompts} prompts, {self.responses} responses in the database")


def add_candidates(conn: sqlite3.Connection, prompt: str, responses: list[str],
                   source: str = "", max_pairs: int | None = None, seed: int = 0,
                   result: AddResult | None = None) -> AddResult:
    """Store a prompt, its responses, and pairs of distinct responses (all of them, or
    `max_pairs` drawn at random). Call inside a transaction."""
    result = result or AddResult()
    pid = add_prompt(conn, prompt)
    ids = list(dict.fromkeys(add_response(conn, pid, r, source) for r in responses))
    result.identical_skipped += len(responses) - len(ids)
    combos = list(itertools.combinations(ids, 2))
    if max_pairs is not None and len(combos) > max_pairs:
        combos = random.Random(f"{seed}:{prompt}").sample(combos, max_pairs)
    for a, b in combos:
        _, new = add_pair(conn, pid, a, b)
        result.pairs_added += new
        result.pairs_existing += not new
    return result


def _import_row(conn: sqlite3.Connection, row: Any, where: str, result: AddResult) -> None:
    # The row's form is read by the shared reader (the trainers' preference layouts too).
    from rlhflab.data.preferences import import_row

    r = import_row(row, where)
    if not r.is_pair:
        add_candidates(conn, r.prompt, r.responses, r.source, result=result)
        return
    pid = add_prompt(conn, r.prompt)
    ra, rb = add_response(conn, pid, r.responses[0], r.source), add_response(conn, pid, r.responses[1], r.source)
    if ra == rb:
        result.identical_skipped += 1
        return
    # Stored JSON-encoded so the export gives back 7 as 7 and "7" as "7".
    _, new = add_pair(conn, pid, ra, rb, None if r.ext_id is None else json.dumps(r.ext_id))
    result.pairs_added += new
    result.pairs_existing += not new


def import_jsonl(conn: sqlite3.Connection, path: str | Path) -> AddResult:
    """Add pairs from a jsonl file, all or nothing (one transaction).

    Each row is {"prompt", "response_a", "response_b"} with an optional "id" (kept as the
    export's pair_id) and "source", or {"prompt", "responses": [...]} which adds every
    pair of distinct responses, or a preference row as `rlhflab rm` and `dpo` read it
    (chosen/rejected, plain or one-turn conversational, explicit or implicit prompt;
    `rlhflab.data.preferences.import_row`). Rows already present are counted, not duplicated.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file; give a jsonl file of pairs")
    result = AddResult()
    with transaction(conn):
        # iter_jsonl: a line that is not JSON, or not UTF-8, is a UserError naming it (and
        # the transaction rolls back, so nothing of the file is kept).
        for lineno, row in iter_jsonl(path, "one JSON object per line"):
            _import_row(conn, row, f"{path} line {lineno}", result)
            result.rows += 1
    if result.rows == 0:
        raise UserError(f"{path}: no rows; one JSON object per line with prompt, response_a, response_b")
    result.prompts = count(conn, "prompts")
    result.responses = count(conn, "responses")
    return result


def count(conn: sqlite3.Connection, table: str) -> int:
    assert table in ("prompts", "responses", "pairs", "labels", "skips")
    return conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


# ---------------------------------------------------------------- serving pairs


def is_flipped(conn: sqlite3.Connection, pair_id: int, annotator: str) -> bool:
    """Whether `annotator` sees response B on the left for this pair."""
    salt = _meta(conn, "flip_salt").encode()
    digest = hmac.new(salt, f"{pair_id}\x00{annotator}".encode(), hashlib.sha256).digest()
    return bool(digest[0] & 1)


def _order_key(annotator: str) -> int:
    # Each annotator walks the pairs in an order of their own, so two people working at
    # once rarely get the same pair; a reload shows the same pair again.
    return int.from_bytes(hashlib.sha256(annotator.encode()).digest()[:4], "big") | 1


RESERVE_SECONDS = 600.0  # `serve --reserve-minutes 10`


def next_pair(conn: sqlite3.Connection, annotator: str, labels_per_pair: int | None = 1,
              reserve_seconds: float = RESERVE_SECONDS, now: float | None = None) -> dict | None:
    """The next pair to show `annotator`, or None when nothing is left for them now.

    Candidates: pairs this annotator has neither labelled nor skipped whose labels plus
    live reservations of other annotators are fewer than `labels_per_pair` (None: no
    limit). The least-taken come first, in an order of the annotator's own.

    The pair returned is reserved for the annotator for `reserve_seconds` (one pair per
    annotator; asking again returns the same pair and renews it, a label or skip of it
    releases it). So while every label comes within its reservation, a pair never gets
    more labels than the limit. `reserve_seconds=0` reserves nothing (reads only).
    """
    if reserve_seconds <= 0:
        with snapshot(conn):
            row = _pick(conn, annotator, labels_per_pair, time.time() if now is None else now)
            return _offer(conn, row, annotator)
    with transaction(conn):  # BEGIN IMMEDIATE: no two servers pick against the same counts
        now = time.time() if now is None else now
        conn.execute("DELETE FROM reservations WHERE expires <= ?", (now,))
        held = conn.execute(
            """SELECT r.pair_id FROM reservations r WHERE r.annotator = :who
               AND NOT EXISTS (SELECT 1 FROM labels l WHERE l.pair_id = r.pair_id AND l.annotator = :who)
               AND NOT EXISTS (SELECT 1 FROM skips s WHERE s.pair_id = r.pair_id AND s.annotator = :who)""",
            {"who": annotator}).fetchone()
        row = _pick(conn, annotator, labels_per_pair, now, only=held[0]) if held else None
        if row is None:
            row = _pick(conn, annotator, labels_per_pair, now)
        if row is None:
            conn.execute("DELETE FROM reservations WHERE annotator=?", (annotator,))
            return None
        conn.execute("INSERT OR REPLACE INTO reservations (annotator, pair_id, expires) VALUES (?, ?, ?)",
                     (annotator, row["id"], now + reserve_seconds))
        return _offer(conn, row, annotator)


def _pick(conn: sqlite3.Connection, annotator: str, labels_per_pair: int | None, now: float,
          only: int | None = None) -> sqlite3.Row | None:
    """The best candidate pair (`only`: the pair the annotator holds, which stays theirs)."""
    limit = labels_per_pair if labels_per_pair is not None else -1
    taken = """(SELECT COUNT(*) FROM labels l WHERE l.pair_id = p.id)
             + (SELECT COUNT(*) FROM reservations r WHERE r.pair_id = p.id
                AND r.annotator != :who AND r.expires > :now)"""
    if only is not None:
        # a held pair stays the annotator's unless labels alone (given without a
        # reservation, or after one ran out) have filled it meanwhile
        where = """p.id = :only
          AND (:limit < 0 OR (SELECT COUNT(*) FROM labels l WHERE l.pair_id = p.id) < :limit)"""
    else:
        where = f"""
          NOT EXISTS (SELECT 1 FROM labels l WHERE l.pair_id = p.id AND l.annotator = :who)
          AND NOT EXISTS (SELECT 1 FROM skips s WHERE s.pair_id = p.id AND s.annotator = :who)
          AND (:limit < 0 OR {taken} < :limit)"""
    return conn.execute(
        f"""
        SELECT p.id, p.response_a, p.response_b, pr.text AS prompt,
               (SELECT COUNT(*) FROM labels l WHERE l.pair_id = p.id) AS n, {taken} AS taken
        FROM pairs p JOIN prompts pr ON pr.id = p.prompt_id
        WHERE {where}
        ORDER BY taken, (p.id * :key) % 4294967291, p.id
        LIMIT 1
        """,
        {"who": annotator, "limit": limit, "key": _order_key(annotator), "now": now,
         "only": only}).fetchone()


def _offer(conn: sqlite3.Connection, row: sqlite3.Row | None, annotator: str) -> dict | None:
    if row is None:
        return None
    texts = dict(conn.execute("SELECT id, text FROM responses WHERE id IN (?, ?)",
                              (row["response_a"], row["response_b"])).fetchall())
    flipped = is_flipped(conn, row["id"], annotator)
    a, b = texts[row["response_a"]], texts[row["response_b"]]
    left, right = (b, a) if flipped else (a, b)
    return {"pair_id": row["id"], "prompt": row["prompt"], "left": left, "right": right,
            "flipped": flipped, "n_labels": row["n"]}


def progress(conn: sqlite3.Connection, annotator: str | None = None,
             labels_per_pair: int | None = 1, now: float | None = None) -> dict:
    """Counts for the progress line, from one snapshot: pairs labelled at least once /
    total, pairs others hold right now, and the annotator's own labels and skips."""
    now = time.time() if now is None else now
    with snapshot(conn):
        total = count(conn, "pairs")
        labelled = conn.execute("SELECT COUNT(DISTINCT pair_id) FROM labels").fetchone()[0]
        out = {"total_pairs": total, "labelled_pairs": labelled, "labels": count(conn, "labels"),
               "labels_per_pair": labels_per_pair}
        if labels_per_pair is not None:
            out["complete_pairs"] = conn.execute(
                "SELECT COUNT(*) FROM (SELECT pair_id FROM labels GROUP BY pair_id HAVING COUNT(*) >= ?)",
                (labels_per_pair,)).fetchone()[0]
        # pairs others hold now that this annotator has not labelled or skipped: when
        # /api/next has nothing, these may still come back (skipped, or left to expire)
        out["reserved_pairs"] = conn.execute(
            """SELECT COUNT(DISTINCT r.pair_id) FROM reservations r
               WHERE r.expires > :now AND r.annotator != :who
                 AND NOT EXISTS (SELECT 1 FROM labels l WHERE l.pair_id = r.pair_id AND l.annotator = :who)
                 AND NOT EXISTS (SELECT 1 FROM skips s WHERE s.pair_id = r.pair_id AND s.annotator = :who)""",
            {"now": now, "who": annotator if annotator is not None else ""}).fetchone()[0]
        if annotator is not None:
            out["mine"] = conn.execute("SELECT COUNT(*) FROM labels WHERE annotator=?",
                                       (annotator,)).fetchone()[0]
            out["my_skips"] = conn.execute("SELECT COUNT(*) FROM skips WHERE annotator=?",
                                           (annotator,)).fetchone()[0]
    return out


# ---------------------------------------------------------------- submissions


@dataclass
class LabelIn:
    """One validated label as the annotator gave it."""

    submission_id: str
    annotator: str
    pair_id: int
    level: int  # 1..5 as shown: 1 = left much better
    comment: str = ""
    criteria: tuple[str, ...] = ()
    flipped: bool | None = None  # what the client showed; checked against the server's order
    elapsed_ms: int | None = None


@dataclass
class Stored:
    """The answer to a submission: `stored` is False for a retry of a stored one."""

    id: int
    stored: bool


def _pair_exists(conn: sqlite3.Connection, pair_id: int) -> bool:
    return conn.execute("SELECT 1 FROM pairs WHERE id=?", (pair_id,)).fetchone() is not None


def submit_label(conn: sqlite3.Connection, label: LabelIn) -> Stored:
    """Store a label once. A retry with the same submission_id and content returns the
    stored row; anything else that clashes is a `Rejected` (404/409) and changes nothing."""
    criteria = json.dumps(sorted(label.criteria))
    with transaction(conn):
        old = conn.execute("SELECT * FROM labels WHERE submission_id=?",
                           (label.submission_id,)).fetchone()
        if old is not None:
            if (old["pair_id"], old["annotator"], old["level"], old["comment"], old["criteria"]) != (
                    label.pair_id, label.annotator, label.level, label.comment, criteria):
                raise Rejected(409, f"submission_id {label.submission_id!r} was already used for "
                                    "a different label; make a new id for a new label")
            return Stored(old["id"], False)
        if not _pair_exists(conn, label.pair_id):
            raise Rejected(404, f"pair {label.pair_id} does not exist; ask /api/next for a pair")
        if conn.execute("SELECT 1 FROM labels WHERE pair_id=? AND annotator=?",
                        (label.pair_id, label.annotator)).fetchone():
            raise Rejected(409, f"annotator {label.annotator!r} already labelled pair "
                                f"{label.pair_id}; ask /api/next for another pair")
        flipped = is_flipped(conn, label.pair_id, label.annotator)
        if label.flipped is not None and label.flipped != flipped:
            raise Rejected(409, f"pair {label.pair_id}: 'flipped' does not match the order the "
                                f"server shows {label.annotator!r}; reload the page")
        a_level = 6 - label.level if flipped else label.level
        conn.execute("DELETE FROM reservations WHERE annotator=? AND pair_id=?",
                     (label.annotator, label.pair_id))
        lid = conn.execute(
            """INSERT INTO labels (submission_id, pair_id, annotator, level, flipped, a_level,
                                   comment, criteria, elapsed_ms, created)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
            (label.submission_id, label.pair_id, label.annotator, label.level, int(flipped),
             a_level, label.comment, criteria, label.elapsed_ms, time.time())).lastrowid
    return Stored(lid, True)


def submit_skip(conn: sqlite3.Connection, submission_id: str, annotator: str, pair_id: int) -> Stored:
    """Record that `annotator` skipped a pair (it is not offered to them again)."""
    with transaction(conn):
        old = conn.execute("SELECT * FROM skips WHERE submission_id=?", (submission_id,)).fetchone()
        if old is not None:
            if (old["pair_id"], old["annotator"]) != (pair_id, annotator):
                raise Rejected(409, f"submission_id {submission_id!r} was already used for a "
                                    "different skip; make a new id")
            return Stored(old["id"], False)
        if not _pair_exists(conn, pair_id):
            raise Rejected(404, f"pair {pair_id} does not exist; ask /api/next for a pair")
        if conn.execute("SELECT 1 FROM labels WHERE pair_id=? AND annotator=?",
                        (pair_id, annotator)).fetchone():
            raise Rejected(409, f"annotator {annotator!r} already labelled pair {pair_id}; "
                                "it cannot be skipped")
        old = conn.execute("SELECT id FROM skips WHERE pair_id=? AND annotator=?",
                           (pair_id, annotator)).fetchone()
        if old is not None:
            return Stored(old["id"], False)
        conn.execute("DELETE FROM reservations WHERE annotator=? AND pair_id=?", (annotator, pair_id))
        sid = conn.execute(
            "INSERT INTO skips (submission_id, pair_id, annotator, created) VALUES (?, ?, ?, ?)",
            (submission_id, pair_id, annotator, time.time())).lastrowid
    return Stored(sid, True)


# ---------------------------------------------------------------- reading labels


@dataclass
class PairLabels:
    """A pair with its texts and every label given to it (canonical a_levels)."""

    pair_id: int | str  # the imported id when the pair has one, else the database id
    prompt: str
    response_a: str
    response_b: str
    a_levels: list[int]
    annotators: list[str]


def labelled_pairs(conn: sqlite3.Connection, include_unlabelled: bool = False) -> list[PairLabels]:
    """Every pair (with at least one label unless `include_unlabelled`), in id order."""
    rows = conn.execute(
        """
        SELECT p.id, p.ext_id, pr.text AS prompt, ra.text AS a, rb.text AS b
        FROM pairs p
        JOIN prompts pr ON pr.id = p.prompt_id
        JOIN responses ra ON ra.id = p.response_a
        JOIN responses rb ON rb.id = p.response_b
        ORDER BY p.id
        """).fetchall()
    by_pair: dict[int, list[sqlite3.Row]] = {}
    for lab in conn.execute("SELECT pair_id, annotator, a_level FROM labels ORDER BY id"):
        by_pair.setdefault(lab["pair_id"], []).append(lab)
    out = []
    for r in rows:
        labs = by_pair.get(r["id"], [])
        if not labs and not include_unlabelled:
            continue
        out.append(PairLabels(
            pair_id=json.loads(r["ext_id"]) if r["ext_id"] is not None else r["id"],
            prompt=r["prompt"], response_a=r["a"], response_b=r["b"],
            a_levels=[lab["a_level"] for lab in labs],
            annotators=[lab["annotator"] for lab in labs]))
    return out
