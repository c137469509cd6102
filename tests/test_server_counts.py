"""The server's own counts win (docs/ANALYZER.md "The server's own counts"): transcripts carry the
provider's usage, and lost tokens, server misses and their causes come from it. The sessions are made
of the real fixture transcripts' lines (fixtures/transcripts/claude, codex) with the usage a provider
writes: Anthropic's input + cache read + cache creation, OpenAI's input_tokens and cached_input_tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from analyzer import analyze, format_text
from analyzer.server_counts import PARTIAL_LOSS_MIN

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures" / "transcripts"
SYSTEM_AND_TOOLS = 21_000  # tokens the server counts that the transcript does not hold
START = datetime(2026, 12, 2, 6, 0, tzinfo=timezone.utc)


def _iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _claude_lines() -> list[dict]:
    path = next(p for p in (FIX / "claude").glob("*.jsonl") if p.name != "recording.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def claude_session(gaps_s: list[float], *, one_hour: bool = False, cached_after: dict[int, int] | None = None,
                   model: str = "claude-sonnet-4-5", base: int = SYSTEM_AND_TOOLS, step: int = 3000):
    """A Claude Code session of len(gaps_s) + 1 calls; call i+1 starts gaps_s[i] seconds after call i's
    reply. The server's usage: each prompt 3,000 tokens longer than the last, read from cache whole
    after a gap within the 5 minute lifetime (1 hour with `one_hour`), re-written after a longer one;
    `cached_after` overrides the cache read of a call (by index)."""
    lines = _claude_lines()
    user = next(o for o in lines if o["type"] == "user")
    reply = next(o for o in lines if o["type"] == "assistant")
    lifetime = 3600 if one_hour else 300
    out, parent, now, prev_prompt = [], None, START, 0
    for i in range(len(gaps_s) + 1):
        if i:
            now += timedelta(seconds=gaps_s[i - 1])
        prompt = base + step * (i + 1)
        hit = i and gaps_s[i - 1] <= lifetime
        read = (cached_after or {}).get(i, prev_prompt if hit else 0)
        usage = {"input_tokens": 40, "cache_read_input_tokens": read,
                 "cache_creation_input_tokens": prompt - read - 40, "output_tokens": 120,
                 "cache_creation": {"ephemeral_1h_input_tokens": prompt - read - 40 if one_hour else 0,
                                    "ephemeral_5m_input_tokens": 0 if one_hour else prompt - read - 40}}
        out.append({**user, "uuid": f"u{i}", "parentUuid": parent, "timestamp": _iso(now),
                    "message": {"role": "user", "content": f"step {i}: " + "read the next file please " * 40}})
        now += timedelta(seconds=5)
        out.append({**reply, "uuid": f"a{i}", "parentUuid": f"u{i}", "timestamp": _iso(now),
                    "message": {**reply["message"], "id": f"msg_{i}", "model": model,
                                "content": [{"type": "text", "text": f"done {i}. " + "noted " * 60}], "usage": usage}})
        parent, prev_prompt = f"a{i}", prompt
    return out


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    return path


def _usage_losses(lines: list[dict]) -> list[int]:
    """Per call after the first, from the usage alone: min(previous prompt, this prompt) - cache read."""
    prompts = [(u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"],
                u["cache_read_input_tokens"]) for o in lines if o["type"] == "assistant"
               for u in [o["message"]["usage"]]]
    return [max(0, min(a, b) - read) for (a, _), (b, read) in zip(prompts, prompts[1:])]


def test_claude_code_misses_after_a_pause_are_ttl_and_cost_the_servers_count(tmp_path):
    gaps = [30, 400, 60, 36_000, 90, 200]  # 6 min 40 s and 10 h: past Anthropic's 5 minutes
    lines = claude_session(gaps)
    report = analyze(_write(tmp_path / "claude.jsonl", lines))
    [s] = report.sessions
    misses = [t for t in s.turns if t.brk]
    assert [(t.number, t.brk.cause, t.brk.subtype) for t in misses] == [(3, "server_miss", "ttl"),
                                                                        (5, "server_miss", "ttl")]
    assert "(6 min 45 s)" in misses[0].brk.detail and "(10 h 0 min)" in misses[1].brk.detail
    assert "Anthropic prompt caching: 5 minutes" in misses[0].brk.detail
    # The server's count: all of the previous prompt (system prompt and tools included), not the rebuilt one's.
    losses = _usage_losses(lines)
    assert [t.lost_tokens for t in misses] == [losses[1], losses[3]] == [27_000, 33_000]
    assert all(t.lost_tokens_basis == "server" for t in misses)
    assert all(t.lost_tokens > t.prompt_tokens for t in misses)  # the rebuilt prompt lacks 21k tokens
    assert report.to_dict()["totals"]["lost_tokens"] == sum(losses)
    text = format_text(report)
    assert "the server read 0 of this prompt's 30,000 tokens from cache" in text
    assert "tokens: the server's own counts" in text
    assert "predicted" not in text.split("turn 3 server_miss")[1].split("\n")[0]  # one unit per sentence


def test_a_local_model_has_no_lifetime_and_short_prompts_no_miss(tmp_path):
    # Claude Code pointed at a local server: the transcript names the local model, not a Claude one.
    local = analyze(_write(tmp_path / "local.jsonl", claude_session([30, 400], model="default"))).sessions[0].turns
    assert (local[2].brk.cause, local[2].brk.subtype) == ("server_miss", "unknown")
    # Under the 1,024 tokens Anthropic caches at all, a read of 0 is the rule, not a loss.
    short = analyze(_write(tmp_path / "short.jsonl", claude_session([30, 400], base=300, step=200))).sessions[0].turns
    assert [t.reported_prompt_tokens for t in short] == [500, 700, 900] and not any(t.brk for t in short)


def test_the_one_hour_lifetime_is_read_from_the_usage(tmp_path):
    lines = claude_session([30, 900, 7200], one_hour=True)
    turns = analyze(_write(tmp_path / "claude-1h.jsonl", lines)).sessions[0].turns
    assert turns[2].brk is None  # 15 min: within the hour
    assert (turns[3].brk.cause, turns[3].brk.subtype) == ("server_miss", "ttl")
    assert "cache_control ttl \"1h\": 1 hour" in turns[3].brk.detail


def test_a_partial_server_loss_of_5k_tokens_is_reported_below_the_share_threshold(tmp_path):
    # Late in a long session, a call reads 6,000 tokens less than the call before left cached: under
    # 10 % of its prompt, so the share rule alone never names it.
    gaps = [20] * 30
    lines = claude_session(gaps, cached_after={25: SYSTEM_AND_TOOLS + 3000 * 25 - 6000,
                                               27: SYSTEM_AND_TOOLS + 3000 * 27 - 4000})
    src = _write(tmp_path / "partial.jsonl", lines)
    turns = analyze(src).sessions[0].turns
    t = turns[25]
    assert 6000 / t.reported_prompt_tokens < 0.10
    assert (t.brk.cause, t.brk.subtype) == ("server_miss", "unknown") and t.lost_tokens == 6000
    assert turns[27].brk is None  # 4,000: under the threshold
    assert [u.number for u in analyze(src, min_partial_loss=3000).sessions[0].turns if u.brk] == [26, 28]
    # The CLI flag, and its default is the library's.
    code = "import sys; from prefixtrace.cli import main; sys.argv[0] = 'prefixtrace'; main()"
    run = subprocess.run([sys.executable, "-c", code, "analyze", str(src), "--json", "--min-partial-loss", "3000"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert [t["number"] for t in out["sessions"][0]["turns"] if t["break"]] == [26, 28]
    from prefixtrace.cli_analyze import PARTIAL_LOSS_MIN as CLI_DEFAULT

    assert CLI_DEFAULT == PARTIAL_LOSS_MIN == 5000


def _codex_lines() -> list[dict]:
    path = next((FIX / "codex").glob("rollout-*.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines()]


def codex_rollout(calls: list[dict]) -> list[dict]:
    """A Codex rollout: the fixture's head, then per call a reasoning item and a function call (its
    output), its usage, the function call's output, and a new user message where `user` is set.
    Each call: {"input": N, "cached": N, "user": bool}, 2 s apart."""
    lines = _codex_lines()
    head = [o for o in lines[:8] if o["type"] in ("session_meta", "response_item", "turn_context")]
    call = next(o for o in lines if o.get("payload", {}).get("type") == "function_call")
    usage = next(o for o in lines if o["type"] == "token_usage_record")
    output = next(o for o in lines if o.get("payload", {}).get("type") == "function_call_output")
    now = START
    out = [{**o, "timestamp": _iso(now)} for o in head]
    for i, c in enumerate(calls):
        now += timedelta(seconds=2)
        if c.get("user"):
            out.append({"timestamp": _iso(now), "type": "response_item",
                        "payload": {"type": "message", "role": "user",
                                    "content": [{"type": "input_text", "text": f"now step {i}"}]}})
        cid = f"call_{i:04d}"
        out.append({"timestamp": _iso(now), "type": "response_item",
                    "payload": {"type": "reasoning", "summary": [{"type": "summary_text", "text": f"think {i}"}],
                                "encrypted_content": "gAAA" + "x" * 200}})
        out.append({**call, "timestamp": _iso(now), "payload": {**call["payload"], "call_id": cid}})
        u = {"input_tokens": c["input"], "cached_input_tokens": c["cached"], "output_tokens": 50}
        out.append({**usage, "timestamp": _iso(now), "payload": {**usage["payload"], "usage": u}})
        out.append({**output, "timestamp": _iso(now),
                    "payload": {**output["payload"], "call_id": cid, "output": f"result {i} " + "z" * 400}})
    return out


def test_codex_reasoning_dropped_by_the_server_at_a_user_turn_is_named_with_its_tokens(tmp_path):
    calls = [{"input": 90_000 + 2000 * i, "cached": 90_000 + 2000 * i - 1500} for i in range(6)]
    # A new user turn: the server's count falls by 5,000 (earlier reasoning dropped) and 7,000 of what
    # it still counts are prefilled again: 7.4 % of the prompt, under the share rule's 10 points.
    calls.append({"input": 95_000, "cached": 88_000, "user": True})
    calls.append({"input": 97_000, "cached": 95_000})
    report = analyze(_write(tmp_path / "rollout-drop.jsonl", codex_rollout(calls)))
    [s] = report.sessions
    [t] = [t for t in s.turns if t.brk]
    assert t.number == 7 and (t.brk.cause, t.brk.subtype) == ("server_miss", "reasoning_drop")
    assert t.lost_tokens == min(100_000, 95_000) - 88_000 == 7000 and t.lost_tokens_basis == "server"
    assert "the server counted 95,000 input tokens, 5,000 fewer than the previous request's 100,000" in t.brk.detail
    assert "a new user turn" in t.brk.detail and "reasoning" in t.brk.suggestion


PI_REAL = FIX / "pi" / "real"  # pi-mono's own version-1 sessions (provenance beside them)


def _pi_usage_pairs(path: Path) -> list[tuple[int, int, int]]:
    """(previous prompt, this prompt, this cache read) of consecutive calls the server counted, read
    from the file's own usage (pi: input + cacheRead + cacheWrite); zero-usage calls (failed or
    aborted) are not counted."""
    counted = []
    for line in path.read_text().splitlines():
        msg = json.loads(line).get("message") or {}
        u = msg.get("usage") if msg.get("role") == "assistant" else None
        if isinstance(u, dict) and (prompt := u["input"] + u["cacheRead"] + u["cacheWrite"]):
            counted.append((prompt, u["cacheRead"]))
    return [(a, b, read) for (a, _), (b, read) in zip(counted, counted[1:])]


@pytest.mark.skipif(not (PI_REAL / "before-compaction.jsonl").exists(), reason="real pi sessions not in this checkout")
@pytest.mark.parametrize("name, ttl_gaps", [("before-compaction.jsonl", ["(6 min 14 s)"]),
                                            ("large-session.jsonl", ["(9 min 27 s)", "(10 min 54 s)"])])
def test_real_pi_sessions_misses_cost_the_usage_and_pauses_are_ttl(name, ttl_gaps):
    path = PI_REAL / name
    [s] = analyze(path).sessions
    misses = [t for t in s.turns if t.brk and t.brk.cause == "server_miss"]
    # A failed call's all-zero usage is no report: never a miss of "0 of 0 tokens".
    assert misses and all(t.reported_prompt_tokens for t in misses)
    pairs = _pi_usage_pairs(path)
    for t in misses:
        if t.lost_tokens_basis == "server":  # the server's loss, straight from the file's usage
            assert any(b == t.reported_prompt_tokens and t.lost_tokens == min(a, b) - read for a, b, read in pairs)
    ttl = [t for t in misses if t.brk.subtype == "ttl"]
    assert [next(g for g in ttl_gaps if g in t.brk.detail) for t in ttl] == ttl_gaps
    assert all("Anthropic prompt caching: 5 minutes" in t.brk.detail for t in ttl)
