"""POST /v1/responses/compact (OpenAI's remote compaction, which Codex calls for a provider named
OpenAI): passed through to a real loopback upstream and recorded as its own endpoint, never
analysed as a call of the loop; refused in one line on the embedded engine."""

from __future__ import annotations

import json

import httpx

from analyzer import analyze
from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from recorder.store import Recorder
from testsupport.scripted_replies import codex_remote_compact
from testsupport.scripted_upstream import ScriptedUpstream
from tests.conftest import rows, running_server

HISTORY = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
           {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "cat hello.txt"}]},
           {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": "{\"cmd\":\"cat hello.txt\"}"},
           {"type": "function_call_output", "call_id": "call_1", "output": "The secret word is mango."}]


def test_compact_goes_to_the_upstream_as_sent_and_is_recorded_apart_from_the_loop(tmp_path):
    upstream = ScriptedUpstream(codex_remote_compact)
    body = {"model": "gpt-test", "input": HISTORY, "instructions": "You are Codex.", "tools": [],
            "parallel_tool_calls": True, "prompt_cache_key": "sess-1"}
    with Recorder(tmp_path / "a.db") as rec, running_server(upstream) as up, \
            running_server(create_app(UpstreamBackend(up), rec)) as url:
        loop = httpx.post(url + "/v1/responses", json={"model": "gpt-test", "input": HISTORY[:2],
                                                       "prompt_cache_key": "sess-1"}, timeout=30)
        reply = httpx.post(url + "/v1/responses/compact", json=body, timeout=30,
                           headers={"Authorization": "Bearer sk-test-secret-0123456789abcdef"})
        recorded = rows(rec)
        live = httpx.get(url + "/ui/api/sessions", timeout=30).json()  # the dashboard leaves it out too
    assert [t["request_id"] for s in live["sessions"] for t in s["turns"]] == [recorded[0]["request_id"]]
    assert loop.status_code == 200
    assert reply.status_code == 200, reply.text
    output = reply.json()["output"]
    assert output[-1]["type"] == "compaction" and output[:-1] == [HISTORY[1]]  # the upstream's answer, whole
    assert upstream.received[-1] == ("/v1/responses/compact", body)  # the body went on unchanged
    turn = recorded[-1]
    assert turn["endpoint"] == "/v1/responses/compact" and turn["status"] == 200 and turn["session_id"] == "sess-1"
    usage = reply.json()["usage"]
    assert (turn["prompt_tokens"], turn["cached_tokens"]) == (usage["input_tokens"],
                                                             usage["input_tokens_details"]["cached_tokens"])
    assert json.loads(turn["usage"]) == usage
    assert "sk-test-secret" not in json.dumps(recorded)

    report = analyze(tmp_path / "a.db")  # the compaction is no call of the loop: left out, counted
    assert report.remote_compactions == 1
    assert [t.request_id for s in report.sessions for t in s.turns] == [recorded[0]["request_id"]]


def test_compact_on_the_embedded_engine_is_refused_in_one_line(engine_server):
    url, recorder = engine_server
    reply = httpx.post(url + "/v1/responses/compact", json={"model": "default", "input": HISTORY}, timeout=30)
    assert reply.status_code == 404
    message = reply.json()["error"]["message"]
    assert "does not compact" in message and "\n" not in message
    assert rows(recorder)[-1]["endpoint"] == "/v1/responses/compact"
