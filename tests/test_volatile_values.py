"""Issue 26, item 4: volatile values (counters, timestamps, UUIDs, hex ids, e-mails, URL queries,
high-entropy strings) are recognised anywhere in the prompt, not only in the system message, and named
in the cause's subtype and in the fix text."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from analyzer import analyze
from analyzer.causes import volatile_change
from analyzer.load import Request
from prefixtrace.cli import cli

VALUES = {
    "counter": ("(stale: 2 turns)", "(stale: 3 turns)"),
    "timestamp": ("Current time: 2026-10-05T12:01:09Z.", "Current time: 2026-10-05T12:04:51Z."),
    "uuid": ("request 3f2a1c9e-1b2c-4d5e-8f90-123456789abc", "request 9e8d7c6b-5a4f-4e3d-8c2b-a1b2c3d4e5f6"),
    "hex_id": ("HEAD is at 1a2b3c4d5e6f", "HEAD is at 9f8e7d6c5b4a"),
    "email": ("signed in as bob@example.com today", "signed in as alice@example.org today"),
    "url_query": ("see https://ci.example.com/run?token=abc123&page=2", "see https://ci.example.com/run?token=zz99&page=3"),
    "high_entropy": ("nonce Zx8Kq2LmN4pR7tVw9YbC done", "nonce Hj3Fd6Sa1Qw5Er8Ty0Ui done"),
}


@pytest.mark.parametrize("kind", sorted(VALUES))
def test_each_kind_is_recognised(kind):
    a, b = VALUES[kind]
    v = volatile_change(a, b)
    assert v is not None and v["kind"] == kind
    assert v["before"] in a and v["after"] in b and v["before"] != v["after"]


def test_a_real_edit_is_not_volatile():
    assert volatile_change("mode: safe", "mode: yolo") is None
    assert volatile_change("a snake_case_identifier_name", "another_snake_case_identifier") is None
    assert volatile_change("run 2 tests", "run 2 tests and the linter") is None


SYSTEM = {"role": "system", "content": "You are a coding agent."}


def _turns(first: list, second: list, tools=None) -> list[Request]:
    extra = {"tools": tools[1]} if tools else {}
    base = {"tools": tools[0]} if tools else {}
    return [Request("a", 0.0, {"messages": first, **base}, "s"), Request("b", 1.0, {"messages": second, **extra}, "s")]


@pytest.mark.parametrize("kind", ["uuid", "timestamp", "email"])
def test_in_an_earlier_user_message_it_is_a_volatile_history_edit_named_in_subtype_and_fix(kind):
    # A harness that re-stamps an earlier message (its request id, the time, the signed-in user) on
    # every request: anywhere in the prompt, not only the system message.
    a, b = VALUES[kind]
    first = [SYSTEM, {"role": "user", "content": f"Fix the bug. {a}"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "go on"}]
    second = [SYSTEM, {"role": "user", "content": f"Fix the bug. {b}"}, *first[2:],
              {"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}]
    brk = analyze(_turns(first, second)).sessions[0].turns[1].brk
    assert (brk.cause, brk.subtype, brk.message_index, brk.role) == ("history_edit", f"volatile:{kind}", 1, "user")
    assert brk.volatile["kind"] == kind
    assert {"uuid": "a UUID", "timestamp": "a timestamp", "email": "an e-mail address"}[kind] in brk.suggestion
    assert "message 1 (user)" in brk.suggestion and repr(brk.volatile["after"])[:20] in brk.suggestion


def test_in_a_tool_description_it_is_a_volatile_tools_change():
    def tools(stamp):
        return [{"type": "function", "function": {"name": "search", "description": f"Search the web. Today is {stamp}.",
                                                  "parameters": {"type": "object", "properties": {}}}}]

    msgs = [SYSTEM, {"role": "user", "content": "hi"}]
    reqs = _turns(msgs, [*msgs, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
                  tools=(tools("2026-10-05"), tools("2026-10-06")))
    brk = analyze(reqs).sessions[0].turns[1].brk
    assert (brk.cause, brk.subtype, brk.tool_name) == ("tools_change", "volatile:timestamp", "search")
    assert "tool definition tools[0] (search) carries a timestamp" in brk.suggestion
    assert "'2026-10-05' → '2026-10-06'" in brk.suggestion


def test_in_the_system_prompt_the_kind_is_named_and_the_cli_shows_it():
    a, b = VALUES["uuid"]
    first = [{"role": "system", "content": f"You are an agent. Session {a}."}, {"role": "user", "content": "hi"}]
    second = [{"role": "system", "content": f"You are an agent. Session {b}."}, first[1],
              {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    report = analyze(_turns(first, second))
    brk = report.sessions[0].turns[1].brk
    assert (brk.cause, brk.subtype) == ("system_rewrite", "volatile:uuid")
    assert brk.suggestion.startswith("the system prompt carries a UUID that changes between requests")
    from analyzer.report import format_text

    text = format_text(report)
    assert "system_rewrite/volatile:uuid at message 0 (system), char 34" in text
    assert "volatile uuid: '3f2a1c9e-1b2c-4d5e-8f90-123456789abc' → '9e8d7c6b-5a4f-4e3d-8c2b-a1b2c3d4e5f6'" in text
    # A real rewrite stays `content`, with the general fix.
    second[0] = {"role": "system", "content": "You are an agent in YOLO mode."}
    brk = analyze(_turns(first, second)).sessions[0].turns[1].brk
    assert (brk.cause, brk.subtype, brk.volatile) == ("system_rewrite", "content", None)


def test_check_names_the_volatile_value(tmp_path):
    import json

    a, b = VALUES["hex_id"]
    first = [SYSTEM, {"role": "user", "content": f"Review {a}"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "next"}]
    second = [SYSTEM, {"role": "user", "content": f"Review {b}"}, *first[2:]]
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps({"session": "s", "ts": i, "request": {"messages": m}}) + "\n"
                           for i, m in enumerate([first, second])))
    out = CliRunner().invoke(cli, ["check", str(src)]).output
    assert "history_edit/volatile:hex_id at message 1 (user), char 18" in out and "carries a hex id" in out


def test_a_long_change_is_an_edit_not_a_volatile_value():
    # A rewritten tool output of many kB is an edit, even when it is all digits and ids: volatile values
    # are short (and the scan over the changed region stays linear on long runs without spaces).
    base = "log:\n" + "0123456789abcdef" * 2000
    assert volatile_change(base, base.replace("0123", "4567")) is None
    blob = "data:" + "A" * 200_000  # only the changed region (with 64 chars either side) is scanned
    assert volatile_change(blob + "@x.com", blob + "@y.com")["kind"] == "email"
