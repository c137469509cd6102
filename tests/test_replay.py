"""Replay recorded traffic against a real server and compare with what was recorded."""

from __future__ import annotations

import httpx

from engine.engine import Engine
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from recorder.replay import replay
from recorder.sources import load_turns
from recorder.store import Recorder
from tests.conftest import TINY_MODEL, free_port, running_server


def test_replay_against_a_fresh_engine_reproduces_recorded_cached_tokens(engine_server, tmp_path):
    url, recorder = engine_server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."}]
    for _ in range(3):
        r = httpx.post(url + "/v1/chat/completions", timeout=60, headers={"X-Session-Id": "s1"},
                       json={"model": "default", "max_tokens": 6, "temperature": 0, "messages": messages})
        text = r.json()["choices"][0]["message"]["content"]
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
    recorder.flush()

    fresh = Engine(TINY_MODEL, name="tiny-llama", dtype="float32").start()
    fresh.wait_ready(60)
    with Recorder(tmp_path / "replayed.db") as rec2, running_server(create_app(EngineBackend(fresh), rec2)) as target:
        report = replay(load_turns(recorder.path), target)
    fresh.shutdown()
    turns = report["targets"][0]["turns"]
    assert [t["status"] for t in turns] == [200, 200, 200]
    assert [t["cached_tokens"] for t in turns] == [t["recorded_cached_tokens"] for t in turns]
    assert turns[2]["cached_tokens"] > 0
    assert all(t["ttft_ms"] is not None and t["ttft_ms"] <= t["total_ms"] for t in turns)


def test_replay_against_an_unreachable_target_reports_each_turn(engine_server):
    url, recorder = engine_server
    httpx.post(url + "/v1/chat/completions", json={"model": "default", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    recorder.flush()
    dead = f"http://127.0.0.1:{free_port()}"
    report = replay(load_turns(recorder.path), dead)
    turn = report["targets"][0]["turns"][0]
    assert turn["status"] == 0 and "unreachable" in turn["error"] and dead in turn["error"]


def test_messages_turns_replay_on_the_messages_endpoint(engine_server, tmp_path):
    """A turn recorded on /v1/messages goes back to /v1/messages (its top-level `system` and
    content blocks mean nothing to chat completions): same prompt, cache reads counted."""
    url, recorder = engine_server
    body = {"model": "default", "max_tokens": 4, "temperature": 0, "system": "Answer in one word. " * 20,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Colour of the sky?"}]}]}
    for _ in range(2):
        r = httpx.post(url + "/v1/messages", json=body, timeout=60, headers={"X-Session-Id": "a1"})
        assert r.status_code == 200, r.text
    recorder.flush()
    recorded = load_turns(recorder.path)
    report = replay(recorded, url)
    turns = report["targets"][0]["turns"]
    assert [t["status"] for t in turns] == [200, 200] and not any(t["error"] for t in turns)
    assert [t["prompt_tokens"] for t in turns] == [t.prompt_tokens for t in recorded]
    assert turns[1]["cached_tokens"] == turns[1]["prompt_tokens"] - 1  # all but the token that samples
    assert all(t["ttft_ms"] is not None and t["completion_tokens"] for t in turns)
