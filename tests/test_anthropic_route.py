"""The Messages route as Claude Code uses it: a system message inside `messages`, newer fields,
its session ids; and max_tokens beyond the context (clamped by default, refused on request)."""

from __future__ import annotations

import json
import sqlite3

import httpx
import pytest

from engine.engine import Engine
from engine.render_policy import DEFAULT_MID_SYSTEM
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from tests.conftest import TINY_MODEL, rows, running_server

anthropic = pytest.importorskip("anthropic")
SESSION = "6f1c2a4e-0b7d-4c3e-9a51-2f8e7d6c5b4a"
USER_ID = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": SESSION})


def claude_body(**extra) -> dict:
    """The shape of Claude Code 2.1's first request (tools left out): a system message after the
    first user message (its agent list), adaptive thinking, context_management, output_config."""
    return {"model": "default", "max_tokens": 8, "stream": True, "temperature": 0,
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "system", "content": "Available agent types for the Agent tool: ..."}],
            "metadata": {"user_id": USER_ID}, "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "medium"}, "some_future_field": {"x": 1}, **extra}


def test_claude_codes_first_request_is_served_with_its_system_message_through_the_policy(engine_server):
    url, recorder = engine_server
    c = anthropic.Anthropic(base_url=url, api_key="sk-ant-test-0123456789abcdef", max_retries=0, timeout=60)
    body = claude_body()
    typed = ("model", "max_tokens", "system", "messages", "metadata", "thinking")
    with c.messages.stream(**{k: body[k] for k in typed},
                           extra_body={k: v for k, v in body.items() if k not in typed and k != "stream"}) as s:
        text = "".join(s.text_stream)
        message = s.get_final_message()
    assert message.stop_reason in ("end_turn", "max_tokens") and message.content[0].text == text
    [row] = rows(recorder)
    assert row["status"] == 200 and row["session_id"] == SESSION and row["response_text"] == text
    policy = json.loads(row["render"])["policy"]
    assert policy["mid_system_messages"] == 1 and policy["mid_system"] == DEFAULT_MID_SYSTEM


def test_the_claude_code_session_header_wins_and_a_failed_request_keeps_its_session(engine_server):
    url, recorder = engine_server
    ok = httpx.post(url + "/v1/messages", json=claude_body(stream=False), timeout=60,
                    headers={"x-claude-code-session-id": "hdr-session"})
    assert ok.status_code == 200, ok.text
    bad = httpx.post(url + "/v1/messages", json=claude_body(messages="not a list"), timeout=60)
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    first, second = rows(recorder)
    assert first["session_id"] == "hdr-session"
    assert second["status"] == 400 and second["session_id"] == SESSION  # the plain id, not the JSON


def test_strict_mid_system_policy_refuses_it_in_anthropic_shape(tmp_path):
    from recorder.store import Recorder

    engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32", mid_system_policy="strict").start()
    engine.wait_ready(60)
    try:
        with Recorder(tmp_path / "t.db") as rec, running_server(create_app(EngineBackend(engine), rec)) as url:
            r = httpx.post(url + "/v1/messages", json=claude_body(stream=False), timeout=60)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            assert "strict" in r.json()["error"]["message"]
            [row] = rows(rec)
            assert row["status"] == 400 and row["session_id"] == SESSION
    finally:
        engine.shutdown()


@pytest.fixture
def small_context(tiny_engine):
    """An engine whose memory ceiling leaves room for about 300 tokens (the tiny model's own
    context is 32k): what a 32,000-token max_tokens meets on a small machine or model."""
    m = tiny_engine.memory
    ceiling = m.weights_bytes + m.transient_bytes + m.kv_bytes_per_token * 300
    engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32", memory_ceiling_bytes=ceiling).start()
    engine.wait_ready(60)
    yield engine
    engine.shutdown()


@pytest.mark.slow
def test_max_tokens_beyond_the_context_is_clamped_to_what_fits(small_context, recorder):
    room_total = small_context.memory.max_context_tokens
    with running_server(create_app(EngineBackend(small_context), recorder)) as url:
        body = {"model": "default", "max_tokens": 32000, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": "hi"}]}
        chat = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
        assert chat["choices"][0]["finish_reason"] == "length"
        usage = chat["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == room_total
        anth = httpx.post(url + "/v1/messages", json={**claude_body(stream=False), "max_tokens": 32000,
                                                      "ignore_eos": True}, timeout=120)
        assert anth.status_code == 200, anth.text
        assert anth.json()["stop_reason"] in ("max_tokens", "end_turn")
        too_long = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            **body, "messages": [{"role": "user", "content": "word " * 2000}]})
        assert too_long.status_code == 400 and too_long.json()["error"]["prompt_tokens"] > room_total
        assert too_long.json()["error"]["message"].startswith("the prompt (")  # max_tokens is not the problem
    clamped = json.loads(rows(recorder)[0]["render"])["max_tokens_clamped"]
    assert clamped == {"asked": 32000, "to": usage["completion_tokens"]}


def test_reject_policy_keeps_the_400_with_the_numbers(small_context, recorder):
    with running_server(create_app(EngineBackend(small_context, max_tokens_policy="reject"), recorder)) as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "default", "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["max_tokens"] == 32000 and "can never fit" in error["message"]
    # What the engine learnt before it refused (the render, who serves, with which renderer) stays on the turn.
    assert json.loads(rows(recorder)[0]["render"])["prompt_tokens"] > 0
    with sqlite3.connect(recorder.path) as con:  # `turn_log`: who served is not in the v1 `turns` view
        ((served_by, renderer_id),) = con.execute("SELECT served_by, renderer_id FROM turn_log").fetchall()
    assert served_by.startswith("embedded:") and renderer_id is not None
