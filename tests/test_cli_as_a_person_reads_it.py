"""What the CLI says when an input is bad (issues 25 #12 and 26 item 6), read as a person reads it:
a bad JSONL line reported once and whole; a damaged database in one line from every command,
without the damaged bytes; an inferred session exported by the name `analyze` gave it.

Each case runs the real CLI in a subprocess over files written by the real recorder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recorder.store import Recorder
from recorder.turn import Turn
from tests.conftest import ROOT
from tests.test_damaged_database import _recorded


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


BAD_LINE = '{"messages": [{"role": "user", "content": "a\tb"}]}'  # a raw TAB inside a JSON string


@pytest.fixture
def jsonl_with_a_bad_line(tmp_path) -> Path:
    first = [{"role": "user", "content": "hello"}]
    lines = [json.dumps({"messages": first}), BAD_LINE,
             json.dumps({"messages": [*first, {"role": "assistant", "content": "hi"},
                                      {"role": "user", "content": "more"}]})]
    path = tmp_path / "traffic.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("command", ["analyze", "check"])
def test_a_bad_jsonl_line_is_reported_once_and_whole(tmp_path, jsonl_with_a_bad_line, command):
    done = _cli(command, str(jsonl_with_a_bad_line), cwd=tmp_path)
    said = done.stdout + done.stderr
    assert said.count("line 2") == 1, said
    assert "not valid JSON: Invalid control character at column 45" in said, said
    assert "first: line 2" not in said


def test_import_names_the_bad_line_and_column(tmp_path, jsonl_with_a_bad_line):
    done = _cli("import", str(jsonl_with_a_bad_line), "--db", str(tmp_path / "t.db"), cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().endswith("traffic.jsonl:2: not valid JSON: Invalid control character at column 45")


def _undecodable_text(path: Path) -> None:
    """A stored message made invalid UTF-8 (bytes the sqlite3 module cannot decode)."""
    data = bytearray(path.read_bytes())
    at = data.index(b"turn 7 ")
    data[at:at + 2] = b"\xff\xfe"
    path.write_bytes(bytes(data))


def _zeroed_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:100] = bytes(100)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_undecodable_text, _zeroed_header])
@pytest.mark.parametrize("command", [["analyze"], ["check"], ["export"], ["db", "info"],
                                     ["replay", "--target", "http://127.0.0.1:9"], ["import"]],
                         ids=["analyze", "check", "export", "db-info", "replay", "import"])
def test_every_command_reports_a_damaged_database_in_one_line(tmp_path, damage, command):
    db = _recorded(tmp_path / "traffic.db", n=40)
    damage(db)
    done = _cli(*command, str(db), cwd=tmp_path)
    if done.returncode == 0:  # `db info` reads no message, so an undecodable one does not stop it
        assert command == ["db", "info"] and damage is _undecodable_text, done.stderr
        return
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, done.stderr
    assert "\ufffd" not in done.stderr and "turn 7 turn 7" not in done.stderr, "the damaged bytes were printed"
    assert len(errors[0]) < 300


def test_an_inferred_session_is_exported_by_its_name(tmp_path):
    db = tmp_path / "t.db"
    system = {"role": "system", "content": "You are a coding agent."}
    conversations = {
        "a": [system, {"role": "user", "content": "Fix the failing test in parser.py"}],
        "b": [system, {"role": "user", "content": "Write a README for the project"}],
    }
    with Recorder(db) as rec:
        start = time.time()
        for i in range(6):  # interleaved, no session ids
            name = "ab"[i % 2]
            messages = conversations[name]
            rec.record(Turn(request_id=f"{name}{i}", started_at=start + i, endpoint="/v1/chat/completions",
                            upstream="embedded:tiny", session_id=None, status=200,
                            request_body={"model": "default", "messages": list(messages)}))
            conversations[name] = [*messages, {"role": "assistant", "content": f"step {i}"},
                                   {"role": "user", "content": f"go on {i}"}]
        rec.flush()
    analysed = json.loads(_cli("analyze", str(db), "--json", cwd=tmp_path).stdout)
    names = {s["id"]: [t["request_id"] for t in s["turns"]] for s in analysed["sessions"]}
    inferred = next(name for name, ids in names.items() if ids and ids[0] == "b1")
    done = _cli("export", str(db), "--session", inferred, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    exported = [json.loads(line)["id"] for line in done.stdout.splitlines()]
    assert exported == ["b1", "b3", "b5"]
    assert "exported 3 turns" in done.stderr


def test_exporting_a_session_that_is_not_there_says_so(tmp_path):
    db = _recorded(tmp_path / "traffic.db", n=10)
    done = _cli("export", str(db), "--session", "inferred-9", cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    assert "no session 'inferred-9'" in done.stderr and "s0" in done.stderr
