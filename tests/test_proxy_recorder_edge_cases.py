"""The proxy and recorder under bad input, upstream trouble, secrets and JSONL round trips (edge cases
found by a bug hunt; each bug test failed before its fix)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from openai import OpenAI

from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
from tests.conftest import rows, running_server

USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "extra, words",
    [
        # used to fail the engine step and hang the request (and any request in flight with it)
        ({"seed": 2**70}, "seed"),
        # used to be a 500 from the chat template's ValueError, and the turn was lost
        ({"tools": [1]}, "tools[0]"),
        # used to be a 500 from the tokenizer's TypeError, and the turn was lost
        ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "surrogate"),
        # used to answer one choice for n=2
        ({"n": 2}, "'n'"),
        # used to stream for "false"
        ({"stream": "false"}, "stream"),
    ],
)
def test_bad_input_is_a_400_with_a_reason_and_is_recorded(engine_server, extra, words):
    url, recorder = engine_server
    body = {"model": "default", "max_tokens": 2, "messages": USER, **extra}
    r = httpx.post(url + "/v1/chat/completions", content=json.dumps(body).encode(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    recorded = rows(recorder)
    assert len(recorded) == 1 and recorded[0]["status"] == 400 and words in recorded[0]["error"]


def test_negative_seed_is_served_and_deterministic(openai_client):
    """OpenAI's seeds are signed 64-bit; the engine's key is unsigned. -1 used to fail the engine step."""
    kwargs = dict(model="default", messages=USER, max_tokens=4, temperature=0.8)
    a = openai_client.chat.completions.create(seed=-1, **kwargs).choices[0].message.content
    b = openai_client.chat.completions.create(seed=-1, **kwargs).choices[0].message.content
    assert a == b


class ExplodingBackend:
    """A forwarding backend (proxy/backend.py) whose every turn fails with a bug."""

    label = "exploding"
    max_context_tokens = None
    embedded = False

    async def ready(self):
        return True

    async def post(self, path, body, headers, *, session_id=None, raw=None):
        raise RuntimeError("boom")

    def renderer_of(self, url):
        return None

    def renderer_identity(self):
        return None

    def stats(self):
        return None

    async def aclose(self):
        pass


def test_an_unexpected_failure_is_an_openai_error_and_still_recorded(tmp_path):
    with Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(ExplodingBackend(), rec)) as url:
            r = httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=10)
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        row = rows(rec)[0]
        assert row["status"] == 500 and "boom" in row["error"]


# --- upstream trouble ------------------------------------------------------------------------



@contextmanager
def raw_upstream(script):
    """A bare HTTP server on 127.0.0.1: `script(writer)` (async) writes the whole reply for each request,
    then the connection is closed. Yields (url, state) where state["closed"] counts client-side closes."""
    state = {"requests": [], "closed": threading.Event()}
    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length)
        state["requests"].append((head, body))
        try:
            await script(writer, reader)
        except (ConnectionError, asyncio.CancelledError):
            state["closed"].set()
        finally:
            writer.close()

    async def main():
        server = await asyncio.start_server(handle, sock=sock)
        state["server"] = server
        async with server:
            await server.serve_forever()

    def run():
        try:
            loop.run_until_complete(main())
        except asyncio.CancelledError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
        thread.join(5)


def chunked(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def chunk(content, finish=None):
    return ("data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                   "choices": [{"index": 0, "delta": {"content": content},
                                                "finish_reason": finish}]}) + "\n\n").encode()


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def test_upstream_stream_cut_midway_is_reported_in_band_and_recorded(tmp_path):
    async def script(writer, reader):
        writer.write(SSE_HEAD + chunked(chunk("par")) + chunked(chunk("tial")))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()  # the upstream dies mid-stream

    with raw_upstream(script) as (up, _), Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(UpstreamBackend(up), rec)) as url:
            body = {"stream": True, "messages": USER}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert r.status_code == 200
        assert lines[-1] == "data: [DONE]"
        assert "error" in json.loads(lines[-2][5:])
        row = rows(rec)[0]
        assert row["response_text"] == "partial" and row["error"] and up in row["error"]


@pytest.mark.parametrize("complete", [False, True], ids=["cut", "whole"])
def test_a_stream_framed_by_connection_close_is_judged_by_its_end_marks(tmp_path, complete):
    """No chunked encoding, no length: the upstream closing the connection is the only framing,
    so a cut reads like an end unless [DONE] / finish_reason are checked."""
    async def script(writer, reader):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                     + chunk("par") + (chunk("tial", "stop") + b"data: [DONE]\n\n" if complete else b""))
        await writer.drain()
        writer.close()

    with raw_upstream(script) as (up, _), Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(UpstreamBackend(up), rec)) as url:
            with httpx.stream("POST", url + "/v1/chat/completions", json={"stream": True, "messages": USER},
                              timeout=10) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data:")]
        row = rows(rec)[0]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    if complete:
        assert row["response_text"] == "partial" and not row["error"]
        assert not any("error" in line for line in lines)
    else:
        assert "without [DONE]" in json.loads(lines[-2][5:])["error"]["message"]
        assert row["response_text"] == "par" and "without [DONE]" in row["error"]


@pytest.mark.parametrize("stream, reply, ctype", [
    (True, b'{"error": {"message": "bad sk-ABCDEFGHIJKLMNOPQRSTUV"}}', b"application/json"),
    (False, b"<html>Bad Gateway sk-ABCDEFGHIJKLMNOPQRSTUV</html>", b"text/html"),
])
def test_upstream_error_status_passes_through_and_is_recorded(tmp_path, stream, reply, ctype):
    async def script(writer, reader):
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: " + ctype
                     + b"\r\ncontent-length: " + str(len(reply)).encode() + b"\r\nconnection: close\r\n\r\n" + reply)
        await writer.drain()

    with raw_upstream(script) as (up, _), Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(UpstreamBackend(up), rec)) as url:
            r = httpx.post(url + "/v1/chat/completions", json={"stream": stream, "messages": USER}, timeout=10)
        assert r.status_code == 503 and r.content == reply
        row = rows(rec)[0]
        assert row["status"] == 503 and row["error"]
        assert "sk-ABCDEFGHIJKLMNOPQRSTUV" not in row["error"]


def test_client_disconnect_from_an_upstream_stream_is_recorded_and_closes_the_upstream(tmp_path):
    async def script(writer, reader):
        writer.write(SSE_HEAD)
        for i in range(2000):
            writer.write(chunked(chunk(f"w{i} ")))
            await writer.drain()
            await asyncio.sleep(0.01)

    with raw_upstream(script) as (up, state), Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(UpstreamBackend(up), rec)) as url:
            with httpx.stream("POST", url + "/v1/chat/completions", json={"stream": True, "messages": USER},
                              timeout=10) as r:
                seen = 0
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                        if seen == 3:
                            break
            assert state["closed"].wait(10), "the proxy kept reading the upstream after the client left"
            deadline = time.monotonic() + 10
            while not rows(rec):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        row = rows(rec)[0]
        assert row["error"] == "client disconnected (upstream_body)" and row["response_text"].startswith("w0 w1 w2")


# --- secrets ---------------------------------------------------------------------------------

SECRET = "sk-proj-" + "Z9y8X7w6" * 5


def db_bytes(path) -> bytes:
    return b"".join(p.read_bytes() for p in (path, path.with_name(path.name + "-wal")) if p.exists())


def test_secrets_in_session_ids_headers_and_streamed_tool_calls_never_reach_the_db_or_export(tmp_path):
    half = len(SECRET) // 2

    def call(i, piece):
        return chunked(("data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                        "choices": [{"index": 0, "delta": {"tool_calls": [dict(index=0, **piece)]}}]}) + "\n\n").encode())

    async def script(writer, reader):
        writer.write(SSE_HEAD + chunked(chunk("key: " + SECRET[:half])) + chunked(chunk(SECRET[half:]))
                     + call(0, {"id": "c1", "type": "function", "function": {"name": "login", "arguments": '{"key": "'}})
                     + call(0, {"function": {"arguments": SECRET[:half]}})
                     + call(0, {"function": {"arguments": SECRET[half:] + '"}'}})
                     + chunked(chunk(None, "tool_calls")) + chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    from recorder.sources import export
    with raw_upstream(script) as (up, state), Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(UpstreamBackend(up), rec)) as url:
            client = OpenAI(base_url=url + "/v1", api_key=SECRET, max_retries=0, timeout=10,
                            default_headers={"X-Session-Id": "team-" + SECRET, "api-key": SECRET,
                                             "X-Custom-Token": f"Bearer {SECRET}"})
            chunks = list(client.chat.completions.create(
                model="m", stream=True, user=SECRET,
                messages=[{"role": "user", "content": [{"type": "text", "text": f"use {SECRET}"}]}],
                tools=[{"type": "function", "function": {"name": "login", "description": f"default {SECRET}",
                                                         "parameters": {"type": "object"}}}]))
        assert chunks  # the client still saw everything, secrets included
        assert SECRET.encode() in state["requests"][0][0]  # and the upstream got its credentials
        row = rows(rec)[0]
        assert row["tool_calls"] and json.loads(row["tool_calls"])[0]["function"]["name"] == "login"
        rec.close()
        assert SECRET.encode() not in db_bytes(rec.path)
        assert export(rec.path, tmp_path / "out.jsonl") == 1
        assert export(rec.path, tmp_path / "out.har", fmt="har") == 1
        for name in ("out.jsonl", "out.har"):
            assert SECRET not in (tmp_path / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("raw, words", [
    (b'{"stream": true, "stream_options": "usage", "messages": [{"role": "user", "content": "x"}]}', "stream_options"),
    (b'{"metadata": {"score": NaN}, "messages": [{"role": "user", "content": "x"}]}', "NaN"),
])
def test_bad_bodies_through_an_upstream_are_a_400_not_a_500(tmp_path, raw, words):
    """Both used to raise inside the upstream backend: a bare 500 and no recorded turn."""
    async def script(writer, reader):  # never reached
        writer.write(b"HTTP/1.1 500 Oops\r\ncontent-length: 0\r\n\r\n")

    with raw_upstream(script) as (up, state), Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(UpstreamBackend(up), rec)) as url:
            r = httpx.post(url + "/v1/chat/completions", timeout=10, content=raw,
                           headers={"content-type": "application/json"})
        assert r.status_code == 400 and words in r.json()["error"]["message"]
        assert rows(rec)[0]["status"] == 400 and not state["requests"]


# --- unicode through the recorder and JSONL ------------------------------------------------------


def test_surrogate_escapes_from_an_upstream_stream_do_not_lose_the_turn(tmp_path):
    """A JavaScript server can split an emoji's UTF-16 pair across two chunks ("\\ud83d", "\\ude00"):
    SQLite refused the text and the whole turn was lost."""
    async def script(writer, reader):
        raw = [b'data: {"choices":[{"index":0,"delta":{"content":"hi \\ud83d"}}]}\n\n',
               b'data: {"choices":[{"index":0,"delta":{"content":"\\ude00 \\udc00!"},"finish_reason":"stop"}]}\n\n',
               b"data: [DONE]\n\n"]
        writer.write(SSE_HEAD + b"".join(chunked(e) for e in raw) + b"0\r\n\r\n")
        await writer.drain()

    with raw_upstream(script) as (up, _), Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(UpstreamBackend(up), rec)) as url:
            body = {"stream": True, "user": "s\ud800", "messages": [{"role": "user", "content": "x\ud800"}]}
            r = httpx.post(url + "/v1/chat/completions", content=json.dumps(body).encode(), timeout=10,
                           headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        row = rows(rec)[0]
        assert row["response_text"] == "hi \U0001F600 \ufffd!" and row["finish_reason"] == "stop"
        assert json.loads(row["request_body"])["messages"][0]["content"] == "x\ud800"  # the body's own escapes


def test_jsonl_round_trip_keeps_line_separators_inside_strings(tmp_path):
    """Export writes U+2028, U+2029 and U+0085 raw (json.dumps(ensure_ascii=False)); import split lines on them."""
    from recorder import Turn, export_jsonl, import_jsonl, iter_turns

    text = "a\u2028b\u2029c\x85d\x1ee" + "é" * 200_000
    with Recorder(tmp_path / "a.db") as rec:
        rec.record(Turn("t1", 1.0, "/v1/chat/completions", "u", {"messages": [{"role": "user", "content": text}]},
                        response_text=text, session_id="s"))
        rec.record(Turn("t2", 2.0, "/v1/chat/completions", "u", {"messages": [{"role": "user", "content": "x"}]}))
    assert export_jsonl(tmp_path / "a.db", tmp_path / "a.jsonl") == 2
    assert import_jsonl(tmp_path / "a.jsonl", tmp_path / "b.db") == 2
    export_jsonl(tmp_path / "b.db", tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert list(iter_turns(tmp_path / "a.db")) == list(iter_turns(tmp_path / "b.db"))
