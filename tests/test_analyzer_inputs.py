"""Issue 16, items 1-3: every real input shape is read, rendered as servers render it, and what cannot
be read is said (never a silent zero). Fixtures: real harness traffic in fixtures/traffic/ (copied from
../shared/traffic/, recorded through the proxy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from analyzer import analyze, check
from analyzer.load import load, parse_ts
from prefixtrace.cli import cli
from prefixtrace.common.errors import InvalidRequest
from prefixtrace.wire.normalize import ChatNormalizer, chat_tool, template_message

ROOT = Path(__file__).resolve().parents[1]
TRAFFIC = ROOT / "fixtures" / "traffic"
QWEN3 = ROOT / "fixtures" / "qwen3.jinja"  # byte-identical to ../shared/templates/qwen3.jinja


def _records(name):
    return [json.loads(line) for line in (TRAFFIC / name).read_text().splitlines() if line.strip()]


def _write(tmp_path, name, records):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return p


def _shape(report):
    return [(len(s.turns), [(t.brk.cause if t.brk else t.note) for t in s.turns]) for s in report.sessions]


# -- ts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    (1765233669.389, 1765233669.389), (1765233669389, 1765233669.389), ("1765233669.389", 1765233669.389),
    ("2025-12-08T22:41:09.389Z", 1765233669.389), ("2025-12-08T23:41:09.389+01:00", 1765233669.389),
    ("2025-12-08T17:41:09.389-05:00", 1765233669.389), ("2025-12-08T22:41:09.389", 1765233669.389),
    (None, None)])
def test_ts_in_every_real_shape(value, expected):
    got = parse_ts(value)
    assert got == expected if expected is None else abs(got - expected) < 1e-3


@pytest.mark.parametrize("value", ["yesterday", True, [1], float("nan")])
def test_a_ts_that_is_no_time_is_refused_with_the_value(value):
    with pytest.raises(InvalidRequest, match="ts"):
        parse_ts(value)


def test_iso_and_millisecond_ts_analyse_like_epoch_seconds(tmp_path):
    # The real pi recording was 0 sessions / exit 0 because every ts was an ISO string (issue 16).
    from datetime import datetime, timezone

    records = _records("pi_tiny.jsonl")
    base = _shape(analyze(_write(tmp_path, "a.jsonl", records), template=QWEN3))
    iso = [{**r, "ts": datetime.fromtimestamp(r["ts"], timezone.utc).isoformat().replace("+00:00", "Z")} for r in records]
    ms = [{**r, "ts": int(r["ts"] * 1000)} for r in records]
    none = [{k: v for k, v in r.items() if k != "ts"} for r in records]
    for variant in (iso, ms, none):
        report = analyze(_write(tmp_path, "b.jsonl", variant), template=QWEN3)
        assert report.skipped == [] and _shape(report) == base


def test_untimed_records_keep_their_place_among_timed_ones(tmp_path):
    records = _records("pi_tiny.jsonl")
    mixed = [r if i % 2 == 0 else {k: v for k, v in r.items() if k != "ts"} for i, r in enumerate(records)]
    loaded = load(_write(tmp_path, "m.jsonl", mixed))
    assert [r.line for r in loaded.requests] == list(range(1, len(records) + 1))
    assert [r.ts_given for r in loaded.requests] == [i % 2 == 0 for i in range(len(records))]


# -- the three APIs --------------------------------------------------------------------------


def test_claude_code_messages_traffic_is_read_with_its_session_ids():
    # Messages bodies (top-level system as blocks, tool_use / tool_result, thinking, cache_control) and
    # the session inside metadata.user_id's JSON: one session per conversation, not per device.
    report = analyze(TRAFFIC / "claude_smol.jsonl", template=QWEN3)
    assert report.skipped == []
    ids = [s.id for s in report.sessions]
    assert ids == ["e31f09b9-a57b-4fd5-9292-89334010d1fd"]
    assert all(not t.note.startswith("unrenderable") for s in report.sessions for t in s.turns)


def test_messages_translation_matches_the_proxy_engine_path():
    # What the analyzer renders for a Messages body is what the proxy hands the engine.
    from proxy.anthropic import to_chat_request

    body = _records("claude_smol.jsonl")[3]["request"]
    ours = ChatNormalizer().to_chat(body, "/v1/messages")
    req = to_chat_request({**body, "stream": False, "max_tokens": 16}, {})
    keys = ("role", "content", "tool_calls", "tool_call_id", "reasoning_content")
    assert [[m.get(k) for k in keys] for m in ours["messages"]] == [[m.get(k) for k in keys] for m in req.messages]
    assert ours["tools"] == req.tools
    assert ours.get("chat_template_kwargs") == req.chat_template_kwargs


def test_responses_bodies_are_read_and_an_extended_input_is_append_only():
    tools = [{"type": "function", "name": "read", "description": "Read a file",
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    first = {"model": "m", "instructions": "You are a coding agent.", "tools": tools,
             "input": [{"role": "user", "content": [{"type": "input_text", "text": "fix the bug"}]}]}
    items = [*first["input"],
             {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "read it first"}]},
             {"type": "function_call", "call_id": "call_1", "name": "read", "arguments": '{"path": "a.py"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "def a(): pass"}]
    second = {**first, "input": items}
    third = {**first, "input": [*items, {"type": "message", "role": "assistant",
                                         "content": [{"type": "output_text", "text": "Fixed."}]},
                                {"role": "user", "content": "thanks"}]}
    chat = ChatNormalizer().to_chat(second, "/v1/responses")
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert chat["messages"][2]["tool_calls"][0]["function"] == {"name": "read", "arguments": '{"path": "a.py"}'}
    assert chat["messages"][2]["reasoning_content"] == "read it first"
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "read", "description": "Read a file", "parameters": tools[0]["parameters"]}}]
    from analyzer.load import Request

    report = analyze([Request(f"r{i}", float(i), b, "s", endpoint="/v1/responses")
                      for i, b in enumerate([first, second, third])], template=QWEN3)
    turns = report.sessions[0].turns
    assert turns[1].brk is None  # function_call + output appended: the prompt extends
    # A new user query: Qwen3's template drops the reasoning of the loop before it, as for chat bodies.
    assert (turns[2].brk.cause, turns[2].brk.subtype, turns[2].brk.message_index) == ("thinking_strip", "template", 2)


def test_the_three_tool_shapes_compare_equal():
    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    openai = {"type": "function", "function": {"name": "read", "description": "Read", "parameters": schema}}
    anthropic = {"name": "read", "description": "Read", "input_schema": schema}
    responses = {"type": "function", "name": "read", "description": "Read", "parameters": schema}
    assert chat_tool(anthropic) == chat_tool(responses) == chat_tool(openai) == openai


def test_plain_bodies_envelopes_and_har_are_read(tmp_path):
    records = _records("pi_tiny.jsonl")
    base = _shape(analyze(_write(tmp_path, "a.jsonl", records), template=QWEN3))
    plain = _write(tmp_path, "plain.jsonl", [r["request"] for r in records])
    envelope = _write(tmp_path, "env.jsonl", [{"request": r["request"], "endpoint": r["endpoint"]} for r in records])
    http = _write(tmp_path, "http.jsonl", [{"request": {"method": "POST", "url": "http://h" + r["endpoint"],
                                                        "body": json.dumps(r["request"])},
                                            "timestamp": r["ts"]} for r in records])
    for src in (plain, envelope, http):
        report = analyze(src, template=QWEN3)
        assert report.skipped == [] and _shape(report) == base, src.name
    from recorder.har import write_har
    from recorder.jsonl import record_to_turn

    har = tmp_path / "traffic.har"
    with open(har, "w") as fh:
        write_har(iter([record_to_turn(r) for r in records]), fh)
    report = analyze(har, template=QWEN3)
    assert report.skipped == [] and _shape(report) == base


def test_what_cannot_be_read_is_reported_per_line_with_the_reason(tmp_path):
    records = _records("pi_tiny.jsonl")
    lines = [json.dumps(records[0]), "{not json", json.dumps({"request": {"prompt": "completions"}}),
             json.dumps({**records[1], "ts": "last tuesday"}), json.dumps(records[2])]
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    report = analyze(src, template=QWEN3)
    assert [s["line"] for s in report.skipped] == [2, 3, 4]
    reasons = [s["error"] for s in report.skipped]
    assert "not valid JSON" in reasons[0] and '"messages"' in reasons[1] and "last tuesday" in reasons[2]


# -- render as servers render ------------------------------------------------------------------


def test_null_content_tool_calls_render_with_the_real_qwen3_template(tmp_path):
    # The real pi sessions: assistant tool-call messages with content null, and Qwen3's template doing
    # `'</think>' in message.content` -> every turn was unrenderable (issue 16).
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "print(1)"}
    sysm, task = {"role": "system", "content": "sys"}, {"role": "user", "content": "go"}
    bodies = [{"messages": [sysm, task]}, {"messages": [sysm, task, call, result]},
              {"messages": [sysm, task, call, result, {"role": "assistant", "content": "done"}, task]}]
    src = _write(tmp_path, "null.jsonl", [{"session": "s", "ts": i, "request": b} for i, b in enumerate(bodies)])
    report = analyze(src, template=QWEN3)
    assert [t.note for t in report.sessions[0].turns] == ["first", "", ""]
    assert all(t.brk is None for t in report.sessions[0].turns)


def test_template_message_is_what_servers_hand_the_template():
    msg = {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert template_message(msg) == {"role": "system", "content": "ab"}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}]}
    assert template_message(call)["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert template_message(call)["content"] == ""
    assert template_message({"role": "assistant", "content": "x", "tool_calls": []}) == {"role": "assistant", "content": "x"}
    plain = {"role": "user", "content": "hi"}
    assert template_message(plain) is plain  # identity kept: the analyzer's caches depend on it


def test_the_engine_applies_the_same_normalisation():
    from engine.chat_render import normalize_messages

    msgs = [{"role": "developer", "content": "rules"}, {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}]}]
    assert normalize_messages(msgs) == [template_message(m) for m in msgs]


def test_a_template_error_names_the_message_index(tmp_path):
    bodies = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                            {"role": "system", "content": "late"}]}]
    report = analyze([{**b} for b in bodies], template=ROOT / "fixtures" / "templates" / "qwen35_style.jinja")
    note = report.sessions[0].turns[0].note
    assert note.startswith("unrenderable") and "(at message 2, system)" in note


# -- never a silent zero ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["text", "json", "html"])
def test_unread_input_is_said_at_the_top_of_every_format_and_exits_non_zero(tmp_path, fmt):
    records = _records("pi_tiny.jsonl")
    src = tmp_path / "part.jsonl"
    src.write_text(json.dumps(records[0]) + "\n{broken\n" + json.dumps(records[1]) + "\n")
    out = tmp_path / f"r.{fmt}"
    result = CliRunner().invoke(cli, ["analyze", str(src), "--format", fmt, "--out", str(out)])
    assert result.exit_code == 1, result.output
    text = out.read_text()
    if fmt == "json":
        d = json.loads(text)
        assert list(d)[:3] == ["version", "warnings", "coverage"]
        assert d["coverage"]["skipped_lines"] == 1 and d["coverage"]["input"] == 3 and d["warnings"]
    elif fmt == "text":
        assert text.startswith("WARNING: 1 of 3 requests not analysed")
    else:
        assert text.index("1 of 3 requests not analysed") < text.index("<h1>")
    ok = CliRunner().invoke(cli, ["analyze", str(src), "--format", fmt, "--out", str(out), "--max-unreadable", "1"])
    assert ok.exit_code == 0, ok.output


def test_analyze_and_check_of_an_empty_or_unreadable_file_exit_non_zero(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for cmd in ("analyze", "check"):
        result = CliRunner().invoke(cli, [cmd, str(empty)])
        assert result.exit_code == 1, (cmd, result.output)
    assert not check(empty).ok


def test_unrenderable_turns_count_against_the_threshold(tmp_path):
    bodies = [{"messages": [{"role": "user", "content": "a"}]},
              {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]}]
    src = _write(tmp_path, "u.jsonl", [{"session": "s", "ts": i, "request": b} for i, b in enumerate(bodies)])
    tpl = str(ROOT / "fixtures" / "templates" / "qwen35_style.jinja")
    result = CliRunner().invoke(cli, ["analyze", str(src), "--template", tpl])
    assert result.exit_code == 1 and "1 turn could not be rendered" in result.output


def test_interleaved_sessions_without_ids_reuse_their_own_parsed_history():
    # Two sessions of one harness, no ids, lines alternating: each line must reuse its own session's
    # parsed messages (same objects), not re-parse the whole history because the line before it was
    # the other session's (the loader's fast path on real multi-session recordings).
    from analyzer.load import IncrementalParser

    system = {"role": "system", "content": "S" * 2000}
    a = [system, {"role": "user", "content": "task A " * 50}]
    b = [system, {"role": "user", "content": "task B " * 50}]
    parser = IncrementalParser()
    lines = []
    for turn in range(4):
        a = [*a, {"role": "assistant", "content": f"a{turn}"}]
        b = [*b, {"role": "assistant", "content": f"b{turn}"}]
        lines += [json.dumps({"request": {"messages": a}}), json.dumps({"request": {"messages": b}})]
    parsed = [parser.loads(line)["request"]["messages"] for line in lines]
    for earlier, later in zip(parsed, parsed[2:]):  # the same session, one turn apart
        assert all(x is y for x, y in zip(earlier, later[: len(earlier)]))
    assert parsed[0] == [json.loads(lines[0])["request"]["messages"]][0]
