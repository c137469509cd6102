"""`analyze` and the fixes (analyzer/fix_report.py): each cause found gets the fix that addresses it with what
it would have saved, measured by applying it to the recorded requests and analysing again; turns the
proxy fixed are named."""

from __future__ import annotations

import json

from analyzer import analyze
from analyzer.report import format_text

SYSTEM = "You are a coding agent working in a repository. " * 30
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object",
                                                                          "properties": {"path": {"type": "string"}}}}}]


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_volatile_proposal_is_measured_by_reanalysis(tmp_path):
    records, history = [], []
    for t in range(5):
        history.append({"role": "user", "content": f"step {t}: do thing {t} " * 5})
        system = SYSTEM + f"Current time: 2026-12-04 22:{t:02d}:1{t} UTC."
        records.append({"id": str(t), "ts": 1000 + t, "session": "s",
                        "request": {"model": "m", "messages": [{"role": "system", "content": system}, *history]}})
        history.append({"role": "assistant", "content": f"done {t} " * 10})
    report = analyze(write(tmp_path / "v.jsonl", records))
    (proposal,) = report.fix_proposals
    assert proposal["fix"] == "volatile" and proposal["breaks"] == proposal["breaks_removed"] == 4
    assert proposal["breaks_caused"] == 0 and proposal["saved_tokens"] > 0 and proposal["requests_changed"] == 5
    text = format_text(report)
    assert "fix proposed: --fix volatile for 4 system_rewrite breaks: would have saved" in text
    assert json.loads(json.dumps(report.to_dict()))["fix_proposals"][0]["fix"] == "volatile"


def test_thinking_proposal_uses_the_recorded_replies(tmp_path):
    user = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "read a.py"}]
    call = [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}]
    reply = {"role": "assistant", "content": "", "reasoning_content": "I should read it first.", "tool_calls": call}
    result = {"role": "tool", "tool_call_id": "c1", "content": "print(1)"}
    stripped = {"role": "assistant", "content": "", "tool_calls": call}
    records = [
        {"id": "1", "ts": 1, "session": "s", "request": {"model": "m", "tools": TOOLS, "messages": user},
         "response": {"status": 200, "text": "", "reasoning": "I should read it first.", "tool_calls": call}},
        {"id": "2", "ts": 2, "session": "s", "request": {"model": "m", "tools": TOOLS, "messages": user + [reply, result]},
         "response": {"status": 200, "text": "done"}},
        {"id": "3", "ts": 3, "session": "s", "request": {"model": "m", "tools": TOOLS, "messages": user + [
            stripped, result, {"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]}},
    ]
    proposals = {p["fix"]: p for p in analyze(write(tmp_path / "t.jsonl", records)).fix_proposals}
    assert proposals["thinking"]["breaks_removed"] == 1 and proposals["thinking"]["requests_changed"] == 1


def test_turns_the_proxy_fixed_are_named(tmp_path):
    entry = {"name": "volatile", "fired": True, "note": "volatile timestamp moved (1 value(s))",
             "bytes_before": 10, "bytes_after": 20}
    records = [{"id": str(i), "ts": i, "session": "s", "render": {"fixes": [entry]},
                "request": {"model": "m", "messages": [{"role": "user", "content": "x" * (i + 1)}]}} for i in range(2)]
    report = analyze(write(tmp_path / "f.jsonl", records))
    assert report.proxy_fixes == [{"name": "volatile", "note": "volatile timestamp moved", "turns": 2}]
    assert "fixed by the proxy: volatile timestamp moved (2 turns)" in format_text(report)
