"""The server's numbers by default (issue 26, item 1): the proxy records what rendered and counted each
prompt (the served model's chat template and tokenizer, once per model in the database), and `analyze DB`
and `check DB` count with it without flags, so the analysis' prompt tokens are the server's and its
predicted cached tokens are what the server reported. Where nothing was recorded the output names the
renderer it fell back to and how to give the right one.

Driven from outside: a real proxy (uvicorn on 127.0.0.1) with the embedded tiny model, real HTTP
turns, the real SQLite recording, the CLI in a subprocess."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from analyzer import analyze, check
from conftest import TINY_MODEL, running_server
from engine.engine import Engine
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder

ROOT = Path(__file__).resolve().parent.parent
TRAFFIC = ROOT.parent.parent / "shared" / "traffic"  # ../shared/traffic from the repository root
if not TRAFFIC.is_dir():
    TRAFFIC = Path("/work/shared/traffic")

SYSTEM = "You are a careful coding assistant. Answer in one short sentence."


def _cli(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from prefixtrace.cli import main; sys.argv[0] = 'prefixtrace'; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _chat(client: httpx.Client, messages: list[dict], session: str) -> str:
    r = client.post("/v1/chat/completions", headers={"X-Session-Id": session},
                    json={"model": "default", "messages": messages, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _message(client: httpx.Client, messages: list[dict], session: str) -> str:
    """The same over the Messages API (top-level system, content blocks)."""
    body = {"model": "default", "system": messages[0]["content"], "max_tokens": 12, "temperature": 0,
            "messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages[1:]]}
    r = client.post("/v1/messages", headers={"X-Session-Id": session}, json=body)
    assert r.status_code == 200, r.text
    return "".join(b.get("text", "") for b in r.json()["content"])


def _conversation(url: str, session: str, system: str, turns: int, *, break_at: int | None = None,
                  send=_chat, question: str = "What does calc.py do?") -> None:
    """`turns` turns that append the reply and a new question; at `break_at` the system prompt is
    edited in the middle (a prefix break the server must re-prefill from there)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    with httpx.Client(base_url=url, timeout=300) as client:
        for i in range(turns):
            if i == break_at:
                messages[0] = {"role": "system", "content": system.replace("careful", "fast")}
            reply = send(client, messages, session)
            messages = messages + [{"role": "assistant", "content": reply},
                                   {"role": "user", "content": f"And what about test_{i}.py?"}]


@pytest.fixture
def recorded_db(tmp_path):
    """A database recorded by a real proxy in front of a fresh tiny engine: one session of five turns
    with a break at the fourth."""
    engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32").start()
    engine.wait_ready(60)
    try:
        with Recorder(tmp_path / "traffic.db") as rec:
            with running_server(create_app(EngineBackend(engine), rec)) as url:
                _conversation(url, "s1", SYSTEM, 5, break_at=3)
            rec.flush()
    finally:
        engine.shutdown()
    return tmp_path / "traffic.db"


def test_the_proxy_stores_the_served_models_renderer_once(recorded_db):
    con = sqlite3.connect(recorded_db)
    rows = con.execute("SELECT id, model, chat_template, tokenizer_sha256, length(tokenizer) FROM renderers").fetchall()
    assert len(rows) == 1  # once per model, however many turns
    rid, model, template, digest, stored = rows[0]
    config = json.loads((TINY_MODEL / "tokenizer_config.json").read_text())
    assert model == "tiny-llama" and template == config["chat_template"]
    import hashlib

    assert digest == hashlib.sha256((TINY_MODEL / "tokenizer.json").read_bytes()).hexdigest() and stored > 0
    assert {r[0] for r in con.execute("SELECT renderer_id FROM turn_log")} == {rid}
    assert {r[0] for r in con.execute("SELECT served_by FROM turn_log")} == {"embedded:tiny-llama"}


def test_analyze_without_flags_counts_as_the_server_did(recorded_db):
    report = analyze(recorded_db)
    assert report.renderer_source == "recorded" and "tiny-llama" in report.renderer_note
    turns = report.sessions[0].turns
    assert len(turns) == 5
    for t in turns:  # every prompt counted as the server counted it, every cached figure as it reported
        assert t.prompt_tokens == t.reported_prompt_tokens, t
        assert t.predicted_cached_tokens == t.reported_cached_tokens, t
        assert not t.cached_disagrees
    brk = turns[3].brk
    assert brk is not None and brk.cause == "system_rewrite"
    assert brk.token_offset == turns[3].reported_cached_tokens  # the break sits where the server's cache stopped
    assert all(t.brk is None for i, t in enumerate(turns) if i != 3)
    # Append-only turns: the server cached past the previous prompt, into the generation prompt and reply.
    assert turns[1].reported_cached_tokens > turns[0].prompt_tokens


def test_a_new_sessions_first_prompt_is_predicted_from_what_other_sessions_left_cached(engine_server):
    """The engine's cache is shared: a second conversation with the same system prompt (and a third
    with another) finds their common start cached; the prediction says how much, exactly."""
    url, rec = engine_server
    _conversation(url, "one", SYSTEM, 2)
    _conversation(url, "two", SYSTEM, 2, question="Where are the tests?")
    _conversation(url, "three", "Be brief. " + SYSTEM, 1)
    rec.flush()
    report = analyze(rec.path)
    firsts = {s.id: s.turns[0] for s in report.sessions}
    assert firsts["two"].reported_cached_tokens > 20  # the whole system prompt
    for t in (t for s in report.sessions for t in s.turns):
        assert t.predicted_cached_tokens == t.reported_cached_tokens, t


def test_cli_analyze_and_check_use_it_without_flags(recorded_db):
    out = _cli("analyze", str(recorded_db))
    assert out.returncode == 0, out.stderr
    assert "recorded:tiny-llama" in out.stdout and "recorded for tiny-llama" in out.stdout
    data = json.loads(_cli("analyze", str(recorded_db), "--format", "json").stdout)
    assert data["renderer_source"] == "recorded"
    res = _cli("check", str(recorded_db), "--allow", "system_rewrite")
    assert res.returncode == 0, res.stdout + res.stderr
    assert check(recorded_db, allow="system_rewrite").ok


def test_a_given_model_counts_the_generation_prompt_too():
    """Recorded without a renderer (a JSONL export of harness traffic): --model gives the server's
    template and tokenizer, and the prompt the server counted includes the generation prompt."""
    report = analyze(TRAFFIC / "llm_tiny.jsonl", model=TINY_MODEL)
    assert report.renderer_source == "given"
    for t in (t for s in report.sessions for t in s.turns):
        assert t.prompt_tokens == t.reported_prompt_tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pi_tiny", "llm_tiny", "claude_smol"])
def test_without_a_recorded_renderer_the_output_names_the_fallback(name):
    report = analyze(TRAFFIC / f"{name}.jsonl")
    assert report.renderer_source == "fallback"
    assert "generic ChatML" in report.renderer_note and "--model" in report.renderer_note
    model = "tiny-llama" if name.endswith("_tiny") else "smollm2-135m-instruct"
    assert model in report.renderer_note  # the model that served it, recorded as the upstream
    out = _cli("analyze", str(TRAFFIC / f"{name}.jsonl"))
    assert "fell back to the generic ChatML renderer" in " ".join(out.stdout.split())
    assert json.loads(_cli("analyze", str(TRAFFIC / f"{name}.jsonl"), "--json").stdout)["renderer_source"] == "fallback"
    checked = _cli("check", str(TRAFFIC / f"{name}.jsonl"))
    assert "note: no renderer was recorded" in checked.stdout and "--model" in checked.stdout


def test_every_harness_recording_names_its_fallback_and_model():
    """All the harness recordings (exported without renderer info): the note names the fallback and the
    embedded model that served them (`upstream: embedded:NAME`), or how to give a template for an upstream."""
    files = sorted(TRAFFIC.glob("*.jsonl"))
    assert len(files) >= 9
    for path in files:
        report = analyze(path)
        assert report.renderer_source == "fallback", path
        upstreams = {u for u in (json.loads(line).get("upstream") for line in path.open()) if u}
        engines = sorted(u.split(":", 1)[1] for u in upstreams if u.startswith("embedded:"))
        for name in engines:
            assert name in report.renderer_note, (path, report.renderer_note)
        if not engines:
            assert "--template FILE.jinja --tokenizer tokenizer.json" in report.renderer_note, path


def test_a_database_without_renderers_falls_back_and_says_so(tmp_path):
    """Turns stored without a renderer (imported from JSONL, or recorded before renderers were: a schema 2
    database gains the table empty) read as 'nothing recorded', never as some other renderer."""
    from recorder.jsonl import import_jsonl

    db = tmp_path / "old.db"
    import_jsonl(TRAFFIC / "aider_tiny.jsonl", db)
    report = analyze(db)
    assert report.renderer_source == "fallback" and "tiny-llama" in report.renderer_note


@pytest.mark.slow
def test_the_bundled_model_too(tmp_path):
    """The bundled SmolLM2 (a real tokenizer and template): the same equalities, over chat completions
    and the Messages API."""
    from engine.default_model import DEFAULT_MODEL_NAME, default_model_dir

    engine = Engine(default_model_dir(), name=DEFAULT_MODEL_NAME, dtype="float32").start()
    engine.wait_ready(300)
    try:
        with Recorder(tmp_path / "smol.db") as rec:
            with running_server(create_app(EngineBackend(engine), rec)) as url:
                _conversation(url, "a", SYSTEM, 4, break_at=2)
                _conversation(url, "b", "Reply tersely. " + SYSTEM, 3, send=_message)
            rec.flush()
    finally:
        engine.shutdown()
    report = analyze(tmp_path / "smol.db")
    assert report.renderer_source == "recorded"
    sessions = {s.id: s.turns for s in report.sessions}
    for sid, turns in sessions.items():
        for t in turns:  # b's first prompt finds the template's opening tokens cached by session a
            assert t.prompt_tokens == t.reported_prompt_tokens, (sid, t)
            assert t.predicted_cached_tokens == t.reported_cached_tokens, (sid, t)
    assert sessions["b"][0].reported_cached_tokens > 0
    assert sessions["a"][2].brk is not None and sessions["a"][2].brk.cause == "system_rewrite"
    assert all(t.brk is None for t in sessions["b"])


def test_an_upstream_that_publishes_its_template_is_recorded_with_it(tiny_engine, tmp_path):
    """A proxy in front of another (as in front of llama.cpp) asks once for the upstream's published chat
    template (GET /props), stores it once and names it on each turn; the analysis renders with it and,
    no tokenizer being published, says the counts are estimates and how to give the tokenizer."""
    with Recorder(tmp_path / "b.db") as rec_b, Recorder(tmp_path / "a.db") as rec_a:
        with running_server(create_app(EngineBackend(tiny_engine), rec_b)) as url_b:
            props = httpx.get(url_b + "/props", timeout=10).json()
            assert props["chat_template"] == json.loads((TINY_MODEL / "tokenizer_config.json").read_text())["chat_template"]
            front = UpstreamBackend(url_b, probe_props=True)
            with running_server(create_app(front, rec_a)) as url_a:
                _conversation(url_a, "s", SYSTEM, 3)
        rec_a.flush()
        rec_b.flush()
    con = sqlite3.connect(tmp_path / "a.db")
    assert con.execute("SELECT source, model, tokenizer FROM renderers").fetchall() == [("upstream", "tiny-llama", None)]
    assert len({r[0] for r in con.execute("SELECT renderer_id FROM turn_log")} - {None}) == 1
    assert sqlite3.connect(tmp_path / "b.db").execute("SELECT count(*) FROM turn_log").fetchone()[0] == 3  # /props is no turn
    report = analyze(tmp_path / "a.db")
    assert report.renderer_source == "recorded" and report.renderer.startswith("recorded:tiny-llama")
    assert "the upstream published" in report.renderer_note and "--tokenizer" in report.renderer_note
    # With the tokenizer given, the front's prompt counts are the upstream engine's own. Its reply tokens
    # are not known here, so the prediction stops after the previous generation prompt: the engine may
    # have served a few of the reply's tokens more, never fewer.
    given = analyze(tmp_path / "a.db", tokenizer=str(TINY_MODEL / "tokenizer.json"))
    assert given.renderer_source == "recorded"
    for t in given.sessions[0].turns:
        assert t.prompt_tokens == t.reported_prompt_tokens
        assert 0 <= t.reported_cached_tokens - t.predicted_cached_tokens <= 12 and t.brk is None
