"""Request limits and hang-ups (issue 14, findings 6, 7, 9, 11), on a real uvicorn
with raw sockets and the official clients."""

from __future__ import annotations

import json
import socket
import time

import httpx

from recorder import iter_turns


def _raw_post(url: str, path: str, body: bytes, extra_headers: bytes = b"") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n%s\r\n%s" % (path.encode(), len(body), extra_headers, body))
    return sock


def _running(url: str) -> int:
    cap = httpx.get(url + "/v1/capacity", timeout=10).json()
    return cap["running"] + cap["prefilling"] + cap["waiting"]


def test_a_hung_up_non_streamed_request_stops_generating_and_is_recorded_as_cancelled(engine_server):
    url, rec = engine_server
    body = json.dumps({"model": "default", "max_tokens": 20000, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "go on forever"}]}).encode()
    sock = _raw_post(url, "/v1/chat/completions", body)
    deadline = time.monotonic() + 30
    while _running(url) == 0:  # generating
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sock.close()  # the client gives up
    deadline = time.monotonic() + 30
    while _running(url) != 0:
        assert time.monotonic() < deadline, "the engine kept generating for a client that hung up"
        time.sleep(0.1)
    assert rec.flush(30)
    (turn,) = iter_turns(rec.path)
    assert (turn.status, turn.error, turn.finish_reason) == (499, "client disconnected", "cancelled")
    # and the server goes on answering
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
