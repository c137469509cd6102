"""The proxy's fast path in upstream mode (issue 17): SSE split on bytes, the lean event-stream
response, the turn routes served without FastAPI's router. Each serves and records as before."""

from __future__ import annotations

import asyncio
import json

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
