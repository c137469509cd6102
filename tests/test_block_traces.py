"""`prefixtrace export --format mooncake|weka`: block-hash traces of real harness traffic, with
identical prefixes giving identical block ids and no text leaving."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from click.testing import CliRunner

from analyzer.block_traces import BlockIds, export_trace
from prefixtrace.cli import cli

TRAFFIC = Path("/work/shared/traffic")


def _rows(name: str, fmt: str = "mooncake", block_size: int = 64) -> list[dict]:
    out = io.StringIO()
    export_trace(TRAFFIC / f"{name}.jsonl", out, fmt, block_size=block_size)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_mooncake_rows_of_real_claude_code_traffic():
    rows = _rows("claude_tiny")
    # Self-contained requests: no session_id, which AIPerf would replay as deltas of one conversation.
    assert rows and all(set(r) <= {"request_id", "timestamp", "input_length", "output_length", "hash_ids"}
                        for r in rows)
    assert all(len(r["hash_ids"]) == math.ceil(r["input_length"] / 64) for r in rows)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows) and rows[0]["timestamp"] == 0
    # A session's next turn repeats the blocks its prompt shares with the previous one (the full ones).
    first, second = rows[0], rows[1]  # the first two turns of the run's conversation
    full = first["input_length"] // 64
    assert second["hash_ids"][: full - 1] == first["hash_ids"][: full - 1]
    # No text of the conversation leaves.
    text = json.dumps(rows)
    assert "README" not in text and "Read" not in text


def test_identical_prefixes_identical_ids_across_sessions():
    ids = BlockIds(4)
    a = ids.of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = ids.of([1, 2, 3, 4, 5, 6, 7, 8, 10, 11])
    c = ids.of([0, 2, 3, 4, 5, 6, 7, 8])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(c) & set(a)  # a block's id stands for everything before it too


def test_weka_trace_per_session_through_the_cli(tmp_path):
    out = tmp_path / "trace.jsonl"
    r = CliRunner().invoke(cli, ["export", str(TRAFFIC / "opencode_tiny.jsonl"), "--format", "weka",
                                 "--block-size", "32", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.splitlines()[-1])["exported"] >= 3
    traces = [json.loads(line) for line in out.read_text().splitlines()]
    main = max(traces, key=lambda t: len(t["requests"]))
    assert main["block_size"] == 32 and main["requests"][0]["t"] == 0.0
    assert all(set(q) >= {"t", "type", "in", "out", "hash_ids"} for q in main["requests"])
    bad = CliRunner().invoke(cli, ["export", str(TRAFFIC / "opencode_tiny.jsonl"), "--format", "mooncake",
                                   "--session", "x"])
    assert bad.exit_code == 2 and "--session is not supported" in bad.output
