"""What is recorded is what the client saw: for every API × stream mode × backend (the embedded engine,
and --upstream in front of a second real engine server), the turn read back from SQLite through the
recorder equals the official client's own parsed view of its reply — text, reasoning, tool calls
(ids, names, arguments), how it ended and its token counts.

The tiny fixture model calls a tool only when `tool_choice` forces one (the grammar makes the call
valid, the model's random logits choose inside it): that is how each API's tool-call path is run.
"""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from proxy.upstream_backend import UpstreamBackend
from recorder import load_turns
from recorder.store import Recorder
from tests.conftest import running_server

anthropic = pytest.importorskip("anthropic")

# Bounded arguments: a random model inside an unbounded string could write until max_tokens.
PARAMS = {"type": "object", "properties": {"command": {"type": "string", "enum": ["ls", "pwd", "cat a.txt"]},
                                           "timeout": {"type": "integer", "minimum": 1, "maximum": 60}},
          "required": ["command", "timeout"], "additionalProperties": False}
CHAT_TOOL = {"type": "function", "function": {"name": "Bash", "description": "Run a command", "parameters": PARAMS}}
ANTHROPIC_TOOL = {"name": "Bash", "description": "Run a command", "input_schema": PARAMS}
RESPONSES_TOOL = {"type": "function", "name": "Bash", "description": "Run a command", "parameters": PARAMS}
PROMPT = "List the files in this directory."
ANTHROPIC_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}


def max_tokens(tools: bool) -> int:
    return 120 if tools else 12  # a forced call needs room for its JSON (the tiny tokenizer's pieces are short)


def view(text="", reasoning="", calls=(), finish=None, prompt=None, cached=None, completion=None) -> dict:
    return {"text": text, "reasoning": reasoning, "calls": list(calls), "finish": finish,
            "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion}


# --- each client's own view of its reply --------------------------------------------------------------


def chat_view(url: str, stream: bool, tools: bool) -> dict:
    c = OpenAI(base_url=url + "/v1", api_key="sk-test-0123456789abcdef", max_retries=0, timeout=120)
    kwargs = dict(model="default", messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens(tools),
                  temperature=0)
    if tools:
        kwargs.update(tools=[CHAT_TOOL], tool_choice="required")
    if stream:  # the SDK's own accumulator (its stream() helper refuses a reply cut by max_tokens)
        state = ChatCompletionStreamState()
        for chunk in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
            state.handle_chunk(chunk)
        r = state.current_completion_snapshot
    else:
        r = c.chat.completions.create(**kwargs)
    message, usage = r.choices[0].message, r.usage
    calls = [(t.id, t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or []]
    return view(message.content or "", (message.model_extra or {}).get("reasoning_content") or "", calls,
                r.choices[0].finish_reason, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                usage.completion_tokens)


def messages_view(url: str, stream: bool, tools: bool) -> dict:
    c = anthropic.Anthropic(base_url=url, api_key="sk-ant-test-0123456789abcdef", max_retries=0, timeout=120)
    kwargs = dict(model="default", max_tokens=max_tokens(tools), messages=[{"role": "user", "content": PROMPT}],
                  extra_body={"temperature": 0})
    if tools:
        kwargs.update(tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"})
    if stream:
        with c.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = c.messages.create(**kwargs)
    text = "".join(b.text for b in m.content if b.type == "text")
    reasoning = "".join(b.thinking for b in m.content if b.type == "thinking")
    calls = [(b.id, b.name, b.input) for b in m.content if b.type == "tool_use"]
    u = m.usage
    return view(text, reasoning, calls, ANTHROPIC_FINISH[m.stop_reason],
                u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0),
                u.cache_read_input_tokens, u.output_tokens)


def responses_view(url: str, stream: bool, tools: bool) -> dict:
    c = OpenAI(base_url=url + "/v1", api_key="sk-test-0123456789abcdef", max_retries=0, timeout=120)
    kwargs = dict(model="default", input=PROMPT, max_output_tokens=max_tokens(tools), temperature=0, store=False)
    if tools:
        kwargs.update(tools=[RESPONSES_TOOL], tool_choice="required")
    if stream:
        with c.responses.stream(**kwargs) as s:
            r = s.get_final_response()
    else:
        r = c.responses.create(**kwargs)
    calls = [(i.call_id, i.name, json.loads(i.arguments)) for i in r.output if i.type == "function_call"]
    reasoning = "".join(p.text for i in r.output if i.type == "reasoning" for p in i.content or [])
    finish = "tool_calls" if calls else ("length" if r.status == "incomplete" else "stop")
    u = r.usage
    return view(r.output_text, reasoning, calls, finish, u.input_tokens, u.input_tokens_details.cached_tokens,
                u.output_tokens)


def completions_view(url: str, stream: bool, tools: bool) -> dict:
    c = OpenAI(base_url=url + "/v1", api_key="sk-test-0123456789abcdef", max_retries=0, timeout=120)
    kwargs = dict(model="default", prompt=PROMPT, max_tokens=12, temperature=0)
    if stream:
        chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason][-1]
        usage = chunks[-1].usage
    else:
        r = c.completions.create(**kwargs)
        text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
    return view(text, "", [], finish, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                usage.completion_tokens)


VIEWS = {"chat": chat_view, "messages": messages_view, "responses": responses_view,
         "completions": completions_view}
ENDPOINTS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses",
             "completions": "/v1/completions"}


def recorded_view(turn) -> dict:
    calls = [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in turn.tool_calls or []]
    return view(turn.response_text, turn.reasoning_text, calls, turn.finish_reason, turn.prompt_tokens,
                turn.cached_tokens, turn.completion_tokens)


@pytest.fixture(params=["engine", "upstream"])
def served(request, tiny_engine, tmp_path):
    """(base URL the client uses, the recorder of the proxy it talks to)."""
    with Recorder(tmp_path / "front.db") as front:
        if request.param == "engine":
            with running_server(create_app(EngineBackend(tiny_engine), front)) as url:
                yield url, front
        else:
            with Recorder(tmp_path / "back.db") as back, \
                    running_server(create_app(EngineBackend(tiny_engine), back)) as url_b, \
                    running_server(create_app(UpstreamBackend(url_b), front)) as url_a:
                yield url_a, front


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", list(VIEWS))
def test_the_recorded_turn_is_what_the_client_saw(served, api, stream):
    url, recorder = served
    seen = [VIEWS[api](url, stream, tools=False)]
    if api != "completions":  # legacy completions have no tools
        seen.append(VIEWS[api](url, stream, tools=True))
        assert seen[1]["calls"] and seen[1]["finish"] == "tool_calls"  # the forced call really came back
    recorder.flush()
    turns = load_turns(recorder.path)
    assert [(t.endpoint, t.status, t.stream) for t in turns] == [(ENDPOINTS[api], 200, stream)] * len(seen)
    assert [recorded_view(t) for t in turns] == seen
