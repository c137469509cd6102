"""Harness transcripts in (docs/FORMATS.md "Transcripts"): the session files Claude Code, Codex, pi
and opencode wrote in one real run each (fixtures/transcripts/<harness>/, recorded by
fixtures/transcripts/record.py against a real `prefixtrace serve` on SmolLM2), rebuilt into requests.

The strong check: the proxy recorded the real requests of that same run (`recording.jsonl`, through
`prefixtrace export`); each rebuilt request must carry the recorded messages (roles, contents, tool
calls and results) except exactly what its session's notes say the transcript does not hold.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from analyzer import analyze, check
from recorder.reader import iter_turns
from recorder.sources import import_path, load_turns
from recorder.transcripts import read_transcripts, sniff_transcript, transcript_turns

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "transcripts"


def session_file(harness: str) -> Path:
    files = [p for p in (FIX / harness).iterdir() if p.name not in ("recording.jsonl", "README.md", "real")]
    assert len(files) == 1, files
    return files[0]


def recording(harness: str) -> list[dict]:
    return [json.loads(line) for line in (FIX / harness / "recording.jsonl").read_text().splitlines() if line.strip()]


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def strip_cache_control(value):
    if isinstance(value, dict):
        return {k: strip_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [strip_cache_control(v) for v in value]
    return value


def parsed_args(call: dict):
    args = call["function"]["arguments"]
    return json.loads(args) if isinstance(args, str) else args


def assert_same_calls(rebuilt: list[dict] | None, recorded: list[dict] | None) -> None:
    rebuilt, recorded = rebuilt or [], recorded or []
    assert [(c["id"], c["function"]["name"], parsed_args(c)) for c in rebuilt] == \
           [(c["id"], c["function"]["name"], parsed_args(c)) for c in recorded]


# --- Claude Code ---------------------------------------------------------------------------------

CLAUDE_MAX_TOKENS_NUDGE = "Output token limit hit."


def claude_wire_view(messages: list[dict]) -> list[dict]:
    """A recorded Messages request less what the notes say a transcript lacks: the <system-reminder>
    block before the first prompt, the max_tokens nudge, cache_control; string content as one block."""
    out = []
    for m in strip_cache_control(messages):
        content = m["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        blocks = [b for b in blocks if not (b.get("type") == "text" and
                                            (b["text"].startswith("<system-reminder>") or
                                             b["text"].startswith(CLAUDE_MAX_TOKENS_NUDGE)))]
        if blocks:
            out.append({"role": m["role"], "content": blocks})
    return out


def test_claude_code_session_is_sniffed_and_rebuilt_call_by_call():
    path = session_file("claude")
    assert sniff_transcript(path) == "claude-code"
    [t] = read_transcripts(path)
    assert t.session_id == path.stem  # the file is named after the session
    assert len(t.turns) == len(recording("claude")) == 4
    for turn in t.turns:
        assert turn.session_id == t.session_id
        assert turn.upstream == "transcript:claude-code" and turn.endpoint == "/v1/messages"
        assert turn.render["transcript"]["not_rebuilt"] == t.notes
        assert "system" not in turn.request_body and "tools" not in turn.request_body  # never guessed
    first = t.turns[0].request_body["messages"]
    assert first == [{"role": "user", "content": "Read the file hello.txt"}]
    assert t.turns[0].tool_calls[0]["function"]["name"] == "Read"
    assert [turn.finish_reason for turn in t.turns] == ["tool_calls", "stop", "length", "stop"]
    assert (t.turns[1].prompt_tokens, t.turns[1].cached_tokens) == (1529, 1500)  # the reply's usage


def test_claude_code_notes_say_what_the_transcript_does_not_hold():
    [t] = read_transcripts(session_file("claude"))
    notes = " | ".join(t.notes)
    for missing in ("system prompt", "tool definitions", "<system-reminder>", "max_tokens is not in the transcript"):
        assert missing in notes, notes


def test_claude_code_rebuilt_requests_match_the_recorded_ones():
    turns, _ = transcript_turns(session_file("claude"))
    recorded = recording("claude")
    for turn, rec in zip(turns, recorded, strict=True):
        assert rec["session"] == turn.session_id
        assert claude_wire_view(turn.request_body["messages"]) == claude_wire_view(rec["request"]["messages"]), \
            turn.request_id
        assert_same_calls(turn.tool_calls, rec["response"]["tool_calls"])
        assert turn.response_text == rec["response"]["text"]
        assert abs(turn.started_at - rec["ts"]) < 2.0  # the line before the call was written as it left
    # what the notes name is exactly what differs: the recorded requests do carry it
    assert all("system" in r["request"] and r["request"]["tools"] for r in recorded)
    assert recorded[0]["request"]["messages"][0]["content"][0]["text"].startswith("<system-reminder>")
    assert recorded[3]["request"]["messages"][-1]["content"][0]["text"].startswith(CLAUDE_MAX_TOKENS_NUDGE)


# --- pi ------------------------------------------------------------------------------------------


def test_pi_session_is_sniffed_and_rebuilt_in_chat_completions_form():
    path = session_file("pi")
    assert sniff_transcript(path) == "pi"
    [t] = read_transcripts(path)
    assert path.stem.endswith(t.session_id)  # <time>_<session id>.jsonl
    assert [turn.endpoint for turn in t.turns] == ["/v1/chat/completions"] * 2
    assert all(turn.upstream == "transcript:pi" and turn.session_id == t.session_id for turn in t.turns)
    second = t.turns[1].request_body["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "tool"]
    assert second[1]["content"] is None and second[1]["tool_calls"][0]["function"]["name"] == "read"
    assert "pineapple-" in second[2]["content"]
    notes = " | ".join(t.notes)
    assert "system prompt" in notes and "tool definitions" in notes


def test_pi_rebuilt_requests_match_the_recorded_ones():
    turns, _ = transcript_turns(session_file("pi"))
    recorded = recording("pi")
    for turn, rec in zip(turns, recorded, strict=True):
        system, *rest = rec["request"]["messages"]
        assert system["role"] == "system"  # the one message the transcript does not hold (noted)
        assert turn.request_body["messages"] == rest  # byte-level JSON equality, tool-call arguments included
        assert_same_calls(turn.tool_calls, rec["response"]["tool_calls"])
        assert turn.response_text == rec["response"]["text"]
        assert (turn.prompt_tokens, turn.cached_tokens) == (rec["tokens"]["prompt"], rec["tokens"]["cached"])
        assert abs(turn.started_at - rec["ts"]) < 2.0


# --- opencode ------------------------------------------------------------------------------------


def test_opencode_database_is_sniffed_and_rebuilt_per_step():
    db = FIX / "opencode" / "opencode.db"
    assert sniff_transcript(db) == "opencode" and sniff_transcript(FIX / "opencode") == "opencode"
    [t] = read_transcripts(db)
    assert t.session_id.startswith("ses_")
    assert [turn.finish_reason for turn in t.turns] == ["tool_calls", "stop"]
    second = t.turns[1].request_body["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "tool"]
    assert second[1]["content"] == "" and second[1]["tool_calls"][0]["function"]["name"] == "read"
    assert "pineapple-" in second[2]["content"]
    notes = " | ".join(t.notes)
    assert "system prompt" in notes and "tool definitions" in notes and "title-generation" in notes


def test_opencode_rebuilt_requests_match_the_recorded_ones():
    turns, [t] = transcript_turns(FIX / "opencode" / "opencode.db")
    recorded = recording("opencode")
    title, *loop = recorded  # the side request the notes say is not in the transcript
    assert not title["request"].get("tools") and "Generate a title" in json.dumps(title["request"]["messages"])
    for turn, rec in zip(turns, loop, strict=True):
        assert rec["session"] == turn.session_id  # opencode's X-Session-Id is its session's id
        without_system = [m for m in rec["request"]["messages"] if m["role"] != "system"]
        assert len(without_system) == len(rec["request"]["messages"]) - 1
        assert turn.request_body["messages"] == without_system
        assert_same_calls(turn.tool_calls, rec["response"]["tool_calls"])
        assert turn.response_text == rec["response"]["text"]
        assert (turn.prompt_tokens, turn.cached_tokens) == (rec["tokens"]["prompt"], rec["tokens"]["cached"])
        # the message is created before opencode composes the prompt: seconds early on a busy CPU
        assert 0 <= rec["ts"] - turn.started_at < 15


def test_opencode_database_is_read_without_writing_to_it(tmp_path):
    db = tmp_path / "opencode.db"
    shutil.copy(FIX / "opencode" / "opencode.db", db)
    db.chmod(0o444)
    before = db.read_bytes()
    assert len(read_transcripts(tmp_path)[0].turns) == 2
    assert db.read_bytes() == before


# --- Codex ---------------------------------------------------------------------------------------


def test_codex_rollout_is_sniffed_and_rebuilt_in_responses_form():
    path = session_file("codex")
    assert sniff_transcript(path) == "codex"
    [t] = read_transcripts(path)
    assert path.stem.endswith(t.session_id)  # rollout-<time>-<session id>.jsonl
    assert [turn.endpoint for turn in t.turns] == ["/v1/responses"] * 2
    first, second = (turn.request_body for turn in t.turns)
    assert "instructions" not in first and "tools" not in first
    assert [i["type"] for i in second["input"]][-2:] == ["function_call", "function_call_output"]
    assert all("internal_chat_message_metadata_passthrough" not in i for i in second["input"])
    assert t.turns[0].tool_calls[0]["function"]["name"] == "exec_command"
    notes = " | ".join(t.notes)
    assert "system prompt not in the transcript" in notes and "tool definitions" in notes


def test_codex_rebuilt_requests_match_the_recorded_ones():
    turns, [t] = transcript_turns(session_file("codex"))
    recorded = recording("codex")
    for turn, rec in zip(turns, recorded, strict=True):
        assert rec["session"] == turn.session_id  # Codex's prompt_cache_key is its session id
        base, *rest = rec["request"]["input"]
        assert base["role"] == "developer" and base["content"][0]["text"].startswith("You are a coding agent")
        assert turn.request_body["input"] == rest  # every item, ids included
        assert_same_calls(turn.tool_calls, rec["response"]["tool_calls"])
        assert turn.response_text == rec["response"]["text"]
        assert (turn.prompt_tokens, turn.cached_tokens) == (rec["tokens"]["prompt"], rec["tokens"]["cached"])
        assert abs(turn.started_at - rec["ts"]) < 2.0
    # the rollout's base_instructions are not what was sent, which is why the notes do not guess them
    meta = json.loads(session_file("codex").read_text().splitlines()[0])["payload"]
    assert meta["base_instructions"]["text"] != recorded[0]["request"]["input"][0]["content"][0]["text"]


# --- every harness: import, analyze, check -------------------------------------------------------

HARNESS_DIRS = ["claude", "pi", "opencode", "codex"]


@pytest.mark.parametrize("harness", HARNESS_DIRS)
def test_import_then_analyze_and_check_as_recorded_traffic(harness, tmp_path):
    path = session_file(harness)
    db = tmp_path / "t.db"
    count, transcripts = import_path(path, db)
    assert count == sum(t.rebuilt_count for t in transcripts) > 0
    stored = list(iter_turns(db))
    assert len(stored) == count
    assert all(t.upstream.startswith("transcript:") and t.render["transcript"]["not_rebuilt"] for t in stored)
    assert {t.session_id for t in stored} == {transcripts[0].session_id}
    # importing again replaces rather than duplicates (ids derive from session and call number)
    import_path(path, db)
    assert len(list(iter_turns(db))) == count
    report = analyze(db, tokenizer="regex")
    [session] = [s for s in report.sessions if s.transcript]
    assert session.id == transcripts[0].session_id and not session.inferred
    assert session.transcript["not_rebuilt"] == transcripts[0].notes
    assert any("rebuilt from harness transcripts" in w for w in report.warnings())
    assert report.to_dict()["sessions"][0]["transcript"]["harness"] == transcripts[0].harness
    assert check(db, tokenizer="regex").ok, check(db, tokenizer="regex").summary()
    # exported (prefixtrace's JSONL), the turns still say where they came from
    exported = tmp_path / "t.jsonl"
    assert cli("export", str(db), "--out", str(exported)).returncode == 0
    again = analyze(exported, tokenizer="regex")
    assert [s.transcript for s in again.sessions] == [s.transcript for s in report.sessions]
    # the transcript file itself is an analyzer source too, with the same result
    direct = analyze(path, tokenizer="regex")
    assert [(t.request_id, t.prompt_tokens) for s in direct.sessions for t in s.turns] == \
           [(t.request_id, t.prompt_tokens) for s in report.sessions for t in s.turns]


def test_cli_import_of_a_harness_home_prints_what_each_session_lacks(tmp_path):
    home = tmp_path / "projects"
    for harness in HARNESS_DIRS:  # a directory tree holding sessions of several harnesses
        (home / harness).mkdir(parents=True)
        shutil.copy(session_file(harness), home / harness)
    (home / "notes.jsonl").write_text('{"not": "a transcript"}\n')
    db = tmp_path / "t.db"
    proc = cli("import", str(home), "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    assert "claude-code session efe4eb98" in proc.stdout and "pi session 01a23585" in proc.stdout
    assert "opencode session ses_dca79073" in proc.stdout and "codex session 01a2358a" in proc.stdout
    assert "not rebuilt: system prompt not in the transcript" in proc.stdout
    as_json = json.loads(cli("import", str(home), "--db", str(db), "--json").stdout)
    assert {s["harness"] for s in as_json["sessions"]} == {"claude-code", "pi", "opencode", "codex"}
    assert as_json["imported"] == len(list(iter_turns(db)))
    text = cli("analyze", str(db), "--tokenizer", "regex")
    assert text.returncode == 0, text.stderr
    assert "rebuilt from a transcript of claude-code" in text.stdout and "not rebuilt:" in text.stdout
    page = tmp_path / "r.html"
    assert cli("analyze", str(db), "--tokenizer", "regex", "--format", "html", "--out", str(page)).returncode == 0
    assert 'class="transcript"' in page.read_text() and "title-generation side request" in page.read_text()
    checked = cli("check", str(session_file("pi")), "--tokenizer", "regex")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_not_a_transcript_is_refused_with_a_reason(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"request": {"messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    assert sniff_transcript(plain) is None  # prefixtrace's own JSONL stays JSONL
    assert len(load_turns(plain)) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = cli("import", str(empty), "--db", str(tmp_path / "t.db"))
    assert proc.returncode != 0 and "no Claude Code, Codex, pi or opencode session" in proc.stderr
    (empty / "opencode" / "storage" / "session").mkdir(parents=True)
    (empty / "opencode" / "storage" / "message").mkdir()
    proc = cli("import", str(empty), "--db", str(tmp_path / "t.db"))
    assert proc.returncode != 0 and "opencode's JSON storage, holding no session with a model call" in proc.stderr
    broken = tmp_path / "cut.jsonl"
    text = session_file("pi").read_text()
    broken.write_text(text + text.splitlines()[-1][:40] + "\n")  # a half-written last line (a live session)
    proc = cli("import", str(broken), "--db", str(tmp_path / "t.db"))
    assert proc.returncode != 0 and "cut.jsonl:8" in proc.stderr


def test_claude_code_sidechain_and_synthetic_lines_are_skipped_and_noted(tmp_path):
    """Lines of the real session, altered as Claude Code writes a sub-agent's messages
    (`isSidechain`) and an API error it shows as a reply (`model: "<synthetic>"`)."""
    lines = [json.loads(line) for line in session_file("claude").read_text().splitlines()]
    reply = next(o for o in lines if o["type"] == "assistant")
    sidechain = {**reply, "uuid": "side-1", "isSidechain": True}
    synthetic = {**reply, "uuid": "syn-1", "message": {**reply["message"], "id": "syn", "model": "<synthetic>"}}
    path = tmp_path / f"{reply['sessionId']}.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in [*lines, sidechain, synthetic]))
    [t] = read_transcripts(path)
    assert len(t.turns) == 4  # neither became a model call
    notes = " | ".join(t.notes)
    assert "sidechain" in notes and "synthetic" in notes


def test_claude_code_branched_conversation_gives_each_call_its_own_history(tmp_path):
    """Rewinding (Esc Esc) writes a new user line whose parent is an earlier message: the call after
    it had that branch's history, not the file's order. Built from the real session's lines."""
    lines = [json.loads(line) for line in session_file("claude").read_text().splitlines()]
    first_reply = next(o for o in lines if o["type"] == "assistant")
    last_reply = [o for o in lines if o["type"] == "assistant"][-1]
    prompt = {**next(o for o in lines if o["type"] == "user"), "uuid": "branch-user",
              "parentUuid": first_reply["uuid"], "message": {"role": "user", "content": "Now say it in French"}}
    answer = {**last_reply, "uuid": "branch-reply", "parentUuid": "branch-user",
              "message": {**last_reply["message"], "id": "msg_branch"}}
    path = tmp_path / f"{first_reply['sessionId']}.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in [*lines, prompt, answer]))
    [t] = read_transcripts(path)
    assert len(t.turns) == 5
    branch = t.turns[-1].request_body["messages"]
    assert [m["role"] for m in branch] == ["user", "assistant", "user"]
    assert branch[1]["content"][0]["type"] == "tool_use" and branch[2]["content"] == "Now say it in French"
    # the calls of the main line are unchanged by the branch
    assert [turn.request_body for turn in t.turns[:4]] == [turn.request_body for turn in read_transcripts(
        session_file("claude"))[0].turns]


def test_pi_branched_session_gives_each_call_its_own_history(tmp_path):
    """pi's entries form a tree (`/tree` branches from an earlier entry); built from the real lines."""
    lines = [json.loads(line) for line in session_file("pi").read_text().splitlines()]
    user = next(o for o in lines if o.get("message", {}).get("role") == "user")
    reply = [o for o in lines if o.get("message", {}).get("role") == "assistant"][-1]
    prompt = {**user, "id": "b-user", "parentId": user["parentId"],  # a second first prompt: a new branch
              "message": {**user["message"], "content": [{"type": "text", "text": "List the directory"}]}}
    answer = {**reply, "id": "b-reply", "parentId": "b-user"}
    path = tmp_path / session_file("pi").name
    path.write_text("".join(json.dumps(o) + "\n" for o in [*lines, prompt, answer]))
    [t] = read_transcripts(path)
    assert len(t.turns) == 3
    assert t.turns[-1].request_body["messages"] == [{"role": "user", "content": [{"type": "text",
                                                                                  "text": "List the directory"}]}]
    assert [turn.request_body for turn in t.turns[:2]] == [turn.request_body for turn in read_transcripts(
        session_file("pi"))[0].turns]


def test_transcript_import_redacts_secrets_like_any_import(tmp_path):
    """A key pasted into a prompt is in the harness's file; it must not reach the database."""
    key = "sk-proj-" + "A1b2C3d4E5f6G7h8J9k0" * 2
    lines = [json.loads(line) for line in session_file("pi").read_text().splitlines()]
    for o in lines:
        if o.get("message", {}).get("role") == "user":
            o["message"]["content"][0]["text"] += f" using the key {key}"
    path = tmp_path / session_file("pi").name
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    db = tmp_path / "t.db"
    import_path(path, db)
    stored = json.dumps([t.request_body for t in iter_turns(db)])
    assert key not in stored and "[REDACTED]" in stored
    assert key not in db.read_bytes().decode("latin-1")


@pytest.mark.parametrize("harness", ["claude", "pi", "opencode", "codex"])
def test_calls_share_their_history_objects(harness):
    """Each call's history extends the previous one's with the same message objects, not copies:
    a long session costs linear time and memory (a 2,000-call Claude Code session was 71 s and 1 GB
    when every call rebuilt its own history; bench numbers in the report)."""
    path = FIX / "opencode" if harness == "opencode" else session_file(harness)
    turns = read_transcripts(path)[0].turns
    key = "input" if harness == "codex" else "messages"
    for before, after in zip(turns, turns[1:]):
        shared = [a is b for a, b in zip(before.request_body[key], after.request_body[key])]
        assert shared and shared[0], (before.request_id, after.request_id)
        assert before.request_body[key] is not after.request_body[key]  # each body its own list
