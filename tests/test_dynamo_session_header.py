"""Upstream, a turn's session id goes out as Dynamo's session header too (X-Dynamo-Session-ID), beside the
routers' routing keys, so a Dynamo router keeps a session on one worker and its traces name it."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request

from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from tests.conftest import running_server


@pytest.mark.slow  # two servers
def test_session_id_reaches_the_upstream_as_dynamo_session_header(recorder):
    seen: list[dict] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        seen.append(dict(request.headers))
        await request.json()
        return {"id": "c", "object": "chat.completion", "model": "m", "created": 0,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}

    with running_server(app) as upstream:
        with running_server(create_app(UpstreamBackend(upstream + "/v1"), recorder)) as url:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            assert httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "task-7"},
                              timeout=30).status_code == 200
            assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    assert seen[0]["x-dynamo-session-id"] == "task-7" == seen[0]["x-session-id"]
    assert "x-dynamo-session-id" not in seen[1]  # no session id: no header
