"""The real server (a child process on a loopback port): concurrency and a hard kill."""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from label_helpers import make_db, request, start_server

from rlhflab.label import db as labeldb

THREADS, PER_THREAD = 20, 100
TOKEN = "tok-concurrency-1"


def _post_until_answered(url, body, attempts=8):
    """POST, retrying connection errors with the same submission_id, as the page does."""
    for k in range(attempts):
        try:
            return request(url, "POST", "/api/labels", body, token=TOKEN, timeout=30)
        except OSError:
            time.sleep(0.05 * (k + 1))
    raise AssertionError(f"no answer for {body['submission_id']}")


@pytest.mark.timeout(180)
def test_many_threads_store_every_label_exactly_once(tmp_path):
    db = make_db(tmp_path / "p.db", n_prompts=PER_THREAD, responses_per_prompt=2)
    server = start_server(db, tmp_path / "server.log", token=TOKEN)
    statuses: dict[str, list[int]] = {}
    lock = threading.Lock()

    def annotator(t: int) -> None:
        for p in range(1, PER_THREAD + 1):
            sub = f"t{t:02d}-pair{p:04d}"
            body = {"submission_id": sub, "annotator": f"ann{t:02d}", "pair_id": p,
                    "level": 1 + (t + p) % 5, "comment": f"c{t}-{p}"}
            tries = 2 if p % 10 == 0 else 1  # every tenth label is "retried" at once
            for _ in range(tries):
                status, _ = _post_until_answered(server.url, body)
                with lock:
                    statuses.setdefault(sub, []).append(status)

    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(annotator, range(THREADS)))
        elapsed = time.monotonic() - t0
    finally:
        server.stop()

    assert len(statuses) == THREADS * PER_THREAD
    for sub, got in statuses.items():
        assert got[0] == 201 and all(s == 200 for s in got[1:]), (sub, got)
    conn = labeldb.connect(db)
    rows = conn.execute("SELECT submission_id, annotator, pair_id, level, comment FROM labels").fetchall()
    assert len(rows) == THREADS * PER_THREAD
    assert len({r["submission_id"] for r in rows}) == len(rows)
    for r in rows:
        t, p = int(r["annotator"][3:]), r["pair_id"]
        assert r["submission_id"] == f"t{t:02d}-pair{p:04d}"
        assert (r["level"], r["comment"]) == (1 + (t + p) % 5, f"c{t}-{p}")
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    print(f"{THREADS * PER_THREAD} labels from {THREADS} threads in {elapsed:.1f}s")


@pytest.mark.timeout(120)
def test_killed_server_loses_nothing_it_acknowledged(tmp_path):
    db = make_db(tmp_path / "p.db", n_prompts=200, responses_per_prompt=2)
    server = start_server(db, tmp_path / "server.log", token=TOKEN)
    acked: dict[str, dict] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def annotator(t: int) -> None:
        for p in range(1, 201):
            if stop.is_set():
                return
            sub = f"kill-t{t}-p{p:04d}"
            body = {"submission_id": sub, "annotator": f"k{t}", "pair_id": p, "level": 1 + p % 5}
            try:
                status, _ = request(server.url, "POST", "/api/labels", body, token=TOKEN, timeout=10)
            except OSError:
                return  # the server is gone: this label was never acknowledged
            if status in (200, 201):
                with lock:
                    acked[sub] = body

    threads = [threading.Thread(target=annotator, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 60
    while len(acked) < 150 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(server.proc.pid, signal.SIGKILL)  # mid-run: requests are in flight
    server.proc.wait(timeout=10)
    stop.set()
    for th in threads:
        th.join(timeout=30)
    assert len(acked) >= 150, open(server.log).read()

    conn = labeldb.connect(db)
    stored = {r[0] for r in conn.execute("SELECT submission_id FROM labels")}
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    missing = set(acked) - stored
    assert not missing, f"{len(missing)} acknowledged labels lost, e.g. {sorted(missing)[:3]}"
    # whatever was in flight was stored at most once; retrying it after a restart is safe
    again = start_server(db, tmp_path / "server2.log", token=TOKEN)
    try:
        first = next(iter(acked.values()))
        status, body = request(again.url, "POST", "/api/labels", first, token=TOKEN)
        assert status == 200 and body["stored"] is False
    finally:
        again.stop()


@pytest.mark.timeout(60)
def test_simultaneous_duplicates_are_stored_once(tmp_path):
    db = make_db(tmp_path / "p.db")
    server = start_server(db, tmp_path / "server.log", token=TOKEN)
    barrier = threading.Barrier(10)
    body = {"submission_id": "dup-000000001", "annotator": "ann", "pair_id": 1, "level": 2}

    def send(_):
        barrier.wait()
        return _post_until_answered(server.url, body)[0]

    try:
        with ThreadPoolExecutor(10) as pool:
            got = sorted(pool.map(send, range(10)))
    finally:
        server.stop()
    assert got == [200] * 9 + [201]
    conn = labeldb.connect(db)
    assert labeldb.count(conn, "labels") == 1
    conn.close()


def test_server_answers_401_without_token_and_serves_assets(tmp_path):
    db = make_db(tmp_path / "p.db")
    server = start_server(db, tmp_path / "server.log", token=TOKEN)
    try:
        status, body = request(server.url, "GET", "/api/next?annotator=a")
        assert status == 401 and "token" in body["error"]
        status, _ = request(server.url, "GET", "/api/next?annotator=a", token=TOKEN)
        assert status == 200
    finally:
        server.stop()
    assert "serving on http://127.0.0.1:" in server.log.read_text()
