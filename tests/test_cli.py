"""The CLI surface: every command documents itself; analyze/check/export/import/replay work end to end."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from prefixtrace.cli import cli
from tests.conftest import ROOT

SESSIONS = ROOT / "fixtures" / "sessions"
REQUIRED = {"serve", "analyze", "check", "replay", "export", "import", "models", "db"}


def all_commands(group=cli, prefix=()):
    for name, command in group.commands.items():
        yield prefix + (name,), command
        if hasattr(command, "commands"):
            yield from all_commands(command, prefix + (name,))


def test_every_required_subcommand_exists():
    assert REQUIRED <= set(cli.commands)


@pytest.mark.parametrize("path", [p for p, _ in all_commands()], ids=lambda p: " ".join(p))
def test_every_command_explains_itself_with_an_example(path):
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example:" in result.output


def test_check_passes_an_append_only_session_and_fails_a_stale_counter():
    runner = CliRunner()
    ok = runner.invoke(cli, ["check", str(SESSIONS / "append_only.jsonl")])
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(cli, ["check", str(SESSIONS / "todo_stale.jsonl")])
    assert bad.exit_code == 1
    assert "message 0" in bad.output and "system_rewrite" in bad.output and "turns without an update" in bad.output


def test_analyze_json_names_the_divergence(tmp_path):
    out = tmp_path / "report.json"
    result = CliRunner().invoke(cli, ["analyze", str(SESSIONS / "todo_stale.jsonl"), "--format", "json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    turns = report["sessions"][0]["turns"]
    assert turns[1]["break"]["message_index"] == 0 and turns[1]["break"]["cause"] == "system_rewrite"


def test_import_export_round_trip_through_the_cli(tmp_path):
    runner = CliRunner()
    db = tmp_path / "t.db"
    assert runner.invoke(cli, ["import", str(SESSIONS / "todo_stale.jsonl"), "--db", str(db)]).exit_code == 0
    info = json.loads(runner.invoke(cli, ["db", "info", str(db)]).output)
    assert info["turns"] == 4
    out = tmp_path / "out.jsonl"
    assert runner.invoke(cli, ["export", str(db), "--out", str(out)]).exit_code == 0
    assert len(out.read_text().splitlines()) == 4


def test_bad_source_is_a_clean_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "x"}]}\n{broken\n')
    result = CliRunner().invoke(cli, ["import", str(bad), "--db", str(tmp_path / "x.db")])
    assert result.exit_code == 1
    assert "2" in result.output and "Traceback" not in result.output
