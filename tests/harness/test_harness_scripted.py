"""The pinned harnesses against a scripted model (testsupport/scripted_replies.py) behind
`prefixtrace serve --upstream`: what the bundled model cannot make them do (a compaction, parallel tool
calls), done again on every run, and the session file the harness wrote read back and compared with
what the proxy recorded of the same run (the fixtures in fixtures/transcripts/*/real/ were made so)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from analyzer import analyze, check
from harness import harness_support as hs
from recorder.transcripts import read_transcripts


@pytest.fixture
def scripted(request, tmp_path):
    """start(script) → a `prefixtrace serve --upstream` in front of the scripted model running `script`."""
    procs: list[subprocess.Popen] = []
    servers: list[hs.Server] = []

    def start(script: str) -> hs.Server:
        port = hs.free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "testsupport.scripted_replies", script, str(port)],
                                      cwd=hs.ROOT, env=hs.server_env(), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or procs[-1].poll() is not None:
                    raise RuntimeError(f"the scripted model {script} did not start")
                time.sleep(0.2)
        servers.append(hs.start_server(tmp_path / "server", script, ["--upstream", f"http://127.0.0.1:{port}"]))
        return servers[-1]

    yield start
    for server in servers:
        hs.stop_server(server)
    for proc in procs:
        proc.terminate()
        proc.wait(10)


def _items(rec: dict) -> list[dict]:
    return [{k: v for k, v in i.items() if k != "internal_chat_message_metadata_passthrough"}
            for i in rec["request"]["input"]]


def test_codex_remote_compaction_through_the_proxy_is_read_back_as_sent(npm_bins, scripted, tmp_path):
    server = scripted("codex_remote_compact")
    scratch = hs.make_scratch(tmp_path / "codex")
    codex_home = scratch.home / ".codex"
    codex_home.mkdir(parents=True)
    # a provider named OpenAI is what makes Codex compact remotely; every call is over the limit
    (codex_home / "config.toml").write_text(f'''\
model = "default"
model_provider = "pt"
model_auto_compact_token_limit = 3000
web_search = "disabled"

[model_providers.pt]
name = "OpenAI"
base_url = "{server.url}/v1"
env_key = "PT_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[tools.experimental_request_user_input]
enabled = false

[skills]
include_instructions = false

[analytics]
enabled = false
''')
    env = hs.harness_env(scratch, {"PT_KEY": "x"})
    base = [npm_bins["codex"], "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--disable", "goals",
            "--disable", "multi_agent", "--disable", "view_image"]
    for args in (["Use exec_command to run: cat hello.txt"],
                 ["resume", "--last", "Use exec_command to run: cat hello.txt again"]):
        result = hs.run_harness(base + args, scratch, env, timeout=300)
        assert result.returncode == 0, result.output[-3000:]
    records = hs.export_records(server.db, tmp_path / "codex.jsonl")
    [rollout] = (codex_home / "sessions").rglob("rollout-*.jsonl")
    [t] = read_transcripts(rollout)
    assert any(i == {"type": "compaction_trigger"} for r in records for i in r["request"]["input"])
    assert len(t.turns) == len(records)
    for turn, rec in zip(t.turns, records, strict=True):
        assert turn.request_body["input"] == _items(rec)[1:]  # less the base-instructions message (noted)
        assert (turn.prompt_tokens, turn.cached_tokens) == (rec["tokens"]["prompt"], rec["tokens"]["cached"])
    assert {t.brk.cause for s in analyze(rollout).sessions for t in s.turns if t.brk} == {"compaction"}
    assert check(rollout, allow="compaction").ok


def test_claude_code_parallel_tool_calls_are_read_back_as_sent(npm_bins, scripted, tmp_path):
    server = scripted("claude_parallel")
    scratch = hs.make_scratch(tmp_path / "claude")
    (scratch.work / "world.txt").write_text("The second word is mango.\n")
    args, env = hs.point("claude", scratch, server.url, hs.harness_env(scratch, {}))
    cmd = [npm_bins["claude"], *args, "-p", "--model", "default", "--tools=Read", "--allowedTools=Read",
           "Read the files hello.txt and world.txt"]
    result = hs.run_harness(cmd, scratch, env, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    loop = [r for r in hs.export_records(server.db, tmp_path / "claude.jsonl")
            if r["request"].get("tools") and "Warmup" not in json.dumps(r["request"]["messages"][0])]
    [session] = [p for p in (scratch.home / ".claude" / "projects").rglob("*.jsonl") if not p.name.startswith("agent-")]
    [t] = read_transcripts(session)

    def strip(v):
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k != "cache_control"}
        return [strip(x) for x in v] if isinstance(v, list) else v
    assert len(t.turns) == len(loop) == 2
    for turn, rec in zip(t.turns, loop, strict=True):
        assert turn.request_body["messages"][1:] == strip(rec["request"]["messages"][1:])
    results = [b["tool_use_id"] for b in t.turns[1].request_body["messages"][2]["content"]]
    assert len(results) == 2


def test_claude_code_compact_with_a_summary_is_read_back_and_named_compaction(npm_bins, scripted, tmp_path):
    server = scripted("claude_compact")
    scratch = hs.make_scratch(tmp_path / "claude-compact")
    args, env = hs.point("claude", scratch, server.url, hs.harness_env(scratch, {}))
    base = [npm_bins["claude"], *args, "-p", "--model", "default", "--tools=Read", "--allowedTools=Read"]
    result = hs.run_harness(base + ["Read the file hello.txt"], scratch, env, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    [session] = [p for p in (scratch.home / ".claude" / "projects").rglob("*.jsonl") if not p.name.startswith("agent-")]
    for prompt in ("/compact", "Read the file hello.txt again"):
        result = hs.run_harness(base + ["-r", session.stem, prompt], scratch, env, timeout=300)
        assert result.returncode == 0, result.output[-3000:]
    lines = [json.loads(line) for line in session.read_text().splitlines()]
    assert any(o.get("subtype") == "compact_boundary" and o.get("compactMetadata") for o in lines)
    recorded = hs.export_records(server.db, tmp_path / "compact.jsonl")
    loop = [r for r in recorded if r["request"].get("tools")  # not the title request
            and "create a detailed summary" not in json.dumps(r["request"]["messages"][-1])]  # nor the summary's
    [t] = read_transcripts(session)
    assert len(t.turns) == len(loop) == 4 and t.compacted == {3}
    for turn, rec in zip(t.turns, loop):
        assert (turn.prompt_tokens, turn.cached_tokens) == (rec["tokens"]["prompt"], rec["tokens"]["cached"])
    assert [t.brk.cause for s in analyze(session).sessions for t in s.turns if t.brk] == ["compaction"]
    assert check(session, allow="compaction").ok
    recording = tmp_path / "compact.jsonl"  # the same run as the proxy recorded it: named the same
    assert check(recording, allow="compaction").ok and not check(recording).ok
