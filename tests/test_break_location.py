"""Issue 26, item 4: where, exactly. Turns are numbered from 1 everywhere (`number`); a break names the
message, its role and the char offset inside that message's own content (`message_char_offset`, not
the offset in the rendering); the characters that differ are marked with a caret line in the CLI and
given as spans (`diff`) for HTML highlighting; the fix text follows the real difference (an empty
<think></think> block dropped by the template is not a key-order problem)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from analyzer import analyze
from analyzer.load import Request
from prefixtrace.cli import cli

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = str(ROOT / "fixtures" / "qwen3.jinja")

SYSTEM = "You are a careful coding agent. Follow the user's rules. Todo list (stale: {} turns)."
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _conversation(n: int, stale: int) -> dict:
    msgs = [{"role": "system", "content": SYSTEM.format(stale)}]
    for i in range(n):
        msgs += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    return {"messages": [*msgs, {"role": "user", "content": "next"}], "tools": TOOLS}


def _write(tmp_path: Path, bodies: list[dict], session: str | None = "s") -> Path:
    src = tmp_path / "rec.jsonl"
    src.write_text("".join(json.dumps({"session": session, "ts": 1_800_000_000 + i, "request": b}) + "\n"
                           for i, b in enumerate(bodies)))
    return src


def test_turns_are_numbered_from_one_in_json_text_and_check(tmp_path):
    src = _write(tmp_path, [_conversation(1, 2), _conversation(2, 2), _conversation(3, 3)])
    report = analyze(src)
    turns = report.sessions[0].turns
    assert [t.number for t in turns] == [1, 2, 3] and [t.index for t in turns] == [0, 1, 2]
    d = report.to_dict()
    assert [t["number"] for t in d["sessions"][0]["turns"]] == [1, 2, 3]
    text = CliRunner().invoke(cli, ["analyze", str(src)]).output
    assert "  turn 3: system_rewrite" in text and "turn 2: system_rewrite" not in text
    result = CliRunner().invoke(cli, ["check", str(src)])
    assert result.exit_code == 1 and "session s turn 3 (" in result.output


def test_the_char_offset_is_inside_the_message_not_the_rendering(tmp_path):
    # The counter sits at char 80 of the system message; in the rendering, the tools block comes first.
    src = _write(tmp_path, [_conversation(1, 2), _conversation(2, 3)])
    brk = analyze(src).sessions[0].turns[1].brk
    expected = SYSTEM.index("{}")
    assert (brk.message_index, brk.role, brk.message_char_offset) == (0, "system", expected)
    assert brk.char_offset > expected + 50  # the old number: an offset in the rendered prompt
    assert brk.location() == f"message 0 (system), char {expected}"
    text = CliRunner().invoke(cli, ["analyze", str(src)]).output
    assert f"system_rewrite/volatile:counter at message 0 (system), char {expected}" in text
    assert f"char {brk.char_offset:,} of the rendered prompt" in text
    # Over the Messages API the system prompt is top-level: still the offset inside it.
    msgs = [{"model": "m", "max_tokens": 10, "system": b["messages"][0]["content"], "messages": b["messages"][1:]}
            for b in (_conversation(1, 2), _conversation(2, 3))]
    reqs = [Request(f"r{i}", float(i), b, "s", endpoint="/v1/messages") for i, b in enumerate(msgs)]
    brk = analyze(reqs).sessions[0].turns[1].brk
    assert (brk.message_index, brk.role, brk.message_char_offset) == (None, "system", expected)
    assert brk.location() == f"the system prompt, char {expected}"


def test_an_edited_user_message_names_its_own_offset(tmp_path):
    a = _conversation(2, 1)
    b = _conversation(3, 1)
    b["messages"][3] = {"role": "user", "content": "question 1 [output truncated]"}
    brk = analyze(_write(tmp_path, [a, b])).sessions[0].turns[1].brk
    assert (brk.cause, brk.message_index, brk.role) == ("history_edit", 3, "user")
    assert brk.message_char_offset == len("question 1")


def test_diff_spans_mark_exactly_the_characters_that_differ(tmp_path):
    brk = analyze(_write(tmp_path, [_conversation(1, 2), _conversation(2, 13)])).sessions[0].turns[1].brk
    d = brk.diff
    assert d["before"][d["start"]:d["before_end"]] == "2" and d["after"][d["start"]:d["after_end"]] == "13"
    assert d["before"][:d["start"]] == d["after"][:d["start"]]
    assert d["before"][d["before_end"]:] == d["after"][d["after_end"]:][:len(d["before"]) - d["before_end"]]
    # An insertion: nothing differs on the previous side, the new characters on this side.
    a, b = _conversation(2, 1), _conversation(3, 1)
    b["messages"][1] = {"role": "user", "content": "question 0 and more"}
    d = analyze(_write(tmp_path, [a, b])).sessions[0].turns[1].brk.diff
    assert d["before_end"] == d["start"] and d["after"][d["start"]:d["after_end"]] == " and more"


def _carets(lines: list[str], sign: str) -> str:
    """The characters of the `sign` side's line that the caret line under it marks."""
    i = next(n for n, line in enumerate(lines) if line.lstrip().startswith(sign + " "))
    text, marks = lines[i], lines[i + 1]
    return "".join(text[k] for k, ch in enumerate(marks) if ch == "^")


def test_the_cli_puts_a_caret_line_under_the_differing_characters(tmp_path):
    src = _write(tmp_path, [_conversation(1, 2), _conversation(2, 13)])
    text = CliRunner().invoke(cli, ["analyze", str(src)]).output
    lines = text.splitlines()
    assert _carets(lines, "-") == "2" and _carets(lines, "+") == "13"
    check = CliRunner().invoke(cli, ["check", str(src)]).output.splitlines()
    assert _carets(check, "-") == "2" and _carets(check, "+") == "13"
    # Newlines are shown escaped, and the carets still line up with what they mark.
    a, b = _conversation(2, 1), _conversation(3, 1)
    b["messages"][1] = {"role": "user", "content": "question 0\nnow with\ttabs"}
    lines = CliRunner().invoke(cli, ["analyze", str(_write(tmp_path, [a, b]))]).output.splitlines()
    assert _carets(lines, "+") == "\\nnow with\\ttabs"


def test_an_empty_think_block_dropped_by_the_template_gets_its_own_fix_not_the_key_order_one():
    # Qwen3's template renders <think>\n\n</think> in an assistant turn after the last user message when
    # its reasoning is whitespace, and drops it once a newer user message follows. This break was
    # `serialization/template` with the fix "same content, other bytes (key order, whitespace)…".
    system = {"role": "system", "content": "You are a coding agent."}
    call = [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]
    assistant = {"role": "assistant", "content": "", "reasoning_content": "\n", "tool_calls": call}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"}
    first = {"messages": [system, {"role": "user", "content": "list the files"}, assistant, tool]}
    second = {"messages": [*first["messages"], {"role": "assistant", "content": "Two files."},
                           {"role": "user", "content": "read a.py"}]}
    report = analyze([Request("a", 0.0, first, "s"), Request("b", 1.0, second, "s")], template=QWEN3)
    brk = report.sessions[0].turns[1].brk
    assert (brk.cause, brk.subtype, brk.message_index, brk.role) == ("thinking_strip", "template_empty", 2,
                                                                     "assistant")
    assert "key order" not in brk.suggestion and "<think></think>" in brk.suggestion
    removed = brk.diff["before"][brk.diff["start"]:brk.diff["before_end"]]
    assert "</think>" in removed and brk.diff["after_end"] == brk.diff["start"]
