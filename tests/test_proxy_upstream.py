"""The proxy in --upstream mode, in front of a second real prefixtrace server (and a few scripted ones)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from openai import OpenAI

from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
from tests.conftest import free_port, rows, running_server


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_turns_pass_through_and_are_recorded(chain, stream):
    url_a, rec_a, rec_b = chain
    client = OpenAI(base_url=url_a + "/v1", api_key="sk-upstream-key-0000000000000000", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    kwargs = dict(model="default", max_tokens=10, temperature=0)
    texts = []
    for _ in range(2):
        if stream:
            chunks = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
            assert all(c.usage is None for c in chunks)  # not asked for, so not forwarded
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.chat.completions.create(messages=messages, **kwargs).choices[0].message.content
        texts.append(text)
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]

    a, b = rows(rec_a), rows(rec_b)
    assert len(a) == len(b) == 2
    for ra, rb, text in zip(a, b, texts):
        assert ra["upstream"].startswith("http://127.0.0.1:")
        assert ra["status"] == rb["status"] == 200
        assert ra["response_text"] == rb["response_text"] == text
        assert (ra["prompt_tokens"], ra["cached_tokens"]) == (rb["prompt_tokens"], rb["cached_tokens"])
    assert a[1]["cached_tokens"] > 0
    if stream:  # every event B sent reached A's recorder, usage included
        assert len(json.loads(a[0]["chunk_times"])) == len(json.loads(b[0]["chunk_times"]))


def test_upstream_models_are_proxied(chain):
    url_a, _, _ = chain
    ids = {m["id"] for m in httpx.get(url_a + "/v1/models").json()["data"]}
    assert ids == {"tiny-llama", "default"}


def test_unreachable_upstream_is_a_502_with_a_reason(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    with Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(UpstreamBackend(dead), rec)) as url:
            r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert httpx.get(url + "/health").status_code == 503
        assert r.status_code == 502
        assert "unreachable" in r.json()["error"]["message"] and dead in r.json()["error"]["message"]
        assert rows(rec)[0]["status"] == 502


def scripted_upstream(handler) -> UpstreamBackend:
    return UpstreamBackend("http://upstream.test", transport=httpx.MockTransport(handler))


def test_upstream_without_cached_tokens_is_recorded_as_unknown(tmp_path):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={
            "id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        })

    with Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(scripted_upstream(handler), rec)) as url:
            r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
        row = rows(rec)[0]
        assert row["prompt_tokens"] == 5 and row["cached_tokens"] is None


def test_stream_is_passed_through_event_by_event(tmp_path):
    """The upstream holds its second event until the client has the first: a buffering proxy would hang."""
    client_has_first = threading.Event()

    async def events():
        yield b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"one"}}]}\n\n'
        for _ in range(500):
            if client_has_first.is_set():
                break
            await asyncio.sleep(0.01)
        yield b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" two"},"finish_reason":"stop"}]}\n\n'
        yield b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":{"cached_tokens":2}}}\n\n'
        yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream_options"]["include_usage"] is True
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    with Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(scripted_upstream(handler), rec)) as url:
            body = {"stream": True, "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "hi"}]}
            received = []
            t0 = time.monotonic()
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        received.append(json.loads(line[6:]))
                        client_has_first.set()
            assert time.monotonic() - t0 < 4  # the upstream waited for us at most briefly
        assert [c["choices"][0]["delta"]["content"] for c in received if c["choices"]] == ["one", " two"]
        assert received[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
        row = rows(rec)[0]
        assert row["response_text"] == "one two" and row["cached_tokens"] == 2 and row["finish_reason"] == "stop"


def test_client_disconnect_mid_stream_stops_generation_and_records_the_partial_turn(engine_server, tiny_engine):
    url, recorder = engine_server
    body = {"model": "default", "stream": True, "max_tokens": 20000, "temperature": 0,
            "messages": [{"role": "user", "content": "Write forever."}]}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 4:
                    break  # leaving the block closes the connection
    deadline = time.monotonic() + 20
    while tiny_engine.stats["cancelled"] < 1:
        assert time.monotonic() < deadline, "the engine kept generating after the client left"
        time.sleep(0.05)
    assert tiny_engine.stats["generated_tokens"] < 20000
    deadline = time.monotonic() + 10
    while not rows(recorder):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    row = rows(recorder)[0]
    assert (row["status"], row["error"]) == (499, "client disconnected (decoding)")
    assert row["response_text"]  # what the client had received so far


def test_stream_commit_starts_at_the_usage_chunk_not_at_done(tmp_path):
    """An upstream commits its own turn between its usage chunk and [DONE]; the proxy's commit
    overlaps it (issue 17): this upstream holds [DONE] until the proxy's turn is in the database."""
    seen_before_done = []

    def committed() -> bool:
        import sqlite3
        try:
            with sqlite3.connect(tmp_path / "a.db") as con:
                return con.execute("select count(*) from turns").fetchone()[0] == 1
        except sqlite3.Error:
            return False

    async def events():
        yield b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
        yield b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n'
        for _ in range(500):
            if committed():
                break
            await asyncio.sleep(0.01)
        seen_before_done.append(committed())
        yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    with Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(scripted_upstream(handler), rec)) as url:
            body = {"stream": True, "messages": [{"role": "user", "content": "hi"}]}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=20) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]" and len(lines) == 2  # the usage chunk was not asked for
        assert seen_before_done == [True]
        row = rows(rec)[0]
        assert row["response_text"] == "hi" and row["prompt_tokens"] == 3 and row["status"] == 200
