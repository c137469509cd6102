"""Upstream, a turn's session id goes out as Dynamo's session header too (X-Dynamo-Session-ID), beside the
routers' routing keys, so a Dynamo router keeps a session on one worker and its traces name it."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request

from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from tests.conftest import running_server


def _capturing_upstream() -> tuple[FastAPI, list[dict]]:
    """An OpenAI-style upstream that keeps each request's headers, in order."""
    seen: list[dict] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        seen.append(dict(request.headers))
        await request.json()
        return {"id": "c", "object": "chat.completion", "model": "m", "created": 0,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}

    return app, seen


@pytest.mark.slow  # two servers
def test_session_id_reaches_the_upstream_as_dynamo_session_header(recorder):
    app, seen = _capturing_upstream()

    with running_server(app) as upstream:
        with running_server(create_app(UpstreamBackend(upstream + "/v1"), recorder)) as url:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            assert httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "task-7"},
                              timeout=30).status_code == 200
            assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    assert seen[0]["x-dynamo-session-id"] == "task-7" == seen[0]["x-session-id"]
    assert "x-dynamo-session-id" not in seen[1]  # no session id: no header


@pytest.mark.slow  # two servers
def test_sub_agent_parent_reaches_the_upstream_as_dynamo_parent_header(recorder):
    """Dynamo reads a harness's own sub-agent headers only without X-Dynamo-Session-ID; the proxy sends
    that header, so it must say the sub-agent and its parent in Dynamo's headers (docs/FLEET.md)."""
    app, seen = _capturing_upstream()

    @app.post("/v1/messages")
    async def messages(request: Request):
        seen.append(dict(request.headers))
        await request.json()
        return {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "stop_reason": "end_turn",
                "stop_sequence": None, "content": [{"type": "text", "text": "ok"}],
                "usage": {"input_tokens": 3, "output_tokens": 1}}

    chat_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    messages_body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    with running_server(app) as upstream:
        with running_server(create_app(UpstreamBackend(upstream + "/v1"), recorder)) as url:
            for path, body, headers in [
                ("/v1/chat/completions", chat_body, {"X-Session-Id": "ses_child", "X-Parent-Session-Id": "ses_root"}),
                ("/v1/messages", messages_body, {"X-Claude-Code-Session-Id": "cc-root", "X-Claude-Code-Agent-Id": "a1"}),
                ("/v1/messages", messages_body, {"X-Claude-Code-Session-Id": "cc-root", "X-Claude-Code-Agent-Id": "a2",
                                                 "X-Claude-Code-Parent-Agent-Id": "a1"}),
                ("/v1/messages", messages_body, {"X-Claude-Code-Session-Id": "cc-root"}),
            ]:
                assert httpx.post(url + path, json=body, headers=headers, timeout=30).status_code == 200
    opencode, agent, nested, root = seen
    assert (opencode["x-dynamo-session-id"], opencode["x-dynamo-parent-session-id"]) == ("ses_child", "ses_root")
    assert (agent["x-dynamo-session-id"], agent["x-dynamo-parent-session-id"]) == ("a1", "cc-root")
    assert agent["x-session-id"] == "cc-root"  # the other routers keep the conversation's key
    assert (nested["x-dynamo-session-id"], nested["x-dynamo-parent-session-id"]) == ("a2", "a1")
    assert root["x-dynamo-session-id"] == "cc-root" and "x-dynamo-parent-session-id" not in root
