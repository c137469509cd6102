"""pi (@mariozechner/pi-coding-agent) in print mode, its `read` tool only, over chat completions."""

from __future__ import annotations

import json

from harness import harness_support as hs


def configure_pi(scratch: hs.Scratch, base_url: str) -> tuple[list[str], dict]:
    """The user's settings in the scratch HOME; the provider is the product's (prefixtrace/harnesses.py)."""
    agent = scratch.home / ".pi" / "agent"
    agent.mkdir(parents=True)
    # compaction's default reserve (16k tokens) exceeds SmolLM2's whole 8k context, so pi would
    # summarise after every turn; the loop under test is the agent's, not its compaction
    (agent / "settings.json").write_text(json.dumps({"enableInstallTelemetry": False,
                                                     "compaction": {"enabled": False}}))
    return hs.point("pi", scratch, base_url, hs.harness_env(scratch, {"PI_OFFLINE": "1"}))


def test_pi_reads_a_file_through_the_proxy(npm_bins, backend, scratch, drive, tmp_path):
    args, env = configure_pi(scratch, backend.url)  # --provider prefixtrace --model default
    cmd = [npm_bins["pi"], *args, "--tools", "read", "--no-session",
           "--no-extensions", "--no-skills", "--no-prompt-templates", "--no-context-files",
           "-p", f"Read the file {scratch.hello}"]
    result, records = drive("pi", cmd, env, timeout=900)
    assert result.returncode == 0, result.output[-3000:]
    assert records, "pi sent nothing the proxy recorded"
    assert all(r["response"]["status"] == 200 for r in records), hs.describe(records)
    assert {r["endpoint"] for r in records} == {"/v1/chat/completions"}
    hs.assert_tool_round_trip(records, scratch, {"read"})
    hs.assert_recorded_calls_match_what_client_saw(records)
    check = hs.run_check(records, tmp_path / "pi.jsonl")
    assert check.returncode == 0, check.stdout + check.stderr
