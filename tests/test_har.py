"""HAR 1.2 export/import: lossless round trip, and HAR as browsers and mitmproxy write it."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from prefixtrace.common.errors import InvalidRequest
from recorder import Recorder, Turn, iter_turns
from recorder.sources import export, import_file, load_turns, sniff

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "sessions").glob("*.jsonl"))


def rich_turn(i: int, stream: bool) -> Turn:
    t = Turn(
        request_id=f"req-{i}", started_at=1700000000.123456 + i, endpoint="/v1/chat/completions",
        upstream="http://127.0.0.1:8080" if i % 2 else "embedded:tiny",
        request_body={"model": "m", "messages": [{"role": "user", "content": f"héllo {i}"}], "stream": stream},
        request_headers={"Content-Type": "application/json", "X-Session-Id": "s"},
        session_id="s", client_addr="127.0.0.1:5", stream=stream, status=200, response_text="ok",
        reasoning_text="hmm", finish_reason="tool_calls",
        tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        prompt_tokens=12, completion_tokens=3, cached_tokens=None if i == 0 else 8,
        usage={"prompt_tokens": 12, "completion_tokens": 3}, ttft_s=0.0123, total_s=0.5,
        chunk_times=[0.0123, 0.2], render={"prompt_token_ids": [1, 2]},
    )
    t.request_raw = json.dumps(t.request_body, separators=(",", ":"), ensure_ascii=False)
    return t


def test_har_round_trip_is_lossless(tmp_path):
    db1, db2 = tmp_path / "a.db", tmp_path / "b.db"
    with Recorder(db1) as rec:
        for i in range(4):
            rec.record(rich_turn(i, stream=bool(i % 2)))
        rec.record(Turn(request_id="bad", started_at=1700000009.0, endpoint="/v1/chat/completions", upstream="u",
                        request_body="not json {", status=400, error="bad body"))
    har1, har2 = tmp_path / "a.har", tmp_path / "b.har"
    assert export(db1, har1, "har") == 5
    doc = json.loads(har1.read_text())
    assert doc["log"]["version"] == "1.2" and len(doc["log"]["entries"]) == 5
    entry = doc["log"]["entries"][1]
    assert entry["request"]["postData"]["text"] == rich_turn(1, True).request_raw
    assert entry["response"]["content"]["mimeType"] == "text/event-stream"
    assert entry["timings"]["wait"] == 12.3
    assert sniff(har1) == "har"
    assert import_file(har1, db2) == 5
    assert list(iter_turns(db1)) == list(iter_turns(db2))
    assert [t.request_raw for t in iter_turns(db2)] == [t.request_raw for t in iter_turns(db1)]
    export(db2, har2, "har")
    assert har1.read_bytes() == har2.read_bytes()


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.name)
def test_fixture_survives_jsonl_to_har_to_jsonl(fixture, tmp_path):
    db1, db2 = tmp_path / "a.db", tmp_path / "b.db"
    import_file(fixture, db1)
    export(db1, tmp_path / "x.har", "har")
    import_file(tmp_path / "x.har", db2)
    export(db1, tmp_path / "direct.jsonl", "jsonl")
    export(db2, tmp_path / "back.jsonl", "jsonl")
    assert (tmp_path / "back.jsonl").read_bytes() == (tmp_path / "direct.jsonl").read_bytes()


def mitm_har(tmp_path: Path) -> Path:
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 2,
                                  "prompt_tokens_details": {"cached_tokens": 16}}},
    ]) + "data: [DONE]\n\n"
    body = '{"model": "qwen", "stream": true, "messages": [{"role": "user", "content": "hi"}], "user": "alice"}'
    whole = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Sure."}, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 30, "completion_tokens": 1}}
    har = {"log": {"version": "1.2", "creator": {"name": "mitmproxy", "version": "10"}, "pages": [], "entries": [
        {"startedDateTime": "2024-05-01T10:00:00.000Z", "time": 50, "request": {"method": "GET",
         "url": "https://example.com/", "headers": []}, "response": {"status": 200, "content": {"text": "<html>"}},
         "timings": {"wait": 10}},
        {"startedDateTime": "2024-05-01T10:00:01.250+00:00", "time": 812.5,
         "request": {"method": "POST", "url": "https://api.example.com/v1/chat/completions", "httpVersion": "HTTP/2",
                     "headers": [{"name": "authorization", "value": "Bearer sk-abcdefghijklmnopqrstuvwxyz"},
                                 {"name": "content-type", "value": "application/json"}],
                     "postData": {"mimeType": "application/json", "text": body}},
         "response": {"status": 200, "content": {"mimeType": "text/event-stream", "encoding": "base64",
                                                 "text": base64.b64encode(sse.encode()).decode()}},
         "timings": {"send": 1, "wait": 120.5, "receive": 600}},
        {"startedDateTime": "2024-05-01T10:00:05.000Z", "time": 300,
         "request": {"method": "POST", "url": "http://127.0.0.1:8080/v1/chat/completions",
                     "headers": [{"name": "X-Session-Id", "value": "s9"}],
                     "postData": {"text": json.dumps({"model": "q", "messages": [{"role": "user", "content": "x"}]})}},
         "response": {"status": 200, "content": {"text": json.dumps(whole)}}, "timings": {"wait": -1}},
        {"startedDateTime": "2024-05-01T10:00:06.000Z", "time": 5, "request": {"method": "POST",
         "url": "https://example.com/track", "postData": {"text": "a=1"}}, "response": {"status": 204}},
    ]}}
    path = tmp_path / "capture.har"
    path.write_text(json.dumps(har, indent=2))
    return path


def test_import_a_mitmproxy_style_har(tmp_path):
    path = mitm_har(tmp_path)
    assert import_file(path, tmp_path / "t.db") == 2  # the page GET and the tracking POST are skipped
    streamed, whole = iter_turns(tmp_path / "t.db")
    assert streamed.request_raw == json.loads(path.read_text())["log"]["entries"][1]["request"]["postData"]["text"]
    assert (streamed.session_id, streamed.upstream, streamed.endpoint) == ("alice", "https://api.example.com",
                                                                             "/v1/chat/completions")
    assert streamed.response_text == "Hello" and streamed.finish_reason == "stop"
    assert (streamed.prompt_tokens, streamed.cached_tokens) == (20, 16)
    assert streamed.ttft_s == pytest.approx(0.1205) and streamed.total_s == pytest.approx(0.8125)
    assert streamed.started_at == pytest.approx(1714557601.25)
    assert "authorization" not in {k.lower() for k in streamed.request_headers}
    assert whole.session_id == "s9" and whole.response_text == "Sure." and whole.cached_tokens is None
    assert whole.ttft_s is None
    assert [t.request_id for t in load_turns(path)] == [streamed.request_id, whole.request_id]


def test_a_broken_har_names_the_entry_and_writes_nothing(tmp_path):
    path = tmp_path / "bad.har"
    path.write_text(json.dumps({"log": {"entries": [
        {"startedDateTime": "2024-05-01T10:00:00Z", "request": {"method": "POST", "url": "http://h/v1/chat/completions",
         "postData": {"text": '{"messages": []}'}}, "response": {"status": 200}},
        {"startedDateTime": "yesterday", "request": {"method": "POST", "url": "http://h/v1/chat/completions",
         "postData": {"text": '{"messages": []}'}}, "response": {"status": 200}},
    ]}}))
    with pytest.raises(InvalidRequest, match="entry 1"):
        import_file(path, tmp_path / "t.db")
    assert not (tmp_path / "t.db").exists()
    (tmp_path / "x.har").write_text('{"log": 3}')
    with pytest.raises(InvalidRequest, match="not a HAR"):
        import_file(tmp_path / "x.har", tmp_path / "t.db")


def _sse(*events: dict) -> str:
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)


def test_a_foreign_har_of_messages_and_responses_traffic_is_read_by_each_apis_reader(tmp_path):
    """A capture of Claude Code (Messages, a streamed tool_use) and Codex (Responses, a streamed
    function call) is imported with each reply read as its API writes it, tool calls included."""
    messages_reply = _sse(
        {"type": "message_start", "message": {"usage": {"input_tokens": 3, "cache_read_input_tokens": 40,
                                                        "output_tokens": 0}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Reading."}},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_1",
                                                                      "name": "Read", "input": {}}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"pa'}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": 'th": "a"}'}},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}},
        {"type": "message_stop"})
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command", "arguments": ""}
    responses_reply = _sse(
        {"type": "response.created", "response": {"status": "in_progress", "output": []}},
        {"type": "response.output_item.added", "output_index": 0, "item": call},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 0, "delta": '{"cmd":'},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 0, "delta": '"ls"}'},
        {"type": "response.completed", "response": {"status": "completed", "output": [{**call, "arguments": '{"cmd":"ls"}'}],
                                                    "usage": {"input_tokens": 50, "output_tokens": 7,
                                                              "input_tokens_details": {"cached_tokens": 32}}}})
    session = json.dumps({"device_id": "d", "session_id": "claude-1"})
    har = {"log": {"version": "1.2", "entries": [
        {"startedDateTime": "2026-12-01T10:00:00.000Z", "time": 100, "request": {
            "method": "POST", "url": "http://127.0.0.1:8765/v1/messages?beta=true", "headers": [],
            "postData": {"text": json.dumps({"model": "m", "max_tokens": 10, "stream": True,
                                             "metadata": {"user_id": session},
                                             "messages": [{"role": "user", "content": "read a"}]})}},
         "response": {"status": 200, "content": {"text": messages_reply}}},
        {"startedDateTime": "2026-12-01T10:00:01.000Z", "time": 100, "request": {
            "method": "POST", "url": "http://127.0.0.1:8765/v1/responses",
            "headers": [{"name": "session-id", "value": "codex-1"}],
            "postData": {"text": json.dumps({"model": "m", "stream": True, "input": "list files"})}},
         "response": {"status": 200, "content": {"text": responses_reply}}},
    ]}}
    path = tmp_path / "agents.har"
    path.write_text(json.dumps(har))
    assert import_file(path, tmp_path / "t.db") == 2
    claude, codex = iter_turns(tmp_path / "t.db")
    assert (claude.endpoint, claude.session_id, claude.response_text) == ("/v1/messages", "claude-1", "Reading.")
    assert claude.tool_calls == [{"id": "toolu_1", "type": "function",
                                  "function": {"name": "Read", "arguments": '{"path": "a"}'}}]
    assert (claude.finish_reason, claude.prompt_tokens, claude.cached_tokens, claude.completion_tokens) == \
        ("tool_calls", 43, 40, 9)
    assert (codex.endpoint, codex.session_id, codex.finish_reason) == ("/v1/responses", "codex-1", "tool_calls")
    assert codex.tool_calls == [{"id": "call_1", "type": "function",
                                 "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'}}]
    assert (codex.prompt_tokens, codex.cached_tokens, codex.completion_tokens) == (50, 32, 7)


def test_a_foreign_har_of_whole_messages_and_responses_bodies_keeps_their_counts_and_the_hars_times(tmp_path):
    """Non-streamed replies: the Messages body's stop_reason and usage (Anthropic's terms), the Responses
    body's usage as sent, and the times the HAR measured (not the import's own clock)."""
    messages_usage = {"input_tokens": 3, "cache_read_input_tokens": 40, "cache_creation_input_tokens": 2,
                      "output_tokens": 9}
    messages_body = {"type": "message", "role": "assistant", "stop_reason": "max_tokens", "usage": messages_usage,
                     "content": [{"type": "text", "text": "Cut"}]}
    responses_usage = {"input_tokens": 50, "output_tokens": 7, "input_tokens_details": {"cached_tokens": 32}}
    responses_body = {"status": "completed", "usage": responses_usage, "output": [
        {"type": "message", "content": [{"type": "output_text", "text": "Done."}]}]}

    def entry(url: str, body: dict, reply: dict, wait: float) -> dict:
        return {"startedDateTime": "2026-12-01T10:00:00.000Z", "time": 250, "timings": {"wait": wait},
                "request": {"method": "POST", "url": url, "headers": [], "postData": {"text": json.dumps(body)}},
                "response": {"status": 200, "content": {"text": json.dumps(reply)}}}

    har = {"log": {"version": "1.2", "entries": [
        entry("http://127.0.0.1:8765/v1/messages", {"model": "m", "max_tokens": 3,
                                                    "messages": [{"role": "user", "content": "go"}]}, messages_body, 120),
        entry("http://127.0.0.1:8765/v1/responses", {"model": "m", "input": "go"}, responses_body, -1)]}}
    path = tmp_path / "whole.har"
    path.write_text(json.dumps(har))
    assert import_file(path, tmp_path / "t.db") == 2
    claude, codex = iter_turns(tmp_path / "t.db")
    assert (claude.response_text, claude.finish_reason) == ("Cut", "length")
    assert (claude.prompt_tokens, claude.cached_tokens, claude.completion_tokens, claude.usage) == \
        (45, 40, 9, messages_usage)
    assert (codex.response_text, codex.finish_reason, codex.usage) == ("Done.", "stop", responses_usage)
    assert (codex.prompt_tokens, codex.cached_tokens, codex.completion_tokens) == (50, 32, 7)
    assert (claude.ttft_s, claude.total_s, codex.ttft_s, codex.total_s) == (0.12, 0.25, None, 0.25)
    assert claude.chunk_times == codex.chunk_times == []
