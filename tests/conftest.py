"""Shared fixtures: the tiny model, a real uvicorn server on 127.0.0.1, the openai client."""

from __future__ import annotations

import os
import socket
import sqlite3
from pathlib import Path

import pytest

from engine.engine import Engine
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
# Shared with bench/ through testsupport/; tests import them from here too.
from testsupport.servers import free_port, running_server, start_uvicorn  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "fixtures" / "tiny-llama"


def rows(recorder):
    """Every recorded turn, oldest first, as dicts (after the writer has flushed)."""
    recorder.flush()
    con = sqlite3.connect(recorder.path)
    con.row_factory = sqlite3.Row
    return [dict(r) for r in con.execute("select * from turns order by started_at")]


async def answer_lifespan(receive, send) -> None:
    """A raw ASGI app's lifespan scope: complete each startup / shutdown message until shutdown."""
    while True:
        message = await receive()
        await send({"type": message["type"] + ".complete"})
        if message["type"] == "lifespan.shutdown":
            return


def read_until(sock: socket.socket, marker: bytes, data: bytes = b"") -> bytes:
    """What `sock` has sent, read until `marker` is in it (after `data`, already read)."""
    while marker not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before {marker!r}; got {data!r}"
        data += chunk
    return data


@pytest.fixture
def tiny_engine():
    """A fresh engine (and so an empty prefix cache) per test; loading takes milliseconds."""
    engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32").start()
    engine.wait_ready(60)
    yield engine
    engine.shutdown()


@pytest.fixture
def recorder(tmp_path):
    with Recorder(tmp_path / "traffic.db") as rec:
        yield rec


@pytest.fixture
def chain(tiny_engine, tmp_path):
    """client → proxy A (upstream mode) → proxy B (embedded tiny engine); both real uvicorn servers.
    Yields (url_a, recorder_a, recorder_b)."""
    with Recorder(tmp_path / "b.db") as rec_b, Recorder(tmp_path / "a.db") as rec_a:
        with running_server(create_app(EngineBackend(tiny_engine), rec_b)) as url_b:
            with running_server(create_app(UpstreamBackend(url_b + "/v1"), rec_a)) as url_a:
                yield url_a, rec_a, rec_b


@pytest.fixture
def engine_server(tiny_engine, recorder):
    """A real proxy with the embedded tiny engine; yields (base_url, recorder)."""
    with running_server(create_app(EngineBackend(tiny_engine), recorder)) as url:
        yield url, recorder


@pytest.fixture
def openai_client(engine_server):
    from openai import OpenAI

    url, _ = engine_server
    return OpenAI(base_url=url + "/v1", api_key="sk-test-secret-0123456789abcdef", max_retries=0, timeout=60)


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    """For CLI tests: no config file or PREFIXTRACE_* variable from the host leaks in; the
    working directory is an empty folder (returned)."""
    for name in list(os.environ):
        if name.startswith("PREFIXTRACE_"):
            monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work
