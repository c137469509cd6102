"""The recorder's writer cannot be killed, and a stuck one is visible (issue 14, finding 1).

Driven as the probe drove it: a real uvicorn (or a real `prefixtrace serve`) on
127.0.0.1, real sockets, clients that hang up at the worst moment.
"""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
import subprocess
import threading
import time

import httpx
import pytest

from engine.engine import Engine
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from recorder import Recorder, iter_turns
from tests.conftest import TINY_MODEL, running_server
from tests.test_recorder import make_turn


class CommitGate:
    """A tracer that holds the writer inside its next `turn_log` INSERT until
    released: a disk that is slow exactly while a client gives up waiting."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.armed = True

    def __call__(self, sql, params):
        if self.armed and sql.lstrip().upper().startswith("INSERT") and "turn_log" in sql:
            self.armed = False
            self.entered.set()
            self.release.wait(60)


def stream_until_finish_then_hang_up(url: str, content: str) -> None:
    """Reads a streamed reply over a raw socket up to its finish_reason chunk (the
    turn is then waiting for its commit, before [DONE]) and closes the socket."""
    body = json.dumps({"model": "default", "max_tokens": 4, "stream": True,
                       "messages": [{"role": "user", "content": content}]}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        while b'"finish_reason":"' not in seen.replace(b" ", b""):
            data = sock.recv(65536)
            assert data, f"server closed early: {seen[-300:]!r}"
            seen += data
        assert b"[DONE]" not in seen  # it is held back until the commit


def chat(url: str, content: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=timeout,
                      json={"model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": content}]})


@pytest.fixture
def gated_server(tmp_path, tiny_engine):
    gate = CommitGate()
    with Recorder(tmp_path / "traffic.db", tracer=gate, stuck_after_s=1.0) as rec:
        with running_server(create_app(EngineBackend(tiny_engine), rec)) as url:
            yield url, rec, gate
        gate.release.set()


def test_a_client_hanging_up_while_its_turn_commits_does_not_stop_the_recorder(gated_server):
    url, rec, gate = gated_server
    stream_until_finish_then_hang_up(url, "first")
    assert gate.entered.wait(30)
    time.sleep(0.5)  # let the server notice the hang-up and cancel the waiting response
    gate.release.set()
    # The next ordinary request answers and is recorded: the writer is alive.
    r = chat(url, "second", timeout=30)
    assert r.status_code == 200
    assert rec.flush(30)
    contents = sorted(t.request_body["messages"][0]["content"] for t in iter_turns(rec.path))
    assert contents == ["first", "second"]  # each exactly once
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_health_reports_a_stuck_writer_and_recovers(gated_server):
    url, rec, gate = gated_server
    results = []
    worker = threading.Thread(target=lambda: results.append(chat(url, "stuck")))
    worker.start()
    assert gate.entered.wait(30)
    deadline = time.monotonic() + 30
    while True:  # stuck_after_s=1: /health turns 503 once the write has hung that long
        health = httpx.get(url + "/health", timeout=10)
        if health.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert health.status_code == 503
    assert health.json()["status"] == "recorder_stuck"
    assert "stuck" in health.json()["reason"]
    gate.release.set()
    worker.join(60)
    assert results and results[0].status_code == 200
    assert rec.flush(30)  # the write that hung is done (the reply did not wait for it): healthy again
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_a_cancelled_waiter_or_a_failing_write_never_stops_the_writer(tmp_path):
    gate = CommitGate()
    with Recorder(tmp_path / "t.db", tracer=gate) as rec:
        first = rec.record(make_turn(1))
        assert gate.entered.wait(30)
        first.cancel()  # the waiter gave up (what asyncio does to a wrapped future it cancels)
        gate.release.set()
        # A turn that cannot be serialised fails alone; the writer goes on.
        bad = rec.record(make_turn(2, usage={"x": object()}))
        good = rec.record(make_turn(3))
        assert good.result(30) is None
        with pytest.raises(Exception):
            bad.result(30)
        assert rec.health() == (True, None)
        with pytest.raises(Exception):  # the failed turn is reported by flush
            rec.flush(30)
    assert sorted(t.request_id for t in iter_turns(tmp_path / "t.db")) == ["req-1", "req-3"]


def test_health_is_not_ok_once_the_recorder_is_closed(tmp_path):
    rec = Recorder(tmp_path / "t.db")
    assert rec.health() == (True, None)
    rec.close()
    ok, reason = rec.health()
    assert not ok and "closed" in reason


def test_sigterm_stops_serve_while_responses_wait_for_a_locked_database(tmp_path):
    """Another process holds the database's write lock: responses wait for their
    commit, /health says so, and SIGTERM still ends the server promptly."""
    from tests.test_cli_serve import serve_process

    db = tmp_path / "traffic.db"
    with serve_process(["--model", str(TINY_MODEL), "--db", str(db)], cwd=tmp_path,
                       env={"PREFIXTRACE_NO_OPENBLAS": "1", "PREFIXTRACE_RECORDER_STUCK_AFTER_S": "1"}) as (url, proc):
        assert chat(url, "before the lock").status_code == 200
        lock = sqlite3.connect(db, timeout=0)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            waiting = [threading.Thread(target=lambda i=i: _swallow(chat, url, f"waiting {i}", 120)) for i in range(3)]
            for t in waiting:
                t.start()
            deadline = time.monotonic() + 60
            while httpx.get(url + "/health", timeout=10).status_code != 503:
                assert time.monotonic() < deadline, "/health never reported the stuck writer"
                time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(45)
            except subprocess.TimeoutExpired:
                pytest.fail("serve did not stop on SIGTERM while its writer waited for the lock")
        finally:
            lock.rollback()
            lock.close()
        for t in waiting:
            t.join(30)


def _swallow(fn, *args):
    try:
        fn(*args)
    except httpx.HTTPError:
        pass


def test_a_body_of_unterminated_pem_headers_does_not_stall_other_responses(engine_server):
    """Issue 14, finding 4: 218 KB of `-----BEGIN PRIVATE KEY-----` lines held the
    writer ~77 s and every other response with it."""
    url, rec = engine_server
    hostile = "-----BEGIN PRIVATE KEY-----\n" * 10_000  # 270 KB
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": hostile}]})
    assert r.status_code in (200, 400)
    assert chat(url, "right after").status_code == 200  # its commit queues behind the hostile turn's
    assert rec.flush(30)
    stored = list(iter_turns(rec.path))
    assert len(stored) == 2
    assert "BEGIN PRIVATE KEY" not in json.dumps(stored[0].request_body)
