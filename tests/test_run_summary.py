"""The summary `prefixtrace run` prints when its harness exits (prefixtrace/run.py): the analyzer's
breaks of the run's own session only, read back from a real database."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from analyzer import analyze
from analyzer.report import cost_text
from prefixtrace.cli import cli
from prefixtrace.run import format_summary, summarize
from recorder.sources import load_turns
from tests.conftest import ROOT

SESSIONS = ROOT / "fixtures" / "sessions"


def test_summary_is_the_sessions_breaks_with_their_cost(tmp_path):
    db = tmp_path / "t.db"
    for name in ("todo_stale.jsonl", "append_only.jsonl"):  # two sessions in one database
        assert CliRunner().invoke(cli, ["import", str(SESSIONS / name), "--db", str(db)]).exit_code == 0
    sessions = {t.session_id for t in load_turns(db)}
    assert "todo-stale" in sessions and len(sessions) == 2

    summary = summarize(db, "todo-stale", prefill_rate=1000)
    report = analyze(load_turns(db, session="todo-stale"), prefill_rate=1000)
    assert summary["requests"] == 4 and summary["chains"] == 1
    assert [b["cause"] for b in summary["breaks"]] == [t.brk.cause for _, t in report.breaks] == ["system_rewrite"] * 3
    assert summary["lost_tokens"] == sum(t.lost_tokens for _, t in report.breaks) > 0
    assert summary["lost_seconds"] == round(sum(t.lost_seconds for _, t in report.breaks), 2) > 0
    text = format_summary(summary)
    assert "3 cache breaks" in text and "system_rewrite" in text and "message 0 (system)" in text
    assert f"lost: {cost_text(summary['lost_seconds'], summary['lost_tokens'])}" in text
    assert text.count("fix:") == 1  # the same advice once

    other = (sessions - {"todo-stale"}).pop()
    clean = summarize(db, other)
    assert clean["breaks"] == [] and clean["lost_tokens"] == 0 and clean["requests"] > 0
    assert summarize(db, "no-such-session")["requests"] == 0
    assert "nothing was recorded" in format_summary(summarize(db, "no-such-session"))


def test_run_refuses_a_harness_it_cannot_start_before_starting_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no harness on it
    monkeypatch.chdir(tmp_path)
    missing = CliRunner().invoke(cli, ["run", "--url", "http://127.0.0.1:9", "pi", "-p", "hi"])
    assert missing.exit_code == 1 and "'pi' is not on PATH" in missing.output, missing.output
    bad_exe = CliRunner().invoke(cli, ["run", "--exe", str(tmp_path / "nope"), "llm"])
    assert bad_exe.exit_code == 1 and "is not an executable file" in bad_exe.output, bad_exe.output
    unknown = CliRunner().invoke(cli, ["run", "vim"])
    assert unknown.exit_code == 2
    assert not (tmp_path / "prefixtrace.db").exists()  # no proxy was started


def test_a_started_proxy_on_the_bundled_model_gets_the_small_model_settings():
    from prefixtrace.run_defaults import small_model_args

    added = small_model_args([])
    assert added == ["--default-temperature", "0", "--default-frequency-penalty", "0.5", "--default-max-tokens", "128",
                     "--tool-choice-default", "required-until-tool-result"]
    assert "--default-max-tokens" not in small_model_args(["--default-max-tokens=512"])  # the user's own stands
    assert small_model_args(["--upstream", "http://x:1"]) == [] and small_model_args(["--model", "m"]) == []


@pytest.mark.slow
def test_a_harness_that_sends_nothing_is_said_plainly(tmp_path):
    """The harness fails before its first request (llm with a broken plugin, say): run names its exit
    code and last lines, not a database it guessed wrong."""
    import os
    import subprocess
    import sys

    from testsupport.servers import ROOT, running_server
    from tests.test_run_trust import capturing_app

    exe = tmp_path / "llm"
    exe.write_text(f"#!{sys.executable}\nimport sys\nprint('Traceback (most recent call last):', file=sys.stderr)\n"
                   "print(\"ModuleNotFoundError: No module named 'llama_cpp'\", file=sys.stderr)\nsys.exit(1)\n")
    exe.chmod(0o755)
    with running_server(capturing_app([])) as upstream:
        result = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "run", "--url", "http://127.0.0.1:9",
                                 "--db", str(tmp_path / "t.db"), "--exe", str(exe), "--upstream", f"{upstream}/v1",
                                 "llm", "Say hi"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_RUNTIME_DIR": str(tmp_path)})
    assert result.returncode == 1
    assert "llm exited 1 before sending any request through the proxy, its last lines:" in result.stderr
    assert "    | ModuleNotFoundError: No module named 'llama_cpp'" in result.stderr
    assert "a reused proxy" not in result.stderr
