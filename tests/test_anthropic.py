"""POST /v1/messages: the official anthropic client against the embedded engine and through an upstream."""

from __future__ import annotations

import json

import pytest

from analyzer import analyze
from proxy.anthropic import to_chat_request
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
from tests.conftest import rows, running_server

anthropic = pytest.importorskip("anthropic")
SYSTEM = "You are a careful coding assistant. Answer briefly."


def client(url: str):
    return anthropic.Anthropic(base_url=url, api_key="sk-ant-test-0123456789abcdef", max_retries=0, timeout=60)


def converse(c, stream: bool, turns: int = 2, **extra):
    """`turns` user turns; returns [(text, usage)]."""
    messages = [{"role": "user", "content": "Write a haiku."}]
    out = []
    for i in range(turns):
        kwargs = dict(model="default", max_tokens=10, extra_body={"temperature": 0}, messages=messages,
                      system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}], **extra)
        if stream:
            with c.messages.stream(**kwargs) as s:
                text = "".join(s.text_stream)
                message = s.get_final_message()
        else:
            message = c.messages.create(**kwargs)
            text = message.content[0].text
        assert message.content[0].type == "text" and message.content[0].text == text
        assert message.stop_reason in ("end_turn", "max_tokens")
        out.append((text, message.usage))
        messages = messages + [{"role": "assistant", "content": [{"type": "text", "text": text}]},
                               {"role": "user", "content": [{"type": "text", "text": f"Another {i}."}]}]
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_messages_on_the_engine_reuse_the_prefix_and_are_recorded(engine_server, stream):
    url, recorder = engine_server
    (text1, u1), (text2, u2) = converse(client(url), stream)

    assert u1.cache_read_input_tokens == 0 and u1.cache_creation_input_tokens == 0
    total1 = u1.input_tokens + u1.cache_read_input_tokens
    assert u2.cache_read_input_tokens > 0 and u2.cache_read_input_tokens >= total1 - 4
    assert u2.input_tokens > 0 and u2.output_tokens > 0

    recorded = rows(recorder)
    assert [r["endpoint"] for r in recorded] == ["/v1/messages", "/v1/messages"]
    for row, usage, text in zip(recorded, (u1, u2), (text1, text2)):
        assert row["status"] == 200 and row["response_text"] == text
        assert row["prompt_tokens"] == usage.input_tokens + usage.cache_read_input_tokens
        assert row["cached_tokens"] == usage.cache_read_input_tokens
        assert row["completion_tokens"] == usage.output_tokens
        assert row["ttft_s"] is not None and bool(row["stream"]) is stream
    assert json.loads(recorded[0]["request_body"])["system"][0]["cache_control"] == {"type": "ephemeral"}

    # Analysed like chat completions: top-level system first, cache_control ignored, append-only.
    report = analyze(recorder.path)
    (session,) = report.sessions
    assert [t.note for t in session.turns] == ["first", ""] and session.turns[1].brk is None


def test_messages_through_an_upstream_pass_usage_and_stream_through(tiny_engine, tmp_path):
    with Recorder(tmp_path / "b.db") as rec_b, Recorder(tmp_path / "a.db") as rec_a:
        with running_server(create_app(EngineBackend(tiny_engine), rec_b)) as url_b:
            with running_server(create_app(UpstreamBackend(url_b), rec_a)) as url_a:
                c = client(url_a)
                (t1, u1), (t2, u2) = converse(c, stream=True)
                (t3, u3), = converse(c, stream=False, turns=1)
        a, b = rows(rec_a), rows(rec_b)
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b):
        assert ra["endpoint"] == rb["endpoint"] == "/v1/messages"
        assert ra["upstream"] == url_b
        assert (ra["prompt_tokens"], ra["cached_tokens"], ra["response_text"]) == \
               (rb["prompt_tokens"], rb["cached_tokens"], rb["response_text"])
    assert a[1]["cached_tokens"] == u2.cache_read_input_tokens > 0
    assert json.loads(a[1]["usage"])["cache_read_input_tokens"] == u2.cache_read_input_tokens


def test_messages_errors_have_anthropic_shape(engine_server):
    url, recorder = engine_server
    c = client(url)
    with pytest.raises(anthropic.NotFoundError) as info:
        c.messages.create(model="claude-nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        c.messages.create(model="default", max_tokens=5, messages=[])
    assert "messages" in info.value.body["error"]["message"]
    assert [r["status"] for r in rows(recorder)] == [404, 400]


def test_content_blocks_translate_to_the_engine_chat_render():
    body = {
        "model": "default", "max_tokens": 20, "stop_sequences": ["END"], "metadata": {"user_id": "u-7"},
        "system": [{"type": "text", "text": "Sys A. "}, {"type": "text", "text": "Sys B."}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [{"name": "read", "description": "Read a file", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "Open a.py"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should read it.", "signature": "x"},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "print(1)"}]},
                {"type": "text", "text": "Explain it.", "cache_control": {"type": "ephemeral"}}]},
        ],
    }
    req = to_chat_request(body, {})
    assert req.body is body and req.session_id == "u-7"
    assert req.sampling.max_tokens == 20 and req.sampling.stop == ["END"]
    assert req.chat_template_kwargs == {"enable_thinking": True}
    assert req.tools == [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"},
                                                           "description": "Read a file"}}]
    assert req.messages == [
        {"role": "system", "content": "Sys A. Sys B."},
        {"role": "user", "content": "Open a.py"},
        {"role": "assistant", "content": "Reading.", "reasoning_content": "I should read it.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "read", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "print(1)"},
        {"role": "user", "content": "Explain it."},
    ]
