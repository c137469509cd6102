"""A harness's title, summary or commit-message call under the session's id is a side request even when
it has the same tools as the main chain (or, as here, none): its system prompt says what it is."""

from __future__ import annotations

import json

import pytest

from analyzer import analyze

SIDES = ["Generate a short title for this conversation.", "You are a context summarization assistant.",
         "Write a commit message for the staged changes."]


@pytest.mark.parametrize("system", SIDES)
def test_a_side_call_without_tools_is_a_side_request_not_a_break(tmp_path, system):
    main = [{"role": "system", "content": "You are a coding agent. " * 20}, {"role": "user", "content": "List the files."}]
    rows = [{"session": "s", "ts": 1, "request": {"messages": main}},
            {"session": "s", "ts": 2, "request": {"messages": main + [{"role": "assistant", "content": "a.py"},
                                                                       {"role": "user", "content": "Open it."}]}},
            {"session": "s", "ts": 3, "request": {"messages": [{"role": "system", "content": system}, main[1]]}}]
    src = tmp_path / "s.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = analyze(src)
    assert report.breaks == []
    (side,) = [s for s in report.sessions if s.parent]
    assert side.parent == "s" and side.id == "s/side-1" and side.turns[0].note.startswith("side request of s")


def test_a_rewritten_system_prompt_is_still_a_break(tmp_path):
    main = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "List the files."}]
    rows = [{"session": "s", "ts": 1, "request": {"messages": main}},
            {"session": "s", "ts": 2, "request": {"messages": [{"role": "system", "content": "You are a coding agent in YOLO mode."},
                                                              main[1], {"role": "assistant", "content": "a"},
                                                              {"role": "user", "content": "b"}]}}]
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [t.brk.cause for _, t in analyze(src).breaks] == ["system_rewrite"]
