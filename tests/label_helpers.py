"""Helpers shared by the tests of `rlhflab.label` (tests/test_label_*.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from file_modules import load_file
from rlhflab.label import db as labeldb

# the load script's HTTP client and port picker, the ones these helpers use
_LOAD = load_file("label_load", Path(__file__).resolve().parents[1] / "scripts" / "label_load.py")
free_port = _LOAD.free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "<script>document.title='pwned';window.__pwned=1</script>"


def make_db(path: Path, n_prompts: int = 3, responses_per_prompt: int = 2,
            script_in: int | None = None) -> Path:
    """A database with n_prompts prompts and every pair of their responses.

    With `script_in=k`, prompt k's first response contains a <script> element.
    """
    conn = labeldb.connect(path, create=True)
    with labeldb.transaction(conn):
        for i in range(n_prompts):
            responses = [f"Response {j} to prompt {i}: **bold** and `code`."
                         for j in range(responses_per_prompt)]
            if script_in == i:
                responses[0] = f"Hello {SCRIPT} <b>not bold</b>"
            labeldb.add_candidates(conn, f"Prompt {i}: explain it to a 10-year-old", responses)
    conn.close()
    return path


@dataclass
class Server:
    """`rlhflab label serve` running as a child process on a loopback port."""

    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_server(db: Path, log: Path, *extra: str, token: str | None = None,
                 timeout: float = 30.0) -> Server:
    """Start the server on a free loopback port and wait until /api/health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "rlhflab", "label", "serve", "--db", str(db),
           "--host", "127.0.0.1", "--port", str(port), "--quiet", *extra]
    if token:
        cmd += ["--token", token]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    # the log goes to a file: a pipe nobody reads would fill up and block the server
    fh = log.open("w")
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    fh.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            status, _ = request(url, "GET", "/api/health", token=token, timeout=2)
            if status == 200:
                return Server(proc, url, log)
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not answer in {timeout}s:\n{log.read_text()}")


def request(base: str, method: str, path: str, body: dict | None = None,
            token: str | None = None, timeout: float = 10.0) -> tuple[int, dict]:
    """One HTTP request with the standard library; returns (status, JSON body)."""
    return _LOAD.http(base, method, path, body, token=token, timeout=timeout)


_TINY: Path | None = None
def tiny_model(tmp_path_factory) -> Path:
    """One small local causal LM for every label test in the session (built once)."""
    global _TINY
    if _TINY is None:
        from rlhflab.models.tiny import make_tiny_model

        _TINY = make_tiny_model(tmp_path_factory.mktemp("label-tiny") / "model", hidden_size=64,
                                num_layers=2, num_heads=2, seed=0)
    return _TINY
