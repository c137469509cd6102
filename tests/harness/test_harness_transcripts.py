"""A harness's own transcript against the proxy's recording of the same run, live: pi (the quickest
harness) with its session file on, then `prefixtrace import` of that file. The rebuilt requests
must carry the recorded messages except the system prompt, which pi's session file does not hold
(docs/FORMATS.md "Transcripts"). tests/test_transcripts.py checks the committed fixtures of all four
harnesses; this one catches a pinned version that changed its file."""

from __future__ import annotations

import json
import subprocess
import sys

from harness import harness_support as hs
from harness.test_harness_pi import configure_pi


def test_pi_transcript_rebuilds_the_requests_the_proxy_recorded(npm_bins, engine_server, scratch, tmp_path):
    args, env = configure_pi(scratch, engine_server.url)  # the provider the product writes (prefixtrace/harnesses.py)
    cmd = [npm_bins["pi"], *args, "--tools", "read",
           "--no-extensions", "--no-skills", "--no-prompt-templates", "--no-context-files",
           "-p", f"Read the file {scratch.hello}"]
    before = {r["id"] for r in hs.export_records(engine_server.db, tmp_path / "before.jsonl")}
    result = hs.run_harness(cmd, scratch, env, 900)
    assert result.returncode == 0, result.output[-3000:]
    recorded = [r for r in hs.export_records(engine_server.db, tmp_path / "after.jsonl") if r["id"] not in before]
    sessions = scratch.home / ".pi" / "agent" / "sessions"
    files = list(sessions.rglob("*.jsonl"))
    assert len(files) == 1, files
    db = tmp_path / "imported.db"
    proc = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "import", str(sessions), "--db", str(db), "--json"],
                          capture_output=True, text=True, env=hs.server_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    [session] = json.loads(proc.stdout)["sessions"]
    assert session["harness"] == "pi" and "system prompt not in the transcript" in session["not_rebuilt"]
    rebuilt = hs.export_records(db, tmp_path / "rebuilt.jsonl")
    assert len(rebuilt) == len(recorded) >= 2, hs.describe(recorded)
    for turn, rec in zip(rebuilt, recorded):
        assert turn["upstream"] == "transcript:pi"
        system, *rest = rec["request"]["messages"]
        assert system["role"] == "system"
        assert turn["request"]["messages"] == rest
        assert [c["id"] for c in turn["response"]["tool_calls"] or []] == \
               [c["id"] for c in rec["response"]["tool_calls"] or []]
    hs.assert_tool_round_trip(rebuilt, scratch, {"read"})
