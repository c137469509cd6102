"""The parent/wait links of `export --format mooncake|agentic-mooncake` on real harness traffic: each
link points at the right recorded request with the recorded wait, and Dynamo's agentic Mooncake
loader accepts the export and replays along the links."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analyzer.block_traces import export_trace

TRAFFIC = Path("/work/shared/traffic")


def _export(name: str, fmt: str) -> list[dict]:
    out = io.StringIO()
    export_trace(TRAFFIC / f"{name}.jsonl", out, fmt, block_size=64)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def _recorded(name: str) -> dict[str, dict]:
    """The traffic file's own records by id: start and end read straight from what the proxy wrote."""
    out = {}
    for line in (TRAFFIC / f"{name}.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["id"]] = {"start": r["ts"], "end": r["ts"] + r["timing"]["total_s"]}
    return out


def test_side_request_spawns_from_its_main_turn_and_turns_wait_for_their_previous_one():
    # qwen-code: main turn 1, then its memory-extraction side request once that turn ended, then main turn 2
    # (docs/results of the harness runs: /work/shared/traffic/README.md).
    rows = {r["request_id"]: r for r in _export("qwen_tiny", "agentic-mooncake")[1:]}
    rec = _recorded("qwen_tiny")
    main1, side1, main2, side2 = "8abc6878d17447f9ad8d59fc32a6edcc", "cfe09970ceaf4a95ab901e9026f93734", \
        "a96af029773f4958b0fac810b87a6cf4", "7118feb2bc784c8389d1ab3833035b4c"
    assert "dependencies" not in rows[main1] and rows[main1]["not_before_ms"] == 0.0
    [spawn] = rows[side1]["dependencies"]
    assert (spawn["request_id"], spawn["relation"], spawn["trigger"]) == (main1, "spawn", "completion")
    assert spawn["delay_ms"] == pytest.approx((rec[side1]["start"] - rec[main1]["end"]) * 1000, abs=0.01)
    [seq] = rows[main2]["dependencies"]
    assert (seq["request_id"], seq["relation"]) == (main1, "sequence")  # not the side request between them
    assert seq["delay_ms"] == pytest.approx((rec[main2]["start"] - rec[main1]["end"]) * 1000, abs=0.01)
    [seq] = rows[side2]["dependencies"]
    assert (seq["request_id"], seq["relation"]) == (side1, "sequence")
    assert rows[side1]["play_id"] == rows[main1]["play_id"] == rows[side2]["play_id"]
    assert rows[side1]["session_id"] != rows[main1]["session_id"]


def test_request_sent_before_its_parent_ended_waits_on_the_dispatch():
    from analyzer.trace_links import links

    rows = [{"id": "a", "session": "s", "parent_session": None, "ts": 10.0, "end": 14.0},
            {"id": "b", "session": "s", "parent_session": None, "ts": 11.5, "end": 13.0},  # a parallel tool loop
            {"id": "c", "session": "s/side-1", "parent_session": "s", "ts": 12.0, "end": None},
            {"id": "d", "session": "s/side-1", "parent_session": "s", "ts": 13.0, "end": None}]
    got = {k: v.to_dict() for k, v in links(rows).items()}
    assert got == {"b": {"request_id": "a", "trigger": "dispatch", "delay_ms": 1500.0, "relation": "sequence"},
                   "c": {"request_id": "b", "trigger": "dispatch", "delay_ms": 500.0, "relation": "spawn"},
                   "d": {"request_id": "c", "trigger": "dispatch", "delay_ms": 1000.0, "relation": "sequence"}}


def test_each_turn_waits_the_recorded_gap_after_its_sessions_previous_turn():
    rows = _export("claude_tiny", "agentic-mooncake")[1:]
    rec = _recorded("claude_tiny")
    by_session: dict[str, list[dict]] = {}
    for r in rows:
        by_session.setdefault(r["session_id"], []).append(r)
    assert len(by_session) == 2
    for turns in by_session.values():
        assert "dependencies" not in turns[0]  # a session's first request waits for nothing
        for prev, row in zip(turns, turns[1:]):
            [dep] = row["dependencies"]
            assert (dep["request_id"], dep["relation"], dep["trigger"]) == (prev["request_id"], "sequence", "completion")
            wait = (rec[row["request_id"]]["start"] - rec[prev["request_id"]]["end"]) * 1000
            assert dep["delay_ms"] == pytest.approx(wait, abs=0.01)
    # The resume (`claude -r`), half a minute after the conversation paused, waits on its last turn.
    assert max(d["delay_ms"] for r in rows for d in r.get("dependencies", [])) > 20_000


# Dynamo's agentic Mooncake v2, as ai-dynamo/dynamo declares it (lib/mocker/src/loadgen/types.rs:
# AGENTIC_MOONCAKE_SCHEMA, AgenticMooncakeHeader, AgenticMooncakeRow, AgenticDependency and its enums);
# the checks its graph builder makes that the tests can state without the Rust runtime.
HEADER_FIELDS = {"schema", "version", "block_size", "hash_id_scope", "source"}
ROW_REQUIRED = {"request_id", "play_id", "session_id", "model", "not_before_ms"}
ROW_FIELDS = ROW_REQUIRED | {"input_length", "output_length", "output_token_ids", "hash_ids", "recorded_api_time_ms",
                             "source_play_ordinal", "priority", "strict_priority", "policy_class", "dependencies"}
TRIGGERS, RELATIONS = {"dispatch", "completion"}, {"sequence", "spawn", "join", "replay_barrier"}


@pytest.mark.parametrize("name", ["claude_tiny", "opencode_tiny", "qwen_tiny", "pi_tiny"])
def test_agentic_mooncake_has_dynamos_shape(name):
    header, *rows = _export(name, "agentic-mooncake")
    assert set(header) == HEADER_FIELDS and header["schema"] == "dynamo.agentic_mooncake" and header["version"] == 2
    assert header["hash_id_scope"] == "local" and header["block_size"] == 64
    assert set(header["source"]) == {"format", "digest"}
    seen: dict[str, str] = {}  # request id -> play
    for row in rows:
        assert ROW_REQUIRED <= set(row) <= ROW_FIELDS
        assert row["request_id"] not in seen
        for dep in row.get("dependencies", []):
            assert set(dep) == {"request_id", "trigger", "delay_ms", "relation"}
            assert dep["trigger"] in TRIGGERS and dep["relation"] in RELATIONS and dep["delay_ms"] >= 0
            assert seen[dep["request_id"]] == row["play_id"]  # an earlier row of the same play
        seen[row["request_id"]] = row["play_id"]
    assert "README" not in json.dumps(rows)  # still no text


REPLAY = """
import json, sys
from dynamo._core import run_mocker_trace_replay
result = run_mocker_trace_replay([sys.argv[1]], trace_format="agentic_mooncake", trace_block_size=64,
                                 report_jsonl_path=sys.argv[2], execution_model="default")
print(json.dumps({"completed": result.summary["completed_requests"]}))
"""


def test_dynamo_replays_the_export_along_its_links(tmp_path):
    """The real loader and simulator (ai-dynamo-runtime 1.6.1's `run_mocker_trace_replay`, the function
    `python -m dynamo.replay --trace-format agentic_mooncake` calls), in an interpreter of its own. Not a
    dependency of prefixtrace: the folder `pip install --no-deps --target DIR ai-dynamo-runtime==1.6.1`
    made, named by PREFIXTRACE_DYNAMO_RUNTIME (.ci/run makes one; docs/FORMATS.md)."""
    runtime = os.environ.get("PREFIXTRACE_DYNAMO_RUNTIME")
    if not runtime or not (Path(runtime) / "dynamo").is_dir():
        pytest.skip("ai-dynamo-runtime is not installed (set PREFIXTRACE_DYNAMO_RUNTIME to its folder)")
    trace, report = tmp_path / "trace.jsonl", tmp_path / "report.jsonl"
    rows = _export("qwen_tiny", "agentic-mooncake")
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = subprocess.run([sys.executable, "-c", REPLAY, str(trace), str(report)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": runtime})
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1])["completed"] == 4
    done = {r["request_id"]: r for r in map(json.loads, report.read_text().splitlines())}
    for row in rows[1:]:
        for dep in row.get("dependencies", []):
            parent = done[dep["request_id"]]
            base = parent["terminal_time_ms"] if dep["trigger"] == "completion" else parent["dispatched_at_ms"]
            assert done[row["request_id"]]["arrival_time_ms"] == pytest.approx(base + dep["delay_ms"], abs=0.01)
    # The session's second main turn reuses the first one's blocks in the simulated prefix cache.
    assert done["a96af029773f4958b0fac810b87a6cf4"]["reused_input_tokens"] > 7000
