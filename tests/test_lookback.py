"""Anthropic's 20-block lookback: a Messages turn whose breakpoints all lie more than 20 content blocks
past the session's newest cache write is `lookback`, with the block count and the fix; `--what-if
anthropic` applies the same rule."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from analyzer.analysis import analyze
from analyzer.whatif import price

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sessions" / "cause_lookback.jsonl"
TRAFFIC = Path("/work/shared/traffic/claude_tiny.jsonl")


def _records() -> list[dict]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines()]


def _write(tmp_path: Path, records: list[dict]) -> Path:
    path = tmp_path / "rec.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def _with_calls(n: int, extra_breakpoint_at: int | None = None) -> list[dict]:
    records = _records()
    second = records[1]["request"]
    second["messages"][1]["content"] = second["messages"][1]["content"][:n]
    results = second["messages"][2]["content"][:n]
    for r in results:
        r.pop("cache_control", None)
    results[-1]["cache_control"] = {"type": "ephemeral"}
    if extra_breakpoint_at is not None:
        results[extra_breakpoint_at]["cache_control"] = {"type": "ephemeral"}
    second["messages"][2]["content"] = results
    return records


def test_twelve_parallel_calls_put_the_breakpoint_past_the_lookback():
    report = analyze(FIXTURE)
    first, turn = report.sessions[0].turns
    brk = turn.brk
    assert brk.cause == "lookback" and brk.where() == "the cache breakpoints"
    # 3 tools + 1 system block + 1 user block: the write after block 5; then 12 tool_use + 12 tool_result.
    assert brk.after == "newest cache write after block 5; breakpoint after block 29: 24 blocks later"
    assert "looks back only 20" in brk.suggestion and "second cache_control breakpoint" in brk.suggestion
    # The system prompt's own breakpoint still hits: the tools and system prompt stay cached.
    assert 0 < turn.common_prefix_tokens < first.prompt_tokens and turn.lost_tokens > 0
    assert turn.blocks == 29


def test_within_twenty_blocks_is_no_break(tmp_path):
    # 10 calls: the breakpoint after block 25, exactly 20 past the write after block 5; 11 calls: 22.
    assert analyze(_write(tmp_path, _with_calls(10))).sessions[0].turns[1].brk is None
    assert analyze(_write(tmp_path, _with_calls(11))).sessions[0].turns[1].brk.cause == "lookback"


def test_a_second_breakpoint_within_the_window_is_the_fix(tmp_path):
    records = _with_calls(12, extra_breakpoint_at=2)  # after block 20: 15 past the write
    assert analyze(_write(tmp_path, records)).sessions[0].turns[1].brk is None


def test_what_if_anthropic_models_the_lookback(tmp_path):
    report = analyze(FIXTURE)
    priced = price(report, "anthropic", min_cacheable=1)
    assert priced["lost_to"] == {"lookback": priced["ideal_cached_tokens"]} and priced["cached_tokens"] == 0
    near = price(analyze(_write(tmp_path, _with_calls(9))), "anthropic", min_cacheable=1)
    assert "lookback" not in near["lost_to"] and near["cached_tokens"] > 0


def test_only_anthropic_has_the_rule(tmp_path):
    records = _records()
    for r in records:
        r["upstream"] = "embedded:qwen3"
    assert analyze(_write(tmp_path, records)).sessions[0].turns[1].brk is None


def test_real_claude_code_session_has_no_false_lookback(tmp_path):
    records = [json.loads(line) for line in TRAFFIC.read_text().splitlines()]
    for r in records:
        r["upstream"] = "https://api.anthropic.com"
    report = analyze(_write(tmp_path, copy.deepcopy(records)))
    turns = [t for s in report.sessions for t in s.turns]
    assert any(t.blocks for t in turns)
    assert not [t for t in turns if t.brk is not None and t.brk.cause == "lookback"]
