"""`prefixtrace replay` through the proxy that recorded the original marks what it re-sends
(`X-Prefixtrace-Replay`): the proxy records the mark with the turn, and `analyze`, `check`, the export
and the dashboard leave the replayed turns out, saying how many, so a replay never shows up later as
the user's traffic (today it did, as breaks). A real proxy on 127.0.0.1 with the embedded tiny engine,
the real recording, the real replay client."""

from __future__ import annotations

import httpx
import pytest
from click.testing import CliRunner

from analyzer import analyze
from conftest import TINY_MODEL, running_server
from engine.engine import Engine
from prefixtrace.cli import cli
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from recorder.reader import iter_turns
from recorder.replay import replay
from recorder.store import Recorder

pytestmark = pytest.mark.slow


def test_a_replay_through_the_recording_proxy_is_not_the_users_traffic(tmp_path):
    db = tmp_path / "traffic.db"
    engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32").start()
    engine.wait_ready(60)
    try:
        with Recorder(db) as rec:
            with running_server(create_app(EngineBackend(engine), rec)) as url:
                messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List files."}]
                for n in range(3):
                    r = httpx.post(url + "/v1/chat/completions", headers={"X-Session-Id": "s1"}, timeout=60,
                                   json={"model": "default", "messages": messages, "max_tokens": 4})
                    messages = messages + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                                           {"role": "user", "content": f"and {n}?"}]
                rec.flush()
                before = analyze(db)
                originals = list(iter_turns(db))
                report = replay(originals, url)  # the same traffic again, through the proxy that records it
                assert all(t["status"] == 200 for t in report["targets"][0]["turns"])
                rec.flush()
                live = httpx.get(url + "/ui/api/sessions", timeout=60).json()
    finally:
        engine.shutdown()
    assert len(list(iter_turns(db))) == 6  # recorded, with the mark
    after = analyze(db)
    assert after.replayed == 3 and "3 replayed requests left out" in after.warnings()[0]
    assert [(s.id, len(s.turns)) for s in after.sessions] == [(s.id, len(s.turns)) for s in before.sessions]
    assert after.breaks == [] and sum(len(s["turns"]) for s in live["sessions"]) == 3
    out = tmp_path / "traffic.jsonl"
    assert CliRunner().invoke(cli, ["export", str(db), "--out", str(out)]).exit_code == 0
    exported = analyze(out)
    assert exported.replayed == 3 and sum(len(s.turns) for s in exported.sessions) == 3
    checked = CliRunner().invoke(cli, ["check", str(db)])
    assert checked.exit_code == 0, checked.output
