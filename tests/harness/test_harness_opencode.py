"""opencode (`opencode run`) over chat completions, its read tool only."""

from __future__ import annotations

import json

from harness import harness_support as hs

# Every tool opencode 1.18 offers but read: nothing the model chooses can write or run a command.
DISABLED = ("bash", "edit", "write", "patch", "glob", "grep", "list", "webfetch", "websearch", "task",
            "todowrite", "todoread", "skill", "codesearch", "lsp")


def configure_opencode(scratch: hs.Scratch, base_url: str) -> dict:
    """The user's opencode.json in the scratch HOME; the provider and model are the product's
    (prefixtrace/harnesses.py: OPENCODE_CONFIG_CONTENT, merged over this file)."""
    config_dir = scratch.home / ".config" / "opencode"
    config_dir.mkdir(parents=True)
    config = {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False, "share": "disabled",
        "tools": {name: False for name in DISABLED},
        "permission": {"edit": "deny", "bash": "deny", "webfetch": "deny", "read": "allow"},
    }
    (config_dir / "opencode.json").write_text(json.dumps(config))
    env = hs.harness_env(scratch, {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1"})
    return hs.point("opencode", scratch, base_url, env)[1]


def test_opencode_reads_a_file_through_the_proxy(npm_bins, backend, scratch, drive, tmp_path):
    env = configure_opencode(scratch, backend.url)
    cmd = [npm_bins["opencode"], "run", "--pure", "Read the file hello.txt"]
    result, records = drive("opencode", cmd, env, timeout=900)
    assert result.returncode == 0, result.output[-3000:]
    assert records, result.output[-3000:]
    assert all(r["response"]["status"] == 200 for r in records), hs.describe(records)
    loop = [r for r in records if r["request"].get("tools")]  # the agent; the title request has none
    assert {t["function"]["name"] for r in loop for t in r["request"]["tools"]} == {"read"}
    hs.assert_tool_round_trip(loop, scratch, {"read"})
    hs.assert_recorded_calls_match_what_client_saw(records)
    check = hs.run_check(loop, tmp_path / "opencode.jsonl")
    assert check.returncode == 0, check.stdout + check.stderr
