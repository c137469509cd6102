"""Issue 16, items 4-5, on real harness traffic recorded through the proxy (fixtures/traffic/, copied
from ../shared/traffic/; see its README for what each recording holds): sessions as harnesses make
them (side requests are forks, compactions stay in their session, failed requests are listed, not
chained) and causes that name what changed."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from analyzer import analyze, check
from analyzer.load import Request
from prefixtrace.cli import cli

ROOT = Path(__file__).resolve().parents[1]
TRAFFIC = ROOT / "fixtures" / "traffic"
QWEN3 = str(ROOT / "fixtures" / "qwen3.jinja")  # the real Qwen3 template


def _records(name):
    return [json.loads(line) for line in (TRAFFIC / name).read_text().splitlines() if line.strip()]


def _by_id(report):
    return {s.id: s for s in report.sessions}


# -- side requests are forks ------------------------------------------------------------------


def test_opencode_title_request_is_a_side_request_and_check_passes():
    # opencode sends its title-generation request under the agent's X-Session-Id first: it was a
    # tools_change break of the main chain and `check` exited 1 on normal traffic.
    report = analyze(TRAFFIC / "opencode_tiny.jsonl", template=QWEN3)
    sid = "ses_dcf74734bffe49M1Js2vxrKkYi"
    main, side = _by_id(report)[sid], _by_id(report)[f"{sid}/side-1"]
    assert main.kind == "main" and [t.brk for t in main.turns] == [None, None, None]
    assert side.parent == sid and len(side.turns) == 1
    assert side.side_reason == "replaces the system prompt and the tools"
    assert side.turns[0].note.startswith(f"side request of {sid}: re-prefilled ")
    assert "because it replaces the system prompt" in side.turns[0].note
    assert report.breaks == []
    result = CliRunner().invoke(cli, ["check", str(TRAFFIC / "opencode_tiny.jsonl"), "--template", QWEN3])
    assert result.exit_code == 0, result.output
    strict = CliRunner().invoke(cli, ["check", str(TRAFFIC / "opencode_tiny.jsonl"), "--template", QWEN3,
                                      "--fail-on", "side_request"])
    assert strict.exit_code == 1 and "side request of" in strict.output


def test_qwen_memory_extraction_is_a_fork_of_the_main_session():
    # Same conversation, another system prompt and tool list, no session id: it landed in the main
    # session as tools_change / system_rewrite breaks.
    report = analyze(TRAFFIC / "qwen_tiny.jsonl", template=QWEN3)
    sessions = _by_id(report)
    main = sessions["inferred-1"]
    side = sessions["inferred-1/side-1"]
    assert main.kind == "main" and all(t.brk is None for t in main.turns) and len(main.turns) == 2
    assert side.parent == "inferred-1" and len(side.turns) == 2
    assert "memory extraction" in _records("qwen_tiny.jsonl")[3]["request"]["messages"][0]["content"]
    # Its own follow-up re-appends the extraction instruction to the grown conversation.
    assert side.turns[1].brk.cause == "request_local_tail"
    assert check(TRAFFIC / "qwen_tiny.jsonl", template=QWEN3).ok


def test_failed_requests_are_listed_not_chained():
    # qwen's first two prompts did not fit the model (400); pi_smol's ten summary side requests asked
    # for more tokens than the context holds (400). They were chained as turns.
    for name, n in (("qwen_tiny.jsonl", 2), ("pi_smol.jsonl", 10)):
        report = analyze(TRAFFIC / name, template=QWEN3)
        statuses = [r["response"]["status"] for r in _records(name)]
        failed_ids = {r["id"] for r, st in zip(_records(name), statuses) if st >= 400}
        assert len(report.failed) == n and {f["request_id"] for f in report.failed} == failed_ids
        assert all(f["status"] == 400 for f in report.failed)
        chained = {t.request_id for s in report.sessions for t in s.turns}
        assert not chained & failed_ids and len(chained) == len(statuses) - n
        assert report.to_dict()["coverage"]["failed_requests"] == n


def test_a_compaction_without_session_ids_stays_in_its_session():
    # Same system prompt and tools, right after the session's latest request, the history replaced by
    # a much shorter summary: it used to start a new inferred session and vanish from the cost.
    rec = _records("pi_tiny.jsonl")[:3]
    bodies = [r["request"] for r in rec]
    system, tools = bodies[2]["messages"][0], bodies[2]["tools"]
    summary = {"role": "user", "content": "Summary of the conversation so far: the user asked to read files."}
    compacted = {**bodies[2], "messages": [system, summary]}
    after = {**compacted, "messages": [system, summary, {"role": "assistant", "content": "ok"},
                                       {"role": "user", "content": "go on"}]}
    reqs = [Request(f"r{i}", float(i), b, None) for i, b in enumerate([*bodies, compacted, after])]
    report = analyze(reqs, template=QWEN3)
    assert len(report.sessions) == 1, [s.id for s in report.sessions]
    turns = report.sessions[0].turns
    assert turns[3].brk.cause == "compaction" and turns[4].brk is None
    assert tools == compacted["tools"]


# -- causes name what changed --------------------------------------------------------------------


def test_claude_resume_dropping_synthetic_user_messages_is_dropped_message_at_2():
    # `claude -r` drops the "Output token limit hit" user notices: it was history_edit/truncated at 3.
    report = analyze(TRAFFIC / "claude_smol.jsonl", template=QWEN3)
    (session,) = report.sessions
    brk = session.turns[4].brk
    assert (brk.cause, brk.subtype, brk.message_index, brk.role) == ("dropped_message", "user", 2, "user")
    assert brk.path == "$.messages[2]"  # the client's own index (Messages API: system is top-level)
    result = CliRunner().invoke(cli, ["check", str(TRAFFIC / "claude_smol.jsonl"), "--template", QWEN3])
    assert result.exit_code == 1 and "dropped_message/user at message 2 (user)" in result.output


def test_pi_chat_then_messages_is_not_a_false_tools_change_of_every_tool(tmp_path):
    # The same four tools, OpenAI-shaped over chat and Anthropic-shaped over Messages: compared without
    # normalising they were `tools_change/edited` at `$.tools[0]` (`message None (None)`). Normalised,
    # read/bash/write only differ in key order and `strict: false`; what really changed is that the
    # Messages client dropped `additionalProperties: false` from the edit tool's schema. (Without ids the
    # second conversation is a session of its own: tests/test_session_inference.py; one id chains them.)
    src = tmp_path / "pi_one_session.jsonl"
    src.write_text("".join(json.dumps({**r, "session": "pi"}) + "\n" for r in _records("pi_tiny.jsonl")))
    report = analyze(src, template=QWEN3)
    brk = report.sessions[0].turns[3].brk
    assert (brk.cause, brk.subtype, brk.tool_index, brk.tool_name) == ("tools_change", "edited", 2, "edit")
    assert brk.path == "$.tools[2]['function']['parameters']['additionalProperties']"
    assert brk.where() == "tools[2] (edit)"
    result = CliRunner().invoke(cli, ["check", str(src), "--template", QWEN3])
    assert "tools_change/edited at tools[2] (edit)" in result.output and "None (None)" not in result.output


def test_the_same_tools_in_other_bytes_are_serialization_not_tools_change():
    rec = _records("pi_tiny.jsonl")
    chat = rec[2]["request"]
    reordered = [{**t, "function": {**t["function"], "parameters": dict(reversed(list(
        t["function"]["parameters"].items())))}} for t in chat["tools"]]
    nxt = {**chat, "tools": reordered, "messages": [*chat["messages"], {"role": "assistant", "content": "x"}]}
    report = analyze([Request("a", 0.0, chat, "s"), Request("b", 1.0, nxt, "s")], template=QWEN3)
    brk = report.sessions[0].turns[1].brk
    assert (brk.cause, brk.subtype, brk.tool_index, brk.tool_name) == ("serialization", "tools", 0, "read")


def test_a_change_the_template_does_not_render_is_not_a_break_in_check(tmp_path):
    # Qwen3's template renders neither a tool message's tool_call_id nor a user message's name.
    rec = _records("pi_tiny.jsonl")
    a = rec[2]["request"]
    b = {**a, "messages": [*a["messages"][:-1], {**a["messages"][-1], "name": "dev"},
                           {"role": "assistant", "content": "x"}]}
    src = tmp_path / "s.jsonl"
    src.write_text("".join(json.dumps({"session": "s", "ts": i, "request": x}) + "\n" for i, x in enumerate([a, b])))
    report = analyze(src, template=QWEN3)
    turn = report.sessions[0].turns[1]
    assert turn.brk is None and turn.payload_change and turn.reprefill_tokens < turn.prompt_tokens
    result = CliRunner().invoke(cli, ["check", str(src), "--template", QWEN3])
    assert result.exit_code == 0, result.output


def test_interleaved_sessions_without_ids_each_keep_their_compaction():
    # Two conversations of one harness, requests alternating (B with fewer tools): A's compaction
    # continues A although B's request came just before it. (When several chains share the system
    # prompt and tools, the most recently active one is taken: adjacent in time.)
    body = _records("pi_tiny.jsonl")[2]["request"]
    system, tools = body["messages"][0], body["tools"]

    def conv(tag, n):
        msgs = [system, {"role": "user", "content": f"task {tag} " * 30}]
        for i in range(n):
            msgs += [{"role": "assistant", "content": f"{tag} step {i} " * 20}, {"role": "user", "content": f"go {i}"}]
        return msgs

    reqs = []
    for i in range(1, 4):
        reqs += [{"messages": conv("A", i), "tools": tools}, {"messages": conv("B", i), "tools": tools[:2]}]
    summary = {"role": "user", "content": "Summary: task A so far."}
    reqs.append({"messages": [system, summary], "tools": tools})  # A compacts right after B's turn
    reqs.append({"messages": conv("B", 4), "tools": tools[:2]})
    report = analyze([Request(f"r{i}", float(i), b, None) for i, b in enumerate(reqs)], template=QWEN3)
    assert [len(s.turns) for s in report.sessions] == [4, 4]
    assert report.sessions[0].turns[3].brk.cause == "compaction"
    assert all(t.brk is None for t in report.sessions[1].turns)


def test_assert_prefix_stable_does_not_let_a_replaced_head_pass_as_a_side_request():
    import pytest

    from analyzer import assert_prefix_stable

    a = {"messages": [{"role": "system", "content": "You are agent A."}, {"role": "user", "content": "go"}],
         "tools": [{"type": "function", "function": {"name": "read", "parameters": {}}}]}
    b = {"messages": [{"role": "system", "content": "Totally different."}, {"role": "user", "content": "go"},
                      {"role": "assistant", "content": "ok"}],
         "tools": [{"type": "function", "function": {"name": "write", "parameters": {}}}]}
    with pytest.raises(AssertionError, match="side request"):
        assert_prefix_stable([a, b])
    assert_prefix_stable([a, b], fail_on=None)
