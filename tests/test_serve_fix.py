"""`serve --fix` against a real upstream on loopback that keeps the bytes it received: an untouched request
goes on byte for byte on every protocol, a fixed one goes on fixed, recorded with its turn and counted in
/metrics, and a fix that raises costs the request nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from analyzer.fixes import FIXES
from analyzer.fixes.sessions import FixSessions
from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
from tests.conftest import ROOT, answer_lifespan, rows, running_server

REPLIES = {
    "/v1/chat/completions": {"id": "c", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}},
    "/v1/messages": {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                     "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                     "usage": {"input_tokens": 5, "output_tokens": 1}},
    "/v1/responses": {"id": "resp_1", "object": "response", "status": "completed", "model": "m", "output": [
        {"type": "message", "id": "m1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "ok", "annotations": []}]}],
        "usage": {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6}},
    "/v1/completions": {"id": "t", "object": "text_completion", "model": "m", "choices": [
        {"index": 0, "text": "ok", "finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 1}},
}
# Each protocol's request, spelt with the spacing and key order no serialiser would choose: only the
# client's own bytes come out the same.
AS_SENT = {
    "/v1/chat/completions": b'{"model" : "m",  "messages":[{"content":"hi at noon","role":"user"}], "tools": []}',
    "/v1/messages": (b'{"max_tokens":8 ,"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi",'
                     b'"cache_control":{"type":"ephemeral"}}]}],"metadata":{"user_id":"u"}}'),
    "/v1/responses": b'{"input":[{"role":"user","content":"hi"}],  "model":"m","prompt_cache_key":"k"}',
    "/v1/completions": b'{"prompt":"at 10:11 hi",  "model":"m"}',
}


class CapturingUpstream:
    """A raw ASGI upstream: answers each POST in its protocol's shape and keeps (path, headers, body bytes)."""

    def __init__(self):
        self.received: list[tuple[str, dict, bytes]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if scope["method"] == "POST":
            self.received.append((path, {k.decode().lower(): v.decode() for k, v in scope["headers"]}, body))
            reply = json.dumps(REPLIES[path]).encode()
        else:
            reply = b'{"object":"list","data":[]}'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": reply})


@pytest.fixture
def proxy(tmp_path):
    """(proxy url, upstream, recorder) for a proxy with the given fixes (a function of the names)."""
    stack = []

    def start(names: list[str]):
        upstream = CapturingUpstream()
        up = running_server(upstream)
        up_url = up.__enter__()
        rec = Recorder(str(tmp_path / f"{len(stack)}.db"))
        srv = running_server(create_app(UpstreamBackend(up_url), rec, fixes=FixSessions(names)))
        stack.append((srv, up, rec))
        return srv.__enter__(), upstream, rec

    yield start
    for srv, up, rec in reversed(stack):
        srv.__exit__(None, None, None)
        up.__exit__(None, None, None)
        rec.close()


@pytest.mark.parametrize("path", list(AS_SENT))
def test_a_request_no_fix_touches_goes_on_byte_for_byte(proxy, path):
    url, upstream, rec = proxy(list(FIXES))  # every fix on; none has anything to do here
    r = httpx.post(url + path, content=AS_SENT[path], headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert upstream.received[-1][2] == AS_SENT[path]
    (row,) = rows(rec)
    entries = json.loads(row["render"])["fixes"]
    assert [e["name"] for e in entries] == list(FIXES) and not any(e["fired"] for e in entries)


def test_a_fired_fix_is_sent_recorded_and_counted(proxy):
    url, upstream, rec = proxy(["volatile", "session-key"])
    body = {"model": "m", "messages": [{"role": "system", "content": "Now: 2026-12-04 10:11:12. Be brief."},
                                       {"role": "user", "content": "hi"}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "s1"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    path, headers, sent = upstream.received[-1]
    sent = json.loads(sent)
    assert sent["messages"][0]["content"] == "Now: <<timestamp_1>>. Be brief."
    assert sent["messages"][1]["content"].endswith("<<timestamp_1>> = 2026-12-04 10:11:12]")
    assert sent["prompt_cache_key"] == "s1" and headers["x-dynamo-session-id"] == "s1"
    (row,) = rows(rec)
    entries = {e["name"]: e for e in json.loads(row["render"])["fixes"]}
    assert entries["volatile"]["fired"] and entries["volatile"]["note"] == "volatile timestamp moved (1 value(s))"
    assert entries["volatile"]["bytes_after"] > entries["volatile"]["bytes_before"]
    assert json.loads(row["request_body"])["messages"][0]["content"] == "Now: <<timestamp_1>>. Be brief."
    metrics = httpx.get(url + "/metrics").text
    assert 'prefixtrace_fixes_total{fix="volatile",outcome="applied"} 1' in metrics
    assert 'prefixtrace_fixes_total{fix="session-key",outcome="applied"} 1' in metrics
    assert httpx.get(url + "/ui/api/sessions").json()["proxy"]["fixes"] == {"volatile": 1, "session-key": 1}


def test_a_fix_that_raises_leaves_the_request_as_sent_and_is_recorded(proxy, monkeypatch):
    def broken(body, protocol, record):
        raise RuntimeError("fix bug")

    monkeypatch.setitem(FIXES, "tool-order", (broken, "tools_change"))
    url, upstream, rec = proxy(["tool-order"])
    raw = AS_SENT["/v1/chat/completions"]
    r = httpx.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200 and upstream.received[-1][2] == raw
    (entry,) = json.loads(rows(rec)[0]["render"])["fixes"]
    assert entry["error"] and "RuntimeError: fix bug" in entry["note"]
    assert 'prefixtrace_fixes_total{fix="tool-order",outcome="failed"} 1' in httpx.get(url + "/metrics").text


def test_tool_args_restores_what_the_upstream_emitted_on_the_next_request(proxy):
    url, upstream, rec = proxy(["tool-args"])
    emitted = '{"path":  "a.py"}'
    REPLY = {"id": "c", "object": "chat.completion", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls",
             "message": {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": emitted}}]}}]}
    original = REPLIES["/v1/chat/completions"]
    REPLIES["/v1/chat/completions"] = REPLY
    try:
        user = [{"role": "user", "content": "read a.py"}]
        httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": user}, headers={"X-Session-Id": "s"})
    finally:
        REPLIES["/v1/chat/completions"] = original
    history = user + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path":"a.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"}]
    httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": history}, headers={"X-Session-Id": "s"})
    sent = json.loads(upstream.received[-1][2])
    assert sent["messages"][1]["tool_calls"][0]["function"]["arguments"] == emitted


def test_serve_refuses_an_unknown_fix_in_one_line():
    out = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "serve", "--upstream", "http://127.0.0.1:9",
                          "--fix", "volatile,nope"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unknown fix 'nope': the fixes are volatile, tool-order, tool-args, thinking, breakpoints, session-key" \
        in out.stderr


def test_thinking_puts_back_reasoning_the_client_stripped(tmp_path):
    upstream = CapturingUpstream()
    reply = {"id": "c", "object": "chat.completion", "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
             "message": {"role": "assistant", "content": "it is 4", "reasoning_content": "2+2 is 4"}}]}
    original = REPLIES["/v1/chat/completions"]
    REPLIES["/v1/chat/completions"] = reply
    try:
        with running_server(upstream) as up, Recorder(str(tmp_path / "t.db")) as rec, running_server(create_app(
                UpstreamBackend(up), rec, fixes=FixSessions(["thinking"], template_keeps_reasoning=True))) as url:
            user = [{"role": "user", "content": "2+2?"}]
            httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": user}, headers={"X-Session-Id": "s"})
            stripped = user + [{"role": "assistant", "content": "it is 4"}, {"role": "user", "content": "sure?"}]
            httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": stripped},
                       headers={"X-Session-Id": "s"})
    finally:
        REPLIES["/v1/chat/completions"] = original
    assert json.loads(upstream.received[-1][2])["messages"][1]["reasoning_content"] == "2+2 is 4"


def test_the_engine_is_asked_whether_its_template_keeps_earlier_reasoning(tiny_engine, tmp_path):
    from proxy.engine_backend import EngineBackend

    fixes = FixSessions(["thinking"])
    with Recorder(str(tmp_path / "e.db")) as rec, running_server(create_app(EngineBackend(tiny_engine), rec, fixes=fixes)):
        applied = fixes.apply("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}]}, "s")
    # The fixture's template renders an earlier tool-loop turn's reasoning_content.
    assert fixes.template_keeps_reasoning is True
    assert applied.entries[0]["note"] == "no stripped reasoning of a reply this proxy recorded"


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"model": "default", "max_tokens": 4, "system": "Now: 10:11:12. Be brief.",
                      "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "default", "max_output_tokens": 4, "instructions": "Now: 10:11:12.",
                       "input": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"model": "default", "max_tokens": 4, "stream": True,
                              "messages": [{"role": "system", "content": "Now: 10:11:12."},
                                           {"role": "user", "content": "hi"}]}),
])
def test_fixes_apply_on_the_embedded_engine_too(tiny_engine, tmp_path, path, body):
    from proxy.engine_backend import EngineBackend

    with Recorder(str(tmp_path / "e.db")) as rec, running_server(create_app(
            EngineBackend(tiny_engine), rec, fixes=FixSessions(["volatile"]))) as url:
        r = httpx.post(url + path, json=body)
        assert r.status_code == 200, r.text
        (row,) = rows(rec)
    (entry,) = json.loads(row["render"])["fixes"]
    assert entry["fired"] and "<<timestamp_1>>" in row["request_body"]
    assert json.loads(row["render"])["prompt_tokens"] > 0  # the engine's own facts kept beside the entries


def test_run_passes_its_fixes_to_the_proxy_it_starts(monkeypatch):
    from click.testing import CliRunner

    import prefixtrace.run
    from prefixtrace.cli import cli

    seen = {}

    def fake_run(harness, args, **kwargs):
        seen.update(kwargs, harness=harness)
        return 0

    monkeypatch.setattr(prefixtrace.run, "run", fake_run)
    result = CliRunner().invoke(cli, ["run", "--fix", "tool-order", "--fix", "volatile", "pi", "-p", "hi"])
    assert result.exit_code == 0, result.output
    assert seen["serve_args"][-2:] == ["--fix", "volatile,tool-order"] and seen["harness"] == "pi"
    bad = CliRunner().invoke(cli, ["run", "--fix", "nope", "pi"])
    assert bad.exit_code == 2 and "unknown fix 'nope'" in bad.output
