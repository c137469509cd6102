"""A session file imported as a stream: batches committed as it is read, a stop keeps them and says
where, a re-import (over today's ids or an older prefixtrace's) never duplicates, a progress line
only on a terminal."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefixtrace.common.errors import InvalidRequest
from recorder.jsonl import store_turns
from recorder.reader import iter_turns
from recorder.sources import import_path
from recorder.transcripts import codex, read_transcripts
from recorder.transcripts.lines import JsonLines
from recorder.transcripts.streamed import BATCH_TURNS, ImportStopped, import_read

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "transcripts"
ROLLOUT = next((FIX / "codex").glob("rollout-*.jsonl"))
CLAUDE = FIX / "claude" / "efe4eb98-da5c-4c54-8f08-1e2f0925168f.jsonl"
sys.path.insert(0, str(ROOT / "bench"))
from bench_rollout_import import write_long_rollout  # noqa: E402  (the bench's long-session rollout)


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def stored_ids(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT request_id FROM turn_log")]


def long_rollout(tmp_path: Path, megabytes: float) -> Path:
    src = tmp_path / "rollout-2026-12-02T06-56-28-01a2358a-58f2-7510-bb4a-7eb6f95d7d6c.jsonl"
    write_long_rollout(src, megabytes)
    return src


def test_a_streamed_import_stores_what_the_whole_read_rebuilds(tmp_path):
    src = long_rollout(tmp_path, 2.5)  # compactions included: their note reaches turns written before it
    [whole] = read_transcripts(src)
    count, [t] = import_path(src, tmp_path / "t.db")
    assert count == len(whole.turns) == t.rebuilt_count > BATCH_TURNS
    back = {turn.request_id: turn for turn in iter_turns(tmp_path / "t.db")}
    assert [back[turn.request_id].request_body for turn in whole.turns] == [turn.request_body for turn in whole.turns]
    assert [back[turn.request_id].render for turn in whole.turns] == [turn.render for turn in whole.turns]
    assert any("compacted" in n for n in back[whole.turns[0].request_id].render["transcript"]["not_rebuilt"])
    assert [n for n, turn in enumerate(whole.turns, 1) if turn.render["transcript"].get("compacted")] \
        == sorted(whole.compacted) != []


def test_a_line_past_the_bound_is_one_line_naming_its_number(tmp_path):
    src = tmp_path / "s.jsonl"
    src.write_text('{"a": 1}\n' + json.dumps({"b": "x" * 5000}) + "\n")
    with pytest.raises(InvalidRequest) as err:
        list(JsonLines(src, max_line=1000))
    assert err.value.message.startswith(f"{src}:2: a line longer than") and "\n" not in err.value.message


def test_a_rollout_cut_off_mid_line_keeps_the_batches_written_and_a_rerun_completes_it(tmp_path):
    full = long_rollout(tmp_path, 1.5)
    data = full.read_bytes()
    cut = tmp_path / "cut" / full.name
    cut.parent.mkdir()
    cut.write_bytes(data[: int(len(data) * 0.8)].rsplit(b"\n", 1)[0] + b"\n" + b'{"timestamp": "2026-')
    db = tmp_path / "t.db"
    with pytest.raises(ImportStopped) as err:
        import_path(cut, db)
    kept = len(stored_ids(db))
    assert kept and kept % BATCH_TURNS == 0
    lines = data[: int(len(data) * 0.8)].count(b"\n") + 1
    assert f"{cut}:{lines}: not valid JSON (the line is cut off" in err.value.message
    assert f"{kept:,} turn(s) of session" in err.value.message and "never duplicated" in err.value.message
    count, _ = import_path(full, db)  # the whole file (same name): the cut import's turns replaced
    assert sorted(stored_ids(db)) == sorted(t.request_id for t in read_transcripts(full)[0].turns)
    assert len(stored_ids(db)) == count


def test_a_cut_off_rollout_in_a_directory_is_named_with_what_it_kept(tmp_path):
    full = long_rollout(tmp_path, 1.5)
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    data = full.read_bytes()
    (sessions / full.name).write_bytes(data[: len(data) // 2] + b"\x00\xff")
    shutil.copy(CLAUDE, sessions / CLAUDE.name)
    db = tmp_path / "t.db"
    count, found = import_path(sessions, db)
    [(name, why)] = found.skipped
    assert name == str(sessions / full.name) and "not UTF-8 text" in why and "turn(s) of session" in why
    kept = int(why.split("; ")[-2].split(" turn(s)")[0].replace(",", ""))
    assert kept > 0 and len(stored_ids(db)) == count == kept + len(read_transcripts(CLAUDE)[0].turns)


@pytest.mark.parametrize("as_dir", [False, True], ids=["file", "directory"])
@pytest.mark.parametrize("fixture", [ROLLOUT, CLAUDE], ids=["codex", "claude-code"])
def test_reimport_over_an_older_prefixtraces_ids_does_not_duplicate(fixture, as_dir, tmp_path):
    """Before ids named the file, a turn's id was the session's hash and the call number: a
    database written then is rebuilt here the way that code stored it."""
    if as_dir:
        (tmp_path / "sessions").mkdir()
        fixture = Path(shutil.copy(fixture, tmp_path / "sessions" / fixture.name))
    [t] = read_transcripts(fixture)
    digest = hashlib.sha256(f"{t.harness}\0{t.session_id}".encode()).hexdigest()[:12]
    older = [turn for turn in t.turns]
    for turn in older:
        turn.request_id = f"transcript-{t.harness}-{digest}-{turn.request_id.rsplit('-', 1)[1]}"
    db = tmp_path / "old.db"
    store_turns(db, older)
    other = read_transcripts(fixture)[0].turns[0]  # the same session's call from another file: kept
    other.request_id = f"transcript-{t.harness}-{digest}-9999"
    other.render["transcript"]["file"] = "another-file.jsonl"
    store_turns(db, [other])
    count, _ = import_path(fixture.parent if as_dir else fixture, db)
    ids = stored_ids(db)
    assert len(ids) == count + 1 == len(t.turns) + 1
    assert [i for i in ids if digest in i] == [other.request_id]
    import_path(fixture.parent if as_dir else fixture, db)
    assert len(stored_ids(db)) == count + 1


def _wait_for_turns(db: Path, proc: subprocess.Popen, at_least: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if len(stored_ids(db)) >= at_least:
                return
        except sqlite3.Error:
            pass
        time.sleep(0.05)
    raise AssertionError("the import wrote nothing before it ended")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_mid_import_keeps_what_was_committed_and_says_where(signum, tmp_path):
    src = long_rollout(tmp_path, 40)
    db = tmp_path / "t.db"
    proc = subprocess.Popen([sys.executable, "-m", "prefixtrace.cli", "import", str(src), "--db", str(db)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    _wait_for_turns(db, proc, 2 * BATCH_TURNS)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    kept = len(stored_ids(db))
    assert f"interrupted at line " in err and f"{kept:,} turn(s) of session" in err and " MB read" in err
    assert 0 < kept < len(read_transcripts(src)[0].turns)
    done = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "import", str(src), "--db", str(db), "--json"],
                          capture_output=True, text=True, env=env(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(stored_ids(db)) == json.loads(done.stdout)["imported"] > kept


def test_the_progress_line_shows_on_a_terminal_and_not_on_a_pipe(tmp_path):
    src = long_rollout(tmp_path, 6)
    pid, fd = pty.fork()
    if pid == 0:  # the child: stderr is the pty
        os.execve(sys.executable, [sys.executable, "-m", "prefixtrace.cli", "import", str(src),
                                   "--db", str(tmp_path / "tty.db")], {**env(), "COLUMNS": "120"})
    seen = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.waitpid(pid, 0)
    (tmp_path / "tty.txt").write_bytes(seen)
    text = seen.decode(errors="replace")
    assert "turns written" in text and "importing rollout-20…" in text and "MB" in text
    piped = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "import", str(src), "--db", str(tmp_path / "p.db")],
                           capture_output=True, text=True, env=env(), timeout=120)
    assert piped.returncode == 0 and piped.stderr == "" and "turns written" not in piped.stdout


SESSION_FILES = sorted(p for p in FIX.glob("*/real/*.jsonl") if not p.name.startswith("recording")) + \
    sorted(p for p in FIX.glob("*/*.jsonl") if p.name != "recording.jsonl")


@pytest.mark.parametrize("src", SESSION_FILES, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_every_real_session_file_streamed_stores_what_the_whole_read_rebuilds(src, tmp_path):
    """Claude Code (two passes, lines read back), pi (one pass, glued lines split) and Codex files are
    imported as a stream; the database holds what the file read whole and then written holds: the
    same requests, replies, counts, times and notes, and the same sessions."""
    whole = read_transcripts(src)
    count, streamed = import_path(src, tmp_path / "streamed.db")
    assert [(t.session_id, t.calls, t.rebuilt_count) for t in streamed] == \
        [(t.session_id, t.calls, len(t.turns)) for t in whole]
    assert count == import_read(whole, tmp_path / "whole.db") == sum(len(t.turns) for t in whole)

    def stored(db: Path) -> list[tuple]:
        return [(t.request_id, t.request_body, t.render, t.started_at, t.response_text, t.tool_calls,
                 t.prompt_tokens, t.cached_tokens) for t in iter_turns(db)]
    assert stored(tmp_path / "streamed.db") == stored(tmp_path / "whole.db")


@pytest.mark.parametrize("src", [FIX / "pi" / "real" / "compact.jsonl",
                                 FIX / "claude" / "real" / "resumed-after-failed-compact.jsonl"], ids=["pi", "claude"])
def test_pi_and_claude_code_hand_on_their_first_call_before_the_file_is_rebuilt(src):
    """Read as a stream: the first call comes while the file is read (pi) or rebuilt (Claude Code's
    second pass reads back lines by offset), not after every call of the file was made."""
    from recorder.transcripts import HARNESSES, sniff_transcript
    stream = HARNESSES[sniff_transcript(src)].stream(src)
    next(stream.turns)
    assert 0 < stream.where.position < stream.where.size / 2


def test_a_directory_import_streams_claude_code_files_and_counts_a_resumed_sessions_calls_once(tmp_path):
    """A resumed session's new file starts with the lines of the file it resumed (same session, same
    reply ids): streamed file by file, each call is stored once, by the first file, as a whole read
    keeps it, and the copy is named in `skipped`."""
    lines = [line for line in CLAUDE.read_text().splitlines() if line.strip()]
    home = tmp_path / "projects"
    home.mkdir()
    (home / "a.jsonl").write_text("\n".join(lines) + "\n")
    (home / "b.jsonl").write_text("\n".join(lines) + "\n")
    whole = read_transcripts(home)
    count, found = import_path(home, tmp_path / "t.db")
    assert count == len(stored_ids(tmp_path / "t.db")) == sum(len(t.turns) for t in whole) == 4
    assert found.skipped == whole.skipped == [(str(home / "b.jsonl"),
                                               f"every call of session {whole[0].session_id} is also in a.jsonl")]
    assert [(t.source, t.rebuilt_count) for t in found] == [(str(home / "a.jsonl"), 4)]


@pytest.mark.parametrize("src", [FIX / "opencode" / "opencode.db", FIX / "opencode",
                                 FIX / "opencode" / "real" / "json-storage-1.1.65"],
                         ids=["database", "data home", "JSON storage"])
def test_opencode_streamed_message_by_message_stores_what_the_whole_read_rebuilds(src, tmp_path):
    """opencode's database (one indexed query per message's parts) and its JSON storage are read
    session by session, message by message; the database holds what the whole read rebuilds."""
    from recorder.transcripts.streamed import STREAMED
    stream = STREAMED["opencode"](src / "opencode.db" if src.name == "opencode" else
                                  src / "storage" if src.is_dir() else src)
    assert not any(t.turns for t in stream.sessions) and next(stream.turns).request_body["messages"]
    whole = read_transcripts(src)
    count, streamed = import_path(src, tmp_path / "streamed.db")
    assert [(t.session_id, t.rebuilt_count) for t in streamed] == [(t.session_id, len(t.turns)) for t in whole]
    assert count == import_read(whole, tmp_path / "whole.db") > 0

    def stored(db: Path) -> list[tuple]:
        return [(t.request_id, t.request_body, t.render, t.started_at, t.response_text, t.tool_calls,
                 t.prompt_tokens, t.cached_tokens) for t in iter_turns(db)]
    assert stored(tmp_path / "streamed.db") == stored(tmp_path / "whole.db")
