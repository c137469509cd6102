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


def test_a_forced_call_cut_by_max_output_tokens_is_an_incomplete_item(engine_server):
    """What a client gets when max_output_tokens ends a forced call: a well-formed Response, status
    incomplete, the call item itself marked incomplete (its arguments may not parse)."""
    url, recorder = engine_server
    tool = {"type": "function", "name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 200}}, "required": ["text"]}}
    for stream in (False, True):
        r = ask(client(url), stream, input="Take a note.", tools=[tool], tool_choice="required",
                max_output_tokens=40, temperature=1)
        [call] = [i for i in r.output if i.type == "function_call"]
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert call.status == "incomplete" and call.name == "note"
    assert [row["finish_reason"] for row in rows(recorder)] == ["length", "length"]


def test_a_stored_response_can_be_retrieved_and_others_are_404(engine_server):
    import openai

    url, recorder = engine_server
    c = client(url)
    made = ask(c, False, input="Hello")
    got = c.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    streamed = ask(c, True, input="Hello")
    assert c.responses.retrieve(streamed.id).output_text == streamed.output_text
    unstored = ask(c, False, input="Hello", store=False)
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError, match="not found"):
            c.responses.retrieve(missing)
    assert len(rows(recorder)) == 3  # a retrieval is not a model turn


LONG = {"type": "json_schema", "name": "long", "schema": {
    "type": "object", "properties": {"t": {"type": "string", "minLength": 1500}}, "required": ["t"]}}


def test_the_stream_says_created_before_its_prefill(tmp_path):
    """With one batch slot taken by a long reply, a second request waits before its prefill: its
    stream must still open at once with response.created and response.in_progress (a client's idle
    timeout, codex's stream_idle_timeout_ms, counts from the request)."""
    import threading

    from engine.engine import Engine
    from proxy.app import create_app
    from proxy.engine_backend import EngineBackend
    from recorder.store import Recorder
    from tests.conftest import TINY_MODEL, running_server

    engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32", max_batch=1).start()
    engine.wait_ready(60)
    long_done = threading.Event()
    try:
        with Recorder(tmp_path / "t.db") as rec, running_server(create_app(EngineBackend(engine), rec)) as url:
            c = client(url)

            def long_reply():
                try:
                    # A grammar that refuses the end before 1500 characters: random weights cannot stop early.
                    with c.responses.stream(model="default", input="Go on.", max_output_tokens=1500,
                                            temperature=1, text={"format": LONG}) as s:
                        for event in s:
                            if event.type == "response.output_text.delta":
                                deltas.append(1)
                                started.set()
                finally:
                    long_done.set()

            started, deltas = threading.Event(), []
            threading.Thread(target=long_reply, daemon=True).start()
            assert started.wait(60)
            body = {"model": "default", "input": "Hello", "max_output_tokens": 3, "stream": True}
            with httpx.stream("POST", url + "/v1/responses", json=body, timeout=120) as r:
                lines = r.iter_lines()
                kinds = []
                for line in lines:
                    if line.startswith("event:"):
                        kinds.append(line.split(":", 1)[1].strip())
                    if len(kinds) == 2:
                        break
                assert kinds == ["response.created", "response.in_progress"]
                seen = len(deltas)
                rest = [line.split(":", 1)[1].strip() for line in lines if line.startswith("event:")]
            assert rest[-1] == "response.completed"
            assert long_done.wait(120)
            # The long reply still held the only slot when the second stream opened: most of its
            # output came after (unfixed, the stream opened only once its prefill could start).
            assert len(deltas) - seen > 200, (seen, len(deltas))
    finally:
        engine.shutdown()


def test_parallel_tool_calls_false_keeps_only_the_first_call():
    """The writer's rule (the engine adapter drops what it refuses before recording, so the turn is
    what the client saw): a model that writes two calls under parallel_tool_calls: false returns one."""
    from prefixtrace.wire.events import ReplyDone, ToolCallArgsDelta, ToolCallStart
    from prefixtrace.wire.responses_stream import ResponsesWriter

    events = [ToolCallStart(0, "call_a", "ls"), ToolCallArgsDelta(0, "{}"), ToolCallStart(1, "call_b", "pwd"),
              ToolCallArgsDelta(1, "{}"), ReplyDone("tool_calls", 5, 9, 0)]
    for parallel, want in ((False, ["call_a"]), (True, ["call_a", "call_b"]), (None, ["call_a", "call_b"])):
        writer = ResponsesWriter({} if parallel is None else {"parallel_tool_calls": parallel}, "m")
        for event in events:
            if writer.accepts(event):
                writer.feed(event)
        assert [i["call_id"] for i in writer.output] == want
