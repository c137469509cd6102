"""What leaves the proxy besides the recording (issue 14, finding 12): the headers it
forwards upstream and the access log line."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request
from openai import OpenAI

from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from recorder import Recorder
from tests.conftest import TINY_MODEL, running_server
from tests.test_cli_serve import serve_process

KEY = "sk-query-secret-0123456789abcdef"


def echo_upstream(seen: list[dict]) -> FastAPI:
    """A real OpenAI-shaped server that remembers the headers it got."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        seen.append({k.lower(): v for k, v in request.headers.items()})
        return {"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    return app


def test_browser_and_network_headers_are_not_forwarded_upstream(tmp_path):
    seen: list[dict] = []
    with running_server(echo_upstream(seen)) as upstream, Recorder(tmp_path / "t.db") as rec:
        with running_server(create_app(UpstreamBackend(upstream), rec)) as url:
            client = OpenAI(base_url=url + "/v1", api_key="sk-forwarded-on-purpose-000000", max_retries=0,
                            default_headers={"Cookie": "session=private", "Origin": "https://evil.example",
                                             "Referer": "https://intranet.example/page", "X-Forwarded-For": "10.1.2.3",
                                             "Forwarded": "for=10.1.2.3", "X-Real-IP": "10.1.2.3"})
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    (headers,) = seen
    for name in ("cookie", "origin", "referer", "x-forwarded-for", "forwarded", "x-real-ip"):
        assert name not in headers, name
    assert headers["authorization"] == "Bearer sk-forwarded-on-purpose-000000"  # the upstream's own key still goes


@pytest.mark.slow
def test_query_string_values_are_masked_in_the_access_log(tmp_path):
    with serve_process(["--model", str(TINY_MODEL), "--log-level", "info"], cwd=tmp_path,
                       env={"PREFIXTRACE_NO_OPENBLAS": "1"}) as (url, proc):
        r = httpx.post(url + f"/v1/chat/completions?key={KEY}&api-version=2024-06-01", timeout=60,
                       json={"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
    output = proc.stdout.read()
    assert "/v1/chat/completions?key=***&api-version=***" in output
    assert KEY not in output
