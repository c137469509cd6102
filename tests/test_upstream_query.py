"""Query strings reach the upstream (proxy/upstream_query.py): an upstream URL's own
(`?api-version=`, as Azure OpenAI wants on every request) and a client's, through a real proxy to a
real upstream on loopback, on the lean client (plain http) and on httpx's (a query in the URL)."""

from __future__ import annotations

import httpx
import pytest

from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
from tests.conftest import rows, running_server
from tests.test_run_trust import capturing_app

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("upstream_query", ["", "?api-version=2024-06-01"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_query_strings_are_forwarded(tmp_path, upstream_query, path):
    seen: list[dict] = []
    with running_server(capturing_app(seen)) as upstream, Recorder(tmp_path / "q.db") as rec:
        backend = UpstreamBackend(f"{upstream}/openai{upstream_query}")
        with running_server(create_app(backend, rec)) as proxy:
            body = CHAT if path != "/v1/responses" else {"model": "m", "input": "hi"}
            reply = httpx.post(f"{proxy}{path}?api-version=2025-01-01&deployment=d%201", json=body, timeout=30)
            models = httpx.get(f"{proxy}/v1/models", timeout=30)
        assert models.status_code == 200
    posted = [r for r in seen if r["path"].endswith(path.removeprefix("/v1"))]
    assert posted and posted[0]["path"] == f"/openai{path}", seen
    query = posted[0]["query"]
    if upstream_query:  # the upstream URL's value stands; the client's other names follow
        assert query == "api-version=2024-06-01&deployment=d%201"
        assert [r["query"] for r in seen if r["path"].endswith("/models")] == ["api-version=2024-06-01"]
        assert "2024-06-01" not in backend.label  # values never shown: they may be keys
    else:
        assert query == "api-version=2025-01-01&deployment=d%201"
    assert reply.status_code in (200, 502), reply.text  # the capture's reply is chat-shaped only


def test_a_query_never_reaches_the_database(tmp_path):
    seen: list[dict] = []
    with running_server(capturing_app(seen)) as upstream, Recorder(tmp_path / "q.db") as rec:
        with running_server(create_app(UpstreamBackend(f"{upstream}/v1?key=sk-secret-1"), rec)) as proxy:
            httpx.post(f"{proxy}/v1/chat/completions?api-key=sk-secret-2", json=CHAT, timeout=30)
        recorded = rows(rec)
    assert seen[-1]["query"] == "key=sk-secret-1&api-key=sk-secret-2"
    assert len(recorded) == 1 and "sk-secret" not in repr(recorded)
    assert not [f for f in tmp_path.glob("q.db*") if b"sk-secret" in f.read_bytes()]
