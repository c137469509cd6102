"""Every protocol's body read as one internal request: the chat-completions body each adapter hands the
engine (proxy/anthropic.py: `messages.to_chat_body`; proxy/responses.py: `responses.to_chat_body`;
proxy/completions.py: `completions.prompt_of`; chat completions as sent)."""

from __future__ import annotations

import pytest

from prefixtrace.common.errors import InvalidRequest
from proxy.chat_request import parse_chat_request
from prefixtrace.wire import completions, messages, responses
from prefixtrace.wire.request import protocol_of

def engine_chat(endpoint: str, body) -> dict:
    """The chat body the engine renders for `body` sent to `endpoint`, as its adapter builds it."""
    protocol = protocol_of(endpoint)
    chat = {"messages": messages.to_chat_body, "responses": responses.to_chat_body}.get(protocol, lambda b: b)(body)
    return parse_chat_request(chat, {}).body


def system_of(chat: dict) -> str:
    return "\n\n".join(m["content"] for m in chat["messages"] if m["role"] == "system")


TOOL_CHAT = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}


def test_the_three_chat_protocols_meet_in_one_shape():
    chat = engine_chat("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a b"}], "tools": [TOOL_CHAT]})
    via_messages = engine_chat("/v1/messages?beta=true", {"system": [{"type": "text", "text": "S"}], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "ls", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "a b"}]}],
        "tools": [{"name": "ls", "input_schema": {"type": "object"}}]})
    via_responses = engine_chat("/v1/responses", {"instructions": "S", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a b"}],
        "tools": [{"type": "function", "name": "ls", "parameters": {"type": "object"}}]})
    assert chat["messages"] == via_messages["messages"] == via_responses["messages"]
    assert chat["tools"] == via_messages["tools"] == via_responses["tools"] == [TOOL_CHAT]
    assert system_of(chat) == system_of(via_messages) == system_of(via_responses) == "S"


def test_responses_input_string_reasoning_items_and_hosted_tools():
    r = engine_chat("/v1/responses", {"input": "hello", "tools": [{"type": "web_search"}]})
    assert r["messages"] == [{"role": "user", "content": "hello"}] and r.get("tools") is None
    r = engine_chat("/v1/responses", {"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "d", "name": "g", "arguments": "{}"}]})
    assistant = r["messages"][1]
    assert assistant["reasoning_content"] == "think"
    assert [c["id"] for c in assistant["tool_calls"]] == ["c", "d"]  # one assistant turn, two calls


def test_messages_system_inside_messages_stays_a_system_message():
    r = engine_chat("/v1/messages", {"messages": [{"role": "system", "content": "mid"},
                                                 {"role": "user", "content": "hi"}]})
    assert r["messages"][0] == {"role": "system", "content": "mid"}


def test_completions_keep_the_raw_prompt_and_bad_bodies_are_invalid():
    assert completions.prompt_of({"prompt": ["once upon"]}) == "once upon"
    with pytest.raises(InvalidRequest):
        completions.prompt_of({"prompt": [1, 2]})
    assert protocol_of("/v1/messages/count_tokens") == "messages"
    for endpoint, body in [("/v1/responses", {"input": 5}), ("/v1/chat/completions", {}),
                           ("/v1/messages", {"messages": "text"})]:
        with pytest.raises(InvalidRequest):
            engine_chat(endpoint, body)


def test_the_analyzers_reading_is_the_engines_for_every_protocol():
    """prefixtrace.wire.normalize (lenient, for analysis) renders what the adapters (strict) hand the engine:
    same messages, same tools, key order included."""
    from prefixtrace.wire.normalize import ChatNormalizer

    bodies = {
        "/v1/responses": {"instructions": "You are Codex.", "tools": [
            {"type": "function", "name": "exec_command", "description": "Run", "strict": False,
             "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
            {"type": "namespace", "name": "multi_agent_v1", "tools": []}, {"type": "web_search"}],
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
                      {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
                      {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd":"ls"}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}]},
        "/v1/messages": {"system": [{"type": "text", "text": "S"}], "thinking": {"type": "adaptive"},
                         "tools": [{"name": "Read", "description": "Read", "input_schema": {"type": "object"}}],
                         "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "agents"},
                                      {"role": "assistant", "content": [
                                          {"type": "thinking", "thinking": "t", "signature": ""},
                                          {"type": "tool_use", "id": "t1", "name": "Read", "input": {"p": 1}}]},
                                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                                    "content": "x"}]}]},
    }
    keys = ("role", "content", "tool_calls", "tool_call_id", "reasoning_content")
    for endpoint, body in bodies.items():
        engine, analyzer = engine_chat(endpoint, body), ChatNormalizer().to_chat(body, endpoint)
        assert [[m.get(k) for k in keys] for m in analyzer["messages"]] == \
            [[m.get(k) for k in keys] for m in engine["messages"]], endpoint
        assert [list(t["function"]) for t in analyzer["tools"]] == [list(t["function"]) for t in engine["tools"]]
        assert analyzer["tools"] == engine["tools"], endpoint
        assert analyzer.get("chat_template_kwargs") == engine.get("chat_template_kwargs")
