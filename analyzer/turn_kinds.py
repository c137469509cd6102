"""What opened each turn (`opened_by`, docs/ANALYZER.md "What opened each turn"), and the miss rate per kind.

A harness sends a request when something happened: the person typed (`user`), a tool returned
(`tool_result`), a sub-agent finished (`subagent`: the result of the harness's agent tool, or Claude
Code's `<task-notification>`), the history was compacted (`compaction`), a session was resumed
(`resume`: Claude Code's `-r` drops its synthetic messages, or the session was idle for
RESUME_GAP_S), or the previous request was sent again (`retry`: the same messages, or the harness's own
"continue" notice after a cut-off reply). A session's first turn is `first`. Some kinds break the
cache far more often than others (a sub-agent's result arriving as a new user message, a resume after
the cache expired); the table says which.
"""

from __future__ import annotations

from typing import Any

KINDS = ("first", "user", "tool_result", "subagent", "compaction", "resume", "retry")
# The tools through which harnesses start sub-agents: Claude Code (`Agent`, formerly `Task`), opencode
# (`task`), qwen-code (`agent`), Codex (`spawn_agent`).
AGENT_TOOLS = frozenset({"Agent", "Task", "task", "agent", "spawn_agent"})
SUBAGENT_NOTES = ("<task-notification>",)
RETRY_NOTES = ("Output token limit hit",)  # Claude Code's notice when it resends a cut-off reply's turn
RESUME_GAP_S = 30 * 60


def _text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def _agent_calls(messages: list) -> set[str]:
    """Ids of the tool calls to an agent tool among `messages`."""
    ids = set()
    for m in messages:
        for call in (m.get("tool_calls") or []) if isinstance(m, dict) else []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and function.get("name") in AGENT_TOOLS:
                ids.add(call.get("id"))
    return ids


def opened_by(prev, payload, brk, gap_s: float | None) -> str:
    """The kind of event that opened a turn, from the session's previous payload (None: the first turn),
    this one, the turn's break and the seconds since the previous turn ended."""
    if prev is None:
        return "first"
    cause = brk.cause if brk is not None else None
    if cause == "compaction":
        return "compaction"
    if cause == "dropped_message" or (gap_s is not None and gap_s > RESUME_GAP_S):
        return "resume"
    if payload.keys == prev.keys:
        return "retry"
    new = payload.messages[len(prev.keys):] if payload.keys[: len(prev.keys)] == prev.keys else payload.messages[-1:]
    new = [m for m in new if isinstance(m, dict) and m.get("role") in ("user", "tool")]
    if any(note in _text(m) for m in new for note in RETRY_NOTES):
        return "retry"
    agents = _agent_calls(payload.messages)
    if any(m.get("role") == "tool" and m.get("tool_call_id") in agents for m in new) or \
            any(note in _text(m) for m in new for note in SUBAGENT_NOTES):
        return "subagent"
    if any(m.get("role") == "tool" for m in new):
        return "tool_result"
    return "user"


def miss_rates(turns) -> dict[str, dict[str, Any]]:
    """Per kind: turns, misses (turns with a break) and their share, in KINDS order."""
    rows: dict[str, dict[str, Any]] = {}
    for t in turns:
        kind = getattr(t, "opened_by", None)
        if kind is None:
            continue
        row = rows.setdefault(kind, {"turns": 0, "misses": 0})
        row["turns"] += 1
        row["misses"] += t.brk is not None
    for row in rows.values():
        row["miss_rate"] = round(row["misses"] / row["turns"], 4)
    return {k: rows[k] for k in KINDS if k in rows}


def text_line(rates: dict[str, dict[str, Any]]) -> str | None:
    if not rates:
        return None
    parts = [f"{k} {r['misses']}/{r['turns']} ({r['miss_rate'] * 100:.0f} %)" for k, r in rates.items() if k != "first"]
    return "misses by what opened the turn: " + (", ".join(parts) if parts else "only first turns")
