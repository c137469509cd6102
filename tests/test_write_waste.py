"""Cache-write waste: tokens a provider wrote to its cache (Anthropic `cache_creation_input_tokens`) that
no later turn read within the entry's lifetime, per session and per cause, in tokens and dollars."""

from __future__ import annotations

import json
from pathlib import Path

from analyzer.analysis import analyze
from analyzer.report import format_text

SYSTEM = "You are a careful coding agent. " * 40


def _body(n: int, system: str = SYSTEM) -> dict:
    messages = [{"role": "user", "content": "fix the failing test"}]
    for k in range(n):
        messages += [{"role": "assistant", "content": f"looked at file {k}"}, {"role": "user", "content": f"go on {k}"}]
    return {"model": "claude-sonnet-4-5", "max_tokens": 512, "system": system, "messages": messages}


def _record(i: int, ts: float, body: dict, read: int, write: int, fresh: int = 20) -> dict:
    return {"id": f"r{i}", "ts": ts, "session": "s", "endpoint": "/v1/messages", "upstream": "https://api.anthropic.com",
            "request": body, "timing": {"ttft_s": 1.0, "total_s": 2.0},
            "usage": {"input_tokens": fresh, "cache_read_input_tokens": read, "cache_creation_input_tokens": write}}


def _write(tmp_path: Path, records: list[dict]) -> Path:
    path = tmp_path / "rec.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_writes_never_read_are_counted_per_cause_in_tokens_and_dollars(tmp_path):
    records = [
        _record(0, 1000, _body(0), 0, 1000),  # written, then read whole by the next turn
        _record(1, 1010, _body(1), 1000, 200),  # its 200 are lost to the next turn's system rewrite
        _record(2, 1020, _body(2, SYSTEM + " Todo: 2 of 5 done."), 0, 1300),  # read by the next turn
        _record(3, 1030, _body(3, SYSTEM + " Todo: 2 of 5 done."), 1300, 100),  # the last: nobody reads it
    ]
    report = analyze(_write(tmp_path, records), price_model="claude-sonnet-4-5")
    waste = report.write_waste
    assert waste["written_tokens"] == 2600 and waste["wasted_tokens"] == 300
    assert {k: v["tokens"] for k, v in waste["by_cause"].items()} == {"system_rewrite": 200, "session_end": 100}
    # Claude Sonnet 4.5 writes at $3.75/M, input $3/M: the writes cost 300 x 3.75e-6, 300 x 0.75e-6 over input.
    assert abs(waste["dollars"] - 300 * 3.75e-6) < 1e-9 and abs(waste["premium_dollars"] - 300 * 0.75e-6) < 1e-9
    assert waste["sessions"]["s"]["by_cause"]["system_rewrite"]["tokens"] == 200
    assert report.to_dict()["cache_write_waste"] == waste
    text = format_text(report)
    assert "cache writes never read: 300 of 2,600 written tokens, $0.0011" in text
    assert "  system_rewrite: 200 tokens" in text


def test_a_pause_past_the_lifetime_wastes_the_write(tmp_path):
    records = [_record(0, 1000, _body(0), 0, 1000), _record(1, 1000 + 400, _body(1), 0, 1040)]
    waste = analyze(_write(tmp_path, records)).write_waste
    assert {k: v["tokens"] for k, v in waste["by_cause"].items()} == {"ttl": 1000, "session_end": 1040}
    assert "dollars" not in waste  # no --price-model: tokens only


def test_a_one_hour_entry_outlives_the_pause(tmp_path):
    records = [_record(0, 1000, _body(0), 0, 1000), _record(1, 1000 + 400, _body(1), 1000, 40)]
    for r in records:
        r["request"]["system"] = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    waste = analyze(_write(tmp_path, records)).write_waste
    assert {k: v["tokens"] for k, v in waste["by_cause"].items()} == {"session_end": 40}


def test_no_reported_writes_is_no_waste_section(tmp_path):
    records = [_record(0, 1000, _body(0), 0, 0), _record(1, 1010, _body(1), 0, 0)]
    report = analyze(_write(tmp_path, records))
    assert report.write_waste is None and "cache_write_waste" not in report.to_dict()
    assert "cache writes never read" not in format_text(report)
