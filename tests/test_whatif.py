"""Issue 16 item 6: the same traffic priced under other caches' documented rules (analyzer/whatif.py,
sources in docs/ANALYZER.md "What if"), and a concrete suggestion with its saving on every break."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from analyzer import analyze
from analyzer.results import Break, Report, SessionResult, TurnResult
from analyzer.whatif import anthropic_min, price
from prefixtrace.cli import cli

ROOT = Path(__file__).resolve().parents[1]
TRAFFIC = ROOT / "fixtures" / "traffic"
QWEN3 = str(ROOT / "fixtures" / "qwen3.jinja")


def _report(*sessions):
    """sessions: (id, [(ts, prompt, common, model), ...])"""
    out = []
    line = 0
    for sid, turns in sessions:
        res = []
        for i, (ts, prompt, common, model) in enumerate(turns):
            line += 1
            t = TurnResult(i, f"{sid}-{i}", ts, line, prompt, common, prompt - common, None, None, model=model)
            res.append(t)
        out.append(SessionResult(sid, False, res))
    return Report("regex", "generic-chatml", None, None, out, [])


def test_vllm_caches_whole_blocks_only():
    r = _report(("s", [(0.0, 100, 0, None), (1.0, 140, 100, None)]))
    w = price(r, "vllm")
    assert w["cached_tokens"] == 96 and w["lost_to"] == {"block_rounding": 4}  # 6 blocks of 16
    assert price(r, "vllm", block_size=32)["cached_tokens"] == 96
    assert price(r, "sglang")["cached_tokens"] == 100  # token-granular radix tree


def test_a_kv_budget_evicts_the_least_recently_used_session_tail_first():
    # Two sessions of 1,000 tokens interleaved in a 1,500-token cache: each turn finds part of its
    # prefix evicted by the other session's.
    r = _report(("a", [(0.0, 1000, 0, None), (2.0, 1100, 1000, None)]),
                ("b", [(1.0, 1000, 0, None), (3.0, 1100, 1000, None)]))
    unlimited = price(r, "sglang")
    tight = price(r, "sglang", kv_budget=1500)
    assert unlimited["cached_tokens"] == 2000 and "eviction" not in unlimited["lost_to"]
    assert tight["cached_tokens"] < 2000 and tight["lost_to"]["eviction"] == 2000 - tight["cached_tokens"]


def test_anthropic_minimum_length_ttl_and_breakpoints():
    assert anthropic_min("claude-sonnet-4-5") == 1024 and anthropic_min("claude-haiku-4-5") == 4096
    assert anthropic_min("claude-3-5-haiku-latest") == 2048
    short = _report(("s", [(0.0, 900, 0, "claude-sonnet-4-5"), (1.0, 1000, 900, "claude-sonnet-4-5")]))
    assert price(short, "anthropic")["cached_tokens"] == 0
    assert price(short, "anthropic")["lost_to"] == {"min_length": 900}
    late = _report(("s", [(0.0, 5000, 0, "claude-sonnet-4-5"), (301.0, 5100, 5000, "claude-sonnet-4-5")]))
    assert price(late, "anthropic")["cached_tokens"] == 0 and price(late, "anthropic")["lost_to"] == {"ttl": 5000}
    soon = _report(("s", [(0.0, 5000, 0, "claude-sonnet-4-5"), (299.0, 5100, 5000, "claude-sonnet-4-5")]))
    assert price(soon, "anthropic")["cached_tokens"] == 5000
    # A break at 3,500 of a 5,000-token prompt: the entry written at the end of turn 0 (2,000) is
    # still live and is what the third turn reads.
    broken = _report(("s", [(0.0, 2000, 0, "m"), (10.0, 5000, 2000, "m"), (20.0, 5200, 3500, "m")]))
    w = price(broken, "anthropic")
    assert w["cached_tokens"] == 2000 + 2000 and w["lost_to"] == {"breakpoints": 1500}
    floor = price(broken, "anthropic", min_cacheable=4096)
    assert floor["cached_tokens"] == 0 and floor["lost_to"] == {"min_length": 2000 + 3500}


def test_openai_minimum_increments_and_routing():
    r = _report(("s", [(0.0, 1500, 0, None), (1.0, 1600, 1400, None)]))
    w = price(r, "openai")
    assert w["cached_tokens"] == 1024 + 2 * 128 and w["lost_to"] == {"block_rounding": 1400 - 1280}
    early = _report(("s", [(0.0, 1500, 0, None), (1.0, 1600, 200, None)]))
    assert price(early, "openai")["lost_to"] == {"routing": 200}
    small = _report(("s", [(0.0, 900, 0, None), (1.0, 1000, 900, None)]))
    assert price(small, "openai")["cached_tokens"] == 0


def test_unknown_policy_is_refused():
    with pytest.raises(Exception, match="unknown --what-if"):
        analyze(TRAFFIC / "pi_tiny.jsonl", what_if="tgi")


def test_what_if_on_real_traffic_in_json_and_text(tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(cli, ["analyze", str(TRAFFIC / "claude_smol.jsonl"), "--template", QWEN3,
                                      "--what-if", "vllm,sglang,anthropic,openai", "--kv-budget", "100000",
                                      "--format", "json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    d = json.loads(out.read_text())
    by = {w["policy"]: w for w in d["what_if"]}
    assert set(by) == {"vllm", "sglang", "anthropic", "openai"}
    for w in by.values():
        assert w["cached_tokens"] <= w["ideal_cached_tokens"] == by["sglang"]["cached_tokens"]
        assert w["prompt_tokens"] == d["totals"]["prompt_tokens"]
    text = CliRunner().invoke(cli, ["analyze", str(TRAFFIC / "claude_smol.jsonl"), "--template", QWEN3,
                                    "--what-if", "openai"]).output
    assert "what if openai (automatic from 1,024 tokens, 128-token increments" in text


def test_every_break_carries_a_suggestion_and_its_saving(tmp_path):
    report = analyze(TRAFFIC / "claude_smol.jsonl", template=QWEN3)
    brk = report.sessions[0].turns[4].brk
    assert brk.cause == "dropped_message" and "keep them in the history" in brk.suggestion
    prev, this = report.sessions[0].turns[3], report.sessions[0].turns[4]
    assert brk.saves_tokens == min(prev.prompt_tokens, this.prompt_tokens) - brk.token_offset > 0
    # pi's two conversations under one id (without ids they are two sessions: tests/test_session_inference.py)
    src = tmp_path / "pi.jsonl"
    src.write_text("".join(json.dumps({**json.loads(line), "session": "pi"}) + "\n"
                           for line in (TRAFFIC / "pi_tiny.jsonl").read_text().splitlines()))
    turn = analyze(src, template=QWEN3).sessions[0].turns[3]
    pi = turn.brk
    assert pi.cause == "tools_change" and "fixed tool list" in pi.suggestion
    text = CliRunner().invoke(cli, ["analyze", str(src), "--template", QWEN3]).output
    assert f"lost {turn.lost_seconds:.2f} s, {turn.lost_tokens:,} tokens" in text
    assert "fix: the tool list changed" in text
    side = analyze(TRAFFIC / "opencode_tiny.jsonl", template=QWEN3).sessions[1].turns[0]
    assert "with the main chain's system prompt and tools" in side.note
    assert isinstance(Break("x", None, None, None, 0, 0, "", "").suggestion, str)
