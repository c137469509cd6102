"""Session files real harnesses wrote through `prefixtrace serve` in front of a scripted model
(testsupport/scripted_replies.py; PROVENANCE.md beside each): what a tiny model cannot make a
harness write (a compaction summary, a server's compaction, parallel tool calls). Each is read
back and compared with the proxy's recording of the same run: what the harness really sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analyzer import analyze, check
from recorder.transcripts import read_transcripts

ROOT = Path(__file__).resolve().parent.parent
CLAUDE = ROOT / "fixtures" / "transcripts" / "claude" / "real"
CODEX = ROOT / "fixtures" / "transcripts" / "codex" / "real"
CODEX_V2 = CODEX / "rollout-2026-12-05T05-01-11-01a24493-e105-7df3-81ff-136f7470f3e9.jsonl"
CODEX_V1 = CODEX / "rollout-2026-12-05T05-01-19-01a24494-00bc-70d2-a7e6-4c549bc505f1.jsonl"


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def recorded(name: Path) -> list[dict]:
    return [json.loads(line) for line in name.read_text().splitlines()]


def breaks(report) -> list[tuple[int, str]]:
    return [(t.number, t.brk.cause) for s in report.sessions for t in s.turns if t.brk is not None]


def without_cache_control(v):
    """What Claude Code sent less its `cache_control` markers (not in the transcript: noted)."""
    if isinstance(v, dict):
        return {k: without_cache_control(x) for k, x in v.items() if k != "cache_control"}
    return [without_cache_control(x) for x in v] if isinstance(v, list) else v


def as_blocks(messages: list) -> list:
    """Each message's text as a text block: Claude Code sends the last message's as one (to carry its
    `cache_control` marker, not in the file); the file has the string."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
            for m in messages]


def codex_items(rec: dict) -> list[dict]:
    return [{k: v for k, v in i.items() if k != "internal_chat_message_metadata_passthrough"}
            for i in rec["request"]["input"]]


# --- Codex 0.171.0: remote compaction (v2: a `compaction_trigger` item on /v1/responses) -----------

def test_codex_remote_compaction_v2_rebuilds_every_call_codex_sent_compaction_requests_included():
    [t] = read_transcripts(CODEX_V2)
    recording = recorded(CODEX / "recording-remote-compaction.jsonl")
    assert t.version == "rollout of codex_exec 0.171.0" and t.calls == len(t.turns) == len(recording) == 7
    assert any("`compaction_trigger` item ending remote compaction requests is not in the file" in n for n in t.notes)
    for turn, rec in zip(t.turns, recording, strict=True):
        # all but the base-instructions message Codex composes first (noted)
        assert turn.request_body["input"] == codex_items(rec)[1:]
        assert (turn.prompt_tokens, turn.cached_tokens) == (rec["tokens"]["prompt"], rec["tokens"]["cached"])
    triggers = [n for n, turn in enumerate(t.turns, 1) if turn.request_body["input"][-1] == {"type": "compaction_trigger"}]
    assert triggers == [2, 4, 6] and sorted(t.compacted) == [3, 5, 7]


def test_codex_remote_compaction_v2_is_named_compaction_and_allowed():
    assert breaks(analyze(CODEX_V2)) == [(3, "compaction"), (5, "compaction"), (7, "compaction")]
    assert check(CODEX_V2, allow="compaction").ok and not check(CODEX_V2).ok
    recording = CODEX / "recording-remote-compaction.jsonl"  # the same run as the proxy recorded it
    assert {cause for _, cause in breaks(analyze(recording))} == {"compaction"}
    assert check(recording, allow="compaction").ok


# --- Codex 0.104.0: remote compaction (v1: POST /v1/responses/compact, through the proxy) -----------

def test_codex_remote_compaction_v1_rebuilds_the_loop_as_sent_and_names_the_compaction():
    [t] = read_transcripts(CODEX_V1)
    loop = [r for r in recorded(CODEX / "recording-remote-compaction-0.104.jsonl") if r["endpoint"] == "/v1/responses"]
    assert t.version == "rollout of codex_exec 0.104.0" and len(t.turns) == len(loop) == 4
    for turn, rec in zip(t.turns, loop, strict=True):
        assert turn.request_body["input"] == codex_items(rec)  # 0.104 sends its base instructions apart
    assert breaks(analyze(CODEX_V1)) == [(4, "compaction")]
    assert check(CODEX_V1, allow="compaction").ok and not check(CODEX_V1).ok


def test_a_recording_with_responses_compact_calls_leaves_them_out_and_names_the_compaction():
    path = CODEX / "recording-remote-compaction-0.104.jsonl"
    assert [r["endpoint"] for r in recorded(path)].count("/v1/responses/compact") == 3
    report = analyze(path)
    assert report.remote_compactions == 3 and report.to_dict()["remote_compaction_requests"] == 3
    assert sum(len(s.turns) for s in report.sessions) == 4  # the loop's calls only, one session
    assert breaks(report) == [(4, "compaction")]  # a new server `compaction` item: not a system rewrite
    assert any("3 remote compaction requests (/v1/responses/compact) left out" in w for w in report.warnings())
    run = cli("check", str(path), "--allow", "compaction")
    assert run.returncode == 0, run.stdout + run.stderr


# --- Claude Code 2.1.197: /compact with a summary (`compact_boundary` + `compactMetadata`) ----------

def _claude_compact():
    [t] = read_transcripts(CLAUDE / "compact-boundary.jsonl")
    recording = recorded(CLAUDE / "recording-compact-boundary.jsonl")
    # the 3rd request is the summarisation (Claude Code's own prompt; not in the transcript)
    assert "create a detailed summary" in json.dumps(recording[2]["request"]["messages"][-1])
    return t, [r for i, r in enumerate(recording) if i != 2]


def test_claude_code_compact_boundary_is_read_and_the_calls_before_it_are_what_claude_code_sent():
    t, loop = _claude_compact()
    lines = [json.loads(line) for line in (CLAUDE / "compact-boundary.jsonl").read_text().splitlines()]
    [boundary] = [o for o in lines if o.get("subtype") == "compact_boundary"]
    assert boundary["compactMetadata"]["trigger"] == "manual" and "preservedSegment" in boundary["compactMetadata"]
    assert t.version == "2.1.197" and t.calls == len(t.turns) == len(loop) == 4 and t.compacted == {3}
    for turn, rec in zip(t.turns, loop):
        assert (turn.prompt_tokens, turn.cached_tokens) == (rec["tokens"]["prompt"], rec["tokens"]["cached"])
    for turn, rec in zip(t.turns[:2], loop[:2]):
        # the first user message less the <system-reminder> block the notes name
        assert turn.request_body["messages"][1:] == without_cache_control(rec["request"]["messages"][1:])
    summary = t.turns[2].request_body["messages"][0]
    assert "This session is being continued from a previous conversation" in json.dumps(summary)


def test_claude_code_compact_boundary_is_named_compaction_and_allowed():
    path = CLAUDE / "compact-boundary.jsonl"
    assert breaks(analyze(path)) == [(3, "compaction")]
    assert check(path, allow="compaction").ok and not check(path).ok
    run = cli("check", str(path), "--allow", "compaction")
    assert run.returncode == 0, run.stdout + run.stderr


def test_claude_code_compaction_in_recorded_traffic_is_named_compaction_not_a_system_rewrite():
    """Through the proxy, the call after /compact opens with Claude Code's summary, and its system prompt's
    billing fingerprint (`cc_version=2.1.197.<fp>`) changed with it: the summary names the cause."""
    path = CLAUDE / "recording-compact-boundary.jsonl"
    systems = [json.dumps(r["request"]["system"]) for r in recorded(path)]
    assert systems[0] == systems[1] != systems[3]  # the fingerprint moved at the compaction
    assert breaks(analyze(path)) == [(4, "compaction")]
    assert check(path, allow="compaction").ok and not check(path).ok


def test_claude_code_calls_after_a_compact_boundary_send_the_preserved_segment_and_the_reattached_file():
    """compactMetadata.preservedSegment: the reply the compaction kept (on the old chain) is sent right
    after the summary (its anchor); the file Claude Code re-attached (an `attachment` line) is sent as
    the `system` message it sent, after the user message of the command's lines."""
    t, loop = _claude_compact()
    for turn, rec in zip(t.turns[2:], loop[2:]):
        sent, rebuilt = without_cache_control(rec["request"]["messages"]), turn.request_body["messages"]
        assert sent[1]["role"] == "assistant" and rebuilt[1] == sent[1]
        [attached] = [m for m in sent if m["role"] == "system"]
        assert [m for m in rebuilt if m["role"] == "system"] == [attached]
        assert rebuilt.index(attached) == 3 == sent.index(attached)


def test_claude_code_calls_after_a_compact_boundary_are_what_claude_code_sent():
    t, loop = _claude_compact()
    for turn, rec in zip(t.turns[2:], loop[2:]):
        assert as_blocks(turn.request_body["messages"][1:]) == as_blocks(without_cache_control(rec["request"]["messages"][1:]))


# --- Claude Code parallel tool calls (each result parented to its own call's line) -------------------

@pytest.mark.parametrize("version", ["2.0.77", "2.1.197"])  # results after the reply's lines / between them
def test_claude_code_parallel_tool_calls_send_back_one_reply_and_every_result_in_the_calls_order(version):
    [t] = read_transcripts(CLAUDE / f"parallel-tool-calls-{version}.jsonl")
    loop = [r for r in recorded(CLAUDE / f"recording-parallel-tool-calls-{version}.jsonl")
            if "Warmup" not in json.dumps(r["request"]["messages"][0])]  # the sub-agents' warm-ups: not this file
    assert t.version == version and len(t.turns) == len(loop) == 2
    for turn, rec in zip(t.turns, loop, strict=True):
        assert turn.request_body["messages"][1:] == without_cache_control(rec["request"]["messages"][1:])
        assert (turn.prompt_tokens, turn.cached_tokens) == (rec["tokens"]["prompt"], rec["tokens"]["cached"])
    calls = [b["id"] for b in t.turns[1].request_body["messages"][1]["content"] if b["type"] == "tool_use"]
    results = [b["tool_use_id"] for b in t.turns[1].request_body["messages"][2]["content"]]
    assert len(calls) == 2 and results == calls
