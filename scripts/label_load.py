"""A team of annotators on `rlhflab label serve`, for real: threads on loopback label a fresh
database to completion while the stats are read throughout; prints what held.

    python scripts/label_load.py [--annotators 32] [--servers 2] [--pairs 160]
                                 [--labels-per-pair 2] [--reserve-minutes 10] [--json]

Each annotator has a token of their own (`--annotator-tokens`) and talks to one of the
servers (all on one SQLite file): GET /api/next, then a label (or, for about one pair in 7,
a skip), every fifth label sent twice as the page's retry does, until /api/next has nothing
left and no pair is on anyone's screen. Meanwhile a lead (the shared token) polls
/api/stats on every server, and `rlhflab label stats --json`, `label export` and
`label backup` run against the file. Checked at the end: no 5xx; every stats answer adds
up (labels = the sum over annotators = the sum of k x pairs labelled k times); every
acknowledged label stored once, nothing else stored; labels per pair against the limit.
`--reserve-minutes 0` serves without reservations (the behaviour before them).

Used by tests/test_label_team.py (smaller) and for the figures in docs/labelling.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_TOKEN = "lead-shared-token-0001"


@dataclass
class LoadResult:
    annotators: int
    servers: int
    pairs: int
    labels_per_pair: int
    reserve_minutes: float
    seconds: float = 0.0
    requests: int = 0
    statuses: dict = field(default_factory=dict)
    server_errors: int = 0          # 5xx answers and requests that got no answer
    refused: dict = field(default_factory=dict)  # 4xx by route and status (a 409 is a race lost)
    stats_polls: int = 0            # /api/stats answers and `label stats` runs checked
    inconsistent_polls: int = 0
    stats_cli_failures: int = 0
    exports: int = 0
    inconsistent_exports: int = 0
    backups_ok: int = 0
    acknowledged: int = 0           # labels answered 201
    stored: int = 0                 # labels in the database at the end
    lost: int = 0                   # acknowledged, not stored
    unacknowledged: int = 0         # stored, never acknowledged
    duplicated: int = 0             # a submission stored twice (cannot happen: UNIQUE)
    skips: int = 0
    max_labels_on_a_pair: int = 0
    labels_beyond_limit: int = 0    # sum over pairs of max(0, labels - limit)
    pairs_over_limit: int = 0
    incomplete_pairs: int = 0       # under the limit though someone could still label them
    problems: list = field(default_factory=list)

    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        r = self
        return [
            f"annotators {r.annotators}, servers {r.servers} on one database, pairs {r.pairs}, "
            f"labels per pair {r.labels_per_pair}, reservations {r.reserve_minutes:g} min",
            f"requests {r.requests} in {r.seconds:.1f} s ({r.requests / max(r.seconds, 1e-9):.0f}/s); "
            f"statuses {dict(sorted(r.statuses.items()))}; 5xx or no answer: {r.server_errors}",
            f"refusals {dict(sorted(r.refused.items()))}",
            f"stats read {r.stats_polls} times, {r.inconsistent_polls} inconsistent, "
            f"`label stats` failures {r.stats_cli_failures}; exports {r.exports} "
            f"({r.inconsistent_exports} inconsistent); backups {r.backups_ok} ok",
            f"labels acknowledged {r.acknowledged}, stored {r.stored}, lost {r.lost}, stored without "
            f"acknowledgement {r.unacknowledged}, duplicated {r.duplicated}; skips {r.skips}",
            f"most labels on a pair {r.max_labels_on_a_pair} (limit {r.labels_per_pair}); "
            f"pairs over the limit {r.pairs_over_limit}; labels beyond the limit "
            f"{r.labels_beyond_limit} of {r.stored} ({100.0 * r.labels_beyond_limit / max(r.stored, 1):.1f}%); "
            f"pairs left incomplete {r.incomplete_pairs}",
        ]


# ------------------------------------------------------------------ the pieces


def make_database(path: Path, pairs: int) -> Path:
    """`pairs` prompts with two responses each: one pair per prompt."""
    from rlhflab.label import db as labeldb

    conn = labeldb.connect(path, create=True)
    with labeldb.transaction(conn):
        for i in range(pairs):
            labeldb.add_candidates(conn, f"Prompt {i}: explain it to a 10-year-old",
                                   [f"Answer A to {i}.", f"Answer B to {i}."])
    conn.close()
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(base: str, method: str, path: str, body: dict | None = None, token: str | None = None,
         timeout: float = 30.0) -> tuple[int, dict]:
    """One HTTP request with the standard library; returns (status, JSON body). The tests'
    helpers (tests/label_helpers.py) use this one too."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, {"raw": raw.decode(errors="replace")}


def start_servers(db: Path, n: int, workdir: Path, tokens_file: Path, labels_per_pair: int,
                  reserve_minutes: float, timeout: float = 30.0) -> list[tuple[subprocess.Popen, str]]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = []
    for k in range(n):
        port = free_port()
        cmd = [sys.executable, "-m", "rlhflab", "label", "serve", "--db", str(db), "--port", str(port),
               "--quiet", "--token", SHARED_TOKEN, "--annotator-tokens", str(tokens_file),
               "--labels-per-pair", str(labels_per_pair), "--reserve-minutes", str(reserve_minutes)]
        with open(workdir / f"server{k}.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
        out.append((proc, f"http://127.0.0.1:{port}"))
    deadline = time.monotonic() + timeout
    for proc, url in out:
        while True:
            if proc.poll() is not None:
                stop_servers(out)
                raise RuntimeError(f"a server exited with {proc.returncode}; see {workdir}/server*.log")
            try:
                if http(url, "GET", "/api/health", token=SHARED_TOKEN, timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                stop_servers(out)
                raise RuntimeError(f"a server did not answer in {timeout} s")
            time.sleep(0.05)
    return out


def stop_servers(servers: list[tuple[subprocess.Popen, str]]) -> None:
    for proc, _ in servers:
        if proc.poll() is None:
            proc.terminate()
    for proc, _ in servers:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def stats_problems(s: dict) -> list[str]:
    """What does not add up in one stats answer."""
    out = []
    by_annotator = sum(a["labels"] for a in s["annotators"].values())
    if s["labels"] != by_annotator:
        out.append(f"labels {s['labels']} != sum over annotators {by_annotator}")
    skips = sum(a["skips"] for a in s["annotators"].values())
    if s["skips"] != skips:
        out.append(f"skips {s['skips']} != sum over annotators {skips}")
    levels = sum(sum(a["levels"].values()) for a in s["annotators"].values())
    if levels != s["labels"]:
        out.append(f"levels used {levels} != labels {s['labels']}")
    k_times = s["pairs_labelled_k_times"]
    if sum(k_times.values()) != s["pairs"]:
        out.append(f"pairs labelled k times add to {sum(k_times.values())}, not {s['pairs']}")
    if sum(int(k) * n for k, n in k_times.items()) != s["labels"]:
        out.append(f"sum of k x pairs labelled k times != labels {s['labels']}")
    return out


def _skips(annotator: str, pair_id: int) -> bool:
    return hashlib.sha256(f"{annotator}/{pair_id}".encode()).digest()[0] % 7 == 0


# ------------------------------------------------------------------ the run


def run(workdir: Path, annotators: int = 32, servers: int = 2, pairs: int = 160,
        labels_per_pair: int = 2, reserve_minutes: float = 10.0, time_limit: float = 120.0) -> LoadResult:
    from rlhflab.label import db as labeldb
    from rlhflab.label.export import stats

    workdir.mkdir(parents=True, exist_ok=True)
    db = make_database(workdir / "team.db", pairs)
    names = [f"annotator{k:02d}" for k in range(annotators)]
    tokens = {name: f"token-{name}-{k:04d}" for k, name in enumerate(names)}
    tokens_file = workdir / "tokens.json"
    tokens_file.write_text(json.dumps(tokens))
    result = LoadResult(annotators, servers, pairs, labels_per_pair, reserve_minutes)
    procs = start_servers(db, servers, workdir, tokens_file, labels_per_pair, reserve_minutes)
    urls = [url for _, url in procs]
    lock = threading.Lock()
    acked: dict[str, tuple[str, int]] = {}
    statuses: Counter = Counter()
    refused: Counter = Counter()
    problems: list[str] = []
    done = threading.Event()
    deadline = time.monotonic() + time_limit

    def call(url: str, method: str, path: str, body: dict | None, token: str) -> tuple[int, dict]:
        try:
            status, data = http(url, method, path, body, token=token)
        except OSError as exc:
            status, data = 599, {"error": f"no answer: {exc}"}
        with lock:
            statuses[status] += 1
            if status >= 500:
                problems.append(f"{method} {path}: {status} {str(data)[:200]}")
            elif status >= 400:
                refused[f"{path.split('?')[0]} {status}"] += 1
        return status, data

    def annotator(k: int) -> None:
        name, url = names[k], urls[k % len(urls)]
        token, n = tokens[name], 0
        while time.monotonic() < deadline:
            status, data = call(url, "GET", "/api/next", None, token)
            if status != 200:
                return
            pair = data["pair"]
            if pair is None:
                if data["progress"]["reserved_pairs"] == 0:
                    return
                time.sleep(0.02)  # pairs on others' screens may come back (a skip)
                continue
            n += 1
            sub = f"{name}-{n:05d}"
            if _skips(name, pair["pair_id"]):
                body = {"submission_id": sub, "pair_id": pair["pair_id"]}
                call(url, "POST", "/api/skip", body, token)
                continue
            body = {"submission_id": sub, "pair_id": pair["pair_id"], "flipped": pair["flipped"],
                    "level": 1 + (k + pair["pair_id"]) % 5, "elapsed_ms": 1000 + 10 * n}
            for attempt in range(2 if n % 5 == 0 else 1):  # every fifth label is retried at once
                status, data = call(url, "POST", "/api/labels", body, token)
                if status == 201:
                    with lock:
                        acked[sub] = (name, pair["pair_id"])
                if attempt and status != 200:
                    with lock:
                        problems.append(f"retry of {sub} got {status}, not 200")

    def lead(url: str) -> None:
        last = -1
        while not done.is_set():
            status, s = call(url, "GET", "/api/stats", None, SHARED_TOKEN)
            if status == 200:
                bad = stats_problems(s)
                with lock:
                    result.stats_polls += 1
                    result.inconsistent_polls += bool(bad)
                    problems.extend(f"/api/stats: {b}" for b in bad)
                    if s["labels"] < last:
                        problems.append(f"/api/stats went back from {last} to {s['labels']} labels")
                last = max(last, s["labels"])
            time.sleep(0.01)

    def cli(*args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        return subprocess.run([sys.executable, "-m", "rlhflab", "label", *args], capture_output=True,
                              text=True, env=env, cwd=str(REPO), timeout=60)

    def files() -> None:
        # the lead's commands on the file while the servers write to it
        k = 0
        while not done.is_set():
            k += 1
            got = cli("stats", "--db", str(db), "--json")
            with lock:
                if got.returncode != 0:
                    result.stats_cli_failures += 1
                    problems.append(f"label stats exited {got.returncode}: {got.stderr.strip()[-200:]}")
                else:
                    bad = stats_problems(json.loads(got.stdout))
                    result.stats_polls += 1
                    result.inconsistent_polls += bool(bad)
                    problems.extend(f"label stats: {b}" for b in bad)
            if k % 3 == 1:
                out = workdir / f"prefs{k}.jsonl"
                got = cli("export", "--db", str(db), "--out", str(out), "--keep-ties")
                if got.returncode != 0 and "no pair to export" not in got.stderr:  # (before the first label)
                    with lock:
                        problems.append(f"label export exited {got.returncode}: {got.stderr.strip()[-200:]}")
                if got.returncode == 0:
                    # "wrote R rows ... (T ties kept, D ties dropped, F pairs with too few labels,
                    # U pairs unlabelled)": with --keep-ties, R + U = every pair
                    words = got.stdout.split()
                    rows, unlabelled = int(words[1]), int(words[words.index("unlabelled)") - 2])
                    lines = len(out.read_text().splitlines())
                    with lock:
                        result.exports += 1
                        if rows != lines or rows + unlabelled != pairs:
                            result.inconsistent_exports += 1
                            problems.append(f"export: {got.stdout.strip()} but {lines} lines, {pairs} pairs")
            if k % 3 == 2:
                copy = workdir / f"backup{k}.db"
                got = cli("backup", "--db", str(db), "--out", str(copy))
                ok = got.returncode == 0
                if ok:
                    c = labeldb.connect(copy)
                    ok = c.execute("PRAGMA integrity_check").fetchone()[0] == "ok" and not stats_problems(stats(c))
                    c.close()
                with lock:
                    result.backups_ok += ok
                    if not ok:
                        problems.append(f"backup {copy.name} failed: {got.stderr.strip()[-200:]}")

    t0 = time.monotonic()
    workers = [threading.Thread(target=annotator, args=(k,)) for k in range(annotators)]
    watchers = [threading.Thread(target=lead, args=(url,)) for url in urls]
    watchers.append(threading.Thread(target=files))
    try:
        for th in watchers + workers:
            th.start()
        for th in workers:
            th.join()
        result.seconds = time.monotonic() - t0
    finally:
        done.set()
        for th in watchers:
            th.join()
        stop_servers(procs)
    if time.monotonic() > deadline:
        problems.append(f"not done in {time_limit} s")

    conn = labeldb.connect(db)
    rows = conn.execute("SELECT submission_id, annotator, pair_id FROM labels").fetchall()
    per_pair = Counter(r["pair_id"] for r in rows)
    skips_per_pair = Counter(r[0] for r in conn.execute("SELECT pair_id FROM skips"))
    result.skips = sum(skips_per_pair.values())
    integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    conn.close()
    stored = {r["submission_id"]: (r["annotator"], r["pair_id"]) for r in rows}
    result.stored = len(rows)
    result.duplicated = len(rows) - len(stored)
    result.acknowledged = len(acked)
    result.lost = sum(1 for sub, what in acked.items() if stored.get(sub) != what)
    result.unacknowledged = sum(1 for sub in stored if sub not in acked)
    result.max_labels_on_a_pair = max(per_pair.values(), default=0)
    result.labels_beyond_limit = sum(max(0, n - labels_per_pair) for n in per_pair.values())
    result.pairs_over_limit = sum(n > labels_per_pair for n in per_pair.values())
    # complete: the limit reached, or every annotator has labelled or skipped the pair
    result.incomplete_pairs = sum(
        1 for pid in range(1, pairs + 1)
        if per_pair[pid] < labels_per_pair and per_pair[pid] + skips_per_pair[pid] < annotators)
    result.requests = sum(statuses.values())
    result.statuses = {str(k): v for k, v in statuses.items()}
    result.server_errors = sum(v for k, v in statuses.items() if k >= 500)
    result.refused = dict(refused)
    if integrity != "ok":
        problems.append(f"integrity_check: {integrity}")
    for name, value in (("lost", result.lost), ("unacknowledged", result.unacknowledged),
                        ("duplicated", result.duplicated), ("incomplete_pairs", result.incomplete_pairs)):
        if value:
            problems.append(f"{name}: {value}")
    result.problems = problems[:50]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--annotators", type=int, default=32)
    ap.add_argument("--servers", type=int, default=2, help="servers on the one database")
    ap.add_argument("--pairs", type=int, default=160)
    ap.add_argument("--labels-per-pair", type=int, default=2)
    ap.add_argument("--reserve-minutes", type=float, default=10.0, help="0: no reservations")
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory(prefix="label-load-") as tmp:
        result = run(Path(tmp), args.annotators, args.servers, args.pairs, args.labels_per_pair,
                     args.reserve_minutes, args.time_limit)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print("\n".join(result.lines()))
        for p in result.problems:
            print(f"problem: {p}")
    return 0 if result.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
