"""Issue 25, finding 10 (second half): every file the tool writes for a person to read (JSONL and
HAR exports, analyze reports, the JUnit file, replay reports, the recorder's spool) is created 0600,
under the usual 022 umask, and a file it overwrites becomes 0600 too. Driven through the CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from recorder import Recorder, Turn
from recorder.files import open_private, write_private_text
from recorder.spool import Spool
from tests.conftest import ROOT


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", *args], capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, preexec_fn=lambda: os.umask(0o022))


def mode(path: Path) -> str:
    return oct(path.stat().st_mode & 0o777)


def _db(tmp_path: Path) -> Path:
    db = tmp_path / "t.db"
    with Recorder(db) as rec:
        for i in range(2):
            rec.record(Turn(request_id=f"r{i}", started_at=float(i), endpoint="/v1/chat/completions", upstream="u",
                            session_id="s", status=200, response_text="ok",
                            request_body={"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]}))
    return db


@pytest.mark.parametrize("args, name", [
    (["export", "{db}", "--format", "jsonl", "--out", "{out}"], "out.jsonl"),
    (["export", "{db}", "--format", "har", "--out", "{out}"], "out.har"),
    (["analyze", "{db}", "--format", "html", "--out", "{out}"], "report.html"),
    (["analyze", "{db}", "--format", "json", "--out", "{out}"], "report.json"),
    (["check", "{db}", "--junit", "{out}"], "junit.xml"),
], ids=["export-jsonl", "export-har", "analyze-html", "analyze-json", "check-junit"])
@pytest.mark.slow
def test_cli_outputs_are_owner_only(tmp_path, args, name):
    db, out = _db(tmp_path), tmp_path / name
    done = _cli(*[a.format(db=db, out=out) for a in args])
    assert done.returncode in (0, 1), done.stderr.decode()
    assert mode(out) == oct(0o600)
    out.chmod(0o644)  # an existing file the tool overwrites
    done = _cli(*[a.format(db=db, out=out) for a in args])
    assert done.returncode in (0, 1), done.stderr.decode()
    assert mode(out) == oct(0o600)


def test_replay_reports_are_owner_only(engine_server, tmp_path):
    url, recorder = engine_server
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    recorder.flush()
    for name in ("replay.html", "replay.json"):
        out = tmp_path / name
        done = _cli("replay", str(recorder.path), "--target", url, "--out", str(out))
        assert done.returncode == 0, done.stderr.decode()
        assert mode(out) == oct(0o600)
        assert json.loads(out.read_text()) if name.endswith(".json") else "prefixtrace replay" in out.read_text()


def test_the_spool_file_and_the_private_writers_are_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        spool = Spool(tmp_path / "t.db.spool", max_memory_bytes=0)
        assert spool.add({"request_id": "r1", "response_text": "x"})
        assert mode(spool.path) == oct(0o600) and spool.file_rows == 1
        target = tmp_path / "plain.txt"
        target.write_text("old")
        target.chmod(0o644)
        write_private_text(target, "new")
        assert mode(target) == oct(0o600) and target.read_text() == "new"
        link = tmp_path / "link"
        link.symlink_to(tmp_path / "elsewhere")
        with pytest.raises(OSError):  # a planted symlink does not redirect the write
            open_private(link).close()
        assert not (tmp_path / "elsewhere").exists()
    finally:
        os.umask(old)
