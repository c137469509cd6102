"""Issue 25, finding 11: a recording holding a request replay cannot re-send (a lone UTF-16
surrogate, from a request the proxy answered 400) is skipped with its reason; the rest replays.

Driven from outside: the hostile request goes through a real server on 127.0.0.1 as raw bytes
(a JSON `\\ud800` escape), is refused and recorded, and the recording is replayed, by the
library and by the CLI, against a real server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from recorder.replay import replay
from recorder.sources import load_turns
from tests.conftest import ROOT


def _record_a_surrogate_and_a_normal_turn(url: str, recorder) -> None:
    raw = b'{"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "bad \\ud800 here"}]}'
    r = httpx.post(url + "/v1/chat/completions", content=raw, timeout=60,
                   headers={"content-type": "application/json", "x-session-id": "s1"})
    assert r.status_code == 400, r.text
    r = httpx.post(url + "/v1/chat/completions", timeout=60, headers={"x-session-id": "s1"},
                   json={"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "fine"}]})
    assert r.status_code == 200, r.text
    recorder.flush()


def test_replay_skips_a_request_it_cannot_send_and_goes_on(engine_server):
    url, recorder = engine_server
    _record_a_surrogate_and_a_normal_turn(url, recorder)
    turns = load_turns(recorder.path)
    assert any("\ud800" in json.dumps(t.request_body, ensure_ascii=False) for t in turns)  # the surrogate is kept
    report = replay(turns, url)
    target = report["targets"][0]
    assert target["error"] is None
    (skipped,) = target["skipped"]
    assert skipped["index"] == 0 and skipped["session"] == "s1"
    assert "surrogate" in skipped["reason"] and "U+D800" in skipped["reason"]
    sent = [t for t in target["turns"] if not t.get("skipped")]
    assert [t["status"] for t in sent] == [200]
    assert target["summary"]["skipped_turns"] == 1
    assert target["summary"]["ok_turns"] == 1


def test_replay_cli_lists_the_skipped_request(engine_server, tmp_path):
    url, recorder = engine_server
    _record_a_surrogate_and_a_normal_turn(url, recorder)
    out = tmp_path / "replay.json"
    done = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "replay", str(recorder.path), "--target", url,
                           "--out", str(out)], capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert done.returncode == 0, done.stderr.decode()
    assert b"Traceback" not in done.stderr
    text = done.stdout.decode()
    assert "skipped" in text and "surrogate" in text
    report = json.loads(out.read_text())
    assert len(report["targets"][0]["skipped"]) == 1
    assert oct(out.stat().st_mode & 0o777) == oct(0o600)
