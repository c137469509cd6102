"""`export --format mooncake` of real Claude Code traffic, replayed by NVIDIA AIPerf (`aiperf profile
--custom-dataset-type mooncake_trace`) against a real `prefixtrace serve` on loopback: every request is
served, and the proxy records the prefix hits the shared block ids predict.

AIPerf is not a test dependency (docs/FORMATS.md "Block-hash traces": 142 packages, 1.2 GB, among them
transformers, datasets, pandas, kubernetes and dash): the test runs the `aiperf` named by
`PREFIXTRACE_AIPERF` or found on PATH (`python -m venv V && V/bin/pip install aiperf==0.13.0`, then
`PREFIXTRACE_AIPERF=V/bin/aiperf`; .ci/run does so) and is skipped without one."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from analyzer.block_traces import export_trace
from testsupport.servers import start_serve, stop

TRAFFIC = Path("/work/shared/traffic")
BLOCK = 64
ROWS = 8  # 16 s of the recording: two sessions, a pause and a second conversation


def _aiperf() -> str:
    found = os.environ.get("PREFIXTRACE_AIPERF") or shutil.which("aiperf")
    if not found or not Path(found).exists():
        pytest.skip("aiperf is not installed (set PREFIXTRACE_AIPERF to an aiperf executable)")
    return found


@pytest.mark.slow  # a serve subprocess and an AIPerf run: ~25 s
def test_aiperf_replays_the_mooncake_export_against_serve(tmp_path):
    aiperf = _aiperf()
    with open(tmp_path / "all.jsonl", "w") as out:
        export_trace(TRAFFIC / "claude_tiny.jsonl", out, "mooncake", block_size=BLOCK)
    rows = [json.loads(line) for line in (tmp_path / "all.jsonl").read_text().splitlines()][:ROWS]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc, url = start_serve(tmp_path / "p.db", tmp_path / "serve.log")
    try:
        run = subprocess.run(
            [aiperf, "profile", "--model", "default", "--url", url, "--endpoint-type", "chat", "--streaming",
             "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
             "--tokenizer", "builtin", "--prompt-input-tokens-block-size", str(BLOCK),
             "--artifact-dir", str(tmp_path / "aiperf"), "--ui-type", "none"],
            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    finally:
        stop(proc)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    profile = json.loads((tmp_path / "aiperf" / "profile_export_aiperf.json").read_text())
    assert profile["request_count"]["avg"] == ROWS
    assert profile.get("error_request_count", {}).get("avg", 0) == 0, profile.get("error_summary")

    with sqlite3.connect(tmp_path / "p.db") as con:
        served = con.execute("select prompt_tokens, cached_tokens from turn_log where status = 200 "
                             "and endpoint = '/v1/chat/completions' order by started_at").fetchall()
    assert len(served) == ROWS
    # The fixed schedule keeps the recorded order: a request whose first block repeats an earlier row's is
    # served mostly from the prefix cache, one that opens a conversation is not.
    for i, (row, (prompt, cached)) in enumerate(zip(rows, served)):
        continues = any(r["hash_ids"][0] == row["hash_ids"][0] for r in rows[:i])
        if continues:
            assert cached > prompt // 2, (i, prompt, cached)
        else:
            assert cached < prompt // 10, (i, prompt, cached)
