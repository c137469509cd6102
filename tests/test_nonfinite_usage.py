"""Issue 25, finding 6 (and the 1e29 row of finding 5): an upstream reporting usage as NaN,
Infinity or a number no token count can be. Every such turn is recorded, its counts NULL
(unknown, not zero) and its usage kept as the upstream sent it, in strict JSON; every reader
(dashboard API, /metrics, JSONL and HAR exports, analyze) keeps working.

Driven from outside: a scripted upstream on loopback writes the usage literally (`NaN` is what
Python's json writes, and what its json reads back), a real proxy in front of it on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import httpx
import pytest

from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from recorder import Recorder
from tests.conftest import ROOT, answer_lifespan, running_server

# What the upstream writes where a count belongs, keyed by the user message that asks for it.
USAGES = {
    "nan": b'{"prompt_tokens": NaN, "completion_tokens": 2, "total_tokens": NaN}',
    "inf": b'{"prompt_tokens": Infinity, "completion_tokens": -Infinity, "total_tokens": Infinity,'
           b' "prompt_tokens_details": {"cached_tokens": NaN}}',
    "huge-float": b'{"prompt_tokens": 1e29, "completion_tokens": 2, "total_tokens": 1e29}',
    "huge-int": b'{"prompt_tokens": 100000000000000000000000000000, "completion_tokens": 2,'
                b' "total_tokens": 100000000000000000000000000002}',
    "fine": b'{"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 3}}',
}


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


async def usage_upstream(scope, receive, send):
    """An OpenAI-compatible upstream whose usage is the one its user message names, spelled raw."""
    if scope["type"] == "lifespan":
        return await answer_lifespan(receive, send)
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"].endswith("/models"):
        payload, kind = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}', b"application/json"
    else:
        request = json.loads(body)
        usage = USAGES[request["messages"][-1]["content"]]
        if request.get("stream"):
            kind = b"text/event-stream"
            payload = (b'data: {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices":'
                       b' [{"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}\n\n'
                       b'data: {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],'
                       b' "usage": ' + usage + b'}\n\ndata: [DONE]\n\n')
        else:
            kind = b"application/json"
            payload = (b'{"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [{"index": 0,'
                       b' "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}], "usage": '
                       + usage + b'}')
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", kind), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", *args], capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)


def _metric_values(text: str) -> list[str]:
    return [line.rsplit(" ", 1)[1] for line in text.splitlines() if line and not line.startswith("#")]


@pytest.fixture
def proxied(tmp_path):
    with running_server(usage_upstream) as up, Recorder(tmp_path / "traffic.db") as rec:
        with running_server(create_app(UpstreamBackend(up), rec)) as url:
            yield url, rec


def test_nonfinite_and_huge_usage_is_recorded_and_every_reader_copes(proxied, tmp_path):
    url, rec = proxied
    names = list(USAGES)
    for stream in (False, True):
        for name in names:
            body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": name}]}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30,
                           headers={"x-session-id": f"s-{name}"})
            assert r.status_code == 200, (name, stream, r.text)
            # The dashboard's API answers (strict JSON) after every turn, not a 500 until restart.
            api = httpx.get(url + "/ui/api/sessions", timeout=30)
            assert api.status_code == 200, (name, stream, api.text[:300])
            _strict(api.text)
    metrics = httpx.get(url + "/metrics", timeout=30)
    assert metrics.status_code == 200
    values = _metric_values(metrics.text)
    assert not [v for v in values if v.lower() in ("nan", "+inf", "-inf", "inf")], metrics.text
    prompt = [line for line in metrics.text.splitlines() if line.startswith("prefixtrace_prompt_tokens_total")]
    assert prompt and prompt[0].endswith(" 14")  # only the "fine" turns' 7 + 7 counted
    unusable = [line for line in metrics.text.splitlines() if line.startswith("prefixtrace_usage_unusable_total")]
    assert unusable and unusable[0].endswith(" 8"), metrics.text  # 4 bad usages x (plain, streamed)
    assert rec.flush(30)

    con = sqlite3.connect(rec.path)
    con.row_factory = sqlite3.Row
    stored = [dict(r) for r in con.execute("select * from turn_log")]
    assert len(stored) == 2 * len(names)  # every turn recorded: the 1e29 row no longer fails
    for row in stored:
        usage = _strict(row["usage"])  # the usage as the upstream sent it, in strict JSON
        for col in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            assert row[col] is None or (isinstance(row[col], int) and 0 <= row[col] < 2 ** 63), (col, row[col])
        session = row["session_id"]
        if session == "s-fine":
            assert (row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"]) == (7, 2, 3)
        elif session == "s-nan":
            assert row["prompt_tokens"] is None and row["completion_tokens"] == 2
            assert usage["prompt_tokens"] == "NaN"
        elif session == "s-inf":
            assert row["prompt_tokens"] is None and row["completion_tokens"] is None and row["cached_tokens"] is None
            assert usage["prompt_tokens"] == "Infinity" and usage["completion_tokens"] == "-Infinity"
        elif session == "s-huge-float":
            assert row["prompt_tokens"] is None and usage["prompt_tokens"] == 1e29
        else:
            assert row["prompt_tokens"] is None and usage["prompt_tokens"] == 10 ** 29

    jsonl, har = tmp_path / "out.jsonl", tmp_path / "out.har"
    for out, fmt in ((jsonl, "jsonl"), (har, "har")):
        done = _cli("export", str(rec.path), "--format", fmt, "--out", str(out))
        assert done.returncode == 0, done.stderr.decode()
    lines = [_strict(line) for line in jsonl.read_text().splitlines()]
    assert len(lines) == 2 * len(names)
    entries = _strict(har.read_text())["log"]["entries"]
    for entry in entries:  # the response content, JSON or SSE, is strict too
        text = entry["response"]["content"]["text"]
        for part in ([text] if not text.startswith("data:") else
                     [p[5:] for p in text.split("\n\n") if p.startswith("data:") and "[DONE]" not in p]):
            _strict(part)
    done = _cli("analyze", str(rec.path), "--json")
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr.decode()
    report = _strict(done.stdout.decode())
    assert len(report["sessions"]) == len(names)


def test_a_database_holding_nonfinite_usage_is_read_and_exported_strictly(tmp_path):
    """A database written before this change (a NaN spelled `NaN` in its usage column, a count
    column holding a float) exports strict JSON all the same."""
    from recorder import Turn

    db = tmp_path / "old.db"
    with Recorder(db) as rec:
        rec.record(Turn(request_id="r1", started_at=1.0, endpoint="/v1/chat/completions", upstream="u",
                        request_body={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                        status=200, usage={"prompt_tokens": 3}, prompt_tokens=3))
    con = sqlite3.connect(db)
    con.execute("update turn_log set usage = ?, prompt_tokens = ?", ['{"prompt_tokens": NaN, "x": Infinity}', 1e300])
    con.commit()
    con.close()
    out = tmp_path / "out.jsonl"
    done = _cli("export", str(db), "--out", str(out))
    assert done.returncode == 0, done.stderr.decode()
    (line,) = out.read_text().splitlines()
    record = _strict(line)
    assert record["usage"] == {"prompt_tokens": "NaN", "x": "Infinity"}
    assert record["tokens"]["prompt"] is None
