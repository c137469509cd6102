"""Edge cases of POST /v1/messages (embedded engine and upstream pass-through) and of the
render policies (bug hunt): bad input is a 400 in Anthropic's shape and recorded, streamed
events come in order with consistent usage, stop sequences are reported as Anthropic does,
and the policies keep earlier parts of the prompt unchanged between consecutive turns."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from proxy.anthropic import to_chat_request
from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
from tests.conftest import rows, running_server

anthropic = pytest.importorskip("anthropic")


def post(url: str, body, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/messages", json=body, timeout=60, **kw)


def events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of an Anthropic event stream."""
    out, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            assert data["type"] == name  # the event line and the data's type agree
            out.append((name, data))
    return out


def greedy(url: str, text: str = "Write a haiku.", **extra) -> dict:
    r = post(url, {"model": "default", "max_tokens": 12, "temperature": 0,
                   "messages": [{"role": "user", "content": text}], **extra})
    assert r.status_code == 200, r.text
    return r.json()


# --- bad input ------------------------------------------------------------------------

BAD = {
    "messages not a list": {"messages": "hi"},
    "no messages": {"messages": []},
    "role tool in messages": {"messages": [{"role": "tool", "content": "x"}]},  # system is accepted (tests/test_anthropic_route.py)
    "content a number": {"messages": [{"role": "user", "content": 5}]},
    "content missing": {"messages": [{"role": "user"}]},
    "image block": {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
    "document block": {"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}}]}]},
    "image inside a tool_result": {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}]}]},
    "text block without a string": {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
    "thinking block without a string": {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": {"a": 1}}, {"type": "text", "text": "x"}]}]},
    "tool_use from the user": {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
    "system a number": {"system": 3, "messages": [{"role": "user", "content": "q"}]},
    "system with an image block": {"system": [{"type": "image"}], "messages": [{"role": "user", "content": "q"}]},
    "max_tokens a string": {"max_tokens": "10", "messages": [{"role": "user", "content": "q"}]},
    "max_tokens zero": {"max_tokens": 0, "messages": [{"role": "user", "content": "q"}]},
    "temperature a string": {"temperature": "hot", "messages": [{"role": "user", "content": "q"}]},
    "top_p out of range": {"top_p": 1.5, "messages": [{"role": "user", "content": "q"}]},
    "empty stop sequence": {"stop_sequences": [""], "messages": [{"role": "user", "content": "q"}]},
    "tools not a list": {"tools": {"name": "f"}, "messages": [{"role": "user", "content": "q"}]},
    "tool without a name": {"tools": [{"input_schema": {}}], "messages": [{"role": "user", "content": "q"}]},
    "stream a string": {"stream": "false", "messages": [{"role": "user", "content": "q"}]},
}


def test_bad_requests_are_400s_in_anthropic_shape_and_recorded(engine_server):
    url, recorder = engine_server
    for name, body in BAD.items():
        r = post(url, {"model": "default", "max_tokens": 4, **body})
        assert r.status_code == 400, (name, r.status_code, r.text)
        data = r.json()
        assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error", name
        assert data["error"]["message"], name
    # Not JSON at all, and a JSON array: the same shape.
    for raw in (b"{not json", b"[1, 2]"):
        r = httpx.post(url + "/v1/messages", content=raw, timeout=60, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    recorded = rows(recorder)
    assert [r["status"] for r in recorded] == [400] * (len(BAD) + 2)
    assert all(r["endpoint"] == "/v1/messages" and r["error"] for r in recorded)


def test_accepted_shapes_translate_and_render(engine_server):
    """Shapes a real harness sends: system as blocks with cache_control, thinking and
    redacted_thinking blocks, nested tool_result content, an error result, metadata.user_id,
    top_k, a first assistant message and consecutive user messages."""
    url, recorder = engine_server
    body = {
        "model": "default", "max_tokens": 3, "temperature": 0, "top_k": 5, "metadata": {"user_id": "sess-42"},
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "read", "description": "Read", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "Open a.py"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "read it", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                 "content": [{"type": "text", "text": "no such file"}]},
                {"type": "text", "text": "<system-reminder>keep going</system-reminder>"}]},
            {"role": "user", "content": "and then?"},
        ],
    }
    r = post(url, body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["type"] == "message" and data["role"] == "assistant" and data["content"][0]["type"] == "text"
    assert data["stop_reason"] == "max_tokens" and data["stop_sequence"] is None
    first_assistant = post(url, {"model": "default", "max_tokens": 2,
                                 "messages": [{"role": "assistant", "content": "Hi."},
                                              {"role": "user", "content": "Hello"}]})
    assert first_assistant.status_code == 200, first_assistant.text
    (row, _) = rows(recorder)
    assert row["session_id"] == "sess-42" and row["status"] == 200
    assert json.loads(row["request_body"]) == body


# --- streaming, stop reasons, usage ---------------------------------------------------


def test_stream_events_are_in_order_with_consistent_usage(engine_server, tiny_engine):
    url, recorder = engine_server
    body = {"model": "default", "max_tokens": 6, "temperature": 0, "stream": True,
            "system": "You are terse.", "messages": [{"role": "user", "content": "Write a haiku."}]}
    evs = []
    for _ in range(2):  # the second is served from the prefix cache
        r = post(url, body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        evs.append(events(r))
    whole = post(url, {**body, "stream": False}).json()
    prompt = len(tiny_engine.render([{"role": "system", "content": "You are terse."},
                                     {"role": "user", "content": "Write a haiku."}]).token_ids)
    for ev in evs:
        names = [n for n, _ in ev]
        assert names[:2] == ["message_start", "content_block_start"]
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert set(names[2:-3]) <= {"content_block_delta"} and len(names) > 5
        start, delta = ev[0][1]["message"], ev[-2][1]
        assert start["role"] == "assistant" and start["content"] == [] and start["stop_reason"] is None
        assert ev[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for n, d in ev if n == "content_block_delta")
        assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        su, du = start["usage"], delta["usage"]
        assert su["input_tokens"] + su["cache_read_input_tokens"] == prompt
        assert du["input_tokens"] + du["cache_read_input_tokens"] == prompt and du["output_tokens"] == 6
        text = "".join(d["delta"]["text"] for n, d in ev if n == "content_block_delta")
        assert text == whole["content"][0]["text"]
    assert evs[0][0][1]["message"]["usage"]["cache_read_input_tokens"] == 0
    assert evs[1][0][1]["message"]["usage"]["cache_read_input_tokens"] > 0
    assert whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"] == prompt
    recorded = rows(recorder)
    assert [r["prompt_tokens"] for r in recorded] == [prompt] * 3


def test_a_matched_stop_sequence_is_reported(engine_server):
    """Anthropic: stop_reason "stop_sequence" and the matched sequence in `stop_sequence`."""
    url, recorder = engine_server
    full = greedy(url)["content"][0]["text"]
    assert len(full) > 6
    stop = full[3:6]
    before = full[: full.index(stop)]
    c = anthropic.Anthropic(base_url=url, api_key="sk-ant-test-0123456789abcdef", max_retries=0, timeout=60)
    kwargs = dict(model="default", max_tokens=12, extra_body={"temperature": 0},
                  stop_sequences=["never-in-output", stop], messages=[{"role": "user", "content": "Write a haiku."}])
    message = c.messages.create(**kwargs)
    assert message.content[0].text == before
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    with c.messages.stream(**kwargs) as s:
        assert "".join(s.text_stream) == before
        streamed = s.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    # No stop sequence matched: the length limit, and no stop_sequence.
    capped = c.messages.create(**{**kwargs, "stop_sequences": ["never-in-output"]})
    assert (capped.stop_reason, capped.stop_sequence) == ("max_tokens", None)
    assert [r["status"] for r in rows(recorder)] == [200] * 4


# --- upstream pass-through ------------------------------------------------------------


def fake_anthropic_upstream(seen: list) -> FastAPI:
    """An upstream that accepts any Messages body (as Anthropic's API does with images)."""
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages(request: Request):
        seen.append(await request.json())
        return JSONResponse({"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
                             "content": [{"type": "text", "text": "a cat"}], "stop_reason": "end_turn",
                             "stop_sequence": None,
                             "usage": {"input_tokens": 7, "output_tokens": 2, "cache_read_input_tokens": 3,
                                       "cache_creation_input_tokens": 0}})

    return app


def test_upstream_passes_blocks_the_engine_cannot_render(tmp_path):
    """Images, documents and server-tool blocks are the upstream's business, not a 400 from the proxy."""
    seen: list = []
    body = {"model": "claude-x", "max_tokens": 20, "messages": [
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}},
            {"type": "text", "text": "What is this?"}]}],
        "metadata": {"user_id": "u-9"}}
    with Recorder(tmp_path / "a.db") as rec, running_server(fake_anthropic_upstream(seen)) as up:
        with running_server(create_app(UpstreamBackend(up), rec)) as url:
            r = post(url, body, headers={"x-api-key": "sk-ant-test-0123456789abcdef"})
        recorded = rows(rec)
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == "a cat"
    assert seen == [body]
    (row,) = recorded
    assert row["status"] == 200 and row["session_id"] == "u-9"
    assert (row["prompt_tokens"], row["cached_tokens"], row["response_text"]) == (10, 3, "a cat")


# --- render policies ------------------------------------------------------------------

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "templates"


def claude_code_loop() -> list[dict]:
    """Anthropic-shaped requests of one agent loop, as a harness sends them: thinking and
    tool_use each turn, tool results with a reminder, a todo notice, then a real prompt."""
    system = [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]
    tools = [{"name": "read", "description": "Read a file", "input_schema": {"type": "object"}}]
    messages: list[dict] = [{"role": "user", "content": "Fix the bug in a.py"}]
    turns = [
        ("I should read a.py first.", "toolu_1",
         [{"type": "text", "text": "<system-reminder>todo list is empty</system-reminder>"}]),
        ("The bug is on line 3.", "toolu_2", []),
        ("Now run the tests.", "toolu_3", []),
    ]
    bodies = [{"model": "default", "max_tokens": 2, "system": system, "tools": tools, "messages": list(messages)}]
    for thinking, tool_id, extra in turns:
        messages += [
            {"role": "assistant", "content": [{"type": "thinking", "thinking": thinking, "signature": "s"},
                                              {"type": "tool_use", "id": tool_id, "name": "read",
                                               "input": {"path": "a.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id,
                                          "content": [{"type": "text", "text": f"result of {tool_id}"}]}, *extra]},
        ]
        bodies.append({**bodies[0], "messages": list(messages)})
    messages += [{"role": "assistant", "content": [{"type": "thinking", "thinking": "Tests pass.", "signature": "s"},
                                                   {"type": "text", "text": "Fixed."}]},
                 {"role": "user", "content": "[todo update] 1 of 1 done"}]
    bodies.append({**bodies[0], "messages": list(messages)})
    messages += [{"role": "assistant", "content": "All done."}, {"role": "user", "content": "Now do b.py"}]
    bodies.append({**bodies[0], "messages": list(messages)})
    return bodies


@pytest.mark.parametrize("template", ["qwen3_style", "qwen35_style"])
def test_an_anthropic_agent_loop_renders_append_only_until_the_next_real_prompt(template, tmp_path):
    from testsupport.harness_session import model_dir_with_template
    from engine.engine import Engine
    from tests.conftest import TINY_MODEL

    model = model_dir_with_template(TINY_MODEL, TEMPLATES / f"{template}.jinja", tmp_path / "m")
    engine = Engine(model, name="tiny-llama", dtype="float32").start()
    try:
        engine.wait_ready(60)
        prompts = []
        for body in claude_code_loop():
            req = to_chat_request(body, {})
            prompts.append(engine.render(req.messages, tools=req.tools,
                                         chat_template_kwargs=req.chat_template_kwargs))
    finally:
        engine.shutdown()
    gen = "<|im_start|>assistant\n"
    for prev, cur in zip(prompts[:-2], prompts[1:-1]):  # the loop: each prompt extends the one before
        assert cur.text.startswith(prev.text[: -len(gen)]), (prev.text, cur.text)
        assert cur.token_ids[: len(prev.token_ids) - 2] == prev.token_ids[: len(prev.token_ids) - 2]
    loop_end = prompts[-2]
    for thinking in ("I should read a.py first.", "The bug is on line 3.", "Now run the tests.", "Tests pass."):
        assert thinking in loop_end.text  # the current loop's reasoning is kept through notices
    assert loop_end.policy["notices"] == 2 and loop_end.policy["reasoning_kept"] == 4
    # The real prompt ends the loop: its reasoning goes, once (the declared boundary).
    last = prompts[-1]
    assert "I should read a.py first." not in last.text and last.policy["reasoning_stripped"] == 4
