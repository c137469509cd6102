"""The Messages writer, fed the reply events, records and sends what it always did.

Pinned against `tests/data/messages_native_events.json`, captured from the writer as it stood before it
was fed reply events natively (it built OpenAI-shaped chunks for the turn builder): for an engine
Messages stream with a forced tool call, the same request whole, a text stream, and through a real
loopback upstream a stream, a whole reply, a refusal and a token count, the bytes the client reads and
the turn recorded must not move.
Ids the proxy makes up per request (`msg_…`, `call_…`) and times are the only things normalised.

Regenerate (only when a change of output is intended): `python -m tests.test_messages_native_events`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
from recorder.reader import iter_turns
from testsupport.servers import TINY_MODEL, running_server

PINNED = Path(__file__).parent / "data" / "messages_native_events.json"
RECORDED = ("status", "error", "response_text", "reasoning_text", "tool_calls", "finish_reason", "prompt_tokens",
            "completion_tokens", "cached_tokens", "usage", "renderer_id", "served_by")

TOOLS = [{"name": "read_file", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


def engine_request(case: str) -> dict:
    """"engine_stream" / "engine_whole": a forced tool call; "engine_text_stream": text alone."""
    body = {"model": "default", "max_tokens": 24, "temperature": 0, "stream": case != "engine_whole",
            "system": "You read files.", "messages": [{"role": "user", "content": "Open README.md please."}]}
    if case != "engine_text_stream":
        body.update(tools=TOOLS, tool_choice={"type": "tool", "name": "read_file"})
    return body


ENGINE_CASES = ("engine_stream", "engine_whole", "engine_text_stream")


# An upstream's Messages stream: thinking, text, a tool call in two argument pieces, usage with a cache read.
UPSTREAM_EVENTS = [
    ("message_start", {"message": {"id": "msg_up1", "type": "message", "role": "assistant", "model": "claude-x",
                                   "content": [], "stop_reason": None, "stop_sequence": None,
                                   "usage": {"input_tokens": 12, "output_tokens": 1, "cache_read_input_tokens": 30,
                                             "cache_creation_input_tokens": 5}}}),
    ("content_block_start", {"index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
    ("content_block_delta", {"index": 0, "delta": {"type": "thinking_delta", "thinking": "Let me "}}),
    ("content_block_delta", {"index": 0, "delta": {"type": "thinking_delta", "thinking": "look."}}),
    ("content_block_delta", {"index": 0, "delta": {"type": "signature_delta", "signature": "sig"}}),
    ("content_block_stop", {"index": 0}),
    ("content_block_start", {"index": 1, "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", {"index": 1, "delta": {"type": "text_delta", "text": "Reading "}}),
    ("content_block_delta", {"index": 1, "delta": {"type": "text_delta", "text": "it now."}}),
    ("content_block_stop", {"index": 1}),
    ("content_block_start", {"index": 2, "content_block": {"type": "tool_use", "id": "toolu_01", "name": "read_file",
                                                           "input": {}}}),
    ("content_block_delta", {"index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"path\": "}}),
    ("content_block_delta", {"index": 2, "delta": {"type": "input_json_delta", "partial_json": "\"README.md\"}"}}),
    ("content_block_stop", {"index": 2}),
    ("message_delta", {"delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": {"output_tokens": 17}}),
    ("message_stop", {}),
]


def upstream_sse() -> bytes:
    return b"".join(f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()
                    for kind, data in UPSTREAM_EVENTS)


# The same reply whole, and what the upstream says to a count and to a request it refuses.
UPSTREAM_WHOLE = {"id": "msg_up2", "type": "message", "role": "assistant", "model": "claude-x",
                  "content": [{"type": "thinking", "thinking": "Let me look.", "signature": "sig"},
                              {"type": "text", "text": "Reading it now."},
                              {"type": "tool_use", "id": "toolu_02", "name": "read_file", "input": {"path": "README.md"}}],
                  "stop_reason": "tool_use", "stop_sequence": None,
                  "usage": {"input_tokens": 12, "output_tokens": 17, "cache_read_input_tokens": 30,
                            "cache_creation_input_tokens": 5}}
UPSTREAM_REFUSAL = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
UPSTREAM_CASES = ("upstream_stream", "upstream_whole", "upstream_refused", "upstream_count")


def scripted_upstream() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages(request: Request):
        body = await request.json()
        if body.get("max_tokens") == 1:
            return JSONResponse(UPSTREAM_REFUSAL, status_code=429)
        if body.get("stream"):
            return Response(upstream_sse(), media_type="text/event-stream")
        return JSONResponse(UPSTREAM_WHOLE)

    @app.post("/v1/messages/count_tokens")
    async def count():
        return {"input_tokens": 47}

    return app


def _normalised(text: str) -> str:
    """Per-request ids the proxy makes up, replaced by their kind."""
    return re.sub(r"\b(msg|call|toolu)_[0-9a-zA-Z]{16,}\b", r"\1_ID", text)


def _record(turn) -> dict:
    out = {k: getattr(turn, k) for k in RECORDED}
    for key in ("tool_calls", "usage"):
        out[key] = json.loads(_normalised(json.dumps(out[key])))
    out["chunk_count"] = len(turn.chunk_times)
    out["has_ttft"] = turn.ttft_s is not None
    return out


def _exchange(url: str, body: dict, recorder: Recorder, sub: str = "") -> dict:
    with httpx.Client(timeout=60) as c:
        r = c.post(url + "/v1/messages" + sub, json=body, headers={"x-api-key": "sk-ant-test-0123456789abcdef",
                                                             "anthropic-version": "2023-06-01"})
    recorder.flush()
    recorded = list(iter_turns(recorder.path))
    assert len(recorded) == 1
    return {"status": r.status_code, "wire": _normalised(r.text), "record": _record(recorded[0])}


def engine_exchange(engine, tmp_path: Path, case: str) -> dict:
    with Recorder(tmp_path / f"{case}.db") as rec:
        with running_server(create_app(EngineBackend(engine), rec)) as url:
            return _exchange(url, engine_request(case), rec)


def upstream_exchange(tmp_path: Path, case: str = "upstream_stream") -> dict:
    with running_server(scripted_upstream()) as upstream, Recorder(tmp_path / f"{case}.db") as rec:
        with running_server(create_app(UpstreamBackend(upstream), rec)) as url:
            body = {"model": "claude-x", "max_tokens": 1 if case == "upstream_refused" else 64,
                    "stream": case == "upstream_stream", "tools": TOOLS,
                    "messages": [{"role": "user", "content": "Open README.md please."}]}
            out = _exchange(url, body, rec, "/count_tokens" if case == "upstream_count" else "")
    out["record"]["served_by"] = out["record"]["served_by"] and "UPSTREAM"
    return out


def capture(tmp_path: Path) -> dict:
    """Every pinned exchange, each engine one on a fresh engine (an empty prefix cache), as the tests run them."""
    from engine.engine import Engine

    out = {}
    for case in ENGINE_CASES:
        engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32").start()
        try:
            engine.wait_ready(60)
            out[case] = engine_exchange(engine, tmp_path, case)
        finally:
            engine.shutdown()
    return {**out, **{case: upstream_exchange(tmp_path, case) for case in UPSTREAM_CASES}}


@pytest.fixture(scope="module")
def pinned() -> dict:
    return json.loads(PINNED.read_text())


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_engine_messages_send_and_record_as_pinned(tiny_engine, tmp_path, pinned, case):
    got = engine_exchange(tiny_engine, tmp_path, case)
    want = pinned[case]
    assert got["wire"] == want["wire"]
    assert got["record"] == want["record"]
    assert got["record"]["tool_calls" if case != "engine_text_stream" else "response_text"]


@pytest.mark.parametrize("case", UPSTREAM_CASES)
def test_upstream_messages_send_and_record_as_pinned(tmp_path, pinned, case):
    got = upstream_exchange(tmp_path, case)
    if case == "upstream_stream":
        assert got["wire"] == upstream_sse().decode()  # passed through as sent
    assert got == pinned[case]


def test_the_messages_writer_records_from_reply_events_not_chat_chunks():
    """What is recorded comes from the reply events the writer writes: no OpenAI-shaped chunk is built to
    feed the turn builder, and no field of the turn is set by hand."""
    source = (Path(__file__).parent.parent / "proxy" / "anthropic.py").read_text()
    assert "on_chunk(" not in source and "ChatChunk" not in source and '"choices"' not in source
    assert re.search(r"\bturn\.[a-z_]+\s*=[^=]", source) is None


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        PINNED.write_text(json.dumps(capture(Path(d)), indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINNED}")
