"""Recordings someone hands you: every read is bounded, writes nothing, runs nothing of the file's own.

Each file is made from outside, as a hostile sender would: a real database written by the recorder,
then altered with the sqlite3 module (a cycle in `prefixes`, `turn_log` replaced by a view over an
endless CTE, one big message chained 2,000 times, an older schema with triggers, a tokenizer that
inflates past its bound, a looping template, a recorded tokenizer path naming a FIFO). The readers
are called as the CLI calls them, and the CLI itself for the one-line error.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from analyzer import analyze
from analyzer.load import load
from analyzer.server_renderer import choose_renderer
from prefixtrace.common.errors import InvalidRequest, RecorderError
from recorder.reader import iter_turns
from recorder.rows import write_turns
from recorder.schema import open_db
from recorder.turn import Turn
from tests.conftest import ROOT


def _recording(path: Path, turns: int = 3) -> Path:
    db = open_db(path)
    write_turns(db, [Turn(f"r{i}", 1.7e9 + i, "/v1/chat/completions", "http://127.0.0.1:9",
                          {"model": "m", "messages": [{"role": "user", "content": f"hi {j}"} for j in range(i + 1)]},
                          session_id="s", status=200) for i in range(turns)])
    db.close()
    con = sqlite3.connect(path)
    con.execute("pragma wal_checkpoint(truncate)")
    con.execute("pragma journal_mode = delete")  # one file: what is handed over
    con.close()
    return path


def _altered(tmp_path: Path, *sql: str, params: tuple = ()) -> Path:
    path = _recording(tmp_path / "handed.db")
    con = sqlite3.connect(path)
    for statement in sql:
        con.execute(statement, params if "?" in statement else ())
    con.commit()
    con.close()
    return path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_cycle_in_the_prefix_chain_is_one_error(tmp_path):
    path = _altered(tmp_path, "update prefixes set parent = (select max(id) from prefixes) where parent = 0")
    start = time.monotonic()
    with pytest.raises(RecorderError, match="loops back on itself"):
        list(iter_turns(path))
    assert time.monotonic() - start < 5


def test_a_turn_log_view_over_an_endless_cte_is_never_queried(tmp_path):
    path = _altered(tmp_path, "drop view turns", "drop table turn_log",
                    "create view turn_log as with recursive r(x) as (select 1 union all select x + 1 from r)"
                    " select x as request_id, x as started_at, null as session_id from r")
    start = time.monotonic()
    with pytest.raises(RecorderError, match="'turn_log' is a view, not a table"):
        list(iter_turns(path))
    assert time.monotonic() - start < 5


def test_one_big_message_chained_thousands_of_times_is_refused_before_it_is_built(tmp_path):
    path = _recording(tmp_path / "handed.db")
    con = sqlite3.connect(path)
    mid = con.execute("insert into messages (hash, body) values (x'01', ?)", ['"' + "a" * 1_000_000 + '"']).lastrowid
    prefix = 0
    for _ in range(2000):
        prefix = con.execute("insert into prefixes (parent, message_id) values (?, ?)", [prefix, mid]).lastrowid
    con.execute("update turn_log set body_prefix = ? where request_id = 'r2'", [prefix])
    con.commit()
    con.close()
    with pytest.raises(RecorderError, match=r"would rebuild to 2,000,\d+,\d+ characters"):
        list(iter_turns(path))


def test_reading_an_older_schema_writes_nothing_and_fires_none_of_its_triggers(tmp_path):
    path = _altered(tmp_path, "update meta set value = '2' where key = 'schema_version'", "drop table renderers",
                    "alter table turn_log drop column renderer_id", "alter table turn_log drop column served_by",
                    "create table junk (x)",
                    "create trigger grow after update on meta begin insert into junk values (zeroblob(5000000)); end",
                    "create trigger grow2 after insert on turn_log begin insert into junk values (zeroblob(5000000));"
                    " end")
    before, size = _digest(path), path.stat().st_size
    turns = list(iter_turns(path))
    assert [t.request_id for t in turns] == ["r0", "r1", "r2"]
    assert turns[2].request_body["messages"][2]["content"] == "hi 2"
    assert _digest(path) == before and path.stat().st_size == size
    assert not any(p.name.startswith("prefixtrace-migrated-") for p in Path(os.environ.get("TMPDIR", "/tmp")).iterdir())


def test_a_virtual_or_generated_table_is_refused(tmp_path):
    path = _altered(tmp_path, "drop table messages",
                    "create table messages (id integer primary key, hash blob, body text,"
                    " slow text as (zeroblob(100000000)))")
    with pytest.raises(RecorderError, match="'messages' has generated or hidden columns"):
        list(iter_turns(path))


def _with_renderer(tmp_path: Path, template: str, tokenizer: bytes | None = None, path: str | None = None) -> Path:
    return _altered(tmp_path, "insert into renderers (id, source, model, chat_template, special, tokenizer,"
                    " tokenizer_path) values ('rid', 'upstream', 'm', ?, '{}', ?, ?)", "update turn_log set renderer_id = 'rid'",
                    params=(template, tokenizer, path))


PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"


def test_a_stored_tokenizer_that_inflates_past_its_bound_is_not_inflated(tmp_path):
    bomb = zlib.compress(b'{"x": "' + b"a" * (80 << 20) + b'"}', 9)  # ~80 KB inflating to 80 MB
    loaded = load(_with_renderer(tmp_path, PLAIN, bomb))
    choice = choose_renderer(loaded, None, None)
    assert choice.source == "recorded" and not choice.exact
    assert "the stored tokenizer inflates past 64 MiB" in choice.note


def test_a_recorded_tokenizer_path_is_never_opened(tmp_path):
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)  # opened for reading, this would wait for a writer for good
    loaded = load(_with_renderer(tmp_path, PLAIN, None, str(fifo)))
    start = time.monotonic()
    choice = choose_renderer(loaded, None, None)
    assert time.monotonic() - start < 5
    assert f"its tokenizer ({fifo}) was too big to store" in choice.note


def test_a_looping_recorded_template_costs_one_render_deadline(tmp_path, monkeypatch):
    import analyzer.template_worker as worker

    monkeypatch.setattr(worker, "RENDER_TIMEOUT_S", 1.0)
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    path = _with_renderer(tmp_path, loop + "<!-- " + str(time.time()) + " -->")  # a template no other test shares
    start = time.monotonic()
    report = analyze(path)
    assert time.monotonic() - start < 15
    reasons = {t.note for s in report.sessions for t in s.turns}
    assert any("did not render within 1 s; its renders are skipped" in r for r in reasons), reasons


def test_a_template_that_allocates_gigabytes_is_stopped_by_its_bound(tmp_path):
    path = _with_renderer(tmp_path, "{{ 'a' * 3000000000 }}")
    report = analyze(path)
    reasons = {t.note for s in report.sessions for t in s.turns}
    assert any("MiB" in r or "characters" in r for r in reasons), reasons


def test_template_and_tokenizer_files_must_be_regular_files(tmp_path):
    fifo = tmp_path / "t.jinja"
    os.mkfifo(fifo)
    zero = tmp_path / "z.jinja"
    zero.symlink_to("/dev/zero")
    from analyzer.render import TemplateRenderer
    from analyzer.tokens import load_tokenizer

    for bad in (fifo, zero):
        with pytest.raises(InvalidRequest, match="not a regular file"):
            TemplateRenderer.from_file(bad)
        with pytest.raises(InvalidRequest, match="not a regular file"):
            load_tokenizer(str(bad))


@pytest.mark.slow
def test_every_reading_command_ends_in_one_line_on_each_hostile_file(tmp_path):
    cases = {
        "cycle": ["update prefixes set parent = (select max(id) from prefixes) where parent = 0"],
        "view": ["drop view turns", "drop table turn_log", "create view turn_log as with recursive r(x) as"
                 " (select 1 union all select x + 1 from r) select x as request_id from r"],
        "deep": ["update messages set body = '" + "[" * 100000 + "]" * 100000 + "' where id = 1"],
    }
    for name, sql in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        path = _altered(folder, *sql)
        before = _digest(path)
        for command in (["analyze"], ["check"], ["export"], ["db", "info"]):
            done = _cli(*command, str(path), timeout=30)
            assert "Traceback" not in done.stderr, (name, command, done.stderr)
            if command != ["db", "info"]:  # its counts walk the chains downward from their roots: a cycle is not reached
                assert done.returncode == 1, (name, command, done.stdout[-500:], done.stderr[-2000:])
                assert len(done.stderr.strip().splitlines()) == 1, (name, command, done.stderr)
        assert _digest(path) == before, name
    deep = tmp_path / "deep.har"
    deep.write_text('{"log": {"entries": ' + "[" * 50000 + "]" * 50000 + "}}")
    done = _cli("analyze", str(deep))
    assert done.returncode == 1 and "nested too deeply" in done.stderr and "Traceback" not in done.stderr


def test_a_fifo_or_a_device_given_to_analyze_is_refused_at_once(tmp_path):
    fifo = tmp_path / "traffic.jsonl"
    os.mkfifo(fifo)  # opened for reading, this would wait for a writer for good
    zero = tmp_path / "traffic.db"
    zero.symlink_to("/dev/zero")
    for bad in (fifo, zero):
        with pytest.raises(InvalidRequest, match="not a file"):
            load(bad)
        with pytest.raises(RecorderError, match="not a regular file"):
            list(iter_turns(bad))
