"""What opened each turn (typed user message, tool result, sub-agent completion, compaction, resume,
retry) and the miss rate per kind."""

from __future__ import annotations

import json
from pathlib import Path

from analyzer.analysis import analyze
from analyzer.report import format_text

ROOT = Path(__file__).resolve().parents[1]
TRAFFIC = Path("/work/shared/traffic/claude_tiny.jsonl")
SYSTEM = {"role": "system", "content": "You are a coding agent. " * 20}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
         for n in ("read", "Agent")]


def _call(i: int, name: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": "{}"}}]}


def _write(tmp_path: Path, bodies: list[dict], gaps: list[float] | None = None) -> Path:
    ts, lines = 1_700_000_000.0, []
    for i, body in enumerate(bodies):
        ts += (gaps or [5.0] * len(bodies))[i]
        lines.append(json.dumps({"id": f"r{i}", "ts": ts, "session": "s", "request": body,
                                 "timing": {"ttft_s": 0.5, "total_s": 1.0}}))
    path = tmp_path / "rec.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _kinds(report) -> list[str]:
    return [t.opened_by for s in report.sessions for t in s.turns]


def test_each_kind_is_told_apart(tmp_path):
    history = [SYSTEM, {"role": "user", "content": "fix the bug"}]
    bodies = [{"model": "m", "tools": TOOLS, "messages": list(history)}]

    def grow(*messages):
        history.extend(messages)
        bodies.append({"model": "m", "tools": TOOLS, "messages": list(history)})

    grow(_call(1, "read"), {"role": "tool", "tool_call_id": "c1", "content": "def a(): pass"})
    grow(_call(2, "Agent"), {"role": "tool", "tool_call_id": "c2", "content": "the sub-agent found it"})
    grow({"role": "assistant", "content": "done"}, {"role": "user", "content": "now the tests"})
    bodies.append(dict(bodies[-1]))  # sent again as it was
    grow({"role": "assistant", "content": "ok"}, {"role": "user", "content": "continue"})  # after a long pause
    gaps = [0, 5, 5, 5, 5, 3600]
    report = analyze(_write(tmp_path, bodies, gaps))
    assert _kinds(report) == ["first", "tool_result", "subagent", "user", "retry", "resume"]


def test_compaction_and_real_claude_code_retries_and_resume():
    compaction = analyze(ROOT / "fixtures" / "sessions" / "cause_compaction.jsonl")
    assert _kinds(compaction)[-1] == "compaction"
    report = analyze(TRAFFIC)
    turns = {(s.id, t.number): t for s in report.sessions for t in s.turns}
    # Claude Code's "Output token limit hit" notices resend a cut-off turn: retries, never a miss here;
    # its resume (-r) drops those notices: a resume, which breaks.
    retries = [t for t in turns.values() if t.opened_by == "retry"]
    assert len(retries) >= 6 and all(t.brk is None for t in retries)
    [resume] = [t for t in turns.values() if t.opened_by == "resume"]
    assert resume.brk.cause == "dropped_message"
    rates = report.to_dict()["opened_by"]
    assert rates["resume"] == {"turns": 1, "misses": 1, "miss_rate": 1.0}
    assert "misses by what opened the turn: resume 1/1 (100 %), retry 0/" in format_text(report)
