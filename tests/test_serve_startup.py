"""`serve` as a person meets it (issue 26, item 6): a busy port or an unwritable database is
refused in one line, in under 2 s and before the model loads, leaving nothing behind; once
ready, `serve` says where it is, where its dashboard is and how to point a harness at it.

Each case runs the real CLI as a subprocess against real sockets and a real filesystem.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, TINY_MODEL

REFUSE_WITHIN_S = 2.0


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXTRACE_")}
    env.update(PYTHONPATH=str(ROOT), PREFIXTRACE_NO_OPENBLAS="1")
    return env


def _serve_refused(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "serve", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - started


def _one_error_line(done: subprocess.CompletedProcess, status: int = 1) -> str:
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, done.stderr
    assert "loading model" not in done.stderr and "converting" not in done.stderr.lower(), done.stderr
    return errors[0]


@pytest.mark.parametrize("backend", [["--model", str(TINY_MODEL)], [], ["--upstream", "http://127.0.0.1:9"]],
                         ids=["model", "bundled-default", "upstream"])
def test_a_busy_port_is_refused_at_once_naming_the_fix(tmp_path, backend):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done, took = _serve_refused(["--port", str(port), "--db", str(tmp_path / "t.db"), *backend], tmp_path)
    line = _one_error_line(done)
    assert f"port {port}" in line and "already in use" in line and "--port" in line
    assert took < REFUSE_WITHIN_S, f"refused after {took:.1f} s"
    assert list(tmp_path.iterdir()) == [], "a refused start left files behind"


@pytest.mark.parametrize("where,expect,status", [
    ("missing-dir/t.db", "does not exist", 1),
    ("a-directory", "is a directory", 2),  # click's own check of the option, a usage error
], ids=["missing-directory", "directory-as-db"])
def test_an_unwritable_database_is_refused_at_once(tmp_path, where, expect, status):
    (tmp_path / "a-directory").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    done, took = _serve_refused(["--port", "0", "--model", str(TINY_MODEL), "--db", str(tmp_path / where)], tmp_path)
    line = _one_error_line(done, status)
    assert expect in line and "--db" in line
    assert took < REFUSE_WITHIN_S, f"refused after {took:.1f} s"
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_database_on_a_read_only_filesystem_is_refused(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (not root, or no mount permission)")
    try:
        done, took = _serve_refused(["--port", "0", "--model", str(TINY_MODEL), "--db", str(mount / "t.db")], tmp_path)
        line = _one_error_line(done)
        assert "read-only" in line and "--db" in line
        assert took < REFUSE_WITHIN_S
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_serve_says_where_it_is_once_ready(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "prefixtrace.cli", "serve", "--port", "0", "--model", str(TINY_MODEL),
                             "--db", str(tmp_path / "t.db"), "--log-level", "warning"],
                            cwd=tmp_path, env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("  point a harness here"):
                break
        banner = "".join(lines)
        ready = re.search(r"prefixtrace is ready: (http://127\.0\.0\.1:(\d+)/v1)\s+\(dashboard (\S+), recording to (.+)\)",
                          banner)
        assert ready, banner
        base, port, ui, db = ready.groups()
        assert ui == f"http://127.0.0.1:{port}/ui" and Path(db) == (tmp_path / "t.db").resolve()
        pointer = lines[-1]
        assert "docs/HARNESSES.md" in pointer and f"ANTHROPIC_BASE_URL=http://127.0.0.1:{port}" in pointer
        for harness in ("codex", "opencode", "qwen-code", "aider", "llm", "pi", "Claude Code"):
            assert harness in pointer
        # What the banner names answers: the model is loaded (no 503) and the dashboard is there.
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        assert httpx.get(ui, timeout=10).status_code == 200
        models = httpx.get(f"{base}/models", timeout=10).json()
        assert any("default" in (m.get("aliases") or []) or m["id"] == "default" for m in models["data"]), models
    finally:
        proc.terminate()
        proc.wait(timeout=60)
