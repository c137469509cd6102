"""Servers on loopback for tests and benchmarks: the proxy's ASGI app under a real uvicorn on a thread of
this process, and `prefixtrace serve` as a subprocess of its own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "fixtures" / "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_uvicorn(config: uvicorn.Config) -> tuple[uvicorn.Server, threading.Thread]:
    """A real uvicorn server on a thread of its own, returned once it listens (30 s at most)."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread


@contextmanager
def running_server(app):
    """Run `app` under a real uvicorn server on a random loopback port."""
    port = free_port()
    server, thread = start_uvicorn(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def start_serve(db: Path, log_path: Path, extra: list[str] = (), *, model: Path | None = TINY_MODEL,
                openblas: bool = False, ready_within_s: float = 120) -> tuple[subprocess.Popen, str]:
    """`prefixtrace serve` on a free port, once /health answers; `model` None: the bundled default (its
    first start may convert it); `openblas`: let serve preload OpenBLAS, as a user's would."""
    port = free_port()
    log = open(log_path, "w")  # a file, not a pipe: nobody reads it while the server runs
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixtrace.cli", "serve", *(["--model", str(model)] if model else []),
         "--db", str(db), "--port", str(port), "--log-level", "warning", *extra],
        cwd=db.parent, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **({} if openblas else {"PREFIXTRACE_NO_OPENBLAS": "1"})},
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, "serve", ready_within_s, log=log_path)
    return proc, url


def wait_healthy(url: str, proc: subprocess.Popen | None, what: str, timeout: float = 180.0, *,
                 log: Path | None = None) -> None:
    """Until `url`/health answers 200. Raises with the end of the server's output (`log`, else its
    stdout pipe) if it exits first, and kills it if it never answers (`proc` None: a server in this
    process, nothing to watch or kill)."""
    def output() -> str:
        if log is not None:
            return log.read_text(errors="replace")[-3000:]
        return proc.stdout.read()[-3000:] if proc is not None and proc.stdout else ""

    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited early ({proc.returncode}):\n{output()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            if proc is not None:
                proc.kill()
            raise RuntimeError(f"{what} did not become healthy at {url}:\n{output()}")
        time.sleep(0.2)


def terminate(proc: subprocess.Popen, wait_s: float) -> tuple[bool, float]:
    """SIGTERM (serve's graceful stop), then a kill if it has not exited within `wait_s`:
    (whether it stopped by itself, the seconds it took)."""
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(wait_s)
        stopped = True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        stopped = False
    return stopped, time.monotonic() - start


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (uvicorn's graceful stop), then a kill after 20 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
