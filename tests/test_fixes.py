"""The fix library (analyzer/fixes, docs/FIXES.md): each fix on the protocols it serves, what it keeps,
and when it stands aside."""

from __future__ import annotations

import copy
import json

import pytest

from analyzer.fixes import FIXES, SessionRecord, apply_fixes, parse_fix_names
from analyzer.fixes.breakpoints import count_breakpoints
from analyzer.fixes.sessions import FixSessions
from prefixtrace.common.errors import InvalidRequest

SYSTEM = "You are a coding agent. Current time: 2026-12-04 22:{m:02d}:10 UTC. Working directory: /repo."


def chat_body(minute: int, turns: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM.format(m=minute)}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    messages.append({"role": "user", "content": f"question {turns}"})
    return {"model": "m", "messages": messages}


def test_unknown_fix_name_is_one_line_listing_the_names():
    with pytest.raises(InvalidRequest) as err:
        parse_fix_names("volatile,speedup")
    assert "'speedup'" in err.value.message and "tool-order" in err.value.message and "\n" not in err.value.message
    assert parse_fix_names(["tool-order", "volatile,tool-order"]) == ["volatile", "tool-order"]


def test_volatile_time_moves_to_the_newest_user_message_and_the_head_stops_changing():
    record = SessionRecord(session_id="s")
    sent = [apply_fixes(["volatile"], chat_body(t, t), "chat", record) for t in range(3)]
    heads = {a.body["messages"][0]["content"] for a in sent}
    assert len(heads) == 1 and "<<timestamp_1>>" in heads.pop()
    for t, applied in enumerate(sent):
        assert applied.fired and applied.entries[0]["note"].startswith("volatile timestamp moved")
        # The model still reads the current value, at the end of the newest message.
        assert applied.body["messages"][-1]["content"].endswith(f"<<timestamp_1>> = 2026-12-04 22:{t:02d}:10]")
    # Each request's history is byte for byte the previous request as sent (the prefix extends).
    for prev, nxt in zip(sent, sent[1:]):
        assert nxt.body["messages"][:len(prev.body["messages"])] == prev.body["messages"]


def test_volatile_learns_a_ticking_counter_from_the_previous_request_and_keeps_moving_it():
    record = SessionRecord()
    body = lambda n: {"messages": [{"role": "system", "content": f"Tokens left: {n}. Rules."},
                                   {"role": "user", "content": "go"}]}
    first = apply_fixes(["volatile"], body(900), "chat", record)
    assert not first.fired and first.body["messages"][0]["content"] == "Tokens left: 900. Rules."
    second = apply_fixes(["volatile"], body(850), "chat", record)
    third = apply_fixes(["volatile"], body(850), "chat", record)  # unchanged now, still moved: no flip back
    assert second.body["messages"][0] == third.body["messages"][0] == {"role": "system",
                                                                       "content": "Tokens left: <<counter_1>>. Rules."}
    assert third.body["messages"][-1]["content"].endswith("<<counter_1>> = 850]")


def test_volatile_on_messages_and_responses_and_standing_aside_on_legacy_completions():
    record = SessionRecord()
    body = {"system": [{"type": "text", "text": "Now: 2026-01-02T10:11:12Z"}],
            "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]}
    applied = apply_fixes(["volatile"], body, "messages", record)
    assert applied.body["system"][0]["text"] == "Now: <<timestamp_1>>"
    assert applied.body["messages"][0]["content"][-1] == {
        "type": "text", "text": "\n\n[Current values of the placeholders above: <<timestamp_1>> = 2026-01-02T10:11:12Z]"}
    assert body["system"][0]["text"] == "Now: 2026-01-02T10:11:12Z"  # the client's body is never changed
    responses = {"instructions": "Time 10:11", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
    out = apply_fixes(["volatile"], responses, "responses", SessionRecord())
    assert out.body["instructions"] == "Time <<timestamp_1>>" and out.body["input"][0]["content"][-1]["type"] == "input_text"
    legacy = apply_fixes(["volatile"], {"prompt": "at 10:11"}, "completions", SessionRecord())
    assert not legacy.fired and "legacy completion" in legacy.entries[0]["note"]


def test_tool_order_sends_the_sessions_first_order_and_spelling_only_when_needed():
    record = SessionRecord()
    a = {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}}
    b = {"type": "function", "function": {"name": "write", "parameters": {"properties": {}, "type": "object"}}}
    first = apply_fixes(["tool-order"], {"messages": [], "tools": [a, b]}, "chat", record)
    assert not first.fired
    same = apply_fixes(["tool-order"], {"messages": [], "tools": [a, b]}, "chat", record)
    assert not same.fired and "already" in same.entries[0]["note"]
    respelled_b = {"function": {"parameters": {"type": "object", "properties": {}}, "name": "write"}, "type": "function"}
    shuffled = apply_fixes(["tool-order"], {"messages": [], "tools": [respelled_b, a]}, "chat", record)
    assert json.dumps(shuffled.body["tools"]) == json.dumps([a, b])
    c = {"type": "function", "function": {"name": "exec", "parameters": {}}}
    changed_a = {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}
    grown = apply_fixes(["tool-order"], {"messages": [], "tools": [c, b, changed_a]}, "chat", record)
    assert grown.body["tools"] == [changed_a, b, c]  # new content kept, a new tool last


def test_tool_order_keeps_anthropic_breakpoints_in_place_and_stands_aside_on_duplicate_names():
    record = SessionRecord()
    x, y = {"name": "x", "input_schema": {}}, {"name": "y", "input_schema": {}}
    apply_fixes(["tool-order"], {"messages": [], "tools": [x, y]}, "messages", record)
    out = apply_fixes(["tool-order"], {"messages": [], "tools": [y, {**x, "cache_control": {"type": "ephemeral"}}]},
                      "messages", record)
    assert out.body["tools"] == [x, {**y, "cache_control": {"type": "ephemeral"}}]
    dup = apply_fixes(["tool-order"], {"messages": [], "tools": [x, x]}, "messages", record)
    assert not dup.fired and "share a name" in dup.entries[0]["note"]


def test_tool_args_restores_the_emitted_spelling_and_never_an_edited_value():
    record = SessionRecord(tool_args={"c1": '{"path": "a.py",  "line":3}', "c2": '{"x": 1}'})
    body = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path":"a.py","line":3}'}},
        {"id": "c2", "type": "function", "function": {"name": "read", "arguments": '{"x":2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "..."}]}
    out = apply_fixes(["tool-args"], body, "chat", record)
    calls = out.body["messages"][1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == '{"path": "a.py",  "line":3}'
    assert calls[1]["function"]["arguments"] == '{"x":2}'  # the client edited it: left as sent
    messages = {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "c1", "name": "read", "input": {"line": 3, "path": "a.py"}}]}]}
    fixed = apply_fixes(["tool-args"], messages, "messages", record)
    assert list(fixed.body["messages"][0]["content"][0]["input"]) == ["path", "line"]
    responses = {"input": [{"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{ "x" : 1 }'}]}
    assert apply_fixes(["tool-args"], responses, "responses", record).body["input"][0]["arguments"] == '{"x": 1}'


def test_thinking_puts_back_recorded_reasoning_only_where_the_template_keeps_it():
    sessions = FixSessions(["thinking"], template_keeps_reasoning=True)
    sessions.learn("s", "the answer", "let me think", None)
    body = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "the answer"},
                         {"role": "user", "content": "more"}]}
    out = sessions.apply("/v1/chat/completions", body, "s")
    assert out.body["messages"][1]["reasoning_content"] == "let me think"
    unknown = FixSessions(["thinking"])
    unknown.learn("s", "the answer", "let me think", None)
    assert "not known" in unknown.apply("/v1/chat/completions", body, "s").entries[0]["note"]
    drops = FixSessions(["thinking"], template_keeps_reasoning=False)
    assert not drops.apply("/v1/chat/completions", body, "s").fired


def test_breakpoints_mark_the_last_cacheable_block_and_stand_aside_for_the_clients_own():
    body = {"system": "sys", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t", "signature": "s"}, {"type": "text", "text": "hello"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "r"},
                                     {"type": "thinking", "thinking": "?"}]}]}
    out = apply_fixes(["breakpoints"], body, "messages", SessionRecord())
    assert out.body["messages"][-1]["content"][0]["cache_control"] == {"type": "ephemeral"}
    assert count_breakpoints(out.body) == 1
    own = copy.deepcopy(body)
    own["messages"][0]["content"] = [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]
    aside = apply_fixes(["breakpoints"], own, "messages", SessionRecord())
    assert not aside.fired and "its own breakpoints (1)" in aside.entries[0]["note"]
    assert not apply_fixes(["breakpoints"], {"messages": []}, "chat", SessionRecord()).fired


def test_session_key_sets_the_routing_key_where_the_client_set_none():
    record = SessionRecord(session_id="abc")
    chat = apply_fixes(["session-key"], {"messages": []}, "chat", record)
    assert chat.body["prompt_cache_key"] == "abc" and chat.headers == {"X-Dynamo-Session-ID": "abc"}
    assert apply_fixes(["session-key"], {"prompt": "x"}, "completions", record).body["user"] == "abc"
    assert apply_fixes(["session-key"], {"messages": []}, "messages", record).body["metadata"] == {"user_id": "abc"}
    own = apply_fixes(["session-key"], {"messages": [], "prompt_cache_key": "mine"}, "chat", record)
    assert not own.fired and own.body["prompt_cache_key"] == "mine"
    assert not apply_fixes(["session-key"], {"messages": []}, "chat", SessionRecord()).fired


def test_a_fix_that_raises_leaves_the_body_untouched_and_says_so(monkeypatch):
    def broken(body, protocol, record):
        raise KeyError("boom")

    monkeypatch.setitem(FIXES, "volatile", (broken, "system_rewrite"))
    body = chat_body(1, 0)
    out = apply_fixes(["volatile", "session-key"], body, "chat", SessionRecord(session_id="s"))
    assert out.entries[0]["error"] and "KeyError" in out.entries[0]["note"] and not out.entries[0]["fired"]
    assert out.body["messages"] == body["messages"] and out.body["prompt_cache_key"] == "s"


def test_no_fix_fired_returns_the_very_body_passed_in():
    body = {"messages": [{"role": "user", "content": "plain"}]}
    out = FixSessions(list(FIXES)).apply("/v1/chat/completions", body, None)
    assert out.body is body and not out.fired


def test_volatile_side_requests_of_the_session_do_not_unlearn_the_main_loop():
    record = SessionRecord(session_id="s")
    head = lambda n: f"Budget: {n} tokens. You are the main agent."
    main = lambda n, k: {"messages": [{"role": "system", "content": head(n)},
                                      *[{"role": "user", "content": f"q{i}"} for i in range(k)]]}
    side = {"messages": [{"role": "system", "content": "Write a 3 word title."}, {"role": "user", "content": "t"}]}
    apply_fixes(["volatile"], main(900, 1), "chat", record)
    second = apply_fixes(["volatile"], main(800, 2), "chat", record)
    apply_fixes(["volatile"], side, "chat", record)
    third = apply_fixes(["volatile"], main(800, 3), "chat", record)
    assert second.body["messages"][0] == third.body["messages"][0]
    assert third.body["messages"][2] == second.body["messages"][2]  # its value line kept in history

