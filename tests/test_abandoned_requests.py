"""A request abandoned at any stage is cancelled and recorded (issue 25, finding 1), driven from
outside: a real uvicorn on 127.0.0.1, clients on raw sockets that close them while their request
is queued in the engine, while it prefills, while it decodes, and a scripted upstream on loopback
that holds its headers or its body. Each abandoned request leaves one row, status 499, whose error
names the stage it reached; the engine's queues are empty again within seconds; a normal request
afterwards is answered."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sqlite3
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from engine.engine import Engine
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
from tests.conftest import TINY_MODEL, read_until, rows, running_server

STAGE = re.compile(r"^client disconnected \((\w+)\)$")


def post(url: str, path: str, body: dict) -> socket.socket:
    """A POST sent on a raw socket, left open: closing the socket is the client giving up."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
    return sock


def capacity(url: str) -> dict:
    return httpx.get(url + "/v1/capacity", timeout=10).json()


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def in_engine(url: str) -> int:
    cap = capacity(url)
    return cap["running"] + cap["prefilling"] + cap["waiting"] + cap["paused"]


def recorded(rec, n: int, timeout: float = 10) -> list[dict]:
    return wait_for(lambda: (lambda r: r if len(r) >= n else None)(rows(rec)), timeout,
                    f"fewer than {n} turns recorded")


def stage_of(row: dict) -> str | None:
    match = STAGE.match(row["error"] or "")
    return match.group(1) if match else None


def abandoned_body(path: str, stream: bool, text: str = "wait for me", max_tokens: int = 8) -> dict:
    if path == "/v1/responses":
        return {"model": "default", "input": text, "max_output_tokens": max_tokens, "stream": stream}
    if path == "/v1/completions":
        return {"model": "default", "prompt": text, "max_tokens": max_tokens, "stream": stream}
    return {"model": "default", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": text}]}


ENDPOINTS = ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions"]
FOREVER = {"model": "default", "max_tokens": 20000, "ignore_eos": True, "stream": True,
           "messages": [{"role": "user", "content": "go on forever"}]}


@contextmanager
def engine_server(tmp_path, *, full_stack: bool = False, **engine_kw):
    """`full_stack`: every request served through Starlette's middleware stack, as a turn POST
    `TurnRoutes` does not take is (its hang-up watch is then the `CancelOnDisconnect` middleware's)."""
    engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32", **engine_kw).start()
    engine.wait_ready(60)
    try:
        with Recorder(tmp_path / "traffic.db") as rec:
            app = create_app(EngineBackend(engine), rec)
            if full_stack:
                app.turn_routes = None
            with running_server(app) as url:
                yield url, rec, engine
    finally:
        engine.shutdown()


def answers(url: str) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    return r


def test_requests_abandoned_while_queued_are_cancelled_and_recorded(tmp_path):
    """One slot (max_batch 1) held by a decoding request; every API, streamed and not, queued behind
    it, then abandoned: each leaves the engine's queue at once and is recorded as 499 (queued)."""
    with engine_server(tmp_path, max_batch=1) as (url, rec, engine):
        blocker = post(url, "/v1/chat/completions", FOREVER)
        read_until(blocker, b"data: {")  # decoding: it holds the only slot
        socks = [post(url, path, abandoned_body(path, stream)) for path in ENDPOINTS for stream in (False, True)]
        wait_for(lambda: capacity(url)["waiting"] == len(socks), 30, "the requests never queued")
        for sock in socks:
            sock.close()
        wait_for(lambda: capacity(url)["waiting"] == 0, 5, "abandoned requests stayed in the engine's queue")
        assert capacity(url)["running"] == 1  # the blocker decodes on
        queued = recorded(rec, len(socks))
        assert len(queued) == len(socks)
        assert all(r["status"] == 499 and stage_of(r) == "queued" for r in queued), \
            [(r["endpoint"], r["stream"], r["status"], r["error"]) for r in queued]
        assert {(r["endpoint"], bool(r["stream"])) for r in queued} == \
            {(p, s) for p in ENDPOINTS for s in (False, True)}
        # What the open learnt before the hang-up (the render, who serves) is recorded with it.
        assert all(json.loads(r["render"])["prompt_tokens"] > 0 for r in queued), [r["render"] for r in queued]
        with sqlite3.connect(rec.path) as con:  # `turn_log`: who served is not in the v1 `turns` view
            served = {by for (by,) in con.execute("SELECT served_by FROM turn_log WHERE status = 499 "
                                                  "AND endpoint != '/v1/completions'")}  # a raw prompt: no renderer
        assert served == {"embedded:tiny-llama"}
        assert engine.stats["cancelled"] == len(socks) and engine.stats["generated_tokens"] < 20000

        blocker.close()  # the decoding one gives up too
        wait_for(lambda: in_engine(url) == 0, 5, "the engine kept decoding for a client that left")
        (first, *_) = recorded(rec, len(socks) + 1)  # the blocker arrived first
        assert (first["status"], stage_of(first), first["finish_reason"]) == (499, "decoding", "cancelled")
        assert first["response_text"]  # what the client had been sent
        answers(url)
        assert len(rows(rec)) == len(socks) + 2  # exactly once each


@pytest.mark.parametrize("path, stream", [("/v1/chat/completions", False), ("/v1/chat/completions", True),
                                          ("/v1/messages", True), ("/v1/responses", True)])
@pytest.mark.slow
def test_a_request_abandoned_while_prefilling_stops_at_its_next_chunk_and_keeps_its_blocks(tmp_path, path, stream):
    """A 6k-token prompt in 16-token chunks prefills for seconds; the client leaves in the middle."""
    text = "hello world " * 2000
    with engine_server(tmp_path, prefill_step_size=16) as (url, rec, engine):
        sock = post(url, path, abandoned_body(path, stream, text, max_tokens=4))
        wait_for(lambda: capacity(url)["prefilling"] == 1, 30, "the prompt never started prefilling")
        sock.close()
        wait_for(lambda: in_engine(url) == 0, 2, "the prefill went on for a client that left")
        assert engine.stats["cancelled"] == 1 and engine.stats["generated_tokens"] == 0
        (row,) = recorded(rec, 1)
        assert (row["status"], stage_of(row)) == (499, "prefilling"), (row["status"], row["error"])
        # The blocks it had computed stay: the same prompt again starts from them.
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": text}]})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert len(rows(rec)) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_abandoned_while_decoding_is_recorded_with_its_stage(tmp_path, stream):
    with engine_server(tmp_path) as (url, rec, engine):
        sock = post(url, "/v1/chat/completions", {**FOREVER, "stream": stream})
        wait_for(lambda: capacity(url)["running"] == 1, 30, "never decoding")
        if stream:
            read_until(sock, b"data: {")
        sock.close()
        wait_for(lambda: in_engine(url) == 0, 5, "the engine kept decoding for a client that left")
        (row,) = recorded(rec, 1)
        assert (row["status"], stage_of(row), row["finish_reason"]) == (499, "decoding", "cancelled")
        answers(url)


@pytest.mark.parametrize("stream", [False, True])
def test_on_the_full_stack_a_request_abandoned_while_decoding_is_recorded_with_its_stage(tmp_path, stream):
    """The same watch off the turn routes' path: a streamed reply is cancelled mid-stream by the
    middleware's watch (the response listens for nothing itself), a whole one while it waits."""
    with engine_server(tmp_path, full_stack=True) as (url, rec, engine):
        sock = post(url, "/v1/chat/completions", {**FOREVER, "stream": stream})
        wait_for(lambda: capacity(url)["running"] == 1, 30, "never decoding")
        if stream:
            read_until(sock, b"data: {")
        sock.close()
        wait_for(lambda: in_engine(url) == 0, 5, "the engine kept decoding for a client that left")
        (row,) = recorded(rec, 1)
        assert (row["status"], stage_of(row), row["finish_reason"]) == (499, "decoding", "cancelled")
        answers(url)


# --- upstream mode: a scripted upstream that holds its headers or its body -------------------------

@contextmanager
def holding_upstream():
    """An upstream on loopback. A request whose body says "hold-head" gets nothing back; "hold-body"
    gets its headers and part of a body (a JSON body, or one SSE event); anything else a whole
    chat.completion. Held connections wait for the proxy to close them: `state["closed"]` counts those."""
    state = {"requests": 0, "closed": 0, "lock": threading.Lock()}
    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                body = await reader.readexactly(length)
                with state["lock"]:
                    state["requests"] += 1
                streamed = json.loads(body).get("stream")
                if b"hold-head" in body or b"hold-body" in body:
                    if b"hold-body" in body and streamed:
                        event = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,' \
                                b'"delta":{"content":"par"},"finish_reason":null}]}\n\n'
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                     b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event))
                    elif b"hold-body" in body:
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                     b"content-length: 400\r\n\r\n{\"id\": \"c\", ")
                    await writer.drain()
                    while await reader.read(65536):  # until the proxy closes the connection
                        pass
                    with state["lock"]:
                        state["closed"] += 1
                    return
                reply = json.dumps({"id": "c", "object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(reply), reply))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main():
        server = await asyncio.start_server(handle, sock=sock)
        async with server:
            await server.serve_forever()

    thread = threading.Thread(target=lambda: _run_until_cancelled(loop, main()), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    finally:
        loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
        thread.join(5)


def _run_until_cancelled(loop, main):
    try:
        loop.run_until_complete(main)
    except asyncio.CancelledError:
        pass


@pytest.mark.parametrize("hold, stream", [("hold-head", False), ("hold-head", True),
                                          ("hold-body", False), ("hold-body", True)])
@pytest.mark.parametrize("client", ["direct", "httpx"])
def test_a_hang_up_while_waiting_for_the_upstream_is_recorded_and_closes_the_upstream_request(tmp_path, hold, stream,
                                                                                             client):
    # "httpx": a transport of its own takes the turn's POST off the proxy's direct client
    # (proxy/upstream_http.py) onto httpx's, the path https upstreams take.
    transport = httpx.AsyncHTTPTransport() if client == "httpx" else None
    with holding_upstream() as (up, state), Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(UpstreamBackend(up, transport=transport), rec)) as url:
            sock = post(url, "/v1/chat/completions", {"model": "m", "stream": stream,
                                                      "messages": [{"role": "user", "content": hold}]})
            wait_for(lambda: state["requests"] == 1, 10, "the upstream never got the request")
            if hold == "hold-body" and stream:
                read_until(sock, b"par")  # the client has the upstream's first event, then leaves
            elif hold == "hold-body":
                time.sleep(1.0)  # the upstream's head and first bytes have reached the proxy (not observable)
            sock.close()
            wait_for(lambda: state["closed"] == 1, 10, "the proxy kept the upstream request open")
            (row,) = recorded(rec, 1)
            expected = "upstream_headers" if hold == "hold-head" else "upstream_body"
            assert (row["status"], stage_of(row)) == (499, expected), (row["status"], row["error"])
            if hold == "hold-body" and stream:
                assert row["response_text"] == "par"
            r = httpx.post(url + "/v1/chat/completions", timeout=10,
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
            assert len(rows(rec)) == 2


# --- the server as `prefixtrace serve` runs it: many abandoned requests, then SIGTERM ---------------

@pytest.mark.slow
def test_many_abandoned_requests_leave_the_engine_free_and_sigterm_prompt(tmp_path):
    """The probe's wedge: requests queued behind a busy slot, given up by their clients, used to stay
    in the engine (each then generated to its max_tokens) and unrecorded; a normal request waited
    behind them, and SIGTERM waited for it. Now each leaves the engine at once and is recorded."""
    import signal
    import sqlite3
    import subprocess

    from tests.test_cli_serve import serve_process

    db = tmp_path / "traffic.db"
    with serve_process(["--model", str(TINY_MODEL), "--db", str(db), "--max-batch", "1"], cwd=tmp_path,
                       env={"PREFIXTRACE_NO_OPENBLAS": "1"}) as (url, proc):
        blocker = post(url, "/v1/chat/completions", FOREVER)
        read_until(blocker, b"data: {")
        many = {**FOREVER, "messages": [{"role": "user", "content": "me too, forever"}]}
        socks = [post(url, "/v1/chat/completions", {**many, "stream": i % 2 == 0}) for i in range(24)]
        wait_for(lambda: capacity(url)["waiting"] == len(socks), 60, "the requests never queued")
        for sock in [*socks, blocker]:
            sock.close()
        wait_for(lambda: in_engine(url) == 0, 5, "abandoned requests stayed in the engine")
        t0 = time.monotonic()
        answers(url)
        assert time.monotonic() - t0 < 10
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            pytest.fail("serve did not stop promptly on SIGTERM")
        stopped_s = time.monotonic() - t0
    con = sqlite3.connect(db)
    found = con.execute("select status, error from turns").fetchall()
    con.close()
    assert len(found) == len(socks) + 2, found
    assert sorted(found).count((499, "client disconnected (queued)")) == len(socks)
    assert (499, "client disconnected (decoding)") in found and (200, None) in found
    assert stopped_s < 15
