"""Session files public projects committed (fixtures/transcripts/*/real, PROVENANCE.md beside them),
read as a user's would be: every format version named, every call rebuilt with its history or left
out with a note, the file's order kept, and compactions named as compactions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analyzer import analyze, check
from recorder.transcripts import read_transcripts, transcript_turns
from recorder.transcripts.common import parse_time

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "fixtures" / "transcripts"


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def history(turn) -> list:
    body = turn.request_body
    return body.get("messages", body.get("input"))


def causes(report) -> list[str]:
    return [t.brk.cause for s in report.sessions for t in s.turns if t.brk is not None]


def write_lines(path: Path, objs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


# --- pi, version 1 (pi-mono's own fixtures) --------------------------------------------------------

def test_pi_version_1_session_rebuilds_every_call_with_its_history():
    [t] = read_transcripts(REAL / "pi" / "real" / "before-compaction.jsonl")
    assert t.version == "session format v1"
    # 318 assistant entries in the 660 lines kept; before this reader every request was "messages": []
    assert t.calls == 318 and len(t.turns) == 318
    assert all(history(turn) for turn in t.turns)
    # the `!ls` the user ran (a bashExecution entry) travels as a user message, as pi's convertToLlm sends it
    assert any(m["role"] == "user" and "Ran `ls`" in json.dumps(m["content"]) for m in history(t.turns[-1]))


def test_pi_version_1_compactions_are_rebuilt_as_pi_sends_them_and_named_compaction():
    path = REAL / "pi" / "real" / "before-compaction.jsonl"
    [t] = read_transcripts(path)
    assert len(t.compacted) == 2
    for n in sorted(t.compacted):
        first = history(t.turns[n - 1])[0]
        assert first["role"] == "user"
        assert first["content"][0]["text"].startswith("The conversation history before this point was compacted")
        assert len(history(t.turns[n - 1])) < len(history(t.turns[n - 2]))
    report = analyze(path)
    assert causes(report).count("compaction") == 2
    assert "system_rewrite" not in causes(report) and "history_edit" not in causes(report)


@pytest.mark.slow
def test_check_allow_compaction_passes_a_pi_session_whose_only_client_breaks_are_compactions():
    path = REAL / "pi" / "real" / "before-compaction.jsonl"
    assert check(path, allow="compaction").ok
    assert not check(path).ok


def test_pi_session_with_two_entries_glued_on_one_line_reads_both():
    """pi appended an entry to a line that had lost its newline (line 440 of this real file): both
    entries were in the session pi sent, so both are read, and the notes say so."""
    path = REAL / "pi" / "real" / "session-glued-line.jsonl"
    [t] = read_transcripts(path)
    assert t.version == "session format v1" and t.calls == len(t.turns) == 212
    assert any("1 line(s) held two entries" in n for n in t.notes)
    # the user's "ok" glued after an assistant reply is in the next call's history
    after = [turn for turn in t.turns if turn.started_at > parse_time("2025-12-17T21:20:35Z")][0]
    assert any(m["role"] == "user" and json.dumps(m["content"]) in ('"ok"', '[{"type": "text", "text": "ok"}]')
               for m in history(after))
    # every break the analyzer finds is one the provider's usage shows: 4 full misses
    assert causes(analyze(path)) == ["server_miss"] * 4


def test_pi_session_with_a_compaction_and_misses_names_each_as_the_usage_shows():
    path = REAL / "pi" / "real" / "compact.jsonl"
    [t] = read_transcripts(path)
    assert t.version == "session format v1" and t.calls == len(t.turns) == 348
    assert len(t.compacted) == 1
    found = causes(analyze(path))
    assert sorted(found) == ["compaction"] + ["server_miss"] * 10


def test_pi_session_format_newer_than_any_shipped_is_refused_in_one_line_naming_it(tmp_path):
    src = write_lines(tmp_path / "s.jsonl", [
        {"type": "session", "version": 9, "id": "x", "timestamp": "2026-01-01T00:00:00Z", "cwd": "/w"},
        {"type": "message", "id": "a", "parentId": None, "message": {"role": "user", "content": "hi"}}])
    out = cli("import", str(src), "--db", str(tmp_path / "t.db"))
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pi session format version 9 is not supported" in lines[0], out.stderr


# --- Claude Code 1.0.x to 2.1 (claude-code-log's test data) -----------------------------------------

def test_claude_code_1_0_files_without_parent_links_keep_the_files_order():
    [t] = read_transcripts(REAL / "claude" / "real" / "representative_messages.jsonl")
    assert t.version == "1.0.0" and t.calls == len(t.turns) == 5
    sizes = [len(history(turn)) for turn in t.turns]
    assert sizes == sorted(sizes) and sizes[0] == 1
    assert any("no parentUuid links" in n for n in t.notes)


def test_a_call_whose_history_is_not_in_the_file_is_left_out_with_a_note(tmp_path):
    transcripts = read_transcripts(REAL / "claude" / "real" / "sidechain_integrated.jsonl")
    [t] = transcripts
    assert t.version == "2.0.46" and t.calls == 2 and len(t.turns) == 1
    assert "1 call(s) left out: their history (the messages sent) is not in the file" in t.notes
    assert all(history(turn) for turn in t.turns)


def test_import_exits_non_zero_when_a_file_rebuilt_under_half_its_calls_and_keeps_what_it_read(tmp_path):
    db = tmp_path / "t.db"
    out = cli("import", str(REAL / "claude" / "real" / "edge_cases.jsonl"), "--db", str(db))
    assert out.returncode == 1
    assert "rebuilt 0 of its 1 call(s): fewer than half" in out.stderr
    assert "imported 3 turns" in out.stdout  # the other session of the file is stored
    analyzed = cli("analyze", str(REAL / "claude" / "real" / "edge_cases.jsonl"))
    assert analyzed.returncode == 1 and "fewer than half" in analyzed.stderr


def test_claude_code_rewind_and_compact_boundary_are_read_from_the_parent_chain():
    path = REAL / "claude" / "real" / "dag_compact_after_rewind.jsonl"
    [t] = read_transcripts(path)
    texts = [[json.dumps(m["content"]) for m in history(turn)] for turn in t.turns]
    assert not any("First attempt" in x for x in texts[2])  # the rewound branch is not in the later history
    assert t.compacted == {5} and "isCompactSummary" not in texts[4][0]
    assert "continued from a previous conversation" in texts[4][0]
    assert causes(analyze(path)) == ["request_local_tail", "compaction"]  # was history_edit
    assert check(path, allow="compaction,request_local_tail").ok
    assert not check(path, allow="request_local_tail").ok


def test_claude_code_turns_keep_the_files_order_when_its_timestamps_go_backwards(tmp_path):
    """A resumed session rewrote many lines to one timestamp: the file's order is the call order."""
    src = REAL / "claude" / "efe4eb98-da5c-4c54-8f08-1e2f0925168f.jsonl"
    objs = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    for i, o in enumerate(objs):
        if "timestamp" in o:
            o["timestamp"] = f"2026-01-01T00:00:{59 - i % 60:02d}.000Z"  # every line earlier than the one before
    turns, _ = transcript_turns(write_lines(tmp_path / "s.jsonl", objs))
    sizes = [len(history(t)) for t in turns]
    assert sizes == sorted(sizes), sizes
    assert check(turns).ok  # as the untouched file: no false compaction


def test_concurrent_replies_are_not_rebuilt_into_requests_ending_with_an_assistant_message(tmp_path):
    base = {"sessionId": "s", "version": "2.0.5", "isSidechain": False, "userType": "external", "cwd": "/w"}

    def reply(uuid, parent, mid, text):
        return {**base, "type": "assistant", "uuid": uuid, "parentUuid": parent, "timestamp": "2026-01-01T00:00:01Z",
                "message": {"id": mid, "role": "assistant", "model": "m", "content": [{"type": "text", "text": text}],
                            "stop_reason": "end_turn", "usage": {"input_tokens": 5, "output_tokens": 1}}}
    src = write_lines(tmp_path / "s.jsonl", [
        {**base, "type": "user", "uuid": "u1", "parentUuid": None, "timestamp": "2026-01-01T00:00:00Z",
         "message": {"role": "user", "content": "two things at once"}},
        reply("a1", "u1", "msg_a", "first"),
        reply("b1", "a1", "msg_b", "second, sent alongside the first"),  # written after a1, linked to it
    ])
    [t] = read_transcripts(src)
    assert len(t.turns) == 2
    assert all(history(turn)[-1]["role"] == "user" for turn in t.turns)
    assert any("concurrent requests" in n for n in t.notes)


# --- Codex -----------------------------------------------------------------------------------------

def test_codex_rollout_before_session_meta_is_read_and_named():
    path = REAL / "codex" / "real" / "rollout-44444444-4444-4444-8444-444444444444.jsonl"
    [t] = read_transcripts(path)
    assert t.version == "rollout before session_meta"
    [turn] = t.turns
    assert history(turn) == [{"type": "message", "role": "user",
                              "content": [{"type": "input_text", "text": "Open the synthetic legacy session."}]}]
    assert turn.response_text == "The synthetic legacy session is open."


def test_codex_remote_compaction_is_named_compaction_and_allowed(tmp_path):
    """A `compacted` line whose replacement history ends in a `compaction` item, appended to the
    recorded rollout (no public rollout with one was found): before, `system_rewrite/volatile:counter`."""
    src = next((REAL / "codex").glob("rollout-*.jsonl"))
    objs = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    user = next(o["payload"] for o in objs if o["type"] == "response_item" and o["payload"].get("role") == "user")
    ts = "2026-12-02T07:30:00.000Z"
    objs += [
        {"timestamp": ts, "type": "compacted", "payload": {"message": "", "replacement_history": [
            user, {"type": "compaction", "id": "cmp_1", "encrypted_content": "opaque"}]}},
        {"timestamp": ts, "type": "response_item", "payload": {"type": "message", "role": "user",
                                                               "content": [{"type": "input_text", "text": "go on"}]}},
        {"timestamp": ts, "type": "response_item", "payload": {"type": "message", "role": "assistant",
                                                               "content": [{"type": "output_text", "text": "done"}]}},
        {"timestamp": ts, "type": "token_usage_record", "payload": {"usage": {"input_tokens": 900, "output_tokens": 2,
                                                                              "cached_input_tokens": 0}}},
    ]
    path = write_lines(tmp_path / src.name, objs)
    [t] = read_transcripts(path)
    assert t.compacted == {len(t.turns)}
    assert causes(analyze(path)) == ["compaction"]
    out = cli("check", str(path), "--allow", "compaction")
    assert out.returncode == 0, out.stdout + out.stderr


# --- opencode --------------------------------------------------------------------------------------

def test_opencode_json_storage_rebuilds_the_same_calls_as_its_database(tmp_path):
    """opencode before 1.x's database kept each session, message and part as a JSON file; written here
    from the recorded database's rows (the same objects, plus their ids), both forms must agree."""
    import sqlite3

    db = REAL / "opencode" / "opencode.db"
    storage = tmp_path / "opencode" / "storage"
    con = sqlite3.connect(db)
    for sid, project, parent, created in con.execute("select id, project_id, parent_id, time_created from session"):
        f = storage / "session" / project / f"{sid}.json"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"id": sid, "projectID": project, "parentID": parent, "time": {"created": created}}))
    for mid, sid, data in con.execute("select id, session_id, data from message"):
        f = storage / "message" / sid / f"{mid}.json"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"id": mid, "sessionID": sid, **json.loads(data)}))
    for pid, mid, sid, data in con.execute("select id, message_id, session_id, data from part"):
        f = storage / "part" / mid / f"{pid}.json"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"id": pid, "messageID": mid, "sessionID": sid, **json.loads(data)}))
    con.close()
    from_db, from_json = read_transcripts(db), read_transcripts(tmp_path)
    assert from_json[0].version.startswith("JSON storage") and from_db[0].version == "opencode.db (opencode 1.18.33)"
    assert [[history(t) for t in s.turns] for s in from_json] == [[history(t) for t in s.turns] for s in from_db]
    assert sum(len(s.turns) for s in from_json) > 0


def test_a_resumed_claude_code_session_repeating_another_files_calls_counts_each_once(tmp_path):
    """Claude Code's file for a resumed session starts with the lines of the file it resumed (same
    session id, same reply ids): a directory import keeps each call once, and says so."""
    src = REAL / "claude" / "efe4eb98-da5c-4c54-8f08-1e2f0925168f.jsonl"
    lines = [line for line in src.read_text().splitlines() if line.strip()]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")  # the resumed copy (nothing new said yet)
    found = read_transcripts(tmp_path)
    assert [len(t.turns) for t in found] == [4]
    assert found.skipped == [(str(tmp_path / "b.jsonl"),
                              f"every call of session {found[0].session_id} is also in a.jsonl")]
    assert found.poorly_rebuilt() == []
    assert check([turn for t in found for turn in t.turns]).ok


# --- opencode JSON storage, written here by opencode 1.1.65 (the last minor before opencode.db) ----

OPENCODE_JSON = REAL / "opencode" / "real" / "json-storage-1.1.65"


def test_opencode_json_storage_written_by_opencode_rebuilds_the_requests_it_sent():
    """Two `opencode run` calls (the second `-c`) against a prefixtrace serve, which recorded what
    opencode sent: the storage's rebuild is those requests, less the system prompt the notes name."""
    turns, [t] = transcript_turns(OPENCODE_JSON / "storage")
    assert t.version == "JSON storage (opencode 1.1.65)"
    recorded = [json.loads(line) for line in (OPENCODE_JSON / "recording.jsonl").read_text().splitlines()]
    loop = [r for r in recorded if r["request"].get("tools")]  # the rest are title requests (noted)
    assert len(turns) == len(loop) == 3 and len(recorded) == 6
    for turn, rec in zip(turns, loop, strict=True):
        assert turn.request_body["messages"] == [m for m in rec["request"]["messages"] if m["role"] != "system"]
        assert turn.response_text == rec["response"]["text"]
        assert (turn.prompt_tokens, turn.cached_tokens) == (rec["tokens"]["prompt"], rec["tokens"]["cached"])
    # the `-c` run continued the same session: one session, append-only, no break
    assert causes(analyze(turns)) == []


def test_opencode_json_storage_imports_from_the_data_directory(tmp_path):
    r = cli("import", str(OPENCODE_JSON), "--db", str(tmp_path / "x.db"))
    assert r.returncode == 0, r.stderr
    assert "JSON storage (opencode 1.1.65)): 3 of 3 call(s) rebuilt" in r.stdout


# --- Codex local compaction, written here by codex-cli 0.171.0 --------------------------------------

def test_codex_rollout_with_local_compactions_names_each_compaction_and_passes_check_allow_compaction():
    path = next((REAL / "codex" / "real").glob("rollout-2026-12-05T03-17-27-*.jsonl"))
    [t] = read_transcripts(path)
    assert t.version == "rollout of codex_exec 0.171.0" and t.calls == 7
    assert all(history(turn) for turn in t.turns)
    assert causes(analyze(path)).count("compaction") >= 1 and set(causes(analyze(path))) == {"compaction"}
    assert check(path, allow="compaction").ok and not check(path).ok


def test_codex_rollout_with_local_compactions_rebuilds_the_loop_and_leaves_the_summary_calls_out():
    """Codex wrote each summarisation call (reply + usage) before its `compacted` line: those 3 calls
    are left out (their prompt is Codex's own), and the 4 calls of the loop are exactly what the proxy
    recorded of the same run, less the base-instructions message the notes name."""
    real = REAL / "codex" / "real"
    path = next(real.glob("rollout-2026-12-05T03-17-27-*.jsonl"))
    [t] = read_transcripts(path)
    assert t.version == "rollout of codex_exec 0.171.0" and t.calls == 7 and len(t.turns) == 4
    assert "3 compaction request(s) left out: Codex's summarisation prompt is not in the file" in t.notes
    assert sorted(t.compacted) == [2, 3, 4]  # each call after a `compacted` line
    recorded = [json.loads(line) for line in (real / "recording-local-compaction.jsonl").read_text().splitlines()]
    loop = [r for r in recorded if r["request"].get("tools")]  # the rest are the summarisation calls
    for turn, rec in zip(t.turns, loop, strict=True):
        sent = [{k: v for k, v in i.items() if k != "internal_chat_message_metadata_passthrough"}
                for i in rec["request"]["input"][1:]]
        assert turn.request_body["input"] == sent
        assert (turn.prompt_tokens, turn.cached_tokens) == (rec["tokens"]["prompt"], rec["tokens"]["cached"])
    assert causes(analyze(path)) == ["compaction"]  # the later two kept the compacted prefix
    assert check(path, allow="compaction").ok and not check(path).ok


# --- Claude Code 2.1.197, resumed twice (`-r`), a `/compact` that failed in between (written here) ---

CLAUDE_RESUMED = REAL / "claude" / "real" / "resumed-after-failed-compact.jsonl"


def _without_cache_control(messages: list) -> list:
    """The messages less Claude Code's `cache_control` markers (not in the transcript: noted)."""
    def strip(v):
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k != "cache_control"}
        return [strip(x) for x in v] if isinstance(v, list) else v
    return strip(messages)


def _claude_resumed():
    [t] = read_transcripts(CLAUDE_RESUMED)
    recorded = [json.loads(line) for line in
                (REAL / "claude" / "real" / "recording-resumed-after-failed-compact.jsonl").read_text().splitlines()]
    # the 3rd recorded request is the failed summarisation (a side request, not in the transcript)
    return t, [r for i, r in enumerate(recorded) if i != 2]


def test_claude_code_resumed_session_rebuilds_the_calls_before_the_local_command():
    t, recorded = _claude_resumed()
    assert t.version == "2.1.197" and t.calls == len(t.turns) == 3
    for turn, rec in zip(t.turns[:2], recorded[:2]):
        # the first user message less the <system-reminder> block the notes name
        assert turn.request_body["messages"][1:] == _without_cache_control(rec["request"]["messages"][1:])
        assert (turn.prompt_tokens, turn.cached_tokens) == (rec["tokens"]["prompt"], rec["tokens"]["cached"])


def test_claude_code_call_after_a_local_command_is_what_claude_code_sent():
    """Resumed after `/compact` (which failed), Claude Code sends its `<synthetic>` "No response
    requested." reply after the command, then the command's stdout (a `system` line beside that reply,
    on no chain) merged into the next prompt, with a "\n" ending each text that meets another."""
    t, recorded = _claude_resumed()
    assert t.turns[2].request_body["messages"][1:] == _without_cache_control(recorded[2]["request"]["messages"][1:])
    assert (t.turns[2].prompt_tokens, t.turns[2].cached_tokens) == (recorded[2]["tokens"]["prompt"],
                                                                   recorded[2]["tokens"]["cached"])
    assert not causes(analyze(CLAUDE_RESUMED))  # each call extends the one before it
