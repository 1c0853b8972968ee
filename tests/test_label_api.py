"""Every route of the labelling app through Flask's test client, bad requests included."""

import json

import pytest
from label_helpers import SCRIPT, make_db

from rlhflab.label import db as labeldb
from rlhflab.label.app import create_app

TOKEN = "s3cret-token-123"


@pytest.fixture
def db_path(tmp_path):
    return make_db(tmp_path / "p.db", n_prompts=3, responses_per_prompt=2, script_in=1)


@pytest.fixture
def client(db_path):
    return create_app(db_path).test_client()


def _labels(db_path):
    conn = labeldb.connect(db_path)
    rows = [dict(r) for r in conn.execute("SELECT * FROM labels ORDER BY id")]
    conn.close()
    return rows


def _post(client, path, body, **kw):
    return client.post(path, data=json.dumps(body), content_type="application/json", **kw)


def _label_body(pair, **over):
    body = {"submission_id": "sub-000000001", "annotator": "ann", "pair_id": pair["pair_id"],
            "level": 2, "flipped": pair["flipped"], "comment": "clearer", "criteria": ["clarity"],
            "elapsed_ms": 1234}
    body.update(over)
    return body


def test_index_serves_the_page_with_its_assets(client):
    page = client.get("/")
    assert page.status_code == 200 and page.mimetype == "text/html"
    html = page.get_data(as_text=True)
    assert "/static/app.js" in html and "/static/app.css" in html
    assert "http://" not in html and "https://" not in html  # no CDN: works offline
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    cfg = json.loads(__import__("html").unescape(html.split('data-config="')[1].split('"')[0]))
    assert cfg["levels"]["1"] == "A much better" and len(cfg["criteria"]) == 5
    for asset in ("/static/app.js", "/static/app.css"):
        assert client.get(asset).status_code == 200


def test_health(client):
    assert client.get("/api/health").get_json() == {"ok": True}


def test_next_returns_a_pair_and_progress(client):
    data = client.get("/api/next?annotator=ann").get_json()
    assert set(data["pair"]) == {"pair_id", "prompt", "left", "right", "flipped", "n_labels"}
    assert data["progress"] == {"total_pairs": 3, "labelled_pairs": 0, "labels": 0,
                                "labels_per_pair": 1, "complete_pairs": 0, "reserved_pairs": 0,
                                "mine": 0, "my_skips": 0}
    # the pair is now held for ann: bob sees it counted as on someone's screen, and gets another
    bob = client.get("/api/next?annotator=bob").get_json()
    assert bob["progress"]["reserved_pairs"] == 1 and bob["pair"]["pair_id"] != data["pair"]["pair_id"]
    assert client.get("/api/next").status_code == 400  # no annotator


def test_model_text_is_json_not_markup(client, db_path):
    # the <script> response reaches the page only inside JSON (rendered with textContent)
    conn = labeldb.connect(db_path)
    pid = conn.execute("SELECT p.id FROM pairs p JOIN responses r ON r.id IN (p.response_a, p.response_b) "
                       "WHERE r.text LIKE '%<script>%'").fetchone()[0]
    conn.close()
    seen = None
    for _ in range(3):
        data = client.get("/api/next?annotator=ann").get_json()
        pair = data["pair"]
        if pair["pair_id"] == pid:
            seen = pair
            break
        _post(client, "/api/skip", {"submission_id": f"skip-{pair['pair_id']:08d}",
                                    "annotator": "ann", "pair_id": pair["pair_id"]})
    assert seen is not None and SCRIPT in seen["left"] + seen["right"]
    resp = client.get("/api/next?annotator=ann")
    assert resp.mimetype == "application/json"
    assert "<script>" not in client.get("/").get_data(as_text=True).split("<body")[1].split("</main>")[0]


def test_post_label_stores_once_and_retry_is_200(client, db_path):
    pair = client.get("/api/next?annotator=ann").get_json()["pair"]
    first = _post(client, "/api/labels", _label_body(pair))
    assert first.status_code == 201 and first.get_json()["stored"] is True
    again = _post(client, "/api/labels", _label_body(pair))
    assert again.status_code == 200 and again.get_json() == {"stored": False,
                                                             "label_id": first.get_json()["label_id"]}
    rows = _labels(db_path)
    assert len(rows) == 1
    row = rows[0]
    assert (row["annotator"], row["level"], row["flipped"], row["comment"], row["elapsed_ms"]) == (
        "ann", 2, int(pair["flipped"]), "clearer", 1234)
    assert json.loads(row["criteria"]) == ["clarity"]
    assert row["a_level"] == (4 if pair["flipped"] else 2)
    nxt = client.get("/api/next?annotator=ann").get_json()
    assert nxt["pair"]["pair_id"] != pair["pair_id"] and nxt["progress"]["mine"] == 1


def _bad_cases(pair):
    long = "x" * 2001
    return [
        (_label_body(pair, pair_id=99999), 404, "pair 99999 does not exist"),
        (_label_body(pair, level=0), 400, "level: must be between 1 and 5"),
        (_label_body(pair, level=6), 400, "level"),
        (_label_body(pair, level="3"), 400, "level: expected an integer"),
        (_label_body(pair, level=True), 400, "level: expected an integer"),
        (_label_body(pair, level=2.5), 400, "level"),
        (_label_body(pair, comment=long), 400, "comment: at most 2000 characters"),
        (_label_body(pair, comment=5), 400, "comment"),
        (_label_body(pair, criteria=["vibes"]), 400, "criteria: unknown ['vibes']"),
        (_label_body(pair, criteria="clarity"), 400, "criteria"),
        (_label_body(pair, submission_id="short"), 400, "submission_id"),
        (_label_body(pair, submission_id="has space in it"), 400, "submission_id"),
        (_label_body(pair, annotator=""), 400, "annotator"),
        (_label_body(pair, annotator="x" * 65), 400, "annotator: at most 64"),
        (_label_body(pair, annotator="a\u0000b"), 400, "control characters"),
        (_label_body(pair, flipped="yes"), 400, "flipped"),
        (_label_body(pair, flipped=not pair["flipped"]), 409, "flipped"),
        (_label_body(pair, elapsed_ms=-1), 400, "elapsed_ms"),
        (_label_body(pair, extra=1), 400, "unknown field(s) ['extra']"),
    ]


def test_bad_label_requests_get_4xx_with_a_message_and_change_nothing(client, db_path):
    pair = client.get("/api/next?annotator=ann").get_json()["pair"]
    for body, status, fragment in _bad_cases(pair):
        resp = _post(client, "/api/labels", body)
        assert resp.status_code == status, (body, resp.get_json())
        assert fragment in resp.get_json()["error"], (fragment, resp.get_json())
    assert _labels(db_path) == []


def test_bad_bodies(client, db_path):
    resp = client.post("/api/labels", data="level=1", content_type="application/x-www-form-urlencoded")
    assert resp.status_code == 415 and "application/json" in resp.get_json()["error"]
    resp = client.post("/api/labels", data="{oops", content_type="application/json")
    assert resp.status_code == 400 and "JSON object" in resp.get_json()["error"]
    resp = client.post("/api/labels", data="[1, 2]", content_type="application/json")
    assert resp.status_code == 400
    resp = client.post("/api/labels", data=json.dumps({"comment": "x" * 70000}),
                       content_type="application/json")
    assert resp.status_code == 413 and "shorten" in resp.get_json()["error"]
    assert client.get("/api/labels").status_code == 405
    resp = client.get("/api/nope")
    assert resp.status_code == 404 and "no route" in resp.get_json()["error"]
    assert _labels(db_path) == []


def _one_line_error(resp, status):
    assert resp.status_code == status, resp.get_data(as_text=True)[:200]
    error = resp.get_json()["error"]
    assert error and "\n" not in error, error
    return error


def test_deeply_nested_json_is_400(client, db_path):
    # issue 52 case 2: 30000 nested arrays (60 KB, under the size limit) made a RecursionError: 500
    deep = "[" * 30000 + "]" * 30000
    for path in ("/api/labels", "/api/skip"):
        assert "nested too deeply" in _one_line_error(
            client.post(path, data=deep, content_type="application/json"), 400)
    # nested inside a field, shallow enough to parse: the field's own check answers
    pair = client.get("/api/next?annotator=ann").get_json()["pair"]
    body = json.dumps(_label_body(pair)).replace('"level": 2', '"level": ' + "[" * 500 + "]" * 500)
    assert "level: expected an integer, got a JSON array" in _one_line_error(
        client.post("/api/labels", data=body, content_type="application/json"), 400)
    assert _labels(db_path) == []


def test_lone_surrogates_are_400(client, db_path):
    # issue 52 case 3: "x\ud800" (a JSON escape of half a UTF-16 pair) made sqlite3 raise
    # UnicodeEncodeError: 500
    pair = client.get("/api/next?annotator=ann").get_json()["pair"]
    for field, value in [("annotator", "x\ud800"), ("comment", "fine \udfff text"),
                         ("criteria", ["\ud800"])]:
        raw = json.dumps(_label_body(pair, **{field: value}))  # ensure_ascii: the escape as sent
        assert "\\ud" in raw.lower()
        error = _one_line_error(client.post("/api/labels", data=raw, content_type="application/json"), 400)
        assert error.startswith(field), error
    raw = json.dumps({"submission_id": "skip-00000001", "annotator": "\ud800", "pair_id": pair["pair_id"]})
    assert "lone surrogate" in _one_line_error(client.post("/api/skip", data=raw, content_type="application/json"), 400)
    # bytes that are not UTF-8 at all
    bad = b'{"submission_id": "sub-000000001", "annotator": "\xff", "pair_id": 1, "level": 1}'
    assert "JSON object" in _one_line_error(client.post("/api/labels", data=bad, content_type="application/json"), 400)
    # a well-formed pair of surrogates is one character, stored as it is
    ok = json.dumps(_label_body(pair, comment="\U0001F600"))
    assert "\\ud83d\\ude00" in ok
    assert client.post("/api/labels", data=ok, content_type="application/json").status_code == 201
    assert [r["comment"] for r in _labels(db_path)] == ["\U0001F600"]


def test_same_annotator_cannot_label_a_pair_twice(client, db_path):
    pair = client.get("/api/next?annotator=ann").get_json()["pair"]
    assert _post(client, "/api/labels", _label_body(pair)).status_code == 201
    resp = _post(client, "/api/labels", _label_body(pair, submission_id="sub-000000002", level=5))
    assert resp.status_code == 409 and "already labelled" in resp.get_json()["error"]
    resp = _post(client, "/api/labels", _label_body(pair, level=5))  # reused id, other content
    assert resp.status_code == 409 and "different label" in resp.get_json()["error"]
    assert [r["level"] for r in _labels(db_path)] == [2]


def test_skip_route(client):
    pair = client.get("/api/next?annotator=ann").get_json()["pair"]
    body = {"submission_id": "skip-00000001", "annotator": "ann", "pair_id": pair["pair_id"]}
    assert _post(client, "/api/skip", body).status_code == 201
    assert _post(client, "/api/skip", body).status_code == 200
    assert _post(client, "/api/skip", dict(body, pair_id=4242)).status_code == 409  # reused id
    assert _post(client, "/api/skip", dict(body, submission_id="skip-00000002", pair_id=4242)).status_code == 404
    assert _post(client, "/api/skip", dict(body, level=1)).status_code == 400
    data = client.get("/api/next?annotator=ann").get_json()
    assert data["pair"]["pair_id"] != pair["pair_id"] and data["progress"]["my_skips"] == 1


def test_progress_and_done(client):
    for i in range(3):
        pair = client.get("/api/next?annotator=ann").get_json()["pair"]
        _post(client, "/api/labels", _label_body(pair, submission_id=f"sub-00000000{i}"))
    data = client.get("/api/next?annotator=ann").get_json()
    assert data["pair"] is None and data["progress"]["labelled_pairs"] == 3
    assert client.get("/api/progress").get_json()["labels"] == 3
    assert client.get("/api/progress?annotator=bob").get_json()["mine"] == 0


def test_stats_route(client):
    pair = client.get("/api/next?annotator=ann").get_json()["pair"]
    _post(client, "/api/labels", _label_body(pair))
    s = client.get("/api/stats").get_json()
    assert s["labels"] == 1 and s["annotators"]["ann"]["labels"] == 1


def test_labels_per_pair_option(db_path):
    client = create_app(db_path, labels_per_pair=2).test_client()
    pair = client.get("/api/next?annotator=ann").get_json()["pair"]
    _post(client, "/api/labels", _label_body(pair))
    bob = client.get("/api/next?annotator=bob").get_json()
    assert bob["progress"]["complete_pairs"] == 0 and bob["pair"] is not None


# ------------------------------------------------------------------ tokens and hosts


def test_token_required_everywhere(db_path):
    client = create_app(db_path, token=TOKEN).test_client()
    for method, path in [("GET", "/"), ("GET", "/static/app.js"), ("GET", "/api/health"),
                         ("GET", "/api/next?annotator=ann"), ("GET", "/api/stats"),
                         ("POST", "/api/labels"), ("POST", "/api/skip"), ("GET", "/api/nope")]:
        resp = client.open(path, method=method)
        assert resp.status_code == 401, (method, path)
    assert "Access token" in client.get("/").get_data(as_text=True)  # the 401 page has a form
    assert client.get("/api/health", headers={"Authorization": "Bearer wrong-token"}).status_code == 401
    assert client.get("/api/health", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert client.get("/api/health", headers={"X-Label-Token": TOKEN}).status_code == 200
    assert client.get(f"/api/health?token={TOKEN}").status_code == 200


def test_token_login_sets_a_cookie(db_path):
    client = create_app(db_path, token=TOKEN).test_client()
    assert client.post("/login", data={"token": "nope-nope"}).status_code == 401
    resp = client.post("/login", data={"token": TOKEN})
    assert resp.status_code == 303
    cookie = resp.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert client.get("/").status_code == 200  # the cookie now carries the token
    # a shared link /?token=... also works, and the token leaves the address bar
    fresh = create_app(db_path, token=TOKEN).test_client()
    resp = fresh.get(f"/?token={TOKEN}")
    assert resp.status_code == 303 and resp.headers["Location"] == "/"
    assert fresh.get("/").status_code == 200


def test_annotator_tokens_fix_the_name(db_path):
    client = create_app(db_path, annotator_tokens={"tok-alice-123": "alice"}).test_client()
    h = {"Authorization": "Bearer tok-alice-123"}
    # alice's token acts as alice: naming someone else is refused, not silently rewritten
    resp = client.get("/api/next?annotator=mallory", headers=h)
    assert resp.status_code == 403 and "belongs to 'alice'" in resp.get_json()["error"]
    pair = client.get("/api/next", headers=h).get_json()["pair"]  # no name: the token's
    body = _label_body(pair, annotator="mallory", flipped=None)
    resp = _post(client, "/api/labels", body, headers=h)
    assert resp.status_code == 403 and "belongs to 'alice'" in resp.get_json()["error"]
    assert _labels(db_path) == []
    assert _post(client, "/api/labels", dict(body, annotator="alice"), headers=h).status_code == 201
    body2 = {k: v for k, v in _label_body(pair, submission_id="sub-000000002").items() if k != "annotator"}
    assert _post(client, "/api/labels", body2, headers=h).status_code == 409  # alice again: already labelled
    assert [r["annotator"] for r in _labels(db_path)] == ["alice"]
    html = client.get("/", headers=h).get_data(as_text=True)
    assert "&#34;annotator_fixed&#34;: true" in html or "&quot;annotator_fixed&quot;: true" in html


def test_shared_token_cannot_act_as_an_annotator_with_a_token(db_path):
    # issue 52 case 4: served with --token S and --annotator-tokens {"alice": ...}, a POST with
    # Bearer S naming alice was stored as alice (201)
    client = create_app(db_path, token=TOKEN, annotator_tokens={"tok-alice-123": "alice"}).test_client()
    shared = {"Authorization": f"Bearer {TOKEN}"}
    pair = client.get("/api/next?annotator=carol", headers=shared).get_json()["pair"]
    for name in ("alice", "Alice", " ALICE "):  # one annotator whatever the case
        resp = _post(client, "/api/labels", _label_body(pair, annotator=name, flipped=None), headers=shared)
        assert resp.status_code == 403, name
        error = resp.get_json()["error"]
        assert "has a token of their own" in error and "\n" not in error
        assert client.get(f"/api/next?annotator={name}", headers=shared).status_code == 403
        body = {"submission_id": "skip-00000001", "annotator": name, "pair_id": pair["pair_id"]}
        assert _post(client, "/api/skip", body, headers=shared).status_code == 403
    assert _labels(db_path) == []
    # a name without a token of its own is the shared token's to use
    resp = _post(client, "/api/labels", _label_body(pair, annotator="carol"), headers=shared)
    assert resp.status_code == 201
    assert [r["annotator"] for r in _labels(db_path)] == ["carol"]


def test_annotator_tokens_file_refuses_names_that_differ_only_in_case(tmp_path):
    from rlhflab.errors import UserError
    from rlhflab.label.app import load_annotator_tokens

    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"alice": "token-alice-1", "Alice": "token-alice-2"}))
    with pytest.raises(UserError, match="differ only in case"):
        load_annotator_tokens(path)


def test_foreign_host_header_is_refused(db_path):
    client = create_app(db_path, allowed_hosts={"127.0.0.1", "localhost", "::1"}).test_client()
    assert client.get("/api/health", headers={"Host": "127.0.0.1:8765"}).status_code == 200
    assert client.get("/api/health", headers={"Host": "[::1]:8765"}).status_code == 200
    resp = client.get("/api/health", headers={"Host": "evil.example:8765"})
    assert resp.status_code == 400 and "not served here" in resp.get_json()["error"]
