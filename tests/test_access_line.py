"""uvicorn's access line is written after a response's last bytes, not inside its head's write
(proxy/connections.py, issue 17), and says what it said before: same logger, same
arguments, same filters, once per request, also when the body never ends."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest
import uvicorn

from proxy.connections import (
    H11WithHeadTimeout,
    QueryValuesMasked,
    _httptools_protocol,
    with_head_timeout,
)
from tests.conftest import answer_lifespan, free_port, read_until, start_uvicorn

PROTOCOLS = {"h11": H11WithHeadTimeout}
if _httptools_protocol() is not None:
    PROTOCOLS["httptools"] = with_head_timeout(15.0)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]


class App:
    """`/slow`: the head, then a body chunk once `release` is set, the last one once `release_last`
    is. `/fail`: the head, then an exception. `/hang`: the head and a body chunk, then waits forever.
    `/quick`: a whole response."""

    def __init__(self):
        self.release = threading.Event()
        self.release_last = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        if scope["path"] == "/quick":
            await send(start)
            await send({"type": "http.response.body", "body": b"done"})
            return
        await send(start)
        if scope["path"] == "/fail":
            raise RuntimeError("failed after the head")
        if scope["path"] == "/hang":
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            await asyncio.sleep(3600)
        while not self.release.is_set():
            await asyncio.sleep(0.005)
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        while not self.release_last.is_set():
            await asyncio.sleep(0.005)
        await send({"type": "http.response.body", "body": b"last", "more_body": False})


@pytest.fixture(params=sorted(PROTOCOLS))
def server(request):
    lines = Lines()
    access = logging.getLogger("uvicorn.access")
    access.addHandler(lines)  # uvicorn writes access lines only where the logger has a handler
    masked = QueryValuesMasked()
    access.addFilter(masked)
    old_level = access.level
    access.setLevel(logging.INFO)
    app = App()
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=PROTOCOLS[request.param], log_config=None,
                            lifespan="on", log_level="info", timeout_graceful_shutdown=1)
    srv, thread = start_uvicorn(config)
    try:
        yield port, app, lines
    finally:
        srv.should_exit = True
        thread.join(15)
        access.removeHandler(lines)
        access.removeFilter(masked)
        access.setLevel(old_level)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def _wait_for(lines: Lines, count: int, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(lines.records) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return lines.messages()


def test_the_line_waits_for_the_last_bytes_and_says_what_uvicorn_said(server):
    port, app, lines = server
    sock = _connect(port)
    try:
        sock.sendall(b"GET /slow?key=sk-secret-1234&v=2 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data = read_until(sock, b"\r\n\r\n")  # the head is out ...
        time.sleep(0.2)
        assert lines.messages() == []  # ... and the line is not: it used to be written before the head
        app.release.set()
        data = read_until(sock, b"first", data)  # the first body bytes (a stream's role chunk) ...
        time.sleep(0.2)
        assert lines.messages() == []  # ... not yet either
        app.release_last.set()
        data = read_until(sock, b"0\r\n\r\n", data)
        client_port = sock.getsockname()[1]
        messages = _wait_for(lines, 1)
        assert messages == [f'127.0.0.1:{client_port} - "GET /slow?key=***&v=*** HTTP/1.1" 200']
        # The same connection's next request gets its own line, once.
        sock.sendall(b"GET /quick HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        read_until(sock, b"done")
        messages = _wait_for(lines, 2)
        time.sleep(0.1)
        assert lines.messages() == [messages[0], f'127.0.0.1:{client_port} - "GET /quick HTTP/1.1" 200']
        assert all(r.name == "uvicorn.access" and r.levelno == logging.INFO for r in lines.records)
    finally:
        sock.close()


def test_a_response_that_never_ends_is_still_logged_once(server):
    port, _, lines = server
    # The app fails after the head: uvicorn closes the connection; the line comes then.
    sock = _connect(port)
    try:
        sock.sendall(b"GET /fail HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        read_until(sock, b"\r\n\r\n")
        assert _wait_for(lines, 1)[-1].endswith('"GET /fail HTTP/1.1" 200')
    finally:
        sock.close()
    # The client hangs up mid-body: the line comes when the connection is lost.
    sock = _connect(port)
    sock.sendall(b"GET /hang HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    read_until(sock, b"first")
    time.sleep(0.1)
    assert len(lines.records) == 1
    sock.close()
    messages = _wait_for(lines, 2)
    time.sleep(0.2)
    assert len(lines.records) == 2 and messages[1].endswith('"GET /hang HTTP/1.1" 200')
