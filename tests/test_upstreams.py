"""Several upstreams: session affinity, consistent hashing, health checks, failover with real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest

from prefixtrace.common.errors import UpstreamError, http_status
from proxy.app import create_app
from proxy.upstream_pool import HashRing, UpstreamPool, session_key
from recorder.store import Recorder
from tests.conftest import ROOT, TINY_MODEL, free_port, rows, running_server

# One upstream process: the embedded tiny engine behind a real prefixtrace proxy.
UPSTREAM = """
import sys, uvicorn
from engine.engine import Engine
from prefixtrace.common.errors import UpstreamError, http_status
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from recorder.store import Recorder
engine = Engine(sys.argv[1], name="tiny-llama", dtype="float32").start()
engine.wait_ready(60)
with Recorder(sys.argv[3]) as rec:
    uvicorn.run(create_app(EngineBackend(engine), rec), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""


@pytest.fixture
def upstreams(tmp_path):
    """Three upstream processes on 127.0.0.1; yields {url: Popen}."""
    procs = {}
    for i in range(3):
        port = free_port()
        procs[f"http://127.0.0.1:{port}"] = subprocess.Popen(
            [sys.executable, "-c", UPSTREAM, str(TINY_MODEL), str(port), str(tmp_path / f"up{i}.db")],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        for url, proc in procs.items():
            while True:
                assert proc.poll() is None, f"upstream {url} exited"
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "upstreams did not start"
                time.sleep(0.1)
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def chat(url: str, session: str, messages: list) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=60, headers={"X-Session-Id": session},
                   json={"messages": messages, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_sessions_stick_fail_over_and_are_repinned(upstreams, tmp_path):
    sessions = [f"s{i}" for i in range(8)]
    histories = {s: [{"role": "system", "content": f"You help user {s}."}, {"role": "user", "content": "Hi."}]
                 for s in sessions}
    pool = UpstreamPool(list(upstreams), health_interval=60)  # failover at request time, not by the check
    with Recorder(tmp_path / "proxy.db") as rec:
        with running_server(create_app(pool, rec)) as url:

            def round_(n: int) -> None:
                for s in sessions:
                    reply = chat(url, s, histories[s])
                    histories[s] += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                                     {"role": "user", "content": f"More {n}."}]

            round_(0)
            round_(1)
            placed = {r["session_id"]: r["upstream"] for r in rows(rec)}
            assert {r["session_id"]: r["upstream"] for r in rows(rec)[8:]} == placed  # sticky
            assert all(r["cached_tokens"] > 0 for r in rows(rec)[8:])  # so the upstream's cache is warm
            assert len(set(placed.values())) >= 2  # spread over the upstreams

            # Kill the busiest upstream; the very next requests fail over before any health check runs.
            victim, moved = Counter(placed.values()).most_common(1)[0]
            upstreams[victim].send_signal(signal.SIGKILL)
            upstreams[victim].wait(10)
            round_(2)  # no request lost: every one is answered 200 (chat() asserts it)
            round_(3)
            after = rows(rec)
            assert len(after) == 32 and all(r["status"] == 200 for r in after)
            third = {r["session_id"]: r["upstream"] for r in after[16:24]}
            fourth = {r["session_id"]: r["upstream"] for r in after[24:]}
            assert victim not in third.values() and fourth == third  # re-pinned, then sticky again
            for s in sessions:
                if placed[s] != victim:
                    assert third[s] == placed[s]  # sessions of live upstreams did not move
            assert all(r["cached_tokens"] > 0 for r in after[24:])  # warm again on the new upstream

            stats = {u["url"]: u for u in pool.stats()}
            assert stats[victim]["failovers"] == moved and stats[victim]["errors"] >= 1
            assert httpx.get(url + "/health").status_code == 200  # runs a health check; the others still serve
            metrics = httpx.get(url + "/metrics").text
            assert f'prefixtrace_upstream_up{{upstream="{victim}"}} 0' in metrics
            assert f'prefixtrace_upstream_failovers_total{{upstream="{victim}"}} {moved}' in metrics


def test_consistent_hashing_moves_few_sessions():
    urls = [f"http://10.0.0.{i}:8000" for i in range(4)]
    keys = [f"id:session-{i}" for i in range(2000)]
    before = HashRing(urls).order
    after = HashRing(urls + ["http://10.0.0.9:8000"]).order
    moved = sum(before(k)[0] != after(k)[0] for k in keys)
    assert 0.1 < moved / len(keys) < 0.3  # about 1/5 move, all of them to the new server
    assert all(after(k)[0] == "http://10.0.0.9:8000" for k in keys if before(k)[0] != after(k)[0])
    spread = Counter(before(k)[0] for k in keys)
    assert min(spread.values()) > 0.15 * len(keys)


def test_session_key_without_an_id_is_the_conversation_head():
    head = [{"role": "system", "content": "S"}, {"role": "user", "content": "Fix the bug."}]
    turn1 = {"model": "m", "messages": head}
    turn2 = {"model": "m", "messages": head + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}],
             "stream": True}
    other = {"model": "m", "messages": [head[0], {"role": "user", "content": "Write docs."}]}
    anthropic = {"model": "m", "system": "S", "messages": [{"role": "user", "content": "Fix the bug.",
                                                            "cache_control": {"type": "ephemeral"}}]}
    assert session_key(turn1, None) == session_key(turn2, None) == session_key(anthropic, None)
    assert session_key(other, None) != session_key(turn1, None)
    assert session_key(other, "abc") == "id:abc"


def test_dead_pool_is_a_502_naming_the_upstreams():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]

    async def go():
        pool = UpstreamPool(dead)
        try:
            with pytest.raises(UpstreamError) as info:
                await pool.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, {})
            assert not await pool.ready()
        finally:
            await pool.aclose()
        return info.value

    error = asyncio.run(go())
    assert "no upstream" in error.message and error.details["upstreams"] == dead and http_status(error) == 502


def test_serve_builds_a_pool_from_repeated_upstreams():
    from click.testing import CliRunner

    from prefixtrace.cli import cli
    from prefixtrace.serve import ServeConfig, build_backend
    from proxy.upstream_backend import UpstreamBackend

    assert isinstance(build_backend(ServeConfig(upstreams=["http://a:1", "http://b:2/v1"])), UpstreamPool)
    one = build_backend(ServeConfig(upstreams=["http://a:1/v1"]))
    assert isinstance(one, UpstreamBackend) and one.base_url == "http://a:1"
    help_text = " ".join(CliRunner().invoke(cli, ["serve", "--help"]).output.split())
    assert "--upstream URL" in help_text and "Repeat it" in help_text
