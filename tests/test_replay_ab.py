"""Replay against several real servers on 127.0.0.1: the embedded engine, mlx_lm.server, a dead port,
a server that fails, and a stub that reports cache hits the llama.cpp way."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from click.testing import CliRunner
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.engine import Engine
from prefixtrace.cli import cli
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from recorder import Recorder, Turn
from recorder.replay import _gaps, replay
from recorder.sources import load_turns
from tests.conftest import ROOT, TINY_MODEL, free_port, running_server

TURN_KEYS = {"session", "index", "prompt_tokens", "cached_tokens", "ttft_ms", "total_ms", "status"}


@pytest.fixture(scope="module")
def mlx_lm_server():
    """mlx_lm's own OpenAI-compatible server on the same tiny model, serving it as "tiny-llama"."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", "tiny-llama", "--port", str(port)],
                            cwd=ROOT / "fixtures", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("mlx_lm server did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def record_sessions(url: str, recorder) -> None:
    for session, n in (("s1", 3), ("s2", 2)):
        messages = [{"role": "system", "content": f"Be brief, {session}."}, {"role": "user", "content": "Hello."}]
        for _ in range(n):
            r = httpx.post(url + "/v1/chat/completions", timeout=60, headers={"X-Session-Id": session},
                           json={"model": "tiny-llama", "max_tokens": 5, "temperature": 0, "messages": messages})
            text = r.json()["choices"][0]["message"]["content"]
            messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
    recorder.flush()


def test_ab_replay_engine_vs_mlx_lm_server_with_a_dead_target(engine_server, mlx_lm_server, tmp_path):
    url, recorder = engine_server
    record_sessions(url, recorder)
    dead = f"http://127.0.0.1:{free_port()}"
    fresh = Engine(TINY_MODEL, name="tiny-llama", dtype="float32").start()
    fresh.wait_ready(60)
    seen = []
    try:
        with Recorder(tmp_path / "r.db") as rec2, running_server(create_app(EngineBackend(fresh), rec2)) as engine:
            report = replay(load_turns(recorder.path), [engine, dead, mlx_lm_server], concurrency=2,
                            progress=lambda target, turn: seen.append(target))
    finally:
        fresh.shutdown()
    assert len(seen) == 3 * 5
    engine_t, dead_t, mlx_t = report["targets"]
    for target in report["targets"]:
        assert [(t["session"], t["index"]) for t in target["turns"]] == [("s1", 0), ("s1", 1), ("s1", 2),
                                                                          ("s2", 0), ("s2", 1)]
        assert all(TURN_KEYS <= set(t) for t in target["turns"])
    # the engine reproduces what was recorded; mlx_lm reports its own cache hits
    assert all(t["status"] == 200 for t in engine_t["turns"] + mlx_t["turns"])
    # Sessions ran two at a time, so a session's first turn may miss what another
    # session's first turn left in the cache when recorded one after the other;
    # within a session the recorded hits come back exactly.
    later = [t for t in engine_t["turns"] if t["index"] > 0]
    assert [t["cached_tokens"] for t in later] == [t["recorded_cached_tokens"] for t in later]
    assert all(t["cached_tokens"] is not None for t in mlx_t["turns"])
    assert mlx_t["turns"][2]["cached_tokens"] > 0
    assert all(t["ttft_ms"] <= t["total_ms"] for t in mlx_t["turns"])
    # the dead target is named, per turn too, and did not stop the others
    assert dead in dead_t["error"] and "unreachable" in dead_t["error"]
    assert all(t["status"] == 0 and dead in t["error"] for t in dead_t["turns"])
    ratios = {c["url"]: c for c in report["comparison"]["targets"]}
    assert ratios[engine_t["url"]]["ttft_ratio"] == 1.0 and ratios[mlx_t["url"]]["ttft_ratio"] > 0


def stub_app(log: list) -> FastAPI:
    """Streams a reply after a short delay; reports cache hits as llama.cpp does (timings.cache_n);
    answers 500 to any request whose last message says "fail"."""
    app = FastAPI()
    state = {"now": 0, "max": 0}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        log.append((time.monotonic(), body))
        if body["messages"][-1]["content"] == "fail":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)

        async def events():
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
            await asyncio.sleep(0.15)
            yield 'data: {"choices": [{"index": 0, "delta": {"content": "ok"}}]}\n\n'
            state["now"] -= 1
            yield ('data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1},'
                   ' "timings": {"cache_n": 7}}\n\n')
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app.state.concurrency = state
    return app


def stub_turns() -> list[Turn]:
    turns = []
    for s in range(3):
        for i in range(2):
            content = "fail" if (s, i) == (2, 1) else f"q{i}"
            turns.append(Turn(request_id=f"{s}-{i}", started_at=1000.0 + s * 0.1 + i * 0.4, endpoint="/v1/chat/completions",
                              upstream="u", session_id=f"s{s}", total_s=0.1,
                              request_body={"model": "m", "stream": False, "messages": [{"role": "user", "content": content}]}))
    return turns


def test_concurrency_pace_llama_cpp_cache_counts_and_per_turn_errors():
    log: list = []
    app = stub_app(log)
    with running_server(app) as url:
        t0 = time.monotonic()
        report = replay(stub_turns(), url, concurrency=2, pace="original")
        elapsed = time.monotonic() - t0
    assert app.state.concurrency["max"] == 2  # three sessions, two at a time
    turns = report["targets"][0]["turns"]
    assert [t["cached_tokens"] for t in turns if t["status"] == 200] == [7] * 5
    failed = [t for t in turns if t["status"] != 200]
    assert [(t["session"], t["index"], t["status"]) for t in failed] == [("s2", 1, 500)] and "boom" in failed[0]["error"]
    assert report["targets"][0]["summary"]["error_turns"] == 1
    # every request streamed with usage, whatever was recorded
    assert all(b["stream"] is True and b["stream_options"] == {"include_usage": True} for _, b in log)
    # original pace: 0.3 s of think time between a session's turns (0.4 s apart, 0.1 s long)
    assert elapsed >= 0.3 + 2 * 0.15


def test_original_gaps_keep_offsets_and_think_time():
    turns = stub_turns()[:2]
    assert _gaps(turns, 999.0, None) == pytest.approx([1.0, 0.3])
    assert _gaps(turns, 999.0, 0.5) == pytest.approx([0.5, 0.3])


def test_cli_replay_writes_html_and_names_the_dead_target(engine_server, tmp_path):
    url, recorder = engine_server
    record_sessions(url, recorder)
    dead = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "ab.html"
    result = CliRunner().invoke(cli, ["replay", str(recorder.path), "--target", url, "--target", dead,
                                      "--concurrency", "2", "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert dead in result.stderr and "unreachable" in result.stderr
    assert "replaying" not in result.stderr  # no progress bar off a terminal (tests/test_cli_comfort.py)
    page = out.read_text()
    assert page.count("<svg") == 2 and "<script src" not in page and "<link" not in page
    embedded = json.loads(page.split('id="report">')[1].split("</script>")[0].replace("&quot;", '"')
                          .replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&#x27;", "'"))
    assert [t["url"] for t in embedded["targets"]] == [url, dead]
    json_out = tmp_path / "ab.json"
    result = CliRunner().invoke(cli, ["replay", str(recorder.path), "--target", url, "--session", "s2",
                                      "--out", str(json_out)])
    assert result.exit_code == 0, result.output
    report = json.loads(json_out.read_text())
    assert [(t["session"], t["index"]) for t in report["targets"][0]["turns"]] == [("s2", 0), ("s2", 1)]
