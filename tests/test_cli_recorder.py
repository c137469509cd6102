"""`prefixtrace export / import / db info` end to end, including HAR and bad files."""

from __future__ import annotations

import json

from click.testing import CliRunner

from prefixtrace.cli import cli
from tests.conftest import ROOT

FIXTURE = ROOT / "fixtures" / "sessions" / "todo_stale.jsonl"


def test_har_export_import_round_trip_and_db_info(tmp_path):
    runner = CliRunner()
    db, db2 = tmp_path / "a.db", tmp_path / "b.db"
    assert runner.invoke(cli, ["import", str(FIXTURE), "--db", str(db)]).exit_code == 0
    har = tmp_path / "out.har"
    result = runner.invoke(cli, ["export", str(db), "--format", "har", "--out", str(har)])
    assert result.exit_code == 0, result.output
    assert json.loads(har.read_text())["log"]["version"] == "1.2"
    result = runner.invoke(cli, ["import", str(har), "--db", str(db2)])
    assert result.exit_code == 0 and "imported 4" in result.output
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    runner.invoke(cli, ["export", str(db), "--out", str(a)])
    runner.invoke(cli, ["export", str(db2), "--format", "jsonl", "--out", str(b)])
    assert a.read_bytes() == b.read_bytes()
    info = json.loads(runner.invoke(cli, ["db", "info", str(db2)]).output)
    assert info["turns"] == 4 and info["sessions"] == 1 and info["first"] and info["last"]
    assert info["size_bytes"] > 0 and info["unique_messages"] > 0 and info["message_refs"] >= info["unique_messages"]


def test_export_one_session(tmp_path):
    runner = CliRunner()
    db = tmp_path / "a.db"
    runner.invoke(cli, ["import", str(FIXTURE), "--db", str(db)])
    session = json.loads(FIXTURE.read_text().splitlines()[0])["session"]
    out = tmp_path / "s.jsonl"
    assert runner.invoke(cli, ["export", str(db), "--session", session, "--out", str(out)]).exit_code == 0
    assert len(out.read_text().splitlines()) == 4
    # A session that is not there is an error naming what is, not an empty export (issue 26); the
    # earlier export is left as it was.
    missing = runner.invoke(cli, ["export", str(db), "--session", "nope", "--out", str(out)])
    assert missing.exit_code == 1 and "no session 'nope'" in missing.output and session in missing.output
    assert len(out.read_text().splitlines()) == 4


def test_corrupt_db_is_a_clean_error_and_nothing_is_overwritten(tmp_path):
    runner = CliRunner()
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"SQLite format 3\x00" + b"\x00\xff" * 2000)
    before = bad.read_bytes()
    out = tmp_path / "out.jsonl"
    out.write_text("previous export\n")
    for args in (["db", "info", str(bad)], ["export", str(bad), "--out", str(out)],
                 ["import", str(FIXTURE), "--db", str(bad)], ["replay", str(bad), "--target", "http://127.0.0.1:9"]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 1, args
        assert "bad.db" in result.output and "Traceback" not in result.output, args
    assert bad.read_bytes() == before
    assert out.read_text() == "previous export\n"  # the old file survives a failed export
