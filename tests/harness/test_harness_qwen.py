"""qwen-code (`qwen -p`, npm) over streamed chat completions, its read_file tool only.

qwen-code's default main request is ~50k tokens (a ~40k-character system prompt, fifteen tool schemas,
an auto-memory section), far above SmolLM2's 8k context: the engine refuses it with a 400. Every knob
below is one a user can set (settings.json, the QWEN_SYSTEM_MD variable its bundle reads), and each is set
for a reason said beside it (docs/HARNESSES.md).
"""

from __future__ import annotations

import json

from harness import harness_support as hs

# Registered even with `tools.core` = [read_file] (they are infrastructure tools, not "core" ones):
# the sub-agent, its task/message tools, skills, and tool_search with the deferred tools it would
# announce in the system prompt (with tool_search gone those would be revealed as schemas, so they
# are excluded by name too).
EXCLUDED_TOOLS = ["tool_search", "agent", "task_stop", "send_message", "skill", "ask_user_question",
                  "exit_plan_mode"]

# Replaces the built-in ~40k-character prompt (QWEN_SYSTEM_MD: a file whose text is the system prompt).
SYSTEM_PROMPT = "You are a coding agent. Use the read_file tool to read files.\n"


def configure_qwen(scratch: hs.Scratch, base_url: str) -> tuple[list[str], dict]:
    """The user's settings.json in the scratch HOME; auth, server and model are the product's flags
    (prefixtrace/harnesses.py)."""
    qwen_dir = scratch.home / ".qwen"
    qwen_dir.mkdir(parents=True)
    settings = {
        "model": {"generationConfig": {
            # it asks for 8,000 output tokens otherwise: prompt + 8,000 can never fit an 8k context
            "samplingParams": {"max_tokens": 200},
            # SmolLM2's real context, so qwen-code's own compression threshold is computed from it
            "contextWindowSize": 8192}},
        # read_file only: nothing the model chooses can write or run a command
        "tools": {"core": ["read_file"], "exclude": EXCLUDED_TOOLS},
        # managed auto-memory adds a ~12k-character section to the system prompt (it names the memory
        # directory under HOME) and, after a turn, a memory-extraction sub-agent with its own ~24k-
        # character prompt and tools: ~6k tokens more per extraction. Its request shape (no session
        # id, another system prompt and tool list) is checked on recorded traffic instead:
        # tests/test_analyzer_real_traffic.py::test_qwen_memory_extraction_is_a_fork_of_the_main_session
        "memory": {"enableManagedAutoMemory": False},
        "telemetry": {"enabled": False},
        "privacy": {"usageStatisticsEnabled": False},
        # the key 0.15.10 reads (its settings migration maps the older `disableAutoUpdate` onto it)
        "general": {"enableAutoUpdate": False},
    }
    (qwen_dir / "settings.json").write_text(json.dumps(settings))
    system_md = scratch.home / "system.md"
    system_md.write_text(SYSTEM_PROMPT)
    return hs.point("qwen", scratch, base_url, hs.harness_env(scratch, {"QWEN_SYSTEM_MD": str(system_md)}))


def test_qwen_code_reads_a_file_through_the_proxy(npm_bins, backend, scratch, drive, tmp_path):
    args, env = configure_qwen(scratch, backend.url)
    cmd = [npm_bins["qwen"], *args, "-p", f"Read the file {scratch.hello}"]  # read_file wants an absolute path
    result, records = drive("qwen", cmd, env, timeout=900)
    assert result.returncode == 0, result.output[-3000:]
    assert records, "qwen-code sent nothing the proxy recorded:\n" + result.output[-3000:]
    assert all(r["response"]["status"] == 200 for r in records), hs.describe(records)
    assert {r["endpoint"] for r in records} == {"/v1/chat/completions"}
    loop = [r for r in records if r["request"].get("tools")]  # the agent (a compression request has none)
    assert {t["function"]["name"] for r in loop for t in r["request"]["tools"]} == {"read_file"}
    assert all(r["stream"] for r in loop)
    assert loop[0]["request"]["messages"][0]["content"].startswith(SYSTEM_PROMPT.strip())
    call = hs.assert_tool_round_trip(loop, scratch, {"read_file"})
    assert hs.call_args(call)["file_path"] == str(scratch.hello)
    hs.assert_recorded_calls_match_what_client_saw(records)
    answer = loop[-1]["response"]["text"].strip()  # the streamed answer after the tool result
    assert answer and answer in result.output, f"recorded {answer!r}, qwen-code printed {result.output[-2000:]!r}"
    check = hs.run_check(loop, tmp_path / "qwen.jsonl")
    assert check.returncode == 0, check.stdout + check.stderr
