"""Redaction happens before any cut, in every sink that sees a turn unredacted (issue 37).

The live path hands turns to the analysis, the dashboard and the OTLP feed before the recorder redacts
them. Two places cut text there: the fix text quotes a volatile value in 40 characters, and a span's
note is cut to 300. A GitHub token cut to 39 characters is too short for `ghp_` + 36, so redacting the
cut text afterwards let its first 39 characters through. The request's `model` went into the span name
and `gen_ai.request.model` as sent.

A real proxy in front of a scripted upstream on loopback, with a real OTLP receiver; the spans, the
dashboard's JSON and the database are searched for any 12-character piece of each secret.
"""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI

from analyzer.advice import volatile_advice
from prefixtrace.otel import LiveFeed, TurnSpans
from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
from tests.conftest import running_server
from tests.test_otel import wait_for
from testsupport.otlp_receiver import OtlpReceiver

TOKENS = ["ghp_" + "Q7w8E9r0T1y2U3i4O5p6A7s8D9f0G1h2J3k4", "ghp_" + "Z1x2C3v4B5n6M7q8W9e0R1t2Y3u4I5o6P7a8"]
MODEL_SECRET = "sk-proj-ModelFieldS3cretAbCdEfGh0123"

pytest.importorskip("opentelemetry.sdk.trace", reason="the [otel] extra (it is in the test extra)")


def _pieces(secret: str, size: int = 12) -> list[str]:
    body = secret.split("_", 1)[-1].split("-")[-1]
    return [body[i:i + size] for i in range(0, len(body) - size + 1)]


def _leaks(text: str) -> list[str]:
    return [p for s in (*TOKENS, MODEL_SECRET) for p in _pieces(s) if p in text]


def test_a_fix_text_quotes_a_secret_redacted_not_cut():
    fix = volatile_advice("system_rewrite", {"kind": "high_entropy", "before": TOKENS[0], "after": TOKENS[1]})
    assert "[REDACTED]" in fix and not _leaks(fix), fix


def test_spans_dashboard_and_database_hold_no_piece_of_a_secret(tmp_path):
    upstream = FastAPI()

    @upstream.post("/v1/chat/completions")
    async def chat(body: dict):
        return {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 50, "completion_tokens": 1, "total_tokens": 51}}

    with OtlpReceiver() as receiver, Recorder(tmp_path / "r.db") as rec:
        feed = LiveFeed(TurnSpans.open(receiver.url), quiet_s=0.05)
        with running_server(upstream) as up_url, \
                running_server(create_app(UpstreamBackend(up_url), rec, turn_feed=feed)) as url:
            history = [{"role": "user", "content": "list the files"}]
            for token in TOKENS:  # the system prompt carries a token that changes each turn: a volatile break
                r = httpx.post(url + "/v1/chat/completions", timeout=30, headers={"X-Session-Id": "s1"},
                               json={"model": MODEL_SECRET, "messages": [
                                   {"role": "system", "content": f"You are a coding agent. GITHUB_TOKEN {token}"},
                                   *history]})
                assert r.status_code == 200, r.text
                history = [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
            wait_for(lambda: len(receiver.spans) >= 2, 30, "2 spans")
            dashboard = httpx.get(url + "/ui/api/sessions", timeout=30).text
        feed.close()
        assert rec.flush(30)
    spans = json.dumps(list(receiver.by_request_id().values()))
    assert len(receiver.spans) >= 2
    # The break was found and its fix text made it to both sinks, redacted.
    assert "[REDACTED]" in spans and "prefixtrace.fix" in spans
    assert not _leaks(spans), _leaks(spans)
    assert not _leaks(dashboard), _leaks(dashboard)
    stored = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("r.db"))
    assert not _leaks(stored.decode("latin-1"))
