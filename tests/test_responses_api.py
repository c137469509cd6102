"""POST /v1/responses: the official openai client's `responses.create/stream` against the embedded
engine and through --upstream; recorded, exported, imported and replayed on /v1/responses."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import BadRequestError, OpenAI

from recorder import export, import_file, load_turns
from recorder.replay import replay
from tests.conftest import rows

INSTRUCTIONS = "You are a careful coding assistant. Answer briefly. " * 4


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="sk-test-0123456789abcdef", max_retries=0, timeout=60)


def ask(c: OpenAI, stream: bool, **kwargs):
    kwargs = {"model": "default", "max_output_tokens": 6, "temperature": 0, **kwargs}
    if stream:
        with c.responses.stream(**kwargs) as s:
            deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
            response = s.get_final_response()
        assert "".join(deltas) == response.output_text
        return response
    return c.responses.create(**kwargs)


def converse(c: OpenAI, stream: bool):
    """Two turns, the second re-sending the first as input items (as Codex does, store: false)."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Write a haiku."}]}]
    first = ask(c, stream, instructions=INSTRUCTIONS, input=items, store=False, prompt_cache_key="conv-1")
    items += [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
              {"role": "user", "content": "Another."}]
    second = ask(c, stream, instructions=INSTRUCTIONS, input=items, store=False, prompt_cache_key="conv-1")
    return first, second


@pytest.mark.parametrize("stream", [False, True])
def test_responses_on_the_engine_reuse_the_prefix_and_are_recorded(engine_server, stream):
    url, recorder = engine_server
    first, second = converse(client(url), stream)

    for r in (first, second):
        assert r.object == "response" and r.status in ("completed", "incomplete") and r.model == "default"
        assert r.output[0].type == "message" and r.output[0].role == "assistant"
        assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 4

    recorded = rows(recorder)
    assert [r["endpoint"] for r in recorded] == ["/v1/responses", "/v1/responses"]
    for row, response in zip(recorded, (first, second)):
        assert row["status"] == 200 and row["stream"] == int(stream) and row["session_id"] == "conv-1"
        assert row["response_text"] == response.output_text and row["finish_reason"] == "length"
        assert row["prompt_tokens"] == response.usage.input_tokens
        assert row["cached_tokens"] == response.usage.input_tokens_details.cached_tokens
        assert json.loads(row["usage"]) == response.usage.model_dump(exclude_none=True)


def test_the_stream_is_the_standard_event_sequence(engine_server):
    url, _ = engine_server
    body = {"model": "default", "input": "Hello", "max_output_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events, names = [], []
        for line in r.iter_lines():
            if line.startswith("event:"):
                names.append(line[6:].strip())
            elif line.startswith("data:"):
                events.append(json.loads(line[5:]))
    kinds = [e["type"] for e in events]
    assert kinds == names  # every event named on its `event:` line
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:-4] == ["response.output_text.delta"] * (len(kinds) - 8)
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    item = events[-2]["item"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert item["content"][0]["text"] == text and events[-1]["response"]["output"] == [item]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []


def test_previous_response_id_continues_a_stored_conversation_and_store_false_is_respected(engine_server):
    url, recorder = engine_server
    c = client(url)
    first = ask(c, False, instructions=INSTRUCTIONS, input="Name a colour.")
    follow = ask(c, False, instructions=INSTRUCTIONS, input="And another.", previous_response_id=first.id)
    # The stored conversation is the prefix of the follow-up: its prompt is served from the cache.
    assert follow.usage.input_tokens > first.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 4

    unstored = ask(c, False, input="Name a colour.", store=False)
    with pytest.raises(BadRequestError) as err:
        ask(c, False, input="And another.", previous_response_id=unstored.id)
    assert err.value.body["param"] == "previous_response_id" and unstored.id in err.value.body["message"]
    last = rows(recorder)[-1]
    assert last["endpoint"] == "/v1/responses" and last["status"] == 400 and unstored.id in last["error"]


def test_bad_bodies_are_openai_shaped_400s_and_recorded(engine_server):
    url, recorder = engine_server
    bad = [{"model": "default"}, {"input": 5}, {"input": [{"role": "robot", "content": "x"}]},
           {"input": [{"type": "function_call", "name": 3}]}, {"input": "x", "stream": "yes"}]
    for body in bad:
        r = httpx.post(url + "/v1/responses", json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert [(t["endpoint"], t["status"]) for t in rows(recorder)] == [("/v1/responses", 400)] * len(bad)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_pass_through_an_upstream_and_are_recorded_as_seen(chain, stream):
    url_a, rec_a, rec_b = chain
    first, second = converse(client(url_a), stream)
    a, b = rows(rec_a), rows(rec_b)
    assert [r["endpoint"] for r in a + b] == ["/v1/responses"] * 4
    for ra, rb, response in zip(a, b, (first, second)):
        assert ra["status"] == rb["status"] == 200 and ra["upstream"].startswith("http://127.0.0.1:")
        assert ra["response_text"] == rb["response_text"] == response.output_text
        assert (ra["prompt_tokens"], ra["cached_tokens"]) == (rb["prompt_tokens"], rb["cached_tokens"])
        assert ra["finish_reason"] == rb["finish_reason"] == "length" and ra["session_id"] == "conv-1"
    assert a[1]["cached_tokens"] > 0
    if stream:
        assert len(json.loads(a[0]["chunk_times"])) == len(json.loads(b[0]["chunk_times"]))


def test_responses_turns_export_import_and_replay_on_the_responses_endpoint(engine_server, tmp_path):
    url, recorder = engine_server
    converse(client(url), stream=True)
    recorder.flush()
    out = tmp_path / "turns.jsonl"
    export(recorder.path, out)
    assert import_file(out, tmp_path / "copy.db") == 2
    recorded = load_turns(tmp_path / "copy.db")
    assert [t.endpoint for t in recorded] == ["/v1/responses"] * 2 and "input" in recorded[0].request_body

    report = replay(recorded, url)
    turns = report["targets"][0]["turns"]
    assert [t["status"] for t in turns] == [200, 200] and not any(t["error"] for t in turns)
    assert [t["prompt_tokens"] for t in turns] == [t.prompt_tokens for t in recorded]
    assert turns[1]["cached_tokens"] == turns[1]["prompt_tokens"] - 1  # all but the token that samples
    assert all(t["ttft_ms"] is not None and t["completion_tokens"] for t in turns)
    # Replayed on /v1/responses: the server recorded them there, as Responses bodies.
    assert [r["endpoint"] for r in rows(recorder)[-2:]] == ["/v1/responses"] * 2


PARAMS = {"type": "object", "properties": {"cmd": {"type": "string", "enum": ["ls", "pwd"]}},
          "required": ["cmd"], "additionalProperties": False}
EXEC = {"type": "function", "name": "exec_command", "description": "Run a shell command", "parameters": PARAMS}


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_round_trip_as_codex_sends_it_reuses_the_prefix(engine_server, stream):
    """Codex's loop: a forced call comes back as a function_call item; the next request re-sends it
    with its function_call_output (store: false), and the re-rendered prompt is the cached prefix."""
    url, recorder = engine_server
    c = client(url)
    items = [{"role": "developer", "content": "You run commands."},
             {"role": "user", "content": [{"type": "input_text", "text": "List the files."}]}]
    first = ask(c, stream, instructions=INSTRUCTIONS, input=items, tools=[EXEC], tool_choice="required",
                max_output_tokens=60, store=False)
    [call] = [i for i in first.output if i.type == "function_call"]
    assert call.name == "exec_command" and json.loads(call.arguments)["cmd"] in ("ls", "pwd")
    assert call.call_id.startswith("call_") and first.status == "completed"
    items += [call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                                                   "output": "a.txt\nb.txt"}]
    second = ask(c, stream, instructions=INSTRUCTIONS, input=items, tools=[EXEC], store=False)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 4
    recorded = rows(recorder)
    assert json.loads(recorded[0]["tool_calls"]) == [{"id": call.call_id, "type": "function", "function": {
        "name": "exec_command", "arguments": call.arguments}}]
    assert recorded[0]["finish_reason"] == "tool_calls" and recorded[1]["tool_calls"] is None


def test_text_format_json_schema_constrains_the_output(engine_server):
    url, _ = engine_server
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    r = ask(client(url), False, input="Pick a colour.", max_output_tokens=40,
            text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    assert json.loads(r.output_text)["colour"] in ("red", "blue")
