"""Each turn records the harness and its version: the User-Agent, the harness's own headers, or the
version a transcript records."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyzer.analysis import analyze
from analyzer.versions import harness_version

ROOT = Path(__file__).resolve().parents[1]
TRAFFIC = Path("/work/shared/traffic")


@pytest.mark.parametrize("name, expected", [
    ("claude_tiny", ("claude-code", "2.1.197")), ("opencode_tiny", ("opencode", "1.18.33")),
    ("qwen_tiny", ("qwen-code", "0.15.10")), ("pi_tiny", ("pi", None)),  # pi sends only its SDK's User-Agent
])
def test_real_traffic_names_harness_and_version(name, expected):
    report = analyze(TRAFFIC / f"{name}.jsonl")
    assert {(t.harness, t.harness_version) for s in report.sessions for t in s.turns} == {expected}


def test_codex_headers_and_unknowns():
    assert harness_version({"originator": "codex_cli_rs", "version": "0.171.0",
                            "User-Agent": "codex_cli_rs/0.171.0 (Ubuntu 24.4.0; x86_64) xterm"}, {}) == ("codex", "0.171.0")
    assert harness_version({"originator": "codex_cli_rs", "version": "0.171.0"}, {}) == ("codex", "0.171.0")
    assert harness_version({"user-agent": "OpenAI/Python 1.99.0"}, {}) == ("OpenAI/Python", None)  # the SDK, never a harness version
    assert harness_version(None, {}) == (None, None)


@pytest.mark.parametrize("harness, pattern, version", [
    ("claude-code", "claude/*.jsonl", "2.1.197"), ("codex", "codex/rollout-*.jsonl", "0.171.0")])
def test_transcripts_carry_their_version(harness, pattern, version):
    path = next(p for p in (ROOT / "fixtures" / "transcripts").glob(pattern) if p.name != "recording.jsonl")
    report = analyze(path)
    assert {(t.harness, t.harness_version) for s in report.sessions for t in s.turns} == {(harness, version)}
