"""A response's head goes out in one write with the body bytes sent in the same step, not by
itself (proxy/connections.py `_HeadHeld`, issue 17 session 8), and is never lost or late: a
body that comes after the app waits for something finds the head already sent; a response that
ends without body bytes, or whose connection closes, still sends it. A real uvicorn on 127.0.0.1, h11 and
httptools, read from a raw socket."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import uvicorn

from proxy.connections import H11WithHeadTimeout, _httptools_protocol, with_head_timeout
from tests.conftest import answer_lifespan, free_port, read_until, start_uvicorn

PROTOCOLS = {"h11": H11WithHeadTimeout}
if _httptools_protocol() is not None:
    PROTOCOLS["httptools"] = with_head_timeout(15.0)

BLOCK_S = 0.4  # the app's synchronous work between its head and its first body bytes


class App:
    """`/together`: the head, `BLOCK_S` of work in the same step (the loop blocked: nothing can be
    written meanwhile), then the first body bytes. `/late`: the head, then the body 1 s later.
    `/empty`: a head with `content-length: 0` and an empty body. `/close`: a whole response that
    closes its connection."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        path = scope["path"]
        headers = [(b"content-type", b"text/plain")]
        if path == "/empty":
            await send({"type": "http.response.start", "status": 200, "headers": [*headers, (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if path == "/close":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*headers, (b"content-length", b"4"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": b"done"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if path == "/together":
            time.sleep(BLOCK_S)  # noqa: ASYNC251 (on purpose: the head's write, if it was made, is out now)
        else:
            await asyncio.sleep(1.0)
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await send({"type": "http.response.body", "body": b"last", "more_body": False})


@pytest.fixture(params=sorted(PROTOCOLS))
def port(request):
    port = free_port()
    config = uvicorn.Config(App(), host="127.0.0.1", port=port, http=PROTOCOLS[request.param], log_config=None,
                            lifespan="on", access_log=False, timeout_graceful_shutdown=1)
    srv, thread = start_uvicorn(config)
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(15)


def _request(port: int, path: str, method: str = "GET") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    return sock


def test_the_head_and_the_first_body_bytes_arrive_in_one_piece(port):
    sock = _request(port, "/together")
    try:
        first = sock.recv(65536)  # the first bytes the client gets: before, the head alone, BLOCK_S early
        assert first.startswith(b"HTTP/1.1 200 ") and b"\r\n\r\n" in first
        assert b"first" in first, first
        data = read_until(sock, b"0\r\n\r\n", first)
        assert data.index(b"first") < data.index(b"last")
    finally:
        sock.close()


def test_a_head_whose_body_is_late_goes_out_by_itself_within_the_hold(port):
    sock = _request(port, "/late")
    try:
        head = read_until(sock, b"\r\n\r\n")
        # The body comes 1 s after the head, after the app waited: the head did not wait for it.
        assert b"first" not in head
        data = read_until(sock, b"0\r\n\r\n", head)
        assert data.index(b"first") < data.index(b"last")
    finally:
        sock.close()


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_a_response_without_body_bytes_still_sends_its_head_on_a_kept_connection(port, method):
    sock = _request(port, "/empty", method)
    try:
        data = read_until(sock, b"\r\n\r\n")
        assert data.startswith(b"HTTP/1.1 200 ") and b"content-length: 0" in data.lower()
        # The connection is still good for the next request, whose head is not mixed up with it.
        sock.sendall(b"GET /together HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        rest = read_until(sock, b"0\r\n\r\n", data.split(b"\r\n\r\n", 1)[1])
        assert rest.startswith(b"HTTP/1.1 200 ") and b"first" in rest
    finally:
        sock.close()


def test_a_response_that_closes_its_connection_sends_head_and_body_before_the_end(port):
    sock = _request(port, "/close")
    try:
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 ") and b"connection: close" in head.lower() and body == b"done"
    finally:
        sock.close()
