"""Server-side misses named (issue 26, item 3): a turn whose prompt only grew but whose reported cached
tokens fall short of the predicted prefix is a `server_miss`, subtype `eviction` (the embedded engine
evicted blocks since the session's previous turn), `routing` (another upstream served it), `ttl` (the
gap since the previous turn is past the provider's cache lifetime) or `unknown`; the provider's own
cache figures (Anthropic cache read / creation tokens and cache diagnostics, OpenAI cached tokens) are
recorded and shown beside the analysis.

Driven from outside: real proxies on 127.0.0.1 (the embedded tiny engine, an upstream pool that fails
over, a scripted Anthropic-like upstream), real SQLite recordings, the CLI in a subprocess."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import uvicorn

from analyzer import analyze, check
from analyzer.causes import PROVIDER_TTLS
from conftest import TINY_MODEL, answer_lifespan, free_port, running_server, start_uvicorn
from engine.engine import Engine
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from proxy.upstream_backend import UpstreamBackend
from proxy.upstream_pool import UpstreamPool
from recorder.store import Recorder

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16
BLOCK_BYTES = 8192  # the tiny model's KV for 16 tokens in float32 (2 layers x K,V x 2 heads x 32 dims x 4 B)


def _cli(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from prefixtrace.cli import main; sys.argv[0] = 'prefixtrace'; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _chat(url: str, session: str, messages: list[dict]) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, headers={"X-Session-Id": session},
                   json={"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _grow(history: list[dict], reply: str, n: int) -> list[dict]:
    return history + [{"role": "assistant", "content": reply}, {"role": "user", "content": f"Then step {n}?"}]


def test_an_evicted_prefix_is_a_server_miss_of_subtype_eviction(tmp_path):
    """A prefix cache that holds about one conversation: session B's long prompt evicts session A's
    blocks, so A's next turn, which only appended, finds less cached than predicted."""
    engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32", block_size=BLOCK,
                    cache_bytes=22 * BLOCK_BYTES).start()
    engine.wait_ready(60)
    a = [{"role": "system", "content": "You review Python code. " + "Be precise about style. " * 12},
         {"role": "user", "content": "Review calc.py."}]
    b = [{"role": "system", "content": "You write release notes. " + "Keep them short and clear. " * 12},
         {"role": "user", "content": "Notes for 1.2."}]
    try:
        with Recorder(tmp_path / "t.db") as rec:
            with running_server(create_app(EngineBackend(engine), rec)) as url:
                a = _grow(a, _chat(url, "a", a), 1)
                a = _grow(a, _chat(url, "a", a), 2)  # warm: A's prefix is cached and reported
                _chat(url, "b", b)  # evicts A's blocks for room
                _chat(url, "a", a)  # A only appended
            rec.flush()
    finally:
        engine.shutdown()
    report = analyze(tmp_path / "t.db")
    assert report.renderer_source == "recorded"
    turns = {s.id: s.turns for s in report.sessions}["a"]
    assert turns[1].brk is None and turns[1].predicted_cached_tokens == turns[1].reported_cached_tokens
    last = turns[2]
    assert last.reported_cached_tokens < last.predicted_cached_tokens
    assert last.brk is not None and (last.brk.cause, last.brk.subtype) == ("server_miss", "eviction")
    assert last.brk.saves_tokens == last.predicted_cached_tokens - last.reported_cached_tokens
    assert last.reprefill_tokens == last.prompt_tokens - last.reported_cached_tokens  # what the server redid
    assert "evicted" in last.brk.detail and last.served_by == "embedded:tiny-llama"
    # The client kept its prefix: check passes unless asked to fail on the server's misses.
    assert check(tmp_path / "t.db").ok
    assert not check(tmp_path / "t.db", fail_on="server_miss").ok
    out = _cli("analyze", str(tmp_path / "t.db"))
    assert "server_miss/eviction" in out.stdout and "evicted" in out.stdout
    assert _cli("check", str(tmp_path / "t.db")).returncode == 0
    assert _cli("check", str(tmp_path / "t.db"), "--fail-on", "server_miss").returncode == 1


def test_a_session_moved_to_another_upstream_is_a_server_miss_of_subtype_routing(tmp_path):
    """Two engine proxies behind a pool; the one holding the session goes away, the pool fails over, and
    the next turn (append-only) is served by the other upstream from a cold cache."""
    engines = [Engine(TINY_MODEL, name="tiny-llama", dtype="float32").start() for _ in range(2)]
    servers = {}
    try:
        for i, engine in enumerate(engines):
            engine.wait_ready(60)
            port = free_port()
            rec = Recorder(tmp_path / f"up{i}.db")
            server, thread = start_uvicorn(uvicorn.Config(create_app(EngineBackend(engine), rec), host="127.0.0.1",
                                                          port=port, log_level="warning"))
            servers[f"http://127.0.0.1:{port}"] = (server, thread, rec)
        pool = UpstreamPool(list(servers), health_interval=60)
        history = [{"role": "system", "content": "You help with shell scripts. " * 20},
                   {"role": "user", "content": "List the files."}]
        with Recorder(tmp_path / "front.db") as rec:
            with running_server(create_app(pool, rec)) as url:
                history = _grow(history, _chat(url, "s", history), 1)
                history = _grow(history, _chat(url, "s", history), 2)
                rec.flush()
                served = sqlite3.connect(rec.path).execute("select served_by from turn_log").fetchall()
                victim = served[-1][0]
                server, thread, _ = servers[victim]
                server.should_exit = True
                thread.join(10)
                _chat(url, "s", history)
            rec.flush()
    finally:
        for server, thread, rec in servers.values():
            server.should_exit = True
            thread.join(10)
            rec.close()
        for engine in engines:
            engine.shutdown()
    report = analyze(tmp_path / "front.db")
    assert report.renderer_source == "fallback"  # an upstream that publishes no template: counted by share
    turns = report.sessions[0].turns
    assert turns[1].brk is None  # warm on the first upstream
    last = turns[2]
    assert last.served_by != victim and last.reported_cached_tokens == 0
    assert last.brk is not None and (last.brk.cause, last.brk.subtype) == ("server_miss", "routing")
    assert victim in last.brk.detail
    # An export keeps who served each turn, so the analysis of the JSONL names the same cause.
    from recorder.jsonl import export_jsonl

    export_jsonl(tmp_path / "front.db", tmp_path / "front.jsonl")
    exported = analyze(tmp_path / "front.jsonl").sessions[0].turns[2].brk
    assert (exported.cause, exported.subtype) == ("server_miss", "routing")


def _records(upstream: str, gaps: list[float], usages: list[dict], endpoint="/v1/chat/completions") -> list[dict]:
    body = [{"role": "system", "content": "You are a coding agent. " * 30}, {"role": "user", "content": "Fix a.py."}]
    out, ts = [], 1_800_000_000.0
    for i, (gap, usage) in enumerate(zip(gaps, usages)):
        ts += gap
        out.append({"id": f"r{i}", "session": "s", "ts": ts, "endpoint": endpoint, "upstream": upstream,
                    "request": {"model": "m", "messages": body}, "usage": usage,
                    "timing": {"ttft_s": 1.0, "total_s": 2.0, "chunk_times": []}})
        body = body + [{"role": "assistant", "content": f"Step {i} done."}, {"role": "user", "content": "Next."}]
    return out


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _openai(prompt: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": cached}}


@pytest.mark.parametrize("gap, subtype", [(PROVIDER_TTLS["openai"][0] + 120, "ttl"), (30, "unknown")])
def test_a_gap_past_the_providers_ttl_is_named(tmp_path, gap, subtype):
    records = _records("https://api.openai.com/v1", [0, 10, gap],
                       [_openai(2000, 0), _openai(2200, 2000), _openai(2400, 0)])  # cacheable: over 1,024
    turns = analyze(_write(tmp_path / "t.jsonl", records)).sessions[0].turns
    assert turns[1].brk is None  # cached as predicted (by share: another tokenizer)
    assert turns[2].brk is not None and (turns[2].brk.cause, turns[2].brk.subtype) == ("server_miss", subtype)
    assert turns[2].reported_cache_read_tokens == 0
    if subtype == "ttl":
        assert f"{gap - 2:,.0f} s since the previous turn ended" in turns[2].brk.detail


def test_anthropic_one_hour_cache_lifetime_is_honoured(tmp_path):
    records = _records("https://api.anthropic.com", [0, 1200], [
        {"input_tokens": 100, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 1900},
        {"input_tokens": 300, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 1900}], "/v1/messages")
    for r in records:
        r["request"] = {"model": "claude", "max_tokens": 100, "system": [
            {"type": "text", "text": r["request"]["messages"][0]["content"], "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "messages": [{"role": m["role"], "content": m["content"]} for m in r["request"]["messages"][1:]]}
    turns = analyze(_write(tmp_path / "t.jsonl", records)).sessions[0].turns
    assert turns[1].brk.cause == "server_miss" and turns[1].brk.subtype == "unknown"  # 20 min < 1 h


class ScriptedAnthropic:
    """A Messages upstream on loopback that reports Anthropic's cache figures and cache diagnostics:
    the first turn writes the cache, the second reads it, the third misses it (diagnostics say why)."""

    def __init__(self):
        self.calls = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        while (await receive()).get("more_body"):
            pass
        if scope["method"] != "POST":  # the proxy's one question for a published template (GET /props)
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        self.calls += 1
        usage = [{"input_tokens": 12, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 400},
                 {"input_tokens": 15, "cache_read_input_tokens": 400, "cache_creation_input_tokens": 20},
                 {"input_tokens": 40, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 420}][self.calls - 1]
        body = {"id": f"msg_{self.calls}", "type": "message", "role": "assistant", "model": "claude-x",
                "content": [{"type": "text", "text": f"ok {self.calls}"}], "stop_reason": "end_turn", "usage": usage}
        if self.calls == 3:
            body["diagnostics"] = {"cache_miss_reason": {"type": "previous_message_not_found"}}
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})


def test_anthropic_cache_figures_and_diagnostics_are_recorded_and_shown(tmp_path):
    upstream = ScriptedAnthropic()
    history = [{"role": "user", "content": "Explain calc.py in detail please. " * 30}]
    with running_server(upstream) as up_url, Recorder(tmp_path / "t.db") as rec:
        with running_server(create_app(UpstreamBackend(up_url), rec)) as url:
            for i in range(3):
                r = httpx.post(url + "/v1/messages", timeout=60, json={
                    "model": "claude-x", "max_tokens": 50, "system": "You are a code reviewer. " * 20,
                    "messages": history})
                assert r.status_code == 200, r.text
                history = history + [{"role": "assistant", "content": r.json()["content"][0]["text"]},
                                     {"role": "user", "content": f"And part {i}?"}]
        rec.flush()
    report = analyze(tmp_path / "t.db")
    turns = report.sessions[0].turns
    assert [t.reported_cache_read_tokens for t in turns] == [0, 400, 0]
    assert [t.reported_cache_write_tokens for t in turns] == [400, 20, 420]
    assert turns[2].server_miss_reason == "previous_message_not_found"
    assert turns[2].brk is not None and turns[2].brk.cause == "server_miss"
    assert turns[2].served_by == up_url
    d = report.to_dict()["sessions"][0]["turns"][2]
    assert d["reported_cache_read_tokens"] == 0 and d["reported_cache_write_tokens"] == 420
    assert d["server_miss_reason"] == "previous_message_not_found" and d["break"]["cause"] == "server_miss"
    out = _cli("analyze", str(tmp_path / "t.db")).stdout
    assert "cache write 420" in out and "previous_message_not_found" in out
