"""`prefixtrace run HARNESS [ARGS...]` with each real harness (prefixtrace/run.py, prefixtrace/harnesses.py).

Each harness runs from `prefixtrace run` as a user would start it: a HOME of its own holding the
user's config for that harness (the settings this suite needs, which the harness must still read:
the product layers its proxy settings over them without writing them), the harness's
non-interactive invocation from docs/HARNESSES.md as ARGS. Asserted: the harness's exit code comes
back (0, and a bad flag's non-zero code, the same as the harness gives run directly), what it sent
is recorded under the run's own session id, the summary is printed, and the user's config files
are byte for byte and mtime for mtime what they were.

All but one reuse the suite's engine server (`--url`); `test_run_starts_its_own_proxy` has `run`
start and stop a `prefixtrace serve` of its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import harness_support as hs
from harness.conftest import ENGINE_ARGS
from harness.test_harness_aider import make_repo, MODEL_METADATA, MODEL_SETTINGS
from harness.test_harness_llm import READ_FILE
from harness.test_harness_opencode import DISABLED
from harness.test_harness_qwen import EXCLUDED_TOOLS, SYSTEM_PROMPT

SESSION = re.compile(r"prefixtrace: session (run-[A-Za-z0-9._:-]+): (\d+) request")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- per harness: the user's own config in HOME, extra environment, ARGS -----------------------


def user_pi(scratch: hs.Scratch, exes) -> tuple[list[Path], dict, list]:
    agent = scratch.home / ".pi" / "agent"
    files = [
        # compaction off: its default reserve exceeds SmolLM2's whole context (test_harness_pi.py)
        write(agent / "settings.json", json.dumps({"enableInstallTelemetry": False, "compaction": {"enabled": False}})),
        write(agent / "models.json", json.dumps({"providers": {"mine": {
            "baseUrl": "http://127.0.0.1:9/v1", "api": "openai-completions", "apiKey": "mine",
            "models": [{"id": "m", "contextWindow": 1000, "maxTokens": 10}]}}})),
    ]
    args = ["--tools", "read", "--no-session", "--no-extensions", "--no-skills", "--no-prompt-templates",
            "--no-context-files", "-p", f"Read the file {scratch.hello}"]
    return files, {"PI_OFFLINE": "1"}, [exes["pi"], args]


def user_claude(scratch: hs.Scratch, exes):
    files = [write(scratch.home / ".claude" / "settings.json", json.dumps({"includeCoAuthoredBy": False}))]
    env = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "200"}
    # no --model: `run` pins the engine's model through Claude Code's model variables
    args = ["-p", "--tools=Read", "--allowedTools=Read", "--no-session-persistence", "Read the file hello.txt"]
    return files, env, [exes["claude"], args]


CODEX_USER_CONFIG = '''\
# the user's own provider and model: `run` overrides both for its run only
model = "gpt-users-own"
model_provider = "mine"
web_search = "disabled"

[model_providers.mine]
name = "mine"
base_url = "http://127.0.0.1:9/v1"
wire_api = "responses"

# tuning of the provider `run` adds (it sets only its name, URL, key variable and wire API)
[model_providers.prefixtrace]
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 1200000

[tools.experimental_request_user_input]
enabled = false

[skills]
include_instructions = false

[analytics]
enabled = false
'''


def user_codex(scratch: hs.Scratch, exes):
    files = [write(scratch.home / ".codex" / "config.toml", CODEX_USER_CONFIG)]
    args = ["exec", "--skip-git-repo-check", "--sandbox", "read-only", "--disable", "goals", "--disable",
            "multi_agent", "--disable", "view_image", f"Use exec_command to run: cat {scratch.hello}"]
    return files, {}, [exes["codex"], args]


def user_opencode(scratch: hs.Scratch, exes):
    config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
              "tools": {name: False for name in DISABLED},
              "permission": {"edit": "deny", "bash": "deny", "webfetch": "deny", "read": "allow"}}
    files = [write(scratch.home / ".config" / "opencode" / "opencode.json", json.dumps(config))]
    env = {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1"}
    return files, env, [exes["opencode"], ["run", "--pure", "Read the file hello.txt"]]


def user_qwen(scratch: hs.Scratch, exes):
    settings = {  # test_harness_qwen.py says why each is set; model and auth come from `run`
        "model": {"generationConfig": {"samplingParams": {"max_tokens": 200}, "contextWindowSize": 8192}},
        "tools": {"core": ["read_file"], "exclude": EXCLUDED_TOOLS},
        "memory": {"enableManagedAutoMemory": False}, "telemetry": {"enabled": False},
        "privacy": {"usageStatisticsEnabled": False}, "general": {"enableAutoUpdate": False},
    }
    # at the settings version qwen-code 0.15.10 writes: it migrates an older file itself (adds
    # "$version" and rewrites it), which it would do with or without `run`
    files = [write(scratch.home / ".qwen" / "settings.json", json.dumps({**settings, "$version": 4}, indent=2)),
             write(scratch.home / "system.md", SYSTEM_PROMPT)]
    return files, {"QWEN_SYSTEM_MD": str(files[1])}, [exes["qwen"], ["-p", f"Read the file {scratch.hello}"]]


def user_aider(scratch: hs.Scratch, exes):
    metadata = write(scratch.home / "aider.model.metadata.json", json.dumps(MODEL_METADATA))
    settings = write(scratch.home / "aider.model.settings.yml", MODEL_SETTINGS)
    # the user's own .aider.conf.yml: kept, while `run`'s environment picks the model and server
    conf = write(scratch.home / ".aider.conf.yml", "analytics-disable: true\ncheck-update: false\n")
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "BROWSER": "true"}
    make_repo(scratch, hs.harness_env(scratch, env))
    args = ["--model-metadata-file", str(metadata), "--model-settings-file", str(settings),
            "--no-show-release-notes", "--no-gitignore", "--map-tokens", "0", "--no-detect-urls", "--yes-always",
            "--no-pretty", "--no-fancy-input", "--message", "What is the secret word in hello.txt?", "hello.txt"]
    return [metadata, settings, conf], env, [exes["aider"], args]


def user_llm(scratch: hs.Scratch, exes):
    user_dir = scratch.home / ".config" / "io.datasette.llm"  # llm's own default under XDG_CONFIG_HOME
    files = [write(user_dir / "extra-openai-models.yaml",
                   "- model_id: mine\n  model_name: m\n  api_base: http://127.0.0.1:9/v1\n"),
             write(user_dir / "keys.json", json.dumps({"openai": "sk-users-own"})),
             write(user_dir / "default_model.txt", "gpt-4o-mini")]
    # no -m: `run` makes its model the default for the run
    args = ["-o", "max_tokens", "200", "--functions", READ_FILE, f"Read the file {scratch.hello}"]
    return files, {}, [exes["llm"], args]


CASES = {"pi": user_pi, "claude": user_claude, "codex": user_codex, "opencode": user_opencode,
         "qwen": user_qwen, "aider": user_aider, "llm": user_llm}


@pytest.fixture
def exes(request):
    """The pinned executables, installing only what the test needs."""
    name = request.node.callspec.params.get("harness", "llm")
    if name == "aider":
        return {"aider": request.getfixturevalue("aider_exe")}
    if name == "llm":
        return {"llm": request.getfixturevalue("llm_exe")}
    return request.getfixturevalue("npm_bins")


def snapshot(files: list[Path]) -> dict:
    return {str(f): (f.read_bytes(), f.stat().st_mtime_ns) for f in files}


def prefixtrace_run(scratch: hs.Scratch, env: dict, run_args: list, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**env, "PYTHONPATH": str(hs.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "prefixtrace.cli", "run", *[str(a) for a in run_args]]
    return subprocess.run(cmd, cwd=scratch.work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def session_records(db: Path, session: str, out: Path) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "export", str(db), "--format", "jsonl",
                           "--session", session, "--out", str(out)], capture_output=True, text=True,
                          env=hs.server_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    from recorder.renderers import RECORD_KEY

    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return [r for r in lines if RECORD_KEY not in r]  # the renderer's own line is no turn


@pytest.mark.parametrize("harness", list(CASES))
def test_run_passes_the_exit_code_tags_the_session_and_summarises(harness, exes, engine_server, scratch, timings,
                                                                   tmp_path):
    files, extra_env, (exe, args) = CASES[harness](scratch, exes)
    env = hs.harness_env(scratch, extra_env)
    before = snapshot(files)
    common = ["--url", engine_server.url, "--db", engine_server.db, "--exe", exe, harness]

    # a flag the harness does not know: its own non-zero exit code comes back
    direct = subprocess.run([str(exe), "--no-such-flag-xyz"], cwd=scratch.work, env=env, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=300)
    assert direct.returncode != 0, direct.stdout + direct.stderr
    bad = prefixtrace_run(scratch, env, [*common, "--no-such-flag-xyz"])
    assert bad.returncode == direct.returncode, bad.stdout + bad.stderr

    import time
    start = time.monotonic()
    result = prefixtrace_run(scratch, env, [*common, *args])
    timings(f"run: prefixtrace run {harness}", time.monotonic() - start, f"exit {result.returncode}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    found = SESSION.search(result.stderr)
    assert found, f"no summary on stderr:\n{result.stderr[-3000:]}"
    session = found.group(1)
    assert session.startswith(f"run-{harness}-")
    records = session_records(engine_server.db, session, tmp_path / "session.jsonl")
    assert records, f"nothing recorded under {session}:\n{output[-3000:]}"
    assert int(found.group(2)) == len(records)
    assert {r["session"] for r in records} == {session}
    assert all(r["response"]["status"] == 200 for r in records), hs.describe(records)
    assert "cache break" in result.stderr and "lost:" in result.stderr, result.stderr[-2000:]
    # the bad-flag run reached no model: nothing of it was recorded under the one session
    assert snapshot(files) == before, "prefixtrace run changed the user's config"
    print(result.stderr[result.stderr.index("prefixtrace: session"):])  # the summary, shown by pytest -rP


def test_run_starts_its_own_proxy(llm_exe, scratch, tmp_path):
    """No proxy at --url: `run` starts `prefixtrace serve` on a free port with --db and the serve
    options it was given, and stops it when the harness exits."""
    files, extra_env, (exe, args) = user_llm(scratch, {"llm": llm_exe})
    from engine.default_model import resolve_cache_root

    env = hs.harness_env(scratch, {**extra_env, "PREFIXTRACE_CACHE_DIR": str(resolve_cache_root())})
    before = snapshot(files)
    db = tmp_path / "own.db"
    dead = f"http://127.0.0.1:{hs.free_port()}"
    result = prefixtrace_run(scratch, env, ["--url", dead, "--db", db, "--serve-args", " ".join(ENGINE_ARGS),
                                            "--exe", exe, "llm", *args])
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    started = re.search(r"starting prefixtrace serve on (http://127\.0\.0\.1:\d+)", result.stderr)
    assert started and started.group(1) != dead, result.stderr[-2000:]
    session = SESSION.search(result.stderr).group(1)
    records = session_records(db, session, tmp_path / "own.jsonl")
    assert records and all(r["session"] == session for r in records)
    hs.assert_tool_round_trip(records, scratch, {"read_file"})
    import httpx

    with pytest.raises(httpx.HTTPError):  # stopped with the harness
        httpx.get(started.group(1) + "/health", timeout=2)
    assert snapshot(files) == before


def test_run_gives_the_harness_its_terminal(llm_exe, engine_server, scratch, tmp_path):
    """Interactive use: `llm chat` through `run` on a pseudo-terminal reads the user's lines from it,
    answers through the proxy, and ends on `quit`; then the summary comes, and the exit code 0."""
    import pty
    import select
    import time

    files, extra_env, (exe, _) = user_llm(scratch, {"llm": llm_exe})
    env = hs.harness_env(scratch, extra_env)
    env["PYTHONPATH"] = str(hs.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    pid, fd = pty.fork()
    if pid == 0:  # the child: `prefixtrace run` on the terminal's slave side
        os.chdir(scratch.work)
        os.execve(sys.executable, [sys.executable, "-m", "prefixtrace.cli", "run", "--url", engine_server.url,
                                   "--db", str(engine_server.db), "--exe", str(exe), "llm", "chat", "-o",
                                   "max_tokens", "20"], env)
    seen = b""

    def read_until(marker: bytes, timeout: float) -> None:
        """Until `marker` appears after everything read so far."""
        nonlocal seen
        start = len(seen)
        deadline = time.monotonic() + timeout
        while marker not in seen[start:]:
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} within {timeout} s:\n{seen.decode(errors='replace')[-3000:]}"
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # the child closed the terminal
                    break
                seen += chunk

    try:
        read_until(b"\n> ", 300)  # llm chat's banner, then its prompt
        assert b"Type 'exit' or 'quit' to exit" in seen
        os.write(fd, b"Say hello.\n")
        read_until(b"\n> ", 600)  # llm chat's prompt again after the answer
        os.write(fd, b"quit\n")
        read_until(b"lost:", 300)
        _, status = os.waitpid(pid, 0)
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, seen.decode(errors="replace")[-3000:]
    session = SESSION.search(seen.decode(errors="replace")).group(1)
    records = session_records(engine_server.db, session, tmp_path / "chat.jsonl")
    assert len(records) == 1 and records[0]["request"]["messages"][-1]["content"] == "Say hello."
