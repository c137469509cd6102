"""Issue 14, finding 10 (database half): a damaged recorder database is refused at start with
one line, nothing written to it; the commands that read one say what is wrong in one line.

The database is written by the real `Recorder`, then damaged as the probe did (bytes
overwritten inside the file), and the real CLI is run on it as subprocesses.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recorder.store import Recorder
from recorder.turn import Turn
from tests.conftest import ROOT, TINY_MODEL, free_port


def _recorded(path: Path, n: int = 300) -> Path:
    with Recorder(path) as rec:
        for i in range(n):
            rec.record(Turn(request_id=f"r{i:03d}", started_at=time.time() + i, endpoint="/v1/chat/completions",
                            upstream="embedded:tiny", session_id=f"s{i % 5}", status=200,
                            request_body={"messages": [{"role": "user", "content": f"turn {i} " * 60}]}))
        rec.flush()
    con = sqlite3.connect(path)
    con.execute("pragma wal_checkpoint(truncate)")  # everything in the main file
    con.close()
    return path


def _damage_pages(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for offset in range(len(data) // 3, len(data) // 3 + 4000, 7):
        data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def _damage_a_stored_json_text(path: Path) -> None:
    """One message's JSON text made unparseable; the b-trees stay intact."""
    data = bytearray(path.read_bytes())
    at = data.index(b'"content": "turn 7 ') if b'"content": "turn 7 ' in data else data.index(b'"content":"turn 7 ')
    data[at] = ord("?")
    path.write_bytes(bytes(data))


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.slow
def test_serve_refuses_a_damaged_database_and_leaves_it_untouched(tmp_path):
    db = _recorded(tmp_path / "traffic.db")
    _damage_pages(db)
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    done = _cli("serve", "--model", str(TINY_MODEL), "--db", str(db), "--port", str(free_port()), cwd=tmp_path)
    line = _one_line_error(done)
    assert "is damaged" in line and "quick_check" in line and "Move it aside" in line
    assert "could not load model" not in done.stderr
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest and not Path(f"{db}-wal").exists()


@pytest.mark.slow
@pytest.mark.parametrize("damage", [_damage_pages, _damage_a_stored_json_text])
def test_reading_commands_report_a_damaged_database_in_one_line(tmp_path, damage):
    db = _recorded(tmp_path / "traffic.db")
    damage(db)
    for args in (["analyze", str(db)], ["export", str(db), "--out", str(tmp_path / "x.jsonl")],
                 ["db", "info", str(db)], ["check", str(db)]):
        if damage is _damage_a_stored_json_text and args[0] == "db":
            continue  # counts only: no body is parsed, and none needs to be
        line = _one_line_error(_cli(*args, cwd=tmp_path))
        assert "damaged" in line or "malformed" in line, (args, line)
