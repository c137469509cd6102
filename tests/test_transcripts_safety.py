"""Bad input to a transcript import gets one clear line (or is passed over with a word), never a hang,
a traceback or a lost database; what import prints of a client's text cannot drive the terminal."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from prefixtrace.common.errors import InvalidRequest
from recorder.reader import iter_turns
from recorder.sources import import_path
from recorder.transcripts import read_transcripts, sniff_transcript, transcript_turns
from recorder.transcripts.store import RedactOnce, store_transcript_turns

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "transcripts"
CLAUDE = FIX / "claude" / "efe4eb98-da5c-4c54-8f08-1e2f0925168f.jsonl"


def cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_a_fifo_in_a_session_directory_is_passed_over_with_a_word(tmp_path):
    (tmp_path / "s.jsonl").write_text(CLAUDE.read_text())
    os.mkfifo(tmp_path / "pipe.jsonl")  # opening it for reading would block the import forever
    out = cli("import", str(tmp_path), "--db", str(tmp_path / "t.db"), timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"skipped {tmp_path / 'pipe.jsonl'}: a FIFO (named pipe), not a file" in out.stdout
    assert "imported 4 turns" in out.stdout


def test_a_fifo_given_as_the_input_is_refused_by_import_and_analyze(tmp_path):
    os.mkfifo(tmp_path / "pipe.jsonl")
    for args in (("import", str(tmp_path / "pipe.jsonl"), "--db", str(tmp_path / "t.db")),
                 ("analyze", str(tmp_path / "pipe.jsonl"))):
        assert "is a FIFO (named pipe), not a file" in one_line_error(cli(*args, timeout=60))


def test_a_directory_import_names_the_files_it_did_not_read(tmp_path):
    (tmp_path / "s.jsonl").write_text(CLAUDE.read_text())
    (tmp_path / "notes.jsonl").write_text('{"hello": "world"}\n')
    found = read_transcripts(tmp_path)
    assert found.skipped == [(str(tmp_path / "notes.jsonl"), "not a session file of Claude Code, Codex or pi")]


def test_terminal_escapes_in_a_session_id_are_printed_escaped(tmp_path):
    objs = [json.loads(line) for line in CLAUDE.read_text().splitlines() if line.strip()]
    for o in objs:
        if "sessionId" in o:
            o["sessionId"] = "evil\x1b]0;owned\x07\x1b[2J"
    src = tmp_path / "s.jsonl"
    src.write_text("".join(json.dumps(o) + "\n" for o in objs))
    out = cli("import", str(src), "--db", str(tmp_path / "t.db"))
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout
    assert "evil\\u001b]0;owned\\u0007\\u001b[2J" in out.stdout


def test_a_transcript_whose_first_line_is_over_8_mb_is_recognised(tmp_path):
    objs = [json.loads(line) for line in CLAUDE.read_text().splitlines() if line.strip()]
    first = next(i for i, o in enumerate(objs) if o.get("type") == "user")
    big = dict(objs[first], uuid="pasted", parentUuid=None, message={"role": "user", "content": "x" * (9 << 20)})
    src = tmp_path / "s.jsonl"
    src.write_text("".join(json.dumps(o) + "\n" for o in [big, *objs]))
    assert sniff_transcript(src) == "claude-code"


def test_a_damaged_opencode_database_is_one_line(tmp_path):
    db = tmp_path / "opencode.db"
    data = bytearray((FIX / "opencode" / "opencode.db").read_bytes())
    data[100:4096] = b"\xff" * (4096 - 100)  # the schema page overwritten: SQLite header intact
    db.write_bytes(bytes(data))
    line = one_line_error(cli("import", str(db), "--db", str(tmp_path / "t.db")))
    assert str(db) in line and "opencode database" in line


def test_bad_files_are_one_line_and_the_database_keeps_what_it_had(tmp_path):
    target = tmp_path / "t.db"
    import_path(CLAUDE, target)
    before = len(list(iter_turns(target)))
    truncated = tmp_path / "truncated.jsonl"
    truncated.write_text(CLAUDE.read_text()[:-40])  # a half-written last line (the harness was killed)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\x00\x01\x02\xff" * 1000)
    other = tmp_path / "other.jsonl"
    other.write_text('{"event": "something else"}\n')
    for bad in (truncated, binary, other):
        with pytest.raises(InvalidRequest) as err:
            import_path(bad, target)
        assert str(bad) in err.value.message and "\n" not in err.value.message
    assert len(list(iter_turns(target))) == before
    assert "truncated.jsonl:" in one_line_error(cli("import", str(truncated), "--db", str(target)))


def test_shared_history_is_redacted_once_per_message_and_still_redacted_everywhere(tmp_path):
    objs = [json.loads(line) for line in CLAUDE.read_text().splitlines() if line.strip()]
    secret = "sk-ant-api03-" + "A" * 80
    user = next(o for o in objs if o.get("type") == "user" and isinstance(o["message"].get("content"), str))
    user["message"]["content"] += f" my key is {secret}"
    src = tmp_path / "s.jsonl"
    src.write_text("".join(json.dumps(o) + "\n" for o in objs))
    turns, _ = transcript_turns(src)

    class Counting(RedactOnce):
        scanned = 0

        def _text(self, value, *args, **kwargs):
            if secret in value:
                Counting.scanned += 1
            return super()._text(value, *args, **kwargs)

    from recorder.rows import write_turns
    from recorder.schema import open_db
    db = open_db(tmp_path / "t.db")
    write_turns(db, turns, Counting())
    db.close()
    assert Counting.scanned == 1  # one message object, shared by every later call's history
    stored = list(iter_turns(tmp_path / "t.db"))
    assert len(stored) == len(turns) > 1
    assert all(secret not in json.dumps(t.request_body) for t in stored)
    assert store_transcript_turns(tmp_path / "u.db", turns) == len(turns)
