"""Requests without session ids are grouped by their shared prefix, so two runs of one task that opened
alike can read as one session; then the clock in their system prompts runs backwards between them.
Such a break says so and suggests ids; with ids, the same traffic is two sessions and no break."""

from __future__ import annotations

import json

from analyzer import analyze
from analyzer.merged_sessions import runs_backwards


def _two_runs(tmp_path, ids: bool):
    """Two conversations of one task, the second started at an earlier clock, interleaved in time."""
    rows, ts = [], 0
    convs = {"a": ["10:00:05", "10:00:07"], "b": ["10:00:01", "10:00:03"]}
    for step in range(2):
        for name, clock in convs.items():
            msgs = [{"role": "system", "content": f"You are an agent. Time: {clock[step]}."},
                    {"role": "user", "content": "Fix the flaky test."}]
            if step:
                msgs += [{"role": "assistant", "content": f"Looking ({name})."}, {"role": "user", "content": "go on"}]
            rows.append({"ts": ts, "request": {"messages": msgs}, **({"session": name} if ids else {})})
            ts += 1
    src = tmp_path / f"runs-{ids}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return analyze(src)


def test_a_clock_running_backwards_across_merged_conversations_says_so(tmp_path):
    report = _two_runs(tmp_path, ids=False)
    backwards = [t for _, t in report.breaks if t.brk.volatile and
                 runs_backwards(t.brk.volatile["before"], t.brk.volatile["after"])]
    assert backwards, [(t.brk.cause, t.brk.volatile) for _, t in report.breaks]
    assert all(t.brk.suggestion.startswith("the value runs backwards, so these are likely two conversations")
               and "X-Session-Id" in t.brk.suggestion for t in backwards)


def test_with_ids_they_are_two_sessions_without_that_note(tmp_path):
    report = _two_runs(tmp_path, ids=True)
    assert all("runs backwards" not in (t.brk.suggestion or "") for _, t in report.breaks)


def test_runs_backwards():
    assert runs_backwards("10:00:07", "10:00:02") and runs_backwards("(stale: 5 turns)", "(stale: 1 turns)")
    assert not runs_backwards("10:00:02", "10:00:07") and not runs_backwards("v1", "v1.2")
