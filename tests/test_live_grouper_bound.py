"""The live analysis keeps at most `max_turns` turns for display, and the session grouper behind it
forgets the sessions dropped with them (each chain holds its last prompt): a proxy that serves many
sessions does not grow for good."""

from __future__ import annotations

from proxy.live import LiveSessions
from recorder.turn import Turn


def _turn(i: int, session: str | None) -> Turn:
    body = {"model": "m", "messages": [{"role": "system", "content": "You are terse. " * 50},
                                       {"role": "user", "content": f"question {i} " * 20}]}
    return Turn(f"r{i}", 1000.0 + i, "/v1/chat/completions", "http://up", body, session_id=session, status=200)


def test_dropped_sessions_leave_the_grouper_too():
    live = LiveSessions(max_turns=10)
    for i in range(60):
        live.observe(_turn(i, f"s{i}" if i % 2 else None))  # explicit and inferred sessions alike
        live.refresh()
    assert sum(len(s.turns) for s in live.sessions.values()) <= 10
    kept = set(live.sessions)
    assert {s.id for s in live.grouper.sessions} == kept
    assert all(s.id in kept for pool in live.grouper._chains.values() for s in pool)
    assert all(s.id in kept for s in live.grouper._inferred)
