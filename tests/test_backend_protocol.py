"""Every backend says what it is through the methods of `proxy.backend.Backend`, and nothing in
proxy/ guesses a backend's kind from the attributes it happens to have."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx

from proxy.backend import Backend, EmbeddedBackend, ForwardingBackend
from proxy.upstream_backend import UpstreamBackend
from proxy.upstream_pool import UpstreamPool

PROXY = Path(__file__).resolve().parents[1] / "proxy"


def _mock() -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(200, json={"data": []}))


def test_an_upstream_and_a_pool_are_forwarding_backends():
    for backend in (UpstreamBackend("http://upstream.test", transport=_mock()),
                    UpstreamPool(["http://a.test", "http://b.test"], transport=_mock())):
        try:
            assert isinstance(backend, Backend) and isinstance(backend, ForwardingBackend)
            assert not isinstance(backend, EmbeddedBackend)  # no engine, no render
            assert backend.embedded is False
            assert backend.renderer_identity() is None
            assert backend.max_context_tokens is None
        finally:
            asyncio.run(backend.aclose())
    pool = UpstreamPool(["http://a.test", "http://b.test"], transport=_mock())
    assert [m["url"] for m in pool.stats()] == ["http://a.test", "http://b.test"]
    assert UpstreamBackend("http://upstream.test", transport=_mock()).stats() is None


class _Engine:
    """What `EngineBackend` reads of an engine before its first request, without loading a model."""

    name = "tiny"
    ready = False

    def renderer_identity(self):
        return {"model": "tiny", "chat_template": "{{ messages }}", "special": {}}


def test_the_engine_backend_is_an_embedded_backend():
    from proxy.engine_backend import EngineBackend

    backend = EngineBackend(_Engine())
    assert isinstance(backend, Backend) and isinstance(backend, EmbeddedBackend)
    assert backend.embedded is True
    assert backend.label == "embedded:tiny"
    assert backend.renderer_identity()["chat_template"] == "{{ messages }}"
    assert backend.stats() is None
    assert backend.max_context_tokens is None  # not loaded yet
    asyncio.run(backend.aclose())


def test_no_module_in_proxy_guesses_a_backend_by_its_attributes():
    guesses = []
    for path in sorted(PROXY.glob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\b(hasattr|getattr)\((self\.)?backend\b", line):
                guesses.append(f"{path.name}:{n}: {line.strip()}")
    assert guesses == []


def test_each_protocol_is_served_by_its_own_adapter_module(tmp_path):
    """A request's route function lives in its protocol's adapter (docs/ARCHITECTURE.md "The path of
    one request"), not in the app that assembles them."""
    from proxy.app import TURN_PATHS, create_app
    from recorder.store import Recorder
    from proxy.turn_routes import TurnRoutes

    backend = UpstreamBackend("http://upstream.test", transport=_mock())
    with Recorder(tmp_path / "r.db") as rec:
        app = create_app(backend, rec)
    handlers = TurnRoutes(fastapi_app=app, paths=TURN_PATHS)._find()
    assert {path: fn.__module__ for path, fn in handlers.items()} == {
        "/v1/chat/completions": "proxy.chat_completions",
        "/v1/messages": "proxy.anthropic",
        "/v1/messages/count_tokens": "proxy.anthropic",
        "/v1/responses": "proxy.responses",
        "/v1/responses/compact": "proxy.responses_compact",
        "/v1/completions": "proxy.completions",
    }
    asyncio.run(backend.aclose())
