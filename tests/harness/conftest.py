"""Fixtures of the harness conformance suite (docs/HARNESSES.md).

Once per pytest session: install the pinned harnesses (cached under ~/.cache/prefixtrace-harness,
keyed by the pins), start one `prefixtrace serve` on the bundled SmolLM2 (the embedded engine) and one
`prefixtrace serve --upstream` in front of it. Each test runs one harness against one of the two
(`backend` is parametrized), in its own scratch HOME and working directory, and reads back the turns
that run added to that server's database.

`PREFIXTRACE_HARNESS=0` skips the suite (for machines without npm); anything else that keeps a
harness from installing or running fails the test: CI must not go green without it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness import harness_support as hs

HERE = Path(__file__).resolve().parent

# Four test aids of `serve` (docs/HARNESSES.md):
# - until a tool has answered, a user turn of a request that offers tools gets a grammar-constrained
#   tool call (engine/constraints.py); after the tool result the model answers freely, so every
#   harness loop ends by itself (Claude Code's own "Output token limit hit" user message after a cut
#   answer is not forced into another call);
# - requests that set no temperature (no harness here sets one) decode greedily, so which tool and
#   which arguments is the model's most likely choice and a run is reproducible;
# - a frequency penalty over the reply's own tokens, so a greedy free answer ends instead of
#   repeating the tool result to max_tokens;
# - requests that set no output cap (Codex sends none) stop after 128 tokens, so a small model's free
#   answer cannot run to the context's end.
ENGINE_ARGS = ["--tool-choice-default", "required-until-tool-result", "--default-temperature", "0",
               "--default-frequency-penalty", "0.5", "--default-max-tokens", "128"]


def pytest_collection_modifyitems(config, items):
    opted_out = os.environ.get(hs.OPT_OUT_ENV) == "0"
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.harness)
            if opted_out:
                item.add_marker(pytest.mark.skip(reason=f"{hs.OPT_OUT_ENV}=0: harness suite opted out"))


def pytest_configure(config):
    config.addinivalue_line("markers", "harness: drives a real coding-agent harness (tests/harness/)")
    config._harness_timings = []


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    timings = getattr(config, "_harness_timings", [])
    if not timings:
        return
    terminalreporter.section("harness timings")
    for row in timings:
        terminalreporter.write_line(f"{row['what']:<36} {row['seconds']:>7.1f} s  {row.get('note', '')}")
    out = os.environ.get("PREFIXTRACE_HARNESS_TIMINGS")
    if out:
        Path(out).write_text(json.dumps(timings, indent=1))


@pytest.fixture(scope="session")
def timings(pytestconfig):
    def note(what: str, seconds: float, note: str = "") -> None:
        pytestconfig._harness_timings.append({"what": what, "seconds": round(seconds, 1), "note": note})
    return note


@pytest.fixture(scope="session")
def npm_bins(timings) -> dict[str, Path]:
    try:
        bins, spent = hs.install_npm_harnesses()
    except hs.HarnessUnavailable as exc:
        pytest.fail(f"harness install failed: {exc}", pytrace=False)
    timings("install: npm harnesses", spent, "cached" if spent == 0 else "fresh")
    return bins


@pytest.fixture(scope="session")
def llm_exe(timings) -> Path:
    try:
        exe, spent = hs.install_llm()
    except hs.HarnessUnavailable as exc:
        pytest.fail(f"harness install failed: {exc}", pytrace=False)
    timings("install: llm (PyPI venv)", spent, "cached" if spent == 0 else "fresh")
    return exe


@pytest.fixture(scope="session")
def aider_exe(timings) -> Path:
    try:
        exe, spent = hs.install_pypi("aider")
    except hs.HarnessUnavailable as exc:
        pytest.fail(f"harness install failed: {exc}", pytrace=False)
    timings("install: aider (PyPI venv)", spent, "cached" if spent == 0 else "fresh")
    return exe


@pytest.fixture(scope="session")
def server_dir():
    """Not under pytest's basetemp: concurrent pytest sessions of one user prune each other's
    older basetemps, and these databases must outlive the whole session."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="prefixtrace-harness-servers-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def engine_server(server_dir, timings):
    import time

    start = time.monotonic()
    server = hs.start_server(server_dir, "engine", ENGINE_ARGS)
    timings("start: engine server", time.monotonic() - start)
    yield server
    hs.stop_server(server)


@pytest.fixture(scope="session")
def front_server(server_dir, engine_server):
    """`prefixtrace serve --upstream` in front of the engine server: a second real server."""
    server = hs.start_server(server_dir, "front", ["--upstream", engine_server.url])
    yield server
    hs.stop_server(server)


@pytest.fixture(params=["engine", "upstream"])
def backend(request) -> hs.Server:
    """The server a harness talks to: the embedded engine, or the proxy in front of it."""
    if request.param == "engine":
        return request.getfixturevalue("engine_server")
    return request.getfixturevalue("front_server")


@pytest.fixture
def scratch(request):
    """The same short path on every run: `/tmp/pt-<harness>-<backend>/`. The model copies the file's
    path into its tool call token by token, so the path is part of the prompt a greedy decode answers:
    a random directory name (pytest's tmp_path, or mkdtemp's 8 random letters) made the call's
    arguments, and so the test's outcome, differ from run to run (CI once saw SmolLM2 write
    `/tmp/pt-51tiu-work/hello.txt` for `/tmp/pt-51tiueke/work/hello.txt`). Words copy reliably.
    A lock file beside it keeps two pytest sessions of one machine from sharing the directory."""
    import fcntl
    import shutil

    harness = request.node.module.__name__.rsplit(".", 1)[-1].removeprefix("test_harness_")
    callspec = getattr(request.node, "callspec", None)
    backend = callspec.params.get("backend", "any") if callspec else "any"
    base = Path(f"/tmp/pt-{harness}-{backend}")
    with open(f"{base}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shutil.rmtree(base, ignore_errors=True)
        try:
            yield hs.make_scratch(base)
        finally:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def drive(request, backend, scratch, timings, tmp_path):
    """drive(name, cmd, env, timeout) → (RunResult, the turns this run added to `backend`'s db)."""
    def run(name: str, cmd: list, env: dict, timeout: float = 600):
        before = {r["id"] for r in hs.export_records(backend.db, tmp_path / "before.jsonl")}
        result = hs.run_harness(cmd, scratch, env, timeout)
        mode = request.node.callspec.params.get("backend", "")
        timings(f"run: {name} [{mode}]", result.seconds, f"exit {result.returncode}")
        records = [r for r in hs.export_records(backend.db, tmp_path / "after.jsonl") if r["id"] not in before]
        return result, records
    return run
