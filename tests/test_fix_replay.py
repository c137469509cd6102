"""`prefixtrace replay SRC --target URL --fix NAME`: a recorded session with a per-turn timestamp, replayed as
recorded and as fixed against the embedded tiny engine, alternating; the fix shows its gain, the report
says what it removed and caused and gives the verdict, in text, JSON and HTML."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from engine.engine import Engine
from prefixtrace.cli import cli
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from recorder.store import Recorder
from testsupport.servers import TINY_MODEL, running_server
from testsupport.volatile_session import play


@pytest.fixture
def engine_url(tmp_path):
    engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32").start()
    engine.wait_ready(60)
    with Recorder(tmp_path / "served.db") as rec, running_server(create_app(EngineBackend(engine), rec)) as url:
        yield url
    engine.shutdown()


@pytest.mark.slow
def test_paired_replay_proves_fix_volatile(tmp_path, engine_url):
    recording = tmp_path / "recorded.db"
    recorder_engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32").start()
    try:
        with Recorder(recording) as rec, running_server(create_app(EngineBackend(recorder_engine), rec)) as url:
            play(url)
    finally:
        recorder_engine.shutdown()
    out = tmp_path / "proof.html"
    result = CliRunner().invoke(cli, ["replay", str(recording), "--target", engine_url, "--fix", "volatile",
                                      "--min-gain", "0.3", "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rec, fixed = report["variants"]["recorded"], report["variants"]["fixed"]
    assert rec["hit_rate_later_turns"] < 0.3 < 0.8 < fixed["hit_rate_later_turns"]
    side = report["side_by_side"]
    assert side["breaks_removed"] == 5 and side["breaks_caused"] == 0 and side["savings_tokens"] > 0
    assert report["verdict"].startswith("pass") and report["fired"] == {"volatile": 6}
    html = out.read_text()
    assert "What the fix does not improve" in html and "pass: hit rate of turns 2+" in html
    text = CliRunner().invoke(cli, ["replay", str(recording), "--target", engine_url, "--fix", "volatile",
                                    "--min-gain", "0.99"])
    assert "verdict: fail" in text.stdout and "breaks removed" in text.stdout


def test_replay_fix_refuses_an_unknown_name_and_two_targets(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"request": {"messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    bad = CliRunner().invoke(cli, ["replay", str(src), "--target", "http://127.0.0.1:9", "--fix", "nope"])
    assert bad.exit_code != 0 and "unknown fix 'nope'" in bad.output and "Traceback" not in bad.output
    two = CliRunner().invoke(cli, ["replay", str(src), "--target", "http://127.0.0.1:9", "--target",
                                   "http://127.0.0.1:10", "--fix", "volatile"])
    assert two.exit_code != 0 and "give one --target" in two.output


def test_a_session_no_fix_changes_is_sent_once_and_gets_no_verdict(tmp_path, engine_url):
    from prefixtrace.fix_replay import paired_replay
    from recorder.sources import load_turns

    src = tmp_path / "plain.jsonl"
    rows = [{"id": str(i), "ts": i, "session": "s", "request": {"model": "default", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hello there"}, *([{"role": "assistant", "content": "hi"},
                                                      {"role": "user", "content": "again"}] if i else [])]}}
            for i in range(2)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = paired_replay(load_turns(src), engine_url, ["volatile"])
    assert report["fired"] == {} and report["verdict"].startswith("no verdict: no fix fired")
    assert report["turns"]["recorded"] == report["turns"]["fixed"] and len(report["turns"]["fixed"]) == 2
