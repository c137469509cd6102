"""What a newcomer reads before `serve` is ready: the model loading and loaded, then the ready
banner; the render policies, open-file limits, reply format, cache sizes and uvicorn's start lines
are at --log-level debug (where they all still are)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from testsupport.servers import ROOT, TINY_MODEL, free_port, terminate


def lines_before_ready(tmp_path, *args: str) -> list[str]:
    log = tmp_path / f"serve{len(args)}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "prefixtrace.cli", "serve", "--model", str(TINY_MODEL),
                                 "--db", str(tmp_path / "q.db"), "--port", str(free_port()), *args],
                                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 180
        while "prefixtrace is ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        terminate(proc, 30)
    text = log.read_text()
    return text[:text.index("prefixtrace is ready")].splitlines()


@pytest.mark.slow
def test_serve_says_little_before_ready(tmp_path):
    quiet = lines_before_ready(tmp_path)
    assert len(quiet) <= 3, quiet
    assert any("loading model" in line for line in quiet)
    assert not [line for line in quiet if "Started server process" in line or "render policies" in line]
    verbose = lines_before_ready(tmp_path, "--log-level", "debug")
    assert any("render policies" in line for line in verbose) and any("open files" in line for line in verbose)
