"""An upstream's reply is read within a size bound once decoded (proxy/reply_bounds.py).

A real upstream on loopback sends a gzip body of ~100 KB that inflates to 100 MB, whole or as a
stream, through a real uvicorn proxy, with the proxy's own client and with httpx's: the client gets
the upstream's fault in the API's shape, and the turn is recorded small, with what was read.
"""

from __future__ import annotations

import gzip
import json

import httpx
import pytest

from tests.conftest import rows, running_server
from tests.test_proxy_recorder_edge_cases import USER, chunk, chunked
from tests.test_upstream_misbehaves import CLIENTS, FAST, proxied, scripted

INFLATED = 100 << 20  # past the 64 MiB bound


def _gzip_answer(body: bytes, content_type: bytes) -> bytes:
    packed = gzip.compress(body, 9)
    assert len(packed) < 1 << 20
    return (b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n"
            % (content_type, len(packed)) + packed)


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_whole_reply_that_inflates_past_the_bound_is_a_502_and_a_small_row(client):
    body = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "' + b"a" * INFLATED + b'"}}]}'
    with proxied(_gzip_answer(body, b"application/json"), FAST, **CLIENTS[client]) as (url, up, rec):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=60)
        recorded = rows(rec)
    assert r.status_code == 502, r.text[:300]
    assert "a reply of over 64 MB (decoded)" in r.json()["error"]["message"] and up in r.json()["error"]["message"]
    assert recorded[0]["status"] == 502 and "over 64 MB" in recorded[0]["error"]
    assert len(recorded[0]["response_text"] or "") < 1 << 20


@pytest.mark.slow  # ~64 MB of events parsed before the bound
@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_stream_that_inflates_past_the_bound_ends_in_an_error_event_and_keeps_what_came(client):
    events = chunk("kept") + b"".join(chunk("b" * 65536) for _ in range(INFLATED // 65536))
    packed = gzip.compress(events, 9)

    async def stream(writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for at in range(0, len(packed), 16384):
            writer.write(chunked(packed[at:at + 16384]))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    with proxied(stream, FAST, **CLIENTS[client]) as (url, up, rec):
        with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": USER, "stream": True},
                          timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        recorded = rows(rec)
    error = json.loads(lines[-2][5:])["error"]
    assert "a reply of over 64 MB (decoded)" in error["message"]
    assert lines[-1] == "data: [DONE]"
    row = recorded[0]
    assert "over 64 MB" in row["error"]
    assert row["response_text"].startswith("kept") and len(row["response_text"]) <= 64 << 20


def test_a_published_template_past_the_bound_is_not_recorded(tmp_path):
    from proxy.app import create_app
    from proxy.upstream_backend import UpstreamBackend
    from recorder.store import Recorder
    from tests.test_upstream_misbehaves import answer

    props = json.dumps({"chat_template": "{{ messages }}" + " " * (3 << 20), "model_alias": "big"}).encode()
    reply = answer(200, b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}')

    async def script(writer):
        writer.write(reply)

    with scripted(script) as up:
        import tests.test_upstream_misbehaves as misbehaves  # GETs answer the model list; /props too

        original = misbehaves.MODELS
        misbehaves.MODELS = props
        try:
            backend = UpstreamBackend(up, probe_props=True)
            with Recorder(tmp_path / "a.db") as rec, running_server(create_app(backend, rec)) as url:
                r = httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=30)
                recorded = rows(rec)
        finally:
            misbehaves.MODELS = original
    assert r.status_code == 200
    assert backend.renderer is None
    assert len(recorded) == 1
