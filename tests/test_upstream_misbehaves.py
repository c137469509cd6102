"""A misbehaving upstream on loopback (issue 25, findings 5 and 8): real sockets, a real uvicorn
proxy in front, a scripted upstream that answers what no upstream should. Whatever it does, the
client gets what it sent or an error in the API's shape that names the upstream's fault (502, or
504 for a timeout; an error event once a stream is under way), never a bare 500, and the turn is
recorded with what the client saw and the upstream's error."""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from proxy.upstream_timeouts import UpstreamTimeouts
from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
from tests.conftest import rows, running_server
from tests.test_proxy_recorder_edge_cases import SSE_HEAD, USER, chunk, chunked, raw_upstream

MODELS = b'{"object":"list","data":[]}'
# The request each API's route gets; its error shape is checked by `error_of`.
ROUTES = {
    "chat": ("/v1/chat/completions", {"messages": USER}),
    "messages": ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": USER}),
    "responses": ("/v1/responses", {"model": "m", "input": "x"}),
}


def answer(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (status, content_type, len(body))
            + body)


@contextmanager
def scripted(reply):
    """`raw_upstream` answering GETs (the proxy's health check) with a model list and POSTs with
    `reply`: bytes to send, or an async function of the writer. Yields its URL."""
    holder = {}

    async def script(writer, reader):
        head = holder["state"]["requests"][-1][0]  # this connection's: appended just before the script runs
        if head.startswith(b"GET"):
            writer.write(answer(200, MODELS))
        elif callable(reply):
            await reply(writer)
        else:
            writer.write(reply)
        await writer.drain()

    with raw_upstream(script) as (url, state):
        holder["state"] = state
        yield url


def error_of(api: str, body: dict) -> dict:
    """The error object of an error body in `api`'s shape (asserting the shape)."""
    if api == "messages":
        assert body["type"] == "error", body
    return body["error"]


@contextmanager
def proxied(reply, timeouts: UpstreamTimeouts | None = None, **backend):
    """client → a real uvicorn proxy → a scripted upstream; yields (proxy url, upstream url, recorder)."""
    with tempfile.TemporaryDirectory() as tmp, scripted(reply) as up, Recorder(f"{tmp}/a.db") as rec:
        with running_server(create_app(UpstreamBackend(up, timeouts=timeouts, **backend), rec)) as url:
            yield url, up, rec


# --- finding 5: bodies and events the proxy cannot read --------------------------------------


@pytest.mark.parametrize("api, body", [
    ("chat", b'{"choices": "x"}'),  # was a bare 500 and no row
    ("chat", b'{"choices": [{"message": {"content": 5}}]}'),
    ("chat", b"{not json"),  # was a 200 with an empty reply
    ("chat", b""),  # was a 200 with an empty reply
    ("chat", b"[1, 2]"),
    ("messages", b'{"type": "message", "content": "x"}'),
    ("messages", b'{"type": "message", "content": [], "usage": "x"}'),  # was a bare 500
    ("messages", b"{not json"),
    ("responses", b'{"object": "response", "output": "x"}'),
    ("responses", b""),
], ids=lambda v: v if isinstance(v, str) else v[:24].decode())
def test_a_success_body_the_proxy_cannot_read_is_a_502_in_the_apis_shape_and_recorded(api, body):
    path, request = ROUTES[api]
    with proxied(answer(200, body)) as (url, up, rec):
        r = httpx.post(url + path, json=request, timeout=20)
        recorded = rows(rec)
    assert r.status_code == 502, r.text
    error = error_of(api, r.json())
    assert up in error["message"] and "upstream" in error["message"]
    assert len(recorded) == 1
    assert recorded[0]["status"] == 502 and up in recorded[0]["error"]
    assert recorded[0]["error"] == error["message"]  # recorded as the client saw it


BAD_SHAPE = b'data: {"choices": "x"}\n\n'
NOT_JSON = b"data: this is not json\n\n"
STREAMS = {
    "chat": [chunk("Hel"), BAD_SHAPE, NOT_JSON, chunk("lo", "stop"), b"data: [DONE]\n\n"],
    "messages": [
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":3}}}\n\n',
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"text","text":""}}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"Hel"}}\n\n',
        b'event: content_block_start\ndata: {"type":"content_block_start","index":1,"content_block":"x"}\n\n',
        NOT_JSON,
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"lo"}}\n\n',
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
        b'"usage":{"output_tokens":2}}\n\n',
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    ],
    "responses": [
        b'event: response.created\ndata: {"type":"response.created","response":{"status":"in_progress"}}\n\n',
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"Hel"}\n\n',
        b'event: response.output_item.added\ndata: {"type":"response.output_item.added","item":"x"}\n\n',
        NOT_JSON,
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"lo"}\n\n',
        b'event: response.completed\ndata: {"type":"response.completed","response":{"status":"completed",'
        b'"usage":{"input_tokens":3,"output_tokens":2}}}\n\n',
    ],
}


@pytest.mark.parametrize("api", list(STREAMS))
def test_a_stream_with_events_the_proxy_cannot_read_reaches_the_client_whole_and_is_recorded(api):
    """Malformed events used to cut the stream (the client got none of it) and the turn was recorded
    as a clean 200. Now every byte the upstream sent reaches the client, and the turn is recorded
    with the reply's readable text and the upstream's fault."""
    events = STREAMS[api]
    path, request = ROUTES[api]
    with proxied(SSE_HEAD + b"".join(chunked(e) for e in events) + b"0\r\n\r\n") as (url, up, rec):
        with httpx.stream("POST", url + path, json={**request, "stream": True}, timeout=20) as r:
            received = r.read()
        recorded = rows(rec)
    assert r.status_code == 200
    assert received == b"".join(events)  # what the upstream sent, byte for byte
    assert len(recorded) == 1
    row = recorded[0]
    assert row["status"] == 200 and row["response_text"] == "Hello"
    assert up in row["error"] and "cannot read" in row["error"]


# --- finding 8: upstreams that hang, and streams that do not end --------------------------------


async def hang(writer):
    await asyncio.sleep(3600)  # until the test's upstream is torn down


async def head_then_hang(writer):
    writer.write(SSE_HEAD + chunked(chunk("par")))
    await writer.drain()
    await asyncio.sleep(3600)


async def part_of_a_body_then_hang(writer):
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"choi")
    await writer.drain()
    await asyncio.sleep(3600)


FAST = UpstreamTimeouts(connect_s=5, first_byte_s=1.0, idle_s=1.0)
# httpx's own client (an https upstream, or one behind a proxy) keeps the same limits as the lean one.
CLIENTS = {"lean": {}, "httpx": {"transport": httpx.AsyncHTTPTransport()}}


@pytest.mark.parametrize("client", list(CLIENTS))
@pytest.mark.parametrize("api", ["chat", "messages"])
def test_an_upstream_that_hangs_before_its_head_is_a_504_in_the_apis_shape_and_recorded(api, client):
    path, request = ROUTES[api]
    with proxied(hang, FAST, **CLIENTS[client]) as (url, up, rec):
        t0 = time.monotonic()
        r = httpx.post(url + path, json=request, timeout=30)
        waited = time.monotonic() - t0
        recorded = rows(rec)
    assert r.status_code == 504, r.text
    error = error_of(api, r.json())
    assert "first-byte timeout" in error["message"] and up in error["message"]
    assert waited < 10  # the configured second, not the 600 s it was
    assert recorded[0]["status"] == 504 and "first-byte timeout" in recorded[0]["error"]


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_stream_that_hangs_midway_ends_in_an_error_event_after_the_idle_timeout_and_is_recorded(client):
    with proxied(head_then_hang, FAST, **CLIENTS[client]) as (url, up, rec):
        t0 = time.monotonic()
        with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": USER, "stream": True},
                          timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        waited = time.monotonic() - t0
        recorded = rows(rec)
    assert r.status_code == 200 and waited < 10
    assert json.loads(lines[0][5:])["choices"][0]["delta"]["content"] == "par"  # what it sent came through
    error = json.loads(lines[-2][5:])["error"]
    assert "idle timeout" in error["message"] and error["code"] == "upstream_timeout"
    assert lines[-1] == "data: [DONE]"
    row = recorded[0]
    assert row["response_text"] == "par" and "idle timeout" in row["error"]


def test_a_body_that_stops_midway_is_a_504_and_recorded():
    with proxied(part_of_a_body_then_hang, FAST) as (url, _, rec):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=30)
        recorded = rows(rec)
    assert r.status_code == 504 and "idle timeout" in r.json()["error"]["message"]
    assert recorded[0]["status"] == 504


def test_the_first_byte_may_take_longer_than_the_idle_timeout():
    """A streamed reply's head comes at once and its first event after the prompt's prefill: that
    wait is the first-byte timeout's, not the idle one's."""
    async def slow_prefill(writer):
        writer.write(SSE_HEAD)
        await writer.drain()
        await asyncio.sleep(1.5)  # > idle_s, < first_byte_s
        writer.write(chunked(chunk("ok", "stop") + b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    timeouts = UpstreamTimeouts(connect_s=5, first_byte_s=20, idle_s=0.5)
    with proxied(slow_prefill, timeouts) as (url, _, rec):
        with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": USER, "stream": True},
                          timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        recorded = rows(rec)
    assert lines[-1] == "data: [DONE]" and not any("error" in line for line in lines)
    assert recorded[0]["response_text"] == "ok" and not recorded[0]["error"]


def test_serve_takes_the_upstream_timeouts(clean_env):
    from click.testing import CliRunner

    from prefixtrace.cli import cli

    result = CliRunner().invoke(cli, ["serve", "--upstream", "http://127.0.0.1:9", "--upstream-first-byte-timeout-s",
                                       "30", "--upstream-idle-timeout-s", "5", "--print-config"])
    assert result.exit_code == 0, result.output
    options = json.loads(result.output)["options"]
    assert options["upstream_first_byte_timeout_s"] == {"value": 30.0, "source": "flag"}
    assert options["upstream_idle_timeout_s"] == {"value": 5.0, "source": "flag"}
    assert options["upstream_connect_timeout_s"]["value"] == UpstreamTimeouts().connect_s


def test_health_answers_while_a_long_fast_stream_passes_through():
    """`/health` timed out during a long stream: building the reply and splitting SSE were
    quadratic, on the event loop. A reply of many small events (sent as fast as the socket takes
    them) now passes while `/health` keeps answering."""
    piece = chunk("x" * 20)
    count = 8_000_000 // len(piece)  # ~8 MB of 130-byte events: before, /health waited ~10 s here

    async def fast_stream(writer):
        writer.write(SSE_HEAD)
        batch = piece * 500
        for _ in range(count // 500):
            writer.write(chunked(batch))
            await writer.drain()
        writer.write(chunked(chunk(None, "stop") + b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    with proxied(fast_stream) as (url, _, rec):
        result = {}

        def stream():
            with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": USER, "stream": True},
                              timeout=120) as r:
                result["bytes"] = len(r.read())

        thread = threading.Thread(target=stream)
        thread.start()
        latencies = []
        with httpx.Client(timeout=30) as client:
            while thread.is_alive():
                t0 = time.monotonic()
                assert client.get(url + "/health").status_code == 200
                latencies.append(time.monotonic() - t0)
                time.sleep(0.05)
        thread.join()
        recorded = rows(rec)
    assert max(latencies) < 5.0, latencies  # ~1 s on a loaded 2-core machine
    assert len(recorded[0]["response_text"]) == 20 * (count // 500 * 500)


@pytest.mark.parametrize("client", list(CLIENTS))
def test_an_upstream_that_does_not_take_the_connection_is_a_504_after_the_connect_timeout(client, tmp_path):
    """A listening socket whose backlog is full: the SYN is never answered (a host that is down)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname())  # fills the backlog; nothing is accepted
    up = "http://127.0.0.1:%d" % listener.getsockname()[1]
    timeouts = UpstreamTimeouts(connect_s=0.5, first_byte_s=30, idle_s=30)
    try:
        with Recorder(tmp_path / "a.db") as rec:
            with running_server(create_app(UpstreamBackend(up, timeouts=timeouts, **CLIENTS[client]), rec)) as url:
                t0 = time.monotonic()
                r = httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=30)
                waited = time.monotonic() - t0
            recorded = rows(rec)
    finally:
        filler.close()
        listener.close()
    assert r.status_code == 504 and "connect timeout" in r.json()["error"]["message"], r.text
    assert waited < 10  # it was a fixed 10 s
    assert recorded[0]["status"] == 504 and "connect timeout" in recorded[0]["error"]


def test_an_event_that_never_ends_is_an_error_event_not_a_buffer_without_bound(monkeypatch):
    """An upstream that streams one event forever (no blank line ever comes): the proxy buffered
    it all, the client got nothing and memory grew until the upstream stopped."""
    from prefixtrace.wire import sse

    monkeypatch.setattr(sse, "MAX_EVENT_BYTES", 1 << 20)  # the proxy runs in this process

    async def endless_event(writer):
        writer.write(SSE_HEAD + chunked(chunk("par")) + chunked(b'data: {"choices": "'))
        for _ in range(400):  # 400 × 64 KB: the limit is crossed after a sixth of it
            writer.write(chunked(b"x" * 65536))
            await writer.drain()

    with proxied(endless_event, FAST) as (url, up, rec):
        with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": USER, "stream": True},
                          timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        recorded = rows(rec)
    error = json.loads(lines[-2][5:])["error"]
    assert "without its end" in error["message"] and up in error["message"]
    assert lines[-1] == "data: [DONE]"
    assert recorded[0]["response_text"] == "par" and "without its end" in recorded[0]["error"]
