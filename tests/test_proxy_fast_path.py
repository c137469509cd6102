"""The proxy's fast path in upstream mode (issue 17): SSE split on bytes, the lean event-stream
response, the turn routes served without FastAPI's router. Each serves and records as before."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from prefixtrace.wire import sse
from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
from tests.conftest import rows, running_server


def _split(stream: bytes, cuts: list[int]) -> list[bytes]:
    async def chunks():
        last = 0
        for cut in [*cuts, len(stream)]:
            yield stream[last:cut]
            last = cut

    async def collect():
        return [event async for event in sse.iter_events_bytes(chunks())]

    return asyncio.run(collect())


def test_sse_events_are_the_same_however_the_bytes_are_cut():
    stream = (b"\n: comment\r\ndata: {\"a\":1}\r\n\r\nevent: x\rdata: 2\r\rdata: [DONE]\n\n\n\n"
              b"data: 3\ndata: 4\n\ndata: last")
    want = [b": comment\ndata: {\"a\":1}\n\n", b"event: x\ndata: 2\n\n", b"data: [DONE]\n\n",
            b"data: 3\ndata: 4\n\n", b"data: last\n\n"]
    assert _split(stream, []) == want
    for cut in range(len(stream) + 1):
        assert _split(stream, [cut]) == want, cut
    assert _split(stream, list(range(1, len(stream)))) == want  # one byte at a time


def test_sse_line_separators_inside_json_strings_are_data():
    """U+2028, U+2029 and U+0085 may stand unescaped in a JSON string; SSE ends lines only at
    CR and LF. A `str.splitlines` reader cut the event there and the chunk reached the client
    (and the recorder) as two broken lines."""
    event = json.dumps({"text": "a\u2028b\u2029c\x85d"}, ensure_ascii=False).encode()
    assert _split(b"data: " + event + b"\n\n", []) == [b"data: " + event + b"\n\n"]


def scripted_stream(chunks: list[dict]) -> UpstreamBackend:
    async def events():
        for chunk in chunks:
            yield b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    return UpstreamBackend("http://upstream.test", transport=httpx.MockTransport(handler))


def test_a_reply_with_unicode_line_separators_passes_through_and_is_recorded(tmp_path):
    text = "one\u2028two\x85three\u2029"
    chunks = [{"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text},
                                                                          "finish_reason": "stop"}]},
              {"id": "x", "object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}]
    with Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(scripted_stream(chunks), rec)) as url:
            body = {"stream": True, "messages": [{"role": "user", "content": "hi"}]}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
                raw = r.read()
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        seen = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
        assert [c["choices"][0]["delta"]["content"] for c in seen] == [text]
        assert rows(rec)[0]["response_text"] == text


# --- the turn's POST on the lean client (proxy/upstream_http.py) ----------------------------------

import socket  # noqa: E402
import threading  # noqa: E402

WHOLE = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()


def _read_head_and_body(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int([line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")][0])
    while len(body) < length:
        body += conn.recv(65536)
    return head


class ScriptedUpstream:
    """A socket server on loopback that answers each connection's first request by `answer(conn)`."""

    def __init__(self, answer):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def close(self):
        self.sock.close()


def test_an_idle_connection_the_upstream_closed_is_not_reused(tmp_path):
    """The upstream answers with keep-alive, then closes the idle connection: the next turn must go
    out on a new connection (the backend's idle check sees the EOF), not fail on the dead one."""
    def answer(conn):
        _read_head_and_body(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(WHOLE), WHOLE))
        time.sleep(0.1)
        conn.close()

    upstream = ScriptedUpstream(answer)
    backend = UpstreamBackend(upstream.url)
    assert backend.connections is not None  # the turn's POST is on the lean client
    try:
        with Recorder(tmp_path / "a.db") as rec:
            with running_server(create_app(backend, rec)) as url:
                body = {"messages": [{"role": "user", "content": "hi"}]}
                first = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
                time.sleep(0.5)  # the upstream has closed its side by now
                second = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
            assert (first.status_code, second.status_code) == (200, 200), second.text
            assert upstream.connections == 2
            assert [r["status"] for r in rows(rec)] == [200, 200]
    finally:
        upstream.close()


def test_an_upstream_that_never_answers_is_a_timeout_with_a_reason(tmp_path):
    def answer(conn):
        _read_head_and_body(conn)
        time.sleep(5)  # never answers within the backend's timeout
        conn.close()

    upstream = ScriptedUpstream(answer)
    try:
        with Recorder(tmp_path / "a.db") as rec:
            with running_server(create_app(UpstreamBackend(upstream.url, timeout=0.5), rec)) as url:
                r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                               timeout=10)
            assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
            assert "ReadTimeout" in r.json()["error"]["message"]
            assert rows(rec)[0]["status"] == 504
    finally:
        upstream.close()


# --- the turn routes without FastAPI's router (proxy/turn_routes.py) ------------------------------


def test_every_turn_route_is_on_the_fast_path_in_both_modes(tiny_engine, tmp_path):
    """A route function that stopped matching `async def f(request)` would silently fall back to
    FastAPI's stack: every turn endpoint must be found, on an upstream and on the engine."""
    from proxy.app import TURN_PATHS
    from proxy.engine_backend import EngineBackend
    from proxy.turn_routes import TurnRoutes

    for n, backend in enumerate((UpstreamBackend("http://127.0.0.1:9"), EngineBackend(tiny_engine))):
        with Recorder(tmp_path / f"{n}.db") as rec:
            app = create_app(backend, rec)
        assert set(TurnRoutes(fastapi_app=app, paths=TURN_PATHS)._find()) == set(TURN_PATHS)


def test_other_methods_and_paths_still_go_through_fastapi(tmp_path):
    with Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(scripted_stream([]), rec)) as url:
            get = httpx.get(url + "/v1/chat/completions")
            slash = httpx.post(url + "/v1/chat/completions/", json={"messages": []})
    assert get.status_code == 405 and get.json()["error"]["type"] == "method_not_allowed"
    assert slash.status_code == 404 and "unknown endpoint" in slash.json()["error"]["message"]


def _keep_answering(answers):
    """A connection handler that answers each request on the connection with the next of
    `answers` (bytes, or a callable given the request head and body), recording what came."""
    seen = []

    def answer(conn):
        data = b""
        for reply in answers:
            while b"\r\n\r\n" not in data:
                more = conn.recv(65536)
                if not more:
                    return
                data += more
            head, _, data = data.partition(b"\r\n\r\n")
            length = int([line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")][0])
            while len(data) < length:
                data += conn.recv(65536)
            body, data = data[:length], data[length:]
            seen.append((head, body))
            conn.sendall(reply(head, body) if callable(reply) else reply)
        time.sleep(0.2)
        conn.close()

    return answer, seen


def _whole(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s" % (
        extra, len(body), body)


def test_the_upstream_gets_the_clients_bytes_and_the_connection_is_kept(tmp_path):
    """A pass-through body goes out as the client sent it (no re-encoding: key order, spacing and
    escapes kept), a streamed chat request gets `include_usage` added to those bytes, and the
    second turn reuses the kept-alive connection."""
    sse_reply = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                 + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in [
                     b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n',
                     b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n',
                     b"data: [DONE]\n\n"]) + b"0\r\n\r\n")
    answer, seen = _keep_answering([_whole(WHOLE), sse_reply])
    upstream = ScriptedUpstream(answer)
    backend = UpstreamBackend(upstream.url)
    whole = b'{ "messages" : [{"role":"user","content":"caf\\u00e9 \\ud83d\\ude00"}],  "z": 1, "a": 2 }'
    streamed = b'{"stream": true, "messages": [{"role": "user", "content": "hi"}]}\n'
    try:
        with Recorder(tmp_path / "a.db") as rec:
            with running_server(create_app(backend, rec)) as url:
                with httpx.Client(base_url=url, timeout=10) as client:
                    first = client.post("/v1/chat/completions", content=whole,
                                        headers={"content-type": "application/json"})
                    second = client.post("/v1/chat/completions", content=streamed,
                                         headers={"content-type": "application/json"})
            assert (first.status_code, second.status_code) == (200, 200), second.text
            assert b'"hi"' in second.content and b"usage" not in second.content  # not asked for: not shown
            assert [r["response_text"] for r in rows(rec)] == ["ok", "hi"]
        assert seen[0][1] == whole
        assert seen[1][1] == streamed.rstrip()[:-1] + b',"stream_options":{"include_usage":true}}'
        assert json.loads(seen[1][1])["stream_options"] == {"include_usage": True}
        assert upstream.connections == 1 and backend.connections.opened == 1
        head = seen[0][0].decode().lower()
        assert head.startswith("post /v1/chat/completions http/1.1\r\n")
        assert f"host: {upstream.url.split('//')[1]}" in head and "accept-encoding: identity" in head
    finally:
        upstream.close()


def test_a_compressed_whole_body_is_decoded_and_a_broken_stream_is_a_502(tmp_path):
    """An upstream that gzips anyway is still read; one that closes mid-body is reported, not
    passed on as a short answer."""
    import gzip

    cut = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{\"id\":"
    answer, _ = _keep_answering([_whole(gzip.compress(WHOLE), b"content-encoding: gzip\r\n"), cut])
    upstream = ScriptedUpstream(answer)
    try:
        with Recorder(tmp_path / "a.db") as rec:
            with running_server(create_app(UpstreamBackend(upstream.url), rec)) as url:
                body = {"messages": [{"role": "user", "content": "hi"}]}
                with httpx.Client(base_url=url, timeout=10) as client:
                    first = client.post("/v1/chat/completions", json=body)
                    second = client.post("/v1/chat/completions", json=body)
            assert first.status_code == 200 and first.json()["choices"][0]["message"]["content"] == "ok"
            assert second.status_code == 502 and "RemoteProtocolError" in second.json()["error"]["message"]
            assert [r["status"] for r in rows(rec)] == [200, 502]
    finally:
        upstream.close()


def test_a_refused_connection_is_a_502_naming_the_upstream(tmp_path):
    port = socket.create_server(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{port.getsockname()[1]}"
    port.close()
    with Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(UpstreamBackend(dead), rec)) as url:
            r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                           timeout=10)
        assert r.status_code == 502 and dead in r.json()["error"]["message"]
        assert "ConnectError" in r.json()["error"]["message"]
        assert rows(rec)[0]["status"] == 502


async def _relayed(chat, builder, learnt) -> list[bytes]:
    """What the relay does with an opened reply's stream: the bytes sent, the facts fed to the turn."""
    for fact in learnt:
        builder.feed(fact)
    sent = []
    async for out in chat.sse():
        if isinstance(out, bytes):
            sent.append(out)
        else:
            builder.feed(out)
    return sent


def test_the_events_of_one_upstream_read_go_out_together_and_done_alone():
    """The role chunk and the first content usually come in one read: one write to the client,
    not two (issue 17). [DONE] still comes by itself (the commit waits in front of it), and a
    usage chunk the client did not ask for is still not shown."""
    from recorder.turn_builder import TurnBuilder
    from proxy.chat_completions import open_upstream
    from proxy.chat_request import parse_chat_request
    from recorder.turn import Turn

    def chunk(delta, finish=None):
        return (b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n")

    role, first, last = chunk({"role": "assistant", "content": ""}), chunk({"content": "hi"}), chunk({}, "stop")
    usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
    reads = [role + first, last + usage + b"data: [DONE]\n\n"]

    async def content():
        for read in reads:
            yield read

    backend = UpstreamBackend("http://upstream.test", transport=httpx.MockTransport(
        lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=content())))

    async def run():
        req = parse_chat_request({"stream": True, "messages": [{"role": "user", "content": "hi"}]})
        builder = TurnBuilder(Turn(request_id="r", started_at=0.0, endpoint="/v1/chat/completions",
                                   upstream="u", request_body=None, request_headers={}))
        learnt = []
        chat = await open_upstream(backend, req, {}, learnt)
        return await _relayed(chat, builder, learnt), builder.turn

    sent, turn = asyncio.run(run())
    assert sent == [role + first, last, sse.DONE]
    assert turn.response_text == "hi" and turn.finish_reason == "stop" and turn.completion_tokens == 1
    assert len(turn.chunk_times) == 4  # every chunk is still in the timeline, usage included


def test_http_chunks_that_arrived_together_go_out_as_one_write(tmp_path):
    """On the proxy's own upstream client (proxy/upstream_http.py): an upstream that sends its role
    chunk and first content as two HTTP chunks that reach the proxy in one read. They leave as one
    item, one write to the client (issue 17: it was one item per HTTP chunk, two writes, two
    wake-ups of the client before its first content), and every chunk is still recorded."""
    from recorder.turn_builder import TurnBuilder
    from proxy.chat_completions import open_upstream
    from proxy.chat_request import parse_chat_request
    from recorder.turn import Turn

    def chunk(delta, finish=None):
        return (b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n")

    def http_chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    role, first, last = chunk({"role": "assistant", "content": ""}), chunk({"content": "hi"}), chunk({}, "stop")
    usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

    def answer(conn):
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        conn.sendall(head + http_chunk(role) + http_chunk(first))  # one write: one read at the proxy
        time.sleep(0.3)
        conn.sendall(http_chunk(last) + http_chunk(usage) + http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        time.sleep(0.2)
        conn.close()

    upstream = ScriptedUpstream(answer)
    backend = UpstreamBackend(upstream.url)
    assert backend.connections is not None  # the proxy's own client, not httpx's

    async def run():
        req = parse_chat_request({"stream": True, "messages": [{"role": "user", "content": "hi"}]})
        builder = TurnBuilder(Turn(request_id="r", started_at=0.0, endpoint="/v1/chat/completions",
                                   upstream="u", request_body=None, request_headers={}))
        learnt = []
        chat = await open_upstream(backend, req, {}, learnt)
        try:
            return await _relayed(chat, builder, learnt), builder.turn
        finally:
            await backend.aclose()

    try:
        sent, turn = asyncio.run(run())
    finally:
        upstream.close()
    assert sent[0] == role + first
    assert sent == [role + first, last, sse.DONE]
    assert turn.response_text == "hi" and turn.finish_reason == "stop" and turn.completion_tokens == 1
    assert len(turn.chunk_times) == 4
