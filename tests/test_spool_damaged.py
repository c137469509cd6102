"""A spool file (`<db>.spool`) that is no spool this recorder wrote: moved aside with one warning, the
recorder goes on and writes the valid rows; a special file there is refused, never read.

The spool is planted from outside before a real Recorder starts on the database (what `serve` does
at start): damaged lines (`[1]`, deep nesting, non-UTF-8 bytes) among valid rows, a FIFO, a symlink
to /dev/zero.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time

from recorder import Recorder
from recorder import numbers
from recorder.rows import redacted_row
from recorder.spool import spool_path
from tests.test_recorder import make_turn


def _line(i: int) -> bytes:
    return (numbers.dumps(redacted_row(make_turn(i)), ensure_ascii=False) + "\n").encode("utf-8")


def _stored_ids(db) -> list[str]:
    con = sqlite3.connect(db)
    try:
        return [r[0] for r in con.execute("select request_id from turn_log order by request_id")]
    finally:
        con.close()


def test_a_damaged_spool_is_moved_aside_and_its_valid_rows_written(tmp_path, caplog):
    db = tmp_path / "a.db"
    Recorder(db).close()
    spool = spool_path(db)
    spool.write_bytes(_line(1) + b"[1]\n" + b"[" * 100000 + b"]" * 100000 + b"\n" + b"\xff\xfe not text\n"
                      + b'{"request_id": 5}\n' + _line(2))
    with caplog.at_level(logging.WARNING, logger="prefixtrace.recorder"):
        with Recorder(db, retry_s=0.1) as rec:
            rec.record(make_turn(3))
            rec.flush(timeout=10)
    assert _stored_ids(db) == ["req-1", "req-2", "req-3"]
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("a.db.spool.damaged-")]
    assert len(moved) == 1 and moved[0].read_bytes().count(b"\n") == 6  # the file as it was, for a person to look at
    assert not spool.exists()  # written, then cleared
    warnings = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
    assert len(warnings) == 1 and "4 line(s) are not spooled turns (line 2: a JSON list, not a row)" in warnings[0]
    assert "its 2 valid turn(s) are kept" in warnings[0]
    assert not [r for r in caplog.records if r.exc_info], "no traceback"


def test_a_fifo_or_a_link_to_dev_zero_in_the_spools_place_is_refused(tmp_path, caplog):
    for name, plant in (("fifo", os.mkfifo), ("zero", lambda p: os.symlink("/dev/zero", p))):
        db = tmp_path / f"{name}.db"
        plant(spool_path(db))
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="prefixtrace.recorder"):
            with Recorder(db) as rec:
                rec.record(make_turn(1))
                rec.flush(timeout=10)
        assert time.monotonic() - start < 10
        assert _stored_ids(db) == ["req-1"]
        assert not spool_path(db).exists() and not spool_path(db).is_symlink()
        assert [p for p in tmp_path.iterdir() if p.name.startswith(f"{name}.db.spool.refused-")]
    assert os.path.exists("/dev/zero")
    messages = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
    assert len(messages) == 2, messages
