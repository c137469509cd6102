"""Issue 26, item 2: seconds first, one cost per break. Every break carries `lost_seconds` (from the
recorded timings by default: the turn's TTFT against the same session's cache hits, else a prefill rate
measured from its turns; `--prefill-rate` overrides) and `lost_tokens` (what a cache would have served
had the request only extended the previous one), defined once in docs/ANALYZER.md and used by text,
JSON, `check` and the totals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from analyzer import analyze, check
from analyzer.load import Request
from prefixtrace.cli import cli

ROOT = Path(__file__).resolve().parents[1]
TRAFFIC = ROOT / "fixtures" / "traffic"
QWEN3 = str(ROOT / "fixtures" / "qwen3.jinja")


def _pi_one_session(tmp_path: Path, usage: bool = True) -> Path:
    """pi_tiny under one session id: its Messages conversation is then a tools_change of the chat one
    (4: TTFT 1.82 s) beside cache hits of 0.13-0.27 s. `usage=False`: the server's counts left out."""
    src = tmp_path / ("pi.jsonl" if usage else "pi-no-usage.jsonl")
    drop = () if usage else ("usage", "tokens")
    src.write_text("".join(json.dumps({**{k: v for k, v in json.loads(line).items() if k not in drop},
                                       "session": "pi"}) + "\n"
                           for line in (TRAFFIC / "pi_tiny.jsonl").read_text().splitlines()))
    return src


def test_lost_seconds_come_from_the_recorded_ttft_against_the_sessions_cache_hits(tmp_path):
    report = analyze(_pi_one_session(tmp_path), template=QWEN3)
    turns = report.sessions[0].turns
    brk = turns[3]
    assert brk.brk.cause == "tools_change" and brk.ttft_s == pytest.approx(1.8174, abs=1e-3)
    # Cache hits: turns 2, 3, 5, 6 (append-only, served from cache). The three nearest in prompt size
    # to turn 4 have TTFTs 0.13, 0.21 and 0.19 s: their median is 0.19 s.
    hits = sorted((abs(t.prompt_tokens - brk.prompt_tokens), t.ttft_s) for t in turns if t.index in (1, 2, 4, 5))
    base = sorted(ttft for _, ttft in hits[:3])[1]
    assert brk.lost_seconds == pytest.approx(round(brk.ttft_s - base, 2))
    assert brk.lost_seconds > 1.5
    assert brk.lost_seconds_basis.startswith("TTFT 1.82 s against 0.19 s") and "cache hits" in brk.lost_seconds_basis
    # Only breaks carry a cost.
    assert all(t.lost_seconds is None and t.lost_tokens is None for t in turns if t.brk is None)


def test_one_cost_in_tokens_what_a_cache_would_have_served_had_the_prompt_only_grown(tmp_path):
    report = analyze(_pi_one_session(tmp_path), template=QWEN3)
    prev, t = report.sessions[0].turns[2], report.sessions[0].turns[3]
    # The server's own counts win: what it would have read had the prompt only grown, less what it read.
    assert t.lost_tokens == min(prev.reported_prompt_tokens, t.reported_prompt_tokens) - t.reported_cached_tokens
    assert t.lost_tokens_basis == "server" and t.lost_tokens > t.prompt_tokens  # the rebuilt prompt counts low
    # The other figures are details: re-prefilled includes the new turn's own tokens.
    assert t.reprefill_tokens == t.prompt_tokens - t.common_prefix_tokens
    # Without the server's counts, the rebuilt prompt's, labelled an estimate.
    bare = analyze(_pi_one_session(tmp_path, usage=False), template=QWEN3).sessions[0].turns
    assert bare[3].lost_tokens == min(bare[2].prompt_tokens, bare[3].prompt_tokens) - bare[3].common_prefix_tokens
    assert bare[3].lost_tokens_basis == "estimate"
    blocks = analyze(_pi_one_session(tmp_path, usage=False), template=QWEN3, block_size=16).sessions[0].turns[3]
    ideal = min(bare[2].prompt_tokens, bare[3].prompt_tokens) // 16 * 16
    assert blocks.lost_tokens == ideal - blocks.predicted_cached_tokens
    d = report.to_dict()
    totals = d["totals"]
    assert totals["lost_tokens"] == t.lost_tokens and totals["lost_seconds"] == t.lost_seconds
    assert totals["by_cause"]["tools_change"]["lost_seconds"] == t.lost_seconds
    assert totals["by_cause"]["tools_change"]["lost_tokens"] == t.lost_tokens
    turn = d["sessions"][0]["turns"][3]
    keys = list(turn)
    assert keys.index("lost_seconds") < keys.index("lost_tokens")  # seconds first, in JSON too
    assert d["top_breaks"][0] == {"session": "pi", "turn": 4, "cause": "tools_change", "subtype": "edited",
                                  "where": "tools[2] (edit)", "lost_seconds": t.lost_seconds,
                                  "lost_tokens": t.lost_tokens, "lost_seconds_basis": t.lost_seconds_basis}


def test_text_json_and_check_show_the_same_one_cost_seconds_first(tmp_path):
    src = _pi_one_session(tmp_path)
    t = analyze(src, template=QWEN3).sessions[0].turns[3]
    cost = f"{t.lost_seconds:.2f} s, {t.lost_tokens:,} tokens"
    text = CliRunner().invoke(cli, ["analyze", str(src), "--template", QWEN3]).output
    assert f"lost {cost}" in text  # the break's own line
    assert f"costing {cost}" in text  # the session's title
    assert f"tools_change cost {cost} over 1 break" in text  # the totals
    assert "fix (saves" not in text and "re-prefilled" not in text.split("prompt tokens:")[0]
    # Nothing else competes with it: no second cost in the break's lines.
    block = text[text.index("  turn 4: "):text.index("  tools_change: 1 break cost")]
    assert re.findall(r"\d[\d,]* tokens", block) == [f"{t.lost_tokens:,} tokens"]
    result = CliRunner().invoke(cli, ["check", str(src), "--template", QWEN3])
    assert result.exit_code == 1 and "session pi turn 4 " in result.output and f"lost {cost}" in result.output
    js = json.loads(CliRunner().invoke(cli, ["check", str(src), "--template", QWEN3, "--json"]).output)
    (problem,) = js["problems"]
    assert (problem["turn_number"], problem["lost_seconds"], problem["lost_tokens"]) == (4, t.lost_seconds,
                                                                                        t.lost_tokens)


def _bodies(n: int) -> list[dict]:
    """A session whose system prompt ticks every turn: every turn after the first is a break."""
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "You are an agent. " * 40 + f"Turn counter: {i}."}]
        for j in range(i + 1):
            msgs += [{"role": "user", "content": f"step {j} " * 30}, {"role": "assistant", "content": "ok " * 20}]
        out.append({"messages": msgs[:-1]})
    return out


def test_without_cache_hits_a_prefill_rate_measured_from_the_sessions_own_turns(tmp_path):
    reqs = [Request(f"r{i}", float(i), b, "s", ttft_s=0.5 + i * 0.1) for i, b in enumerate(_bodies(4))]
    report = analyze(reqs)
    turns = report.sessions[0].turns
    assert all(t.brk is not None for t in turns[1:])
    rates = sorted(t.reprefill_tokens / t.ttft_s for t in turns)
    rate = (rates[1] + rates[2]) / 2
    for t in turns[1:]:
        assert t.lost_seconds == pytest.approx(round(t.lost_tokens / rate, 2))
        assert t.lost_seconds_basis == f"prefill rate {rate:,.0f} tok/s measured from this session's turns"


def test_fallbacks_in_order_other_sessions_then_nothing_then_the_flag():
    timed = [Request(f"a{i}", float(i), {**b, "model": "m"}, "timed", ttft_s=1.0) for i, b in enumerate(_bodies(3))]
    untimed = [Request(f"b{i}", 10.0 + i, {**b, "model": "m"}, "untimed") for i, b in enumerate(_bodies(3))]
    report = analyze([*timed, *untimed])
    by = {s.id: s for s in report.sessions}
    t = by["untimed"].turns[2]
    assert t.lost_seconds is not None and "measured from all recorded turns of this model" in t.lost_seconds_basis
    bare = analyze(untimed).sessions[0].turns[2]
    assert bare.lost_seconds is None and bare.lost_tokens > 0
    assert "--prefill-rate" in bare.lost_seconds_basis
    given = analyze(timed, prefill_rate=1000.0).sessions[0].turns[2]
    assert given.lost_seconds == pytest.approx(round(given.lost_tokens / 1000.0, 2))
    assert given.lost_seconds_basis == "--prefill-rate 1,000 tok/s"


def test_a_recorder_database_carries_its_ttft_into_the_cost(tmp_path):
    from recorder.sources import import_file

    db = tmp_path / "p.db"
    import_file(_pi_one_session(tmp_path), db)
    t = analyze(db, template=QWEN3).sessions[0].turns[3]
    assert t.brk.cause == "tools_change" and t.ttft_s == pytest.approx(1.8174, abs=1e-3)
    assert t.lost_seconds > 1.5 and t.lost_seconds_basis.startswith("TTFT")
    assert not check(db, template=QWEN3).ok
