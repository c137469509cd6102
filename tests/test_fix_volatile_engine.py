"""The measurement of issue 33 on the embedded engine: a session whose system prompt carries a per-turn
timestamp, served by the tiny fixture model, with and without `--fix volatile`; then `analyze` of each
recording proposes the fix (measured by re-analysis) or names it as applied."""

from __future__ import annotations

import pytest

from analyzer import analyze
from analyzer.fix_report import fix_lines
from analyzer.fixes.sessions import FixSessions
from engine.engine import Engine
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from recorder.store import Recorder
from testsupport.servers import TINY_MODEL, running_server
from testsupport.volatile_session import cached_share, play


def served(tmp_path, name: str, fixes: list[str]) -> tuple[float, str]:
    engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32").start()
    engine.wait_ready(60)
    db = tmp_path / f"{name}.db"
    try:
        with Recorder(db) as rec:
            with running_server(create_app(EngineBackend(engine), rec, fixes=FixSessions(fixes) if fixes else None)) as url:
                share = cached_share(play(url))
    finally:
        engine.shutdown()
    return share, str(db)


@pytest.mark.slow
def test_fix_volatile_takes_the_cached_share_of_later_turns_past_80_percent(tmp_path):
    before, plain_db = served(tmp_path, "plain", [])
    after, fixed_db = served(tmp_path, "fixed", ["volatile"])
    assert before < 0.30 and after > 0.80, (before, after)
    proposal = {p["fix"]: p for p in analyze(plain_db).fix_proposals}["volatile"]
    assert proposal["breaks_removed"] == proposal["breaks"] == 5 and proposal["breaks_caused"] == 0
    assert proposal["saved_tokens"] > 0
    fixed = analyze(fixed_db)
    assert fixed.proxy_fixes == [{"name": "volatile", "note": "volatile timestamp moved", "turns": 6}]
    assert "fixed by the proxy: volatile timestamp moved (6 turns)" in fix_lines(fixed)
    assert not [b for _, b in fixed.breaks if (b.brk.subtype or "").startswith("volatile")]
