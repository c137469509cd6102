"""Claude Code in print mode, its Read tool only, over the Anthropic Messages API."""

from __future__ import annotations

from harness import harness_support as hs


def claude_env(scratch: hs.Scratch, base_url: str) -> dict:
    args, env = hs.point("claude", scratch, base_url, hs.harness_env(scratch, {
        "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # it asks for 32,000 output tokens otherwise: clamped to the 8k context, the free answer after
        # the tool result could run for minutes on a CPU
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "200",
    }))
    assert args == []  # Claude Code is pointed by its environment alone
    return env


def test_claude_code_reads_a_file_through_the_proxy(npm_bins, backend, scratch, drive, tmp_path):
    # Read only: Claude Code's whole tool set makes a ~7.5k-token prompt, most of SmolLM2's 8k context
    # and minutes of CPU prefill; Read is allowed without a prompt, nothing else is offered.
    cmd = [npm_bins["claude"], "-p", "--model", "default", "--tools=Read", "--allowedTools=Read",
           "--no-session-persistence", "Read the file hello.txt"]
    result, records = drive("claude", cmd, claude_env(scratch, backend.url), timeout=900)
    assert result.returncode == 0, result.output[-3000:]
    messages = [r for r in records if r["endpoint"] == "/v1/messages"]
    assert messages, hs.describe(records)
    assert all(r["response"]["status"] == 200 for r in records), hs.describe(records)
    call = hs.assert_tool_round_trip(messages, scratch, {"Read"})
    assert (scratch.work / hs.call_args(call)["file_path"]).resolve() == scratch.hello.resolve()
    hs.assert_recorded_calls_match_what_client_saw(messages)
    sessions = {r["session"] for r in messages}
    assert len(sessions) == 1 and None not in sessions, sessions  # the plain session id, every turn
    check = hs.run_check(messages, tmp_path / "claude.jsonl")
    assert check.returncode == 0, check.stdout + check.stderr
