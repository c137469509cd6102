"""Analyzer edge cases found by a bug hunt: offsets at exact boundaries, non-ASCII near the break,
payload changes the template does not render, and `check` on inputs it cannot read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from analyzer import analyze, check
from analyzer.divergence import common_prefix_len
from analyzer.load import Request
from analyzer.render import GenericRenderer, TemplateRenderer
from prefixtrace.cli import cli

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "fixtures" / "templates"
SYS = {"role": "system", "content": "You are a coding agent."}
TASK = {"role": "user", "content": "Fix the bug"}


def _session(bodies, **kw):
    """One explicit session, in order."""
    return analyze([Request(f"r{i}", float(i), b, "s") for i, b in enumerate(bodies)], **kw).sessions[0].turns


def _call(i, args='{"path": "a.py"}'):
    return {"role": "assistant", "content": "", "reasoning_content": f"thinking {i}",
            "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": args}}]}


def _result(i, content=None):
    return {"role": "tool", "tool_call_id": f"c{i}", "content": content or f"output {i} " * 20}


@pytest.mark.parametrize("tail_a, tail_b", [
    ("héllo 😀😀 wörld 中文a", "héllo 😀😀 wörld 中文b"),      # emoji / CJK right before the break
    ("cafe\u0301 x", "caf\u00e9 x"),                              # combining accent vs precomposed
    ("中文😀", "中文😁"),                                          # the break inside an astral character
])
def test_non_ascii_break_offsets_match_the_plain_text(tail_a, tail_b):
    from analyzer.tokens import default_tokenizer

    tok = default_tokenizer()
    a = {"messages": [SYS, {"role": "user", "content": tail_a}]}
    b = {"messages": [SYS, {"role": "user", "content": tail_b}, {"role": "assistant", "content": "ok"}]}
    turn = _session([a, b])[1]
    ta, tb = GenericRenderer().render(a).text, GenericRenderer().render(b).text
    assert turn.brk.message_index == 1 and turn.brk.role == "user"
    assert turn.brk.char_offset == common_prefix_len(ta, tb)
    assert turn.brk.token_offset == turn.common_prefix_tokens == common_prefix_len(tok(ta), tok(tb))
    assert turn.prompt_tokens == len(tok(tb)) and turn.reprefill_tokens == turn.prompt_tokens - turn.common_prefix_tokens


def test_identical_request_and_pure_truncation_cost_nothing():
    a = {"messages": [SYS, TASK, {"role": "assistant", "content": "ok"}]}
    same, cut = _session([a, a, {"messages": [SYS, TASK]}])[1:]
    assert same.brk is None and same.reprefill_tokens == 0
    text = GenericRenderer().render({"messages": [SYS, TASK]}).text
    assert cut.brk.char_offset == len(text) and cut.brk.message_index == 2 and cut.brk.role == "assistant"
    assert cut.reprefill_tokens == 0 and cut.common_prefix_tokens == cut.prompt_tokens


def test_unrendered_reasoning_strip_does_not_hide_a_later_truncation():
    # qwen3-style templates drop reasoning before the last user query, so stripping it from message 2 changes
    # nothing in the prompt; the real break is the truncated tool output of message 6.
    prev = [SYS, TASK, _call(1), _result(1), {"role": "user", "content": "next"}, _call(2), _result(2),
            {"role": "user", "content": "more"}]
    nxt = list(prev)
    nxt[2] = {k: v for k, v in prev[2].items() if k != "reasoning_content"}
    nxt[6] = _result(2, "[truncated]")
    turn = _session([{"messages": prev}, {"messages": nxt}],
                    renderer=TemplateRenderer.from_file(TEMPLATES / "qwen3_style.jinja"))[1]
    assert (turn.brk.cause, turn.brk.subtype, turn.brk.message_index, turn.brk.role) == \
        ("history_edit", "truncated", 6, "tool")
    assert turn.brk.path == "$.messages[6]['content']"
    assert turn.payload_change.startswith("thinking_strip/client")  # still reported at the payload level


def test_unrendered_field_change_does_not_hide_a_later_dropped_message():
    # The generic renderer ignores tool_call_id; the break is the dropped empty assistant turn.
    prev = [SYS, TASK, _call(1), _result(1), {"role": "user", "content": "next"},
            {"role": "assistant", "content": ""}, {"role": "user", "content": "retry"}]
    nxt = [*prev[:3], {**prev[3], "tool_call_id": "renumbered"}, prev[4], prev[6], {"role": "assistant", "content": "x"}]
    turn = _session([{"messages": prev}, {"messages": nxt}])[1]
    assert (turn.brk.cause, turn.brk.subtype, turn.brk.message_index) == ("dropped_message", "empty_assistant", 5)


def test_a_rendered_change_in_an_empty_content_tool_call_keeps_its_message():
    # The template's literal text after an empty content belongs to the next message's sentinel: the
    # cause must still be the re-serialised arguments of message 2.
    # (Reordered keys: whitespace alone is not a change once arguments are parsed, as servers do.)
    prev = [SYS, TASK, _call(1, '{"path": "a.py", "n": 1}'), _result(1)]
    nxt = [SYS, TASK, _call(1, '{"n":1,"path":"a.py"}'), _result(1), {"role": "user", "content": "go"}]
    turn = _session([{"messages": prev}, {"messages": nxt}],
                    renderer=TemplateRenderer.from_file(TEMPLATES / "qwen3_style.jinja"))[1]
    assert (turn.brk.cause, turn.brk.message_index) == ("serialization", 2)


SESSIONS = ROOT / "fixtures" / "sessions"


def test_check_fails_on_a_turn_the_servers_template_cannot_render(tmp_path):
    # Qwen3.5-style templates raise on a mid-conversation system message: the server rejects that request,
    # so the gate must not report "every transition append-only".
    src = SESSIONS / "cause_system_fold.jsonl"
    result = check(src, template=TEMPLATES / "qwen35_style.jinja")
    assert not result.ok
    assert "unrenderable" in result.summary() and "System message must be at the beginning" in result.summary()
    junit = tmp_path / "j.xml"
    cli_result = CliRunner().invoke(cli, ["check", str(src), "--template", str(TEMPLATES / "qwen35_style.jinja"),
                                          "--junit", str(junit)])
    assert cli_result.exit_code == 1, cli_result.output
    assert "unrenderable" in cli_result.output
    assert "unrenderable" in junit.read_text()


def test_assert_prefix_stable_fails_on_a_request_without_messages():
    from analyzer import assert_prefix_stable

    with pytest.raises(AssertionError, match="could not be analysed"):
        assert_prefix_stable([{"messages": [TASK]}, {"prompt": "not a chat request"}])


@pytest.mark.parametrize("content", [b"not json\n{\"a\": 1}\n", b"\xff\xfe\x00garbage\n\x80\x81\n"])
def test_check_of_a_file_with_no_readable_request_fails(tmp_path, content):
    src = tmp_path / "garbage.jsonl"
    src.write_bytes(content)
    result = CliRunner().invoke(cli, ["check", str(src)])
    assert result.exit_code == 1, result.output
    if b"\x00" in content:  # binary, not a text file at all: one line says so (a damaged database's look)
        assert "holds binary data" in result.output and result.output.count("Error:") == 1
    else:
        assert "skipped line 1" in result.output


def test_check_fails_on_a_skipped_line_unless_the_threshold_allows_it(tmp_path):
    good = [{"messages": [TASK]}, {"messages": [TASK, {"role": "assistant", "content": "ok"}]}]
    src = tmp_path / "s.jsonl"
    src.write_text(json.dumps(good[0]) + "\n{broken\n" + json.dumps(good[1]) + "\n")
    result = CliRunner().invoke(cli, ["check", str(src)])
    assert result.exit_code == 1, result.output
    assert "1 of 3 requests could not be analysed" in result.output and "skipped line 2" in result.output
    result = CliRunner().invoke(cli, ["check", str(src), "--max-unreadable", "1"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok: 2 requests") and "skipped line 2" in result.output
    result = CliRunner().invoke(cli, ["check", str(src), "--max-unreadable", "50%"])
    assert result.exit_code == 0, result.output


def test_check_exit_codes_on_recorder_databases(tmp_path):
    from recorder.jsonl import store_turns
    from recorder.schema import open_db
    from recorder.turn import Turn

    runner = CliRunner()
    empty = tmp_path / "empty.db"
    open_db(empty).close()
    empty_result = runner.invoke(cli, ["check", str(empty)])  # nothing checked is not a pass (issue 16)
    assert empty_result.exit_code == 1 and "the input is empty" in empty_result.output
    db = tmp_path / "t.db"
    bodies = [{"messages": [SYS, TASK]}, {"messages": [{**SYS, "content": "rewritten"}, TASK]}]
    store_turns(db, [Turn(f"r{i}", 1.0 + i, "/v1/chat/completions", "x", b, session_id="s") for i, b in enumerate(bodies)])
    one = tmp_path / "one.db"
    store_turns(one, [Turn("r0", 1.0, "/v1/chat/completions", "x", bodies[0], session_id="s")])
    assert runner.invoke(cli, ["check", str(one)]).exit_code == 0
    bad = runner.invoke(cli, ["check", str(db)])
    assert bad.exit_code == 1 and "system_rewrite/content at message 0 (system)" in bad.output
    missing = runner.invoke(cli, ["check", str(tmp_path / "nope.db")])
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_a_later_body_without_messages_is_reported_unreadable_not_an_empty_prompt():
    report = analyze([Request(f"r{i}", float(i), b, "s") for i, b in enumerate(
        [{"messages": [TASK]}, {"prompt": "completions-style body"}, {"messages": "not a list"}])])
    assert [t.request_id for t in report.sessions[0].turns] == ["r0"]
    assert [s["request_id"] for s in report.skipped] == ["r1", "r2"]
    assert all("messages" in s["error"] for s in report.skipped)
    assert report.too_much_unread(0) and not report.too_much_unread(2)


def test_odd_but_valid_json_does_not_crash_the_analysis():
    # A tool entry with a null "function", a non-string role: the turn is classified, not a traceback.
    tools = [{"type": "function", "function": None}, {"type": "function", "function": {"name": "read"}}]
    turns = _session([{"messages": [TASK], "tools": tools}, {"messages": [TASK], "tools": tools[::-1]}])
    assert (turns[1].brk.cause, turns[1].brk.subtype) == ("tools_change", "reordered")
    odd = {"role": 7, "content": "x"}
    turns = _session([{"messages": [TASK, odd, {"role": "user", "content": "go"}]},
                      {"messages": [TASK, {"role": "user", "content": "go"}, {"role": "assistant", "content": "y"}]}])
    assert (turns[1].brk.cause, turns[1].brk.subtype, turns[1].brk.message_index) == ("dropped_message", "7", 1)
    assert "dropped_message/7" in turns[1].payload_change
