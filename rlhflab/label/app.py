"""The labelling web app: Flask routes over the SQLite database in `db.py`.

Routes (JSON unless noted; with a token configured every request needs it, else 401):

    GET  /                 the labelling page (HTML; its JS and CSS come from /static)
    POST /login            form field `token`: sets the token cookie, redirects to /
    GET  /api/next         ?annotator=NAME -> {"pair": {...} | null, "progress": {...}};
                           the pair is reserved for NAME (see db.next_pair)
    POST /api/labels       {submission_id, annotator, pair_id, level 1..5, comment?,
                            criteria?, flipped?, elapsed_ms?} -> 201 stored, 200 retry
    POST /api/skip         {submission_id, annotator, pair_id} -> 201 stored, 200 retry
    GET  /api/progress     ?annotator=NAME -> counts
    GET  /api/stats        the numbers `rlhflab label stats` prints
    GET  /api/health       {"ok": true}

Model text is untrusted: it reaches the page only as JSON and is put into the document
with `textContent` (never innerHTML), and a Content-Security-Policy allows scripts from
this server only. POSTs must be `application/json`, which a cross-site form cannot send.
Bad requests get a 4xx with {"error": "..."} and change nothing: bodies are parsed here
(nesting too deep, invalid UTF-8 or JSON, a lone surrogate: 400; over 64 KiB, chunked or
not: 413), and `serve` closes the connection after an answer sent before the body was read.

Identity: with annotator tokens, a request's annotator is its token's; naming another is
403, and so is the shared token naming an annotator who has a token of their own.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import sqlite3
import time
import unicodedata
from pathlib import Path
from typing import Any

from flask import Flask, Response, g, jsonify, redirect, render_template, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from rlhflab.label import CRITERIA, LEVELS
from rlhflab.label import db as labeldb
from rlhflab.label.db import LabelIn, Rejected

COOKIE = "rlhflab_label_token"
MAX_BODY_BYTES = 64 * 1024
MAX_ANNOTATOR_CHARS = 64
SUBMISSION_ID = re.compile(r"[A-Za-z0-9_-]{8,128}")
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1"}

PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
LOGIN_CSP = ("default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
             "base-uri 'none'; frame-ancestors 'none'")


class BadRequest(Rejected):
    """A 400 with a message that names the field and the fix."""

    def __init__(self, message: str):
        super().__init__(400, message)


# ---------------------------------------------------------------- validation


def _annotator(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise BadRequest("annotator: give your name (a non-empty string)")
    name = value.strip()
    if len(name) > MAX_ANNOTATOR_CHARS:
        raise BadRequest(f"annotator: at most {MAX_ANNOTATOR_CHARS} characters, got {len(name)}")
    if any(unicodedata.category(ch) in ("Cc", "Cf") for ch in name):
        raise BadRequest("annotator: control characters are not allowed in a name")
    _text("annotator", name)
    return name


def _text(key: str, value: str) -> str:
    """A string SQLite can store: JSON's \\ud800 escapes make lone surrogates, which are
    not Unicode text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{key}: contains a lone surrogate (an unpaired \\uD800-\\uDFFF "
                         "escape), which is not text; send valid UTF-8") from None
    return value


def name_key(name: str) -> str:
    """How names are compared for identity: 'Alice' and 'alice' are one annotator."""
    return unicodedata.normalize("NFKC", name).casefold()


def _shown(value: Any) -> str:
    """A short picture of a value for an error message (never a deep dump)."""
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)[:40]
    if isinstance(value, str):
        return json.dumps(value)[:40]  # ensure_ascii: a lone surrogate prints as \\ud800
    return f"a JSON {'array' if isinstance(value, list) else 'object'}"


def _int(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key}: expected an integer, got {_shown(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise BadRequest(f"{key}: must be between {lo} and {hi}, got {value}")
    return value


SQLITE_INT = (-(2**63), 2**63 - 1)  # the integers SQLite can store; an id outside cannot exist


def _pair_id(body: dict) -> int:
    """The request's pair_id: an integer; one SQLite cannot hold is a pair that does not
    exist (404), not an overflow inside the query (500)."""
    value = _int(body, "pair_id")
    if not SQLITE_INT[0] <= value <= SQLITE_INT[1]:
        raise Rejected(404, f"pair {value} does not exist; ask /api/next for a pair")
    return value


def _submission_id(body: dict) -> str:
    value = body.get("submission_id")
    if not isinstance(value, str) or not SUBMISSION_ID.fullmatch(value):
        raise BadRequest("submission_id: 8 to 128 characters from A-Z a-z 0-9 _ -, made by the "
                         "client once per label and reused when the request is retried")
    return value


def _check_keys(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")


# ---------------------------------------------------------------- the app


def load_annotator_tokens(path: str | Path) -> dict[str, str]:
    """Read {"name": "token", ...}; returns token -> name."""
    from rlhflab.errors import UserError
    from rlhflab.files import read_json

    path = Path(path)
    try:
        data = read_json(path)
    except (OSError, UserError) as exc:
        raise UserError(f"--annotator-tokens {path}: cannot read a JSON object ({exc}); "
                        'write {"alice": "token-for-alice", ...}') from None
    if not isinstance(data, dict) or not data:
        raise UserError(f'--annotator-tokens {path}: expected a non-empty JSON object {{"name": "token"}}')
    out: dict[str, str] = {}
    for name, token in data.items():
        if not isinstance(token, str) or len(token) < 8:
            raise UserError(f"--annotator-tokens {path}: the token of {name!r} must be a string "
                            "of 8+ characters")
        if token in out:
            raise UserError(f"--annotator-tokens {path}: {name!r} and {out[token]!r} share a token")
        try:
            out[token] = _annotator(name)
        except Rejected as exc:
            raise UserError(f"--annotator-tokens {path}: name {name!r}: {exc}") from None
    keys: dict[str, str] = {}
    for name in out.values():
        if name_key(name) in keys:
            raise UserError(f"--annotator-tokens {path}: {keys[name_key(name)]!r} and {name!r} "
                            "differ only in case; give each annotator a distinct name")
        keys[name_key(name)] = name
    return out


def create_app(db_path: str | Path, *, token: str | None = None,
               annotator_tokens: dict[str, str] | None = None,
               labels_per_pair: int | None = 1, criteria: tuple[str, ...] = CRITERIA,
               max_comment: int = 2000, allowed_hosts: set[str] | None = None,
               reserve_seconds: float = labeldb.RESERVE_SECONDS) -> Flask:
    """The Flask app serving one database.

    token: a shared access token (annotators still type their name; not one that
        annotator_tokens gives to someone: that is 403).
    annotator_tokens: token -> annotator name; the token identifies the annotator.
    labels_per_pair: stop offering a pair once its labels and reservations reach this (None: never).
    reserve_seconds: how long a pair offered by /api/next stays held for its annotator (0: not held).
    allowed_hosts: accepted Host header names (DNS-rebinding guard); None accepts any.
    """
    db_path = Path(db_path)
    labeldb.connect(db_path).close()  # fail early on a missing or foreign file
    tokens: dict[str, str | None] = {}
    if token:
        tokens[token] = None
    tokens.update(annotator_tokens or {})
    own_names = {name_key(n): n for n in (annotator_tokens or {}).values()}
    criteria = tuple(criteria)

    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.json.sort_keys = False  # type: ignore[attr-defined]
    page_config = {
        "levels": {str(k): v for k, v in LEVELS.items()},
        "criteria": list(criteria),
        "max_comment": max_comment,
        "labels_per_pair": labels_per_pair,
        "annotator_fixed": False,
    }

    def conn() -> sqlite3.Connection:
        if "conn" not in g:
            g.conn = labeldb.connect(db_path)
        return g.conn

    @app.teardown_appcontext
    def _close(_exc: BaseException | None) -> None:
        c = g.pop("conn", None)
        if c is not None:
            c.close()

    # -------------------------------------------------------- guards

    def _given_token() -> str:
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
        return (request.headers.get("X-Label-Token") or request.cookies.get(COOKIE)
                or request.args.get("token") or "")

    def _match(given: str) -> tuple[bool, str | None]:
        found, name = False, None
        for tok, who in tokens.items():  # compare with every token: no early exit on a match
            if hmac.compare_digest(tok.encode(), given.encode()):
                found, name = True, who
        return found, name

    def _unauthorized(message: str) -> Response:
        if request.path.startswith("/api/"):
            resp = jsonify(error=message)
        else:
            resp = Response(render_template("login.html", message=message), mimetype="text/html")
            resp.headers["Content-Security-Policy"] = LOGIN_CSP
        resp.status_code = 401
        resp.headers["WWW-Authenticate"] = 'Bearer realm="rlhflab label"'
        return resp

    def _with_cookie(resp: Response, value: str) -> Response:
        resp.set_cookie(COOKIE, value, httponly=True, samesite="Strict", path="/")
        return resp

    @app.before_request
    def _guard() -> Response | None:
        if allowed_hosts is not None:
            host = request.host
            name = host[1:].split("]")[0] if host.startswith("[") else host.partition(":")[0]
            if name.lower() not in allowed_hosts:
                return jsonify(error=f"Host {host!r} is not served here; open http://127.0.0.1"), 400
        g.fixed_annotator = None
        if not tokens:
            return None
        if request.path == "/login" and request.method == "POST":
            given = request.form.get("token", "")
            ok, _ = _match(given)
            if not ok:
                return _unauthorized("That token is not right; ask whoever runs the server.")
            return _with_cookie(redirect("/", code=303), given)
        ok, who = _match(_given_token())
        if not ok:
            return _unauthorized("This labelling server needs an access token.")
        g.fixed_annotator = who
        if request.method == "GET" and "token" in request.args and not request.path.startswith("/api/"):
            # /?token=... from a shared link: keep it in a cookie, drop it from the address bar
            return _with_cookie(redirect(request.path, code=303), request.args["token"])
        return None

    @app.after_request
    def _headers(resp: Response) -> Response:
        resp.headers.setdefault("Content-Security-Policy", PAGE_CSP)
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["X-Frame-Options"] = "DENY"
        resp.headers["Referrer-Policy"] = "no-referrer"
        if request.path.startswith("/api/"):
            resp.headers["Cache-Control"] = "no-store"
        return resp

    # -------------------------------------------------------- errors

    @app.errorhandler(Rejected)
    def _rejected(exc: Rejected):
        return jsonify(error=str(exc)), exc.status

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException):
        if not request.path.startswith("/api/") and exc.code != 413:
            return exc
        messages = {
            404: f"no route {request.method} {request.path}; see the routes in rlhflab/label/app.py",
            405: f"{request.method} is not allowed on {request.path}",
            413: f"request body over {MAX_BODY_BYTES} bytes; shorten the comment",
        }
        return jsonify(error=messages.get(exc.code, exc.description)), exc.code

    @app.errorhandler(RecursionError)
    def _too_deep(_exc: RecursionError):
        return jsonify(error="the request is nested too deeply; send one flat JSON object"), 400

    # -------------------------------------------------------- helpers

    def _who(value: Any) -> str:
        fixed = g.fixed_annotator
        if fixed is not None:  # an annotator's own token: the label is theirs
            if value is not None and value != "" and _annotator(value) != fixed:
                raise Rejected(403, f"annotator {_shown(value)}: this token belongs to {fixed!r} "
                                    "and writes only as them; leave annotator out or send their name")
            return fixed
        name = _annotator(value)
        if name_key(name) in own_names:
            raise Rejected(403, f"annotator {name!r} has a token of their own and only that token "
                                f"can act as {own_names[name_key(name)]!r}; sign in with it, or use another name")
        return name

    def _read_body() -> bytes:
        """The body, at most MAX_BODY_BYTES (else 413). With a Content-Length werkzeug checks
        the header; a chunked body is read here to one byte past the limit, since werkzeug's
        limited stream hands back the first 64 KiB of a longer one as if it were all."""
        if request.content_length is not None or "wsgi.input_terminated" not in request.environ:
            return request.get_data(cache=True)
        stream, data = request.environ["wsgi.input"], bytearray()
        try:
            while len(data) <= MAX_BODY_BYTES:
                chunk = stream.read(min(65536, MAX_BODY_BYTES + 1 - len(data)))
                if not chunk:
                    break
                data += chunk
        except OSError:  # werkzeug's dechunker: a bad chunk header or terminator
            raise BadRequest("the body's chunked encoding is broken; send one JSON object") from None
        if len(data) > MAX_BODY_BYTES:
            raise RequestEntityTooLarge()
        return bytes(data)

    def _json_body() -> dict:
        if not request.is_json:
            raise Rejected(415, "send the body as JSON with Content-Type: application/json")
        raw = _read_body()
        try:
            body = json.loads(raw)
        except RecursionError:
            raise BadRequest("the body is nested too deeply; send one flat JSON object") from None
        except ValueError as exc:  # not JSON, or not UTF-8
            raise BadRequest(f"the body must be one JSON object ({str(exc).splitlines()[0][:80]})") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    # -------------------------------------------------------- routes

    @app.get("/")
    def index():
        cfg = dict(page_config, annotator_fixed=g.fixed_annotator is not None,
                   annotator=g.fixed_annotator)
        return render_template("index.html", config_json=json.dumps(cfg))

    @app.post("/login")
    def login():  # reached only without tokens configured
        return redirect("/", code=303)

    @app.get("/api/health")
    def health():
        return jsonify(ok=True)

    @app.get("/api/next")
    def next_pair():
        who = _who(request.args.get("annotator"))
        pair = labeldb.next_pair(conn(), who, labels_per_pair, reserve_seconds)
        return jsonify(pair=pair, progress=labeldb.progress(conn(), who, labels_per_pair))

    @app.get("/api/progress")
    def progress():
        raw = request.args.get("annotator")
        who = _who(raw) if raw is not None or g.fixed_annotator is not None else None
        return jsonify(labeldb.progress(conn(), who, labels_per_pair))

    @app.post("/api/labels")
    def post_label():
        body = _json_body()
        _check_keys(body, {"submission_id", "annotator", "pair_id", "level", "comment",
                           "criteria", "flipped", "elapsed_ms"})
        comment = body.get("comment", "")
        if not isinstance(comment, str):
            raise BadRequest("comment: expected a string")
        _text("comment", comment)
        if len(comment) > max_comment:
            raise BadRequest(f"comment: at most {max_comment} characters, got {len(comment)}; shorten it")
        picked = body.get("criteria", [])
        if not isinstance(picked, list) or not all(isinstance(c, str) for c in picked):
            raise BadRequest("criteria: expected a list of strings")
        unknown = [c for c in picked if c not in criteria]
        if unknown:
            raise BadRequest(f"criteria: unknown {unknown}; choose from {list(criteria)}")
        flipped = body.get("flipped")
        if flipped is not None and not isinstance(flipped, bool):
            raise BadRequest("flipped: expected true or false")
        elapsed = body.get("elapsed_ms")
        if elapsed is not None:
            elapsed = _int(body, "elapsed_ms", 0, 7 * 24 * 3600 * 1000)
        label = LabelIn(
            submission_id=_submission_id(body), annotator=_who(body.get("annotator")),
            pair_id=_pair_id(body), level=_int(body, "level", 1, 5),
            comment=comment, criteria=tuple(dict.fromkeys(picked)), flipped=flipped,
            elapsed_ms=elapsed)
        stored = labeldb.submit_label(conn(), label)
        return jsonify(stored=stored.stored, label_id=stored.id), 201 if stored.stored else 200

    @app.post("/api/skip")
    def post_skip():
        body = _json_body()
        _check_keys(body, {"submission_id", "annotator", "pair_id"})
        stored = labeldb.submit_skip(conn(), _submission_id(body), _who(body.get("annotator")),
                                     _pair_id(body))
        return jsonify(stored=stored.stored, skip_id=stored.id), 201 if stored.stored else 200

    @app.get("/api/stats")
    def stats():
        from rlhflab.label.export import stats as compute

        return jsonify(compute(conn()))

    return app


# After an answer sent before the body was read (a 413, a refusal), werkzeug discards what
# the client still sends, but with blocking reads that wait for the client to close. These
# bound it: then the connection closes, whatever the client does.
DRAIN_SECONDS = 1.0
DRAIN_BYTES = 1024 * 1024


class _Input:
    """The request handler's input file; after the answer's headers, reads return what has
    arrived (never waiting for more) until DRAIN_SECONDS or DRAIN_BYTES, then end."""

    def __init__(self, raw: Any):
        self._raw = raw
        self._until: float | None = None
        self._drained = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def answered(self) -> None:
        self._until, self._drained = time.monotonic() + DRAIN_SECONDS, 0

    def next_request(self) -> None:
        self._until = None

    def read(self, n: int = -1) -> bytes:
        if self._until is None:
            return self._raw.read(n)
        if time.monotonic() > self._until or self._drained >= DRAIN_BYTES:
            return b""
        read1 = getattr(self._raw, "read1", None)
        size = 65536 if n is None or n < 0 else min(n, 65536)
        data = read1(size) if read1 is not None else self._raw.read(size)
        self._drained += len(data)
        return data


def _request_handler() -> type:
    from werkzeug.serving import WSGIRequestHandler

    class Handler(WSGIRequestHandler):
        def setup(self) -> None:
            super().setup()
            self.rfile = _Input(self.rfile)

        def handle_one_request(self) -> None:
            self.rfile.next_request()
            super().handle_one_request()

        def end_headers(self) -> None:
            super().end_headers()
            self.rfile.answered()

    return Handler


def serve(app: Flask, host: str = "127.0.0.1", port: int = 8765, quiet: bool = False,
          announce: str = "") -> None:
    """Serve with werkzeug's threaded server (one thread per request) until Ctrl-C."""
    from werkzeug.serving import make_server

    if quiet:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server(host, port, app, threaded=True, request_handler=_request_handler())
    shown = f"[{host}]" if ":" in host else host
    print(f"rlhflab label: {announce}serving on http://{shown}:{server.server_port}/ "
          "(Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        server.server_close()
