"""A stream's opening events, which show nothing (chat's role chunk, Messages' message_start),
wait a moment for the first content and leave with it in one write, also when they reached the
proxy one read before it (proxy/upstream_backend.py `Relayed._hold`, issue 17 session 8); never
longer than `OPENING_HOLD_S`, and everything is still recorded. With the response head held for
its first body bytes (prefixtrace/connections.py), a client of the proxy gets head, role chunk and
first content in one piece. A scripted upstream on a real socket; the proxy's real upstream client,
app and uvicorn."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from prefixtrace import connections
from prefixtrace.serve import uvicorn_config
from prefixtrace.wire import sse
from prefixtrace.wire.turn_builder import TurnBuilder
from proxy import upstream_backend
from proxy.anthropic import UpstreamMessages
from proxy.app import create_app
from proxy.chat_request import parse_chat_request
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
from recorder.turn import Turn
from tests.conftest import free_port, rows
from tests.test_proxy_fast_path import ScriptedUpstream

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(delta, finish=None) -> bytes:
    return (b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n")


def _http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


ROLE, FIRST, LAST = _chunk({"role": "assistant", "content": ""}), _chunk({"content": "hi"}), _chunk({}, "stop")
USAGE = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
TAIL = _http_chunk(LAST) + _http_chunk(USAGE) + _http_chunk(sse.DONE) + b"0\r\n\r\n"


def _answer_in_two_reads(gap_s: float, opening: bytes = ROLE, rest: tuple[bytes, ...] = (FIRST,), tail=TAIL):
    """An upstream that sends its head and `opening` in one write, the first content `gap_s` later."""
    def answer(conn):
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        conn.sendall(HEAD + _http_chunk(opening))
        time.sleep(gap_s)
        conn.sendall(b"".join(map(_http_chunk, rest)))
        time.sleep(0.05)
        conn.sendall(tail)
        time.sleep(0.2)
        conn.close()
    return answer


def _turn(endpoint: str) -> TurnBuilder:
    return TurnBuilder(Turn(request_id="r", started_at=0.0, endpoint=endpoint, upstream="u", request_body=None,
                            request_headers={}))


def _chat_items(answer) -> tuple[list[bytes], Turn]:
    upstream = ScriptedUpstream(answer)
    backend = UpstreamBackend(upstream.url)
    assert backend.connections is not None  # the proxy's own client: it can tell more is coming

    async def run():
        req = parse_chat_request({"stream": True, "messages": [{"role": "user", "content": "hi"}]})
        builder = _turn("/v1/chat/completions")
        chat = await backend.open(req, builder, {})
        try:
            return [out async for out in chat.sse()], builder.turn
        finally:
            await backend.aclose()

    try:
        return asyncio.run(run())
    finally:
        upstream.close()


def test_a_role_chunk_one_read_before_the_content_leaves_with_it(monkeypatch):
    monkeypatch.setattr(upstream_backend, "OPENING_HOLD_S", 2.0)  # room for a loaded machine's scheduling
    sent, turn = _chat_items(_answer_in_two_reads(0.1))
    assert sent == [ROLE + FIRST, LAST, sse.DONE]  # before: ROLE alone, then FIRST
    assert turn.response_text == "hi" and turn.finish_reason == "stop" and turn.completion_tokens == 1
    assert len(turn.chunk_times) == 4  # role, content, finish, usage: all recorded


def test_a_role_chunk_waits_no_longer_than_the_hold(monkeypatch):
    monkeypatch.setattr(upstream_backend, "OPENING_HOLD_S", 0.05)
    sent, turn = _chat_items(_answer_in_two_reads(0.6))
    assert sent == [ROLE, FIRST, LAST, sse.DONE]  # the content was 0.6 s late: the role went alone
    assert turn.response_text == "hi" and len(turn.chunk_times) == 4


def test_a_chunk_with_content_is_never_held(monkeypatch):
    monkeypatch.setattr(upstream_backend, "OPENING_HOLD_S", 2.0)
    opening = _chunk({"role": "assistant", "content": "he"})  # the role chunk carries content: it shows
    t0 = time.monotonic()
    sent, _ = _chat_items(_answer_in_two_reads(0.6, opening=opening))
    assert sent == [opening, FIRST, LAST, sse.DONE]
    assert time.monotonic() - t0 < 2.0 + 0.6  # (not held for the 2 s hold either)


@pytest.mark.parametrize("chunk", [
    {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None}], "usage": None},
])
def test_what_counts_as_a_bare_role_chunk(chunk):
    assert upstream_backend._is_role_chunk(chunk)


@pytest.mark.parametrize("chunk", [
    {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}}]},
    {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": []}}]},
    {"id": "x", "choices": [{"index": 0, "delta": {"reasoning_content": ""}}]},
    {"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": {"content": []}}]},
    {"id": "x", "choices": [], "usage": {"prompt_tokens": 1}},
    {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}}], "error": {"message": "no"}},
    {"id": "x", "choices": [{"index": 0, "text": ""}]},  # legacy completions: not a role chunk
])
def test_what_is_not_a_bare_role_chunk(chunk):
    assert not upstream_backend._is_role_chunk(chunk)


def _event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\n".encode() + sse.encode({"type": kind, **data})


def test_message_start_one_read_before_the_first_block_leaves_with_it(monkeypatch):
    monkeypatch.setattr(upstream_backend, "OPENING_HOLD_S", 2.0)
    start = _event("message_start", {"message": {"id": "m", "type": "message", "role": "assistant", "content": [],
                                                 "usage": {"input_tokens": 3, "output_tokens": 0}}})
    block = _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    delta = _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "hi"}})
    stop = _event("content_block_stop", {"index": 0}) + _event(
        "message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}})
    end = _event("message_stop", {})
    upstream = ScriptedUpstream(_answer_in_two_reads(0.1, opening=start, rest=(block, delta),
                                                     tail=_http_chunk(stop) + _http_chunk(end) + b"0\r\n\r\n"))
    backend = UpstreamBackend(upstream.url)

    async def run():
        builder = _turn("/v1/messages")
        response, url = await backend.post("/v1/messages", {"messages": []}, {})
        chat = UpstreamMessages(response, builder, url)
        try:
            return [out async for out in chat.sse()], builder.turn
        finally:
            await backend.aclose()

    try:
        sent, turn = asyncio.run(run())
    finally:
        upstream.close()
    assert sent[0] == start + block + delta  # before: message_start alone
    assert b"".join(sent) == start + block + delta + stop + end and sent[-1] == end
    assert turn.response_text == "hi" and turn.prompt_tokens == 3 and turn.completion_tokens == 1


@pytest.fixture
def proxy_on(tmp_path):
    """The proxy app (recorder on) in front of `answer`'s upstream, under serve's own uvicorn setup."""
    started = []

    def start(answer):
        upstream = ScriptedUpstream(answer)
        rec = Recorder(tmp_path / "p.db")
        port = free_port()
        server = uvicorn.Server(uvicorn_config(create_app(UpstreamBackend(upstream.url), rec), "127.0.0.1", port,
                                               "warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        started.append((server, thread, rec, upstream))
        return port, rec

    yield start
    for server, thread, rec, upstream in started:
        server.should_exit = True
        thread.join(10)
        rec.close()
        upstream.close()


def test_a_client_of_the_proxy_gets_head_role_and_first_content_in_one_piece(proxy_on, monkeypatch, tmp_path):
    monkeypatch.setattr(upstream_backend, "OPENING_HOLD_S", 2.0)
    monkeypatch.setattr(connections, "HEAD_HOLD_S", 2.0)
    port, rec = proxy_on(_answer_in_two_reads(0.1))
    body = json.dumps({"stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        data = sock.recv(65536)  # before: the head alone, then the role chunk, then the content
        assert data.startswith(b"HTTP/1.1 200 ") and ROLE in data and FIRST in data, data
        while not data.endswith(b"0\r\n\r\n"):
            more = sock.recv(65536)
            assert more, data
            data += more
    finally:
        sock.close()
    assert data.index(ROLE) < data.index(FIRST) < data.index(LAST) < data.index(sse.DONE)
    assert USAGE not in data  # the client did not ask for usage: still not sent
    found = rows(rec)
    assert [(r["response_text"], r["finish_reason"], r["status"]) for r in found] == [("hi", "stop", 200)]
