"""Claude Code, Codex and pi through `serve --fix` (docs/FIXES.md): their tool loops still complete with
every fix on, each fix that applies to the harness's protocol is recorded with its turns, and the
session, recorded as the harness sent it, replayed with `replay --fix` shows the gain or that none was
there.

The chain: harness → a recording proxy (`serve --upstream`, the harness's own bodies) → `serve --fix`
on the embedded engine (the fixed bodies). The paired replay sends the first proxy's recording to a
plain engine server, as recorded and as fixed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import harness_support as hs
from harness.conftest import ENGINE_ARGS
from harness.test_harness_claude import claude_env
from harness.test_harness_codex import configure_codex
from harness.test_harness_pi import configure_pi

ALL_FIXES = "volatile,tool-order,tool-args,thinking,breakpoints,session-key"


@pytest.fixture(scope="module")
def fixed_chain(server_dir):
    fixed = hs.start_server(server_dir, "fixed", [*ENGINE_ARGS, "--fix", ALL_FIXES])
    # The fixed engine's prefill is cold (nothing before it warmed its cache) and can run for minutes
    # on a busy host between two events of a stream: the front waits for it.
    front = hs.start_server(server_dir, "fixed-front", ["--upstream", fixed.url, "--upstream-idle-timeout-s", "1800"])
    yield front, fixed
    hs.stop_server(front)
    hs.stop_server(fixed)


@pytest.fixture(params=["fixed"])
def backend(request, fixed_chain) -> hs.Server:
    """The harness talks to the recording proxy in front of `serve --fix` (overrides conftest's)."""
    return fixed_chain[0]


def fix_entries(records: list[dict]) -> list[dict]:
    return [e for r in records for e in ((r.get("render") or {}).get("fixes") or [])]


def prove(name: str, fixed_chain, engine_server, drive_records: list[dict], tmp_path) -> dict:
    """The fixed server recorded one entry per fix for every turn; the paired replay of the session as
    the harness sent it, against a plain engine server."""
    front, fixed = fixed_chain
    fixed_records = hs.export_records(fixed.db, tmp_path / f"{name}-fixed.jsonl")
    mine = [r for r in fixed_records if r["session"] in {d["session"] for d in drive_records}]
    entries = fix_entries(mine)
    assert entries and {e["name"] for e in entries} == set(ALL_FIXES.split(",")), hs.describe(mine)
    assert not any(e.get("error") for e in entries), entries
    recording = tmp_path / f"{name}-as-sent.jsonl"
    recording.write_text("".join(json.dumps(r) + "\n" for r in drive_records))
    out = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "replay", str(recording), "--target",
                          engine_server.url, "--fix", ALL_FIXES, "--min-gain", "0", "--json"],
                         capture_output=True, text=True, env=hs.server_env(), timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    side = report["side_by_side"]
    rec, fixed_v = report["variants"]["recorded"], report["variants"]["fixed"]
    print(f"{name}: fired {report['fired']}; hit rate {rec['hit_rate']} -> {fixed_v['hit_rate']} (turns 2+: "
          f"{rec['hit_rate_later_turns']} -> {fixed_v['hit_rate_later_turns']}); removed {side['breaks_removed']}, caused {side['breaks_caused']}; "
          f"{report['verdict']}; not improved: {report['not_improved']}")
    # The gain, or that none was there: a fix that fired never costs cached tokens it did not gain back.
    assert side["breaks_caused"] <= side["breaks_removed"], report
    return report


def test_claude_code_through_serve_fix(npm_bins, backend, scratch, drive, fixed_chain, engine_server, tmp_path):
    cmd = [npm_bins["claude"], "-p", "--model", "default", "--tools=Read", "--allowedTools=Read",
           "--no-session-persistence", "Read the file hello.txt"]
    result, records = drive("claude", cmd, claude_env(scratch, backend.url), timeout=900)
    assert result.returncode == 0, result.output[-3000:]
    messages = [r for r in records if r["endpoint"] == "/v1/messages"]
    hs.assert_tool_round_trip(messages, scratch, {"Read"})
    prove("claude", fixed_chain, engine_server, messages, tmp_path)


def test_codex_through_serve_fix(npm_bins, backend, scratch, drive, fixed_chain, engine_server, tmp_path):
    args, env = configure_codex(scratch, backend.url)
    cmd = [npm_bins["codex"], *args, "exec", "--skip-git-repo-check", "--sandbox", "read-only",
           "--disable", "goals", "--disable", "multi_agent", "--disable", "view_image",
           f"Use exec_command to run: cat {scratch.hello}"]
    result, records = drive("codex", cmd, env, timeout=900)
    assert result.returncode == 0, result.output[-3000:]
    responses = [r for r in records if r["endpoint"] == "/v1/responses"]
    hs.assert_tool_round_trip(responses, scratch, {"exec_command", "shell"})
    prove("codex", fixed_chain, engine_server, responses, tmp_path)


def test_pi_through_serve_fix(npm_bins, backend, scratch, drive, fixed_chain, engine_server, tmp_path):
    args, env = configure_pi(scratch, backend.url)
    cmd = [npm_bins["pi"], *args, "--tools", "read", "--no-session", "--no-extensions", "--no-skills",
           "--no-prompt-templates", "--no-context-files", "-p", f"Read the file {scratch.hello}"]
    result, records = drive("pi", cmd, env, timeout=900)
    assert result.returncode == 0, result.output[-3000:]
    hs.assert_tool_round_trip(records, scratch, {"read"})
    prove("pi", fixed_chain, engine_server, records, tmp_path)
