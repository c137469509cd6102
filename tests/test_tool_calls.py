"""Tool calls from the embedded engine (docs/TOOLS.md): the model's output parsed in its family's format
and returned as OpenAI `tool_calls`, through a real uvicorn, read back by the official openai client.

The tiny fixture model has random weights, so it calls a tool only when tool_choice forces one: the
grammar makes the structure and the arguments valid, the model's (random) logits pick within it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from mlx_lm.tokenizer_utils import load

from engine.reply_parser import ReplyFormat, ReplyParser
from prefixtrace.wire.events import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from tests.conftest import TINY_MODEL, rows

# Bounded schemas: a random model inside an unbounded string could write until max_tokens.
READ = {"type": "function", "function": {"name": "Read", "description": "Read a file", "parameters": {
    "type": "object", "properties": {"file_path": {"type": "string", "maxLength": 12}},
    "required": ["file_path"], "additionalProperties": False}}}
BASH = {"type": "function", "function": {"name": "Bash", "description": "Run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string", "enum": ["ls", "pwd", "cat hello.txt"]},
                                     "timeout": {"type": "integer", "minimum": 1, "maximum": 600}},
    "required": ["command", "timeout"], "additionalProperties": False}}}
TOOLS = [READ, BASH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Read the file hello.txt"}]


@pytest.fixture(scope="module")
def tiny_format():
    return ReplyFormat.for_tokenizer(load(Path(TINY_MODEL)))


def feed_in_pieces(parser: ReplyParser, text: str, size: int):
    events = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i:i + size])
    return events + parser.finish()


# --- the parser, on real text -------------------------------------------------------------------------


def test_tiny_fixture_format_is_mlx_lms_inference(tiny_format):
    """The Qwen3-style template names `<tool_call>` and `tool_call.name`: mlx-lm infers json_tools."""
    assert tiny_format.tool_parser_name == "json_tools" and not tiny_format.fallback
    assert (tiny_format.think_start, tiny_format.think_end) == ("<think>", "</think>")


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_parser_separates_reasoning_text_and_calls_however_the_text_is_cut(tiny_format, size):
    text = ('<think>\nThe user wants a file.\n</think>\n\nReading it.<tool_call>\n{"name": "Read", "arguments": '
            '{"file_path": "hello.txt"}}\n</tool_call>\n<tool_call>\n{"name": "Bash", "arguments": '
            '{"command": "ls", "timeout": 5}}\n</tool_call>')
    events = feed_in_pieces(ReplyParser(tiny_format, tools=TOOLS), text, size)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    args = {}
    for e in events:
        if isinstance(e, ToolCallArgsDelta):
            args[e.index] = args.get(e.index, "") + e.text
    assert reasoning == "\nThe user wants a file.\n"
    assert content.strip() == "Reading it."
    assert [(s.index, s.name) for s in starts] == [(0, "Read"), (1, "Bash")]
    assert len({s.call_id for s in starts}) == 2
    assert json.loads(args[0]) == {"file_path": "hello.txt"} and json.loads(args[1]) == {"command": "ls", "timeout": 5}


def test_parser_holds_back_a_partial_marker(tiny_format):
    parser = ReplyParser(tiny_format, tools=TOOLS)
    assert parser.feed("Hello <tool") == [ContentDelta("Hello ")]  # "<tool" may start a call
    assert parser.feed("s are fun") == [ContentDelta("<tools are fun")]


@pytest.mark.parametrize("size", [1, 2, 5])
def test_forced_call_arguments_stream_as_written(tiny_format, size):
    """A grammar-forced call starts once its name is out; the arguments follow in pieces, never with the
    call object's own closing brace."""
    text = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "a}b.txt", "n": {"x": 1}}}\n</tool_call>'
    parser = ReplyParser(tiny_format, tools=TOOLS, stream_arguments=True)
    events = []
    for i in range(0, len(text), size):
        new = parser.feed(text[i:i + size])
        if any(isinstance(e, ToolCallStart) for e in new):
            assert '"arguments"' in text[:i + size] and "</tool_call>" not in text[:i + size]
        events += new
    events += parser.finish()
    args = [e.text for e in events if isinstance(e, ToolCallArgsDelta)]
    assert len(args) > 3 and json.loads("".join(args)) == {"file_path": "a}b.txt", "n": {"x": 1}}
    assert "".join(args).startswith("{"), "the space after 'arguments:' is not part of the arguments"
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["Read"] and parser.num_calls == 1


def test_unparseable_call_text_comes_back_as_text(tiny_format):
    parser = ReplyParser(tiny_format, tools=TOOLS)
    events = feed_in_pieces(parser, "<tool_call>\n{not json\n</tool_call>", 4)
    assert "".join(e.text for e in events) == "<tool_call>\n{not json\n</tool_call>"
    assert not parser.made_tool_call


def test_no_tools_or_tool_choice_none_leaves_markers_as_text(tiny_format):
    text = '<tool_call>\n{"name": "Read", "arguments": {}}\n</tool_call>'
    events = feed_in_pieces(ReplyParser(tiny_format, tools=TOOLS, parse_tools=False), text, 5)
    assert all(isinstance(e, ContentDelta) for e in events) and "".join(e.text for e in events) == text


def test_output_that_starts_inside_an_open_think_block(tiny_format):
    prompt = "<|im_start|>assistant\n<think>\n"
    assert tiny_format.opens_reasoning(prompt)
    events = feed_in_pieces(ReplyParser(tiny_format, reasoning=True), "hmm</think>\n\nhi", 2)
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "hmm"
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "\n\nhi"


def test_tokenizer_without_tool_format_falls_back_to_hermes():
    class Plain:  # what a TokenizerWrapper says for a template with no tool markers (SmolLM2)
        has_tool_calling = False
        has_thinking = False

    fmt = ReplyFormat.for_tokenizer(Plain())
    assert fmt.fallback and fmt.tool_parser_name == "json_tools" and fmt.tool_call_start == "<tool_call>"


# --- end to end: real model, real server, the official client -----------------------------------------


def _validate(call):
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "Bash"}}])
def test_forced_call_is_schema_valid_whole(openai_client, engine_server, tool_choice):
    reply = openai_client.chat.completions.create(
        model="default", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(tool_choice, dict):
        assert call.function.name == "Bash"
    _validate(call)
    (row,) = rows(engine_server[1])
    assert json.loads(row["tool_calls"])[0]["function"] == call.function.model_dump()
    assert row["finish_reason"] == "tool_calls"


def test_forced_call_streams_as_delta_tool_calls(openai_client, engine_server):
    stream = openai_client.chat.completions.create(
        model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0.8,
        seed=7, stream=True, stream_options={"include_usage": True})
    deltas, finish, calls = [], None, {}
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                deltas.append(tc)
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                slot["name"] += (tc.function.name or "") if tc.function else ""
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert finish == "tool_calls"
    assert deltas[0].id and deltas[0].function.name, "the first delta names the call"
    assert sum(1 for d in deltas if d.function and d.function.arguments) > 1, "arguments stream in increments"
    (call,) = calls.values()
    assert call["arguments"].startswith("{")
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    (row,) = rows(engine_server[1])
    recorded = json.loads(row["tool_calls"])
    assert recorded == [{"id": call["id"], "type": "function",
                         "function": {"name": call["name"], "arguments": call["arguments"]}}]


def test_forced_calls_in_one_batch_each_keep_their_grammar(tiny_engine, tmp_path):
    """Rows of a batch each have their own grammar or none: four concurrent requests, three forced
    (different tools), one free, all decoded together."""
    import asyncio

    from openai import AsyncOpenAI

    from proxy.app import create_app
    from proxy.engine_backend import EngineBackend
    from recorder.store import Recorder
    from tests.conftest import running_server

    async def go(url):
        client = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        asks = [{"type": "function", "function": {"name": "Read"}}, {"type": "function", "function": {"name": "Bash"}},
                "required", "auto"]
        return await asyncio.gather(*[client.chat.completions.create(
            model="default", messages=MESSAGES, tools=TOOLS, tool_choice=tc, max_tokens=60, temperature=1.0, seed=i)
            for i, tc in enumerate(asks)])

    with Recorder(tmp_path / "t.db") as rec, running_server(create_app(EngineBackend(tiny_engine), rec)) as url:
        replies = asyncio.run(go(url))
    assert tiny_engine.stats["peak_batch"] >= 2
    for reply, name in zip(replies[:2], ["Read", "Bash"]):
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == name
        _validate(call)
    (call,) = replies[2].choices[0].message.tool_calls
    _validate(call)
    assert replies[3].choices[0].finish_reason in ("stop", "length")


def test_tool_choice_naming_an_unknown_tool_is_a_400(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError, match="Nope"):
        openai_client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=5,
                                              tool_choice={"type": "function", "function": {"name": "Nope"}})


def test_tool_choice_required_without_tools_is_a_400(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError, match="at least one tool"):
        openai_client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=5, tool_choice="required")


def test_free_reply_has_no_tool_calls(openai_client):
    reply = openai_client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                                  temperature=0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"


# --- Anthropic Messages: tool_use blocks --------------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def _anthropic(url):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=url, api_key="sk-ant-test-0123456789abcdef", max_retries=0, timeout=60)


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "Read"}])
def test_messages_forced_tool_use_whole(engine_server, tool_choice):
    url, recorder = engine_server
    message = _anthropic(url).messages.create(model="default", max_tokens=120, messages=MESSAGES,
                                              tools=ANTHROPIC_TOOLS, tool_choice=tool_choice,
                                              extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].id.startswith("call_")
    if tool_choice["type"] == "tool":
        assert uses[0].name == "Read"
    jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    (row,) = rows(recorder)
    (recorded,) = json.loads(row["tool_calls"])
    assert recorded["id"] == uses[0].id and recorded["function"]["name"] == uses[0].name
    assert json.loads(recorded["function"]["arguments"]) == uses[0].input


def test_messages_forced_tool_use_streams_input_json_delta(engine_server):
    url, recorder = engine_server
    kinds = []
    with _anthropic(url).messages.stream(model="default", max_tokens=120, messages=MESSAGES, tools=ANTHROPIC_TOOLS,
                                         tool_choice={"type": "any"}, extra_body={"temperature": 0}) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                kinds.append(event.delta.type)
            elif event.type == "content_block_start":
                kinds.append("start:" + event.content_block.type)
        message = stream.get_final_message()
    assert message.stop_reason == "tool_use"
    assert "start:tool_use" in kinds and "input_json_delta" in kinds
    (use,) = [b for b in message.content if b.type == "tool_use"]
    jsonschema.validate(use.input, SCHEMAS[use.name])
    (row,) = rows(recorder)
    (recorded,) = json.loads(row["tool_calls"])
    assert recorded["id"] == use.id and json.loads(recorded["function"]["arguments"]) == use.input


def test_messages_tool_result_round_trip_renders_and_answers(engine_server):
    """A full loop: the forced call goes back as tool_use + tool_result, the next turn answers freely."""
    url, _ = engine_server
    client = _anthropic(url)
    first = client.messages.create(model="default", max_tokens=120, messages=MESSAGES, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "any"}, extra_body={"temperature": 0})
    (use,) = [b for b in first.content if b.type == "tool_use"]
    second = client.messages.create(
        model="default", max_tokens=8, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0},
        messages=MESSAGES + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                           "content": "hello"}]}])
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.usage.cache_read_input_tokens > 0  # the first turn's prompt is the second's prefix


# --- another family: Qwen3-Coder's XML calls ---------------------------------------------------------------

CODER_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if tools %}<|im_start|>system\nCall tools as <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n"
    "</parameter>\n</function>\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(scope="module")
def coder_model(tmp_path_factory):
    """The tiny model with a template in Qwen3-Coder's tool format (mlx-lm infers qwen3_coder from it)."""
    import shutil

    target = tmp_path_factory.mktemp("coder") / "tiny-coder"
    shutil.copytree(TINY_MODEL, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = CODER_TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def test_qwen3_coder_calls_are_read_by_mlx_lms_parser(coder_model):
    fmt = ReplyFormat.for_tokenizer(load(coder_model))
    assert fmt.tool_parser_name == "qwen3_coder"
    text = ("Let me look.\n<tool_call>\n<function=Bash>\n<parameter=command>\nls -la\n</parameter>\n"
            "<parameter=timeout>\n5\n</parameter>\n</function>\n</tool_call>")
    events = feed_in_pieces(ReplyParser(fmt, tools=TOOLS), text, 4)
    (start,) = [e for e in events if isinstance(e, ToolCallStart)]
    args = "".join(e.text for e in events if isinstance(e, ToolCallArgsDelta))
    assert start.name == "Bash" and json.loads(args) == {"command": "ls -la", "timeout": 5}  # typed from the tool
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)).strip() == "Let me look."


def test_forced_call_on_another_family_is_written_and_read_as_hermes(coder_model, tmp_path):
    from openai import OpenAI

    from engine.engine import Engine
    from proxy.app import create_app
    from proxy.engine_backend import EngineBackend
    from recorder.store import Recorder
    from tests.conftest import running_server

    engine = Engine(coder_model, name="tiny-coder", dtype="float32").start()
    engine.wait_ready(60)
    try:
        with Recorder(tmp_path / "t.db") as rec, running_server(create_app(EngineBackend(engine), rec)) as url:
            client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            reply = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS,
                                                   tool_choice="required", max_tokens=120, temperature=0)
    finally:
        engine.shutdown()
    (call,) = reply.choices[0].message.tool_calls
    _validate(call)


def test_tool_choice_none_keeps_the_tools_in_the_prompt(openai_client):
    """"none" suppresses calls, not the tools: the rendered prefix stays the one the loop's other turns
    share (the prefix cache keeps hitting)."""
    def prompt_tokens(**extra):
        return openai_client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=1,
                                                     temperature=0, **extra).usage.prompt_tokens

    with_tools = prompt_tokens(tools=TOOLS)
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == with_tools > prompt_tokens()
