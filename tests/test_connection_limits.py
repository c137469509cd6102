"""Idle and half-sent connections cannot starve the server (issue 14, finding 9)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from prefixtrace.serve import uvicorn_config
from tests.conftest import TINY_MODEL, free_port, start_uvicorn
from tests.test_cli_serve import serve_process



def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_idle_and_slow_loris_connections_are_closed_and_requests_still_answer(tiny_engine, recorder):
    port = free_port()
    app = create_app(EngineBackend(tiny_engine), recorder)
    server, thread = start_uvicorn(uvicorn_config(app, "127.0.0.1", port, "warning", head_timeout_s=1.0))
    idle, loris = [], []
    try:
        for _ in range(300):  # connect, send nothing
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        for _ in range(40):  # a request head trickled a byte at a time, never finished
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
            loris.append(s)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # the trickle goes on past the head deadline
            for s in loris:
                try:
                    s.sendall(b"X")
                except OSError:
                    pass
            time.sleep(0.3)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        deadline = time.monotonic() + 20  # one budget for all: bounded even when nothing is closed
        still_open = 0
        for s in idle + loris:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            still_open += not _closed_by_server(s)
        assert still_open == 0, f"{still_open} of {len(idle) + len(loris)} idle connections still held"
    finally:
        for s in idle + loris:
            s.close()
        server.should_exit = True
        thread.join(10)


def _open_file_limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-file limit in /proc")


@pytest.mark.slow
def test_serve_raises_its_open_file_limit_to_the_hard_limit(tmp_path):
    # This test process has imported mlx-lm (the fixtures' engine), so it passes its
    # lowered (2048, 4096) limit on: serve must at least lift its soft limit to the hard one.
    with serve_process(["--model", str(TINY_MODEL)], cwd=tmp_path, env={"PREFIXTRACE_NO_OPENBLAS": "1"}) as (url, proc):
        soft, hard = _open_file_limits(proc.pid)
    assert soft == hard and soft > 2048, (soft, hard)
