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
    assert (turn.status, turn.error, turn.finish_reason) == (499, "client disconnected (decoding)", "cancelled")
    # and the server goes on answering
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200


# --- finding 7: request size ---------------------------------------------------------------------

import pytest  # noqa: E402

from proxy.app import create_app  # noqa: E402
from proxy.engine_backend import EngineBackend  # noqa: E402
from tests.conftest import running_server  # noqa: E402

SECRET = "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"


@pytest.fixture
def small_limit_server(tiny_engine, recorder):
    with running_server(create_app(EngineBackend(tiny_engine), recorder, max_request_mb=1)) as url:
        yield url, recorder


def test_a_body_over_the_limit_is_a_413_in_the_api_shape_and_recorded_without_its_body(small_limit_server):
    from openai import APIStatusError, OpenAI

    url, rec = small_limit_server
    client = OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=60)
    big = f"{SECRET} " + "x" * (3 << 20)
    with pytest.raises(APIStatusError) as caught:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": big}], max_tokens=1)
    assert caught.value.status_code == 413
    assert caught.value.body["type"] == "request_too_large"  # the openai client unwraps {"error": ...}
    assert "1 MB" in caught.value.body["message"]
    # Just under the limit is served (the bulk in a field the model does not read).
    ok = client.chat.completions.create(model="default", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
                                        extra_body={"metadata": {"note": "y" * 900_000}})
    assert ok.choices[0].finish_reason is not None
    assert rec.flush(30)
    first, second = iter_turns(rec.path)
    assert first.status == 413 and isinstance(first.request_body, str)
    assert first.request_body.startswith("[request body not stored:")
    assert SECRET not in first.request_body and "xxxx" not in first.request_body
    assert second.status == 200


def test_anthropic_clients_get_their_413_too(small_limit_server):
    import anthropic

    url, rec = small_limit_server
    client = anthropic.Anthropic(base_url=url, api_key="sk-ant-test", max_retries=0, timeout=60)
    with pytest.raises(anthropic.APIStatusError) as caught:
        client.messages.create(model="default", max_tokens=1, messages=[{"role": "user", "content": "z" * (2 << 20)}])
    assert caught.value.status_code == 413
    assert caught.value.body["error"]["type"] == "request_too_large"
    assert rec.flush(30)
    assert [t.status for t in iter_turns(rec.path)] == [413]


def test_a_huge_declared_length_is_refused_before_the_body_is_sent(small_limit_server):
    url, rec = small_limit_server
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{\"messages\": [" % (200 << 20))
        reply = b""
        while b"\r\n\r\n" not in reply:
            data = sock.recv(65536)
            assert data, reply
            reply += data
    assert reply.startswith(b"HTTP/1.1 413")
    assert rec.flush(30)
    (turn,) = iter_turns(rec.path)
    assert turn.status == 413 and "200.0 MB" in turn.request_body


def test_a_chunked_body_is_cut_off_at_the_limit(small_limit_server):
    url, rec = small_limit_server

    def chunks():
        yield b'{"model": "default", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}]}'

    r = httpx.post(url + "/v1/chat/completions", content=chunks(), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert rec.flush(30)
    assert [t.status for t in iter_turns(rec.path)] == [413]


# --- finding 6: nesting ---------------------------------------------------------------------------

def _nested(depth: int) -> str:
    """JSON text nesting `depth` arrays/objects (as text: json.dumps itself recurses)."""
    opens = "".join('{"a":' if i % 2 else "[" for i in range(depth))
    return opens + '"leaf"' + "".join("}" if i % 2 else "]" for i in reversed(range(depth)))


@pytest.mark.parametrize("depth", [150, 700, 2000])
def test_deep_json_is_a_400_that_is_still_recorded(engine_server, depth):
    url, rec = engine_server
    body = ('{"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "metadata": '
            + _nested(depth) + "}")
    r = httpx.post(url + "/v1/chat/completions", content=body, timeout=60, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "deep" in r.json()["error"]["message"]
    assert rec.flush(30)
    (turn,) = iter_turns(rec.path)
    assert turn.status == 400 and isinstance(turn.request_body, str) and '"leaf"' in turn.request_body


def test_deeply_nested_tools_do_not_break_the_dashboard_or_metrics(engine_server):
    url, rec = engine_server
    tools = '[{"type": "function", "function": {"name": "f", "parameters": {"p": ' + _nested(450) + "}}}]"
    bad = httpx.post(url + "/v1/chat/completions", timeout=60, headers={"Content-Type": "application/json"},
                     content='{"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],'
                             ' "tools": ' + tools + "}")
    assert bad.status_code == 400
    good = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hello"}]})
    assert good.status_code == 200
    assert httpx.get(url + "/metrics", timeout=30).status_code == 200
    sessions = httpx.get(url + "/ui/api/sessions", timeout=30)
    assert sessions.status_code == 200
    statuses = sorted(t["status"] for s in sessions.json()["sessions"] for t in s["turns"])
    assert statuses == [200, 400]  # both turns reached the dashboard
    assert rec.flush(30)
    assert len(list(iter_turns(rec.path))) == 2
