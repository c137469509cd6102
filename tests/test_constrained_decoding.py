"""Grammar-constrained decoding on the tiny random model (docs/TOOLS.md): response_format json_schema and
json_object, the `--tool-choice-default required-after-user` test aid, and the grammar glue itself.
Random weights make anything but the grammar's job unlikely: a schema-valid reply is the grammar's doing.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import load

from engine.constraints import after_user_turn, forced_by_default, parse_tool_choice, response_schema
from engine.grammar import GrammarCompiler, apply_bitmask
from prefixtrace.common.errors import InvalidRequest
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from recorder.store import Recorder
from tests.conftest import TINY_MODEL, rows, running_server
from tests.test_tool_calls import MESSAGES, SCHEMAS, TOOLS

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "admin": {"type": "boolean"}}, "required": ["name", "age", "admin"], "additionalProperties": False}


def test_apply_bitmask_keeps_exactly_the_allowed_tokens():
    n = 70
    allowed = {0, 5, 31, 32, 63, 69}
    words = np.zeros((n + 31) // 32, dtype=np.int32)
    for t in allowed:
        words[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    out = np.array(apply_bitmask(mx.zeros((1, n + 2)), words, n))  # logits padded past the vocabulary
    assert set(np.nonzero(np.isfinite(out[0]))[0]) == allowed


def test_grammar_processor_walks_a_valid_call_and_forbids_the_rest():
    tokenizer = load(Path(TINY_MODEL))
    compiler = GrammarCompiler(tokenizer, 508)
    proc = compiler.tool_call(TOOLS, "Read", "<tool_call>", "</tool_call>")
    text = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "a.txt"}}\n</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    context = [1, 2, 3]  # a prompt
    for token in ids:
        logits = proc(mx.array(context), mx.zeros((1, 508)))
        assert np.isfinite(np.array(logits)[0, token]), tokenizer.decode([token])
        context.append(token)
    logits = np.array(proc(mx.array(context), mx.zeros((1, 508))))[0]
    assert set(np.nonzero(np.isfinite(logits))[0]) <= tokenizer.eos_token_ids  # only the end may follow
    assert proc.failed is None


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_gives_a_valid_object(openai_client, engine_server, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kwargs = dict(model="default", messages=MESSAGES, response_format=fmt, max_tokens=80, temperature=0.9, seed=3)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in openai_client.chat.completions.create(
            stream=True, **kwargs) if c.choices)
    else:
        reply = openai_client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "stop"
        text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    (row,) = rows(engine_server[1])
    assert row["response_text"] == text and json.loads(row["render"])["constrained"] == "json"


def test_response_format_json_object(openai_client):
    reply = openai_client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=60, temperature=0,
                                                  response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":  # an object may be longer than max_tokens; a stop is a whole one
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].message.content.startswith("{")


def test_bad_response_format_is_a_400(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError, match="json_schema.schema"):
        openai_client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=5,
                                              response_format={"type": "json_schema", "json_schema": {"name": "x"}})


def test_request_parsing_rules():
    assert parse_tool_choice(None, TOOLS) == ("auto", None)
    assert parse_tool_choice({"type": "function", "function": {"name": "Bash"}}, TOOLS) == ("required", "Bash")
    with pytest.raises(InvalidRequest):
        parse_tool_choice("sometimes", TOOLS)
    assert response_schema({"type": "text"}) is None
    assert response_schema({"type": "json_object"}) == {"type": "object"}
    user = {"role": "user", "content": "hi"}
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}
    result = {"role": "tool", "tool_call_id": "1", "content": "ok"}
    assert after_user_turn([user]) and after_user_turn([user, call, result, {"role": "assistant", "content": "x"}, user])
    assert not after_user_turn([user, call, result])
    assert not after_user_turn([user, call, result, user])  # a Messages tool_result followed by text


def test_required_until_tool_result_stops_forcing_once_a_tool_has_answered():
    """Claude Code answers a reply cut at max_tokens with a user message of its own; under
    required-after-user that continuation is forced into another call, under required-until-tool-result
    it is free once any tool has answered."""
    user = {"role": "user", "content": "Read hello.txt"}
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}
    result = {"role": "tool", "tool_call_id": "1", "content": "ok"}
    cut = {"role": "assistant", "content": "The file says"}
    resume = {"role": "user", "content": "Output token limit hit. Resume directly"}
    assert forced_by_default("required-until-tool-result", [user])
    assert forced_by_default("required-after-user", [user, call, result, cut, resume])
    assert not forced_by_default("required-until-tool-result", [user, call, result, cut, resume])
    assert not forced_by_default("required-until-tool-result", [user, call, result])
    assert not forced_by_default("auto", [user])


def test_required_after_user_forces_the_first_call_and_frees_the_answer(tiny_engine, tmp_path):
    """The harness loop: user asks → forced call (the client sent tool_choice auto) → tool result →
    the model answers freely, so the loop ends."""
    from openai import OpenAI

    with Recorder(tmp_path / "t.db") as rec, running_server(
            create_app(EngineBackend(tiny_engine, tool_choice_default="required-after-user"), rec)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        first = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                               temperature=0)
        (call,) = first.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        messages = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": call.id, "content": "hello"}]
        second = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, max_tokens=6,
                                                temperature=0)
        assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason == "length"
        # Without tools nothing is forced, whatever the default.
        plain = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4, temperature=0)
        assert plain.choices[0].message.tool_calls is None
        recorded = rows(rec)
    assert [json.loads(r["render"]).get("constrained") for r in recorded] == ["tool_call", None, None]


def test_without_the_default_nothing_is_forced(openai_client):
    reply = openai_client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=6,
                                                  temperature=0)
    assert reply.choices[0].message.tool_calls is None


BROKEN = [{"type": "function", "function": {"name": "Odd", "parameters": {"type": "object", "properties": {
    "x": {"$ref": "https://example.com/elsewhere.json"}}}}}]


def test_a_schema_the_grammar_cannot_take(tiny_engine, tmp_path):
    """Asked for explicitly, a schema that cannot be enforced is a 400 with llguidance's reason; under the
    serve default (the client asked for nothing) the reply is simply free. Keywords llguidance does not
    implement (`not`) are left unenforced rather than refused."""
    import openai
    from openai import OpenAI

    with Recorder(tmp_path / "t.db") as rec, running_server(
            create_app(EngineBackend(tiny_engine, tool_choice_default="required-after-user"), rec)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="cannot be enforced"):
            client.chat.completions.create(model="default", messages=MESSAGES, tools=BROKEN, tool_choice="required",
                                           max_tokens=5)
        free = client.chat.completions.create(model="default", messages=MESSAGES, tools=BROKEN, max_tokens=5,
                                              temperature=0)
        assert free.choices[0].message.tool_calls is None
        negated = [{"type": "function", "function": {"name": "Neg", "parameters": {"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 9, "not": {"const": 3}}},
            "required": ["n"], "additionalProperties": False}}}]
        forced = client.chat.completions.create(model="default", messages=MESSAGES, tools=negated, max_tokens=60,
                                                temperature=0)
        (call,) = forced.choices[0].message.tool_calls
        assert 0 <= json.loads(call.function.arguments)["n"] <= 9


def test_serve_option_reaches_the_backend():
    from prefixtrace.serve import ServeConfig, build_backend

    backend = build_backend(ServeConfig(model=TINY_MODEL, dtype="float32", tool_choice_default="required-after-user"))
    try:
        assert backend.tool_choice_default == "required-after-user"
    finally:
        backend.engine.wait_ready(60)
        backend.engine.shutdown()


# A tool whose values nothing in its schema bounds: a session id (a number), a free string and a list,
# the shape of codex's write_stdin/request_user_input, on which greedy SmolLM2 repeats digits or an id
# until max_tokens.
UNBOUNDED = [{"type": "function", "function": {"name": "Poll", "parameters": {"type": "object", "properties": {
    "session_id": {"type": "number"}, "note": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["session_id", "note", "tags"]}}}]


def test_bounded_schema_bounds_only_what_the_schema_leaves_open():
    from engine.grammar import GrammarLimits, bounded_schema

    limits = GrammarLimits(string_chars=10, array_items=3, number_magnitude=1000, number_decimals=2)
    params = UNBOUNDED[0]["function"]["parameters"]
    out = bounded_schema(params, limits)
    assert out["properties"]["note"] == {"type": "string", "maxLength": 10}
    assert out["properties"]["tags"] == {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 10}}
    assert out["properties"]["session_id"] == {"type": "number", "minimum": -1000, "maximum": 1000, "multipleOf": 0.01}
    assert out["additionalProperties"] is False
    assert params["properties"]["note"] == {"type": "string"}  # the tool's own schema is left as it was
    kept = {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 99999}, "b": {"type": "string", "minLength": 50},
        "c": {"enum": ["x", "y"], "type": "string"}, "n": {"type": "integer", "minimum": 5000},
        "m": {"type": "integer", "exclusiveMaximum": -5000}}, "additionalProperties": {"type": "string"}}
    out = bounded_schema(kept, limits)["properties"]
    assert out["a"]["maxLength"] == 99999 and out["b"]["maxLength"] == 50 and "maxLength" not in out["c"]
    assert out["n"] == {"type": "integer", "minimum": 5000, "maximum": 5000}  # never below its own minimum
    assert out["m"] == {"type": "integer", "exclusiveMaximum": -5000, "minimum": -5000}
    assert bounded_schema(kept, limits)["additionalProperties"] == {"type": "string", "maxLength": 10}


def test_grammar_refuses_what_passes_the_bounds():
    from engine.grammar import GrammarLimits

    tokenizer = load(Path(TINY_MODEL))
    compiler = GrammarCompiler(tokenizer, 508)
    limits = GrammarLimits(string_chars=5, array_items=2, number_magnitude=100, number_decimals=1)

    def accepted(args: str) -> bool:
        proc = compiler.tool_call(UNBOUNDED, None, "<tool_call>", "</tool_call>", limits=limits)
        text = '<tool_call>\n{"name": "Poll", "arguments": ' + args + '}\n</tool_call>'
        ids = tokenizer.encode(text, add_special_tokens=False)
        return proc.matcher.try_consume_tokens(ids) == len(ids) and proc.matcher.is_accepting()

    assert accepted('{"session_id": 12.5, "note": "abcde", "tags": ["a", "b"]}')
    assert not accepted('{"session_id": 12.5, "note": "abcdef", "tags": []}')  # a sixth character
    assert not accepted('{"session_id": 1234, "note": "", "tags": []}')  # past the magnitude
    assert not accepted('{"session_id": 1.25, "note": "", "tags": []}')  # a second decimal
    assert not accepted('{"session_id": 1, "note": "", "tags": ["a", "b", "c"]}')  # a third item
    assert not accepted('{"session_id": 1, "note": "", "tags": [], "extra": 1}')  # a property it does not list


def test_a_forced_call_ends_within_the_bounds(tiny_engine, tmp_path):
    """Random weights at temperature 1 stay inside an open string (closing it is one token of 508):
    unbounded, the call runs to max_tokens and comes back cut; bounded, it closes by itself and
    validates against the tool's schema."""
    from openai import OpenAI

    from engine.grammar import GrammarLimits

    limits = GrammarLimits(string_chars=12, array_items=2)
    with Recorder(tmp_path / "t.db") as rec, running_server(
            create_app(EngineBackend(tiny_engine, grammar_limits=limits), rec)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        for seed in (1, 2, 3):
            reply = client.chat.completions.create(model="default", messages=MESSAGES, tools=UNBOUNDED,
                                                   tool_choice="required", max_tokens=400, temperature=1, seed=seed)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls", (seed, choice)
            args = json.loads(choice.message.tool_calls[0].function.arguments)
            jsonschema.validate(args, UNBOUNDED[0]["function"]["parameters"])
            assert len(args["note"]) <= 12 and len(args["tags"]) <= 2 and abs(args["session_id"]) < 1e15
            assert reply.usage.completion_tokens < 400


# Codex 0.171.0's write_stdin tool as it sends it: greedy SmolLM2, forced to call it, writes
# "session_id": 1234567890… until max_tokens when numbers are unbounded (83+ digits in 120 tokens).
CODEX_WRITE_STDIN = {"type": "function", "function": {
    "name": "write_stdin",
    "description": "Writes characters to an existing unified exec session and returns recent output.",
    "parameters": {"type": "object", "properties": {
        "chars": {"type": "string", "description": "Bytes to write to stdin. Defaults to empty, which polls "
                                                   "without writing."},
        "max_output_tokens": {"type": "number", "description": "Output token budget. Defaults to 10000 tokens; "
                                                             "larger requests may be capped by policy."},
        "session_id": {"type": "number", "description": "Identifier of the running unified exec session."},
        "yield_time_ms": {"type": "number", "description": "Wait before yielding output. Non-empty writes "
                          "default to 250 ms and cap at 30000 ms; empty polls wait 5000-300000 ms by default."}},
        "required": ["session_id"], "additionalProperties": False}}}


@pytest.mark.slow
def test_greedy_smollm2_closes_a_forced_call_it_would_run_on(tmp_path):
    from openai import OpenAI

    from engine.default_model import DEFAULT_MODEL_NAME, default_model_dir
    from engine.engine import Engine

    engine = Engine(default_model_dir(), name=DEFAULT_MODEL_NAME, dtype="float32").start()
    try:
        engine.wait_ready(300)
        with Recorder(tmp_path / "t.db") as rec, running_server(create_app(EngineBackend(engine), rec)) as url:
            client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
            reply = client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "Read the file /tmp/x/hello.txt"}],
                tools=[CODEX_WRITE_STDIN], tool_choice="required", max_tokens=120, temperature=0)
    finally:
        engine.shutdown()
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice  # unbounded: "length", the id still growing
    args = json.loads(choice.message.tool_calls[0].function.arguments)
    jsonschema.validate(args, CODEX_WRITE_STDIN["function"]["parameters"])
    assert abs(args["session_id"]) < 1e15
