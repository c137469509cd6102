import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prefixtrace.common.errors import RecorderError
from recorder import SCHEMA_VERSION, Recorder, Turn, db_info, iter_turns

REPO = Path(__file__).resolve().parents[1]


def make_turn(i: int, session: str | None = "s1", **kw) -> Turn:
    body = kw.pop("request_body", {"model": "m", "messages": [{"role": "user", "content": f"hello {i}"}]})
    return Turn(
        request_id=f"req-{i}",
        started_at=1700000000.0 + i,
        endpoint="/v1/chat/completions",
        upstream="http://127.0.0.1:9",
        request_body=body,
        session_id=session,
        status=200,
        response_text=f"reply {i}",
        **kw,
    )


class BlockingTracer:
    """Stalls the writer thread inside its first INSERT until released:
    a deterministic 'slow disk' that needs no timing assumptions."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, sql, params):
        if sql.lstrip().upper().startswith("INSERT") and "turn_log" in sql:
            self.entered.set()
            self.release.wait(10)


def test_recorder_writes_and_reads_back(tmp_path):
    db = tmp_path / "t.db"
    turns = [make_turn(i, tool_calls=[{"id": "c1", "type": "function"}], chunk_times=[0.1, 0.2]) for i in range(3)]
    with Recorder(db) as rec:
        for t in reversed(turns):  # stored order comes from started_at, not insertion
            rec.record(t)
    assert list(iter_turns(db)) == turns


def test_schema_version_index_and_wal(tmp_path):
    db = tmp_path / "t.db"
    with Recorder(db):
        pass
    conn = sqlite3.connect(db)
    assert conn.execute("select value from meta where key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)
    indexes = {r[1] for r in conn.execute("pragma index_list(turn_log)")}
    assert "idx_turn_log_session_started" in indexes
    assert conn.execute("pragma journal_mode").fetchone() == ("wal",)


def test_newer_schema_is_refused(tmp_path):
    db = tmp_path / "t.db"
    with Recorder(db):
        pass
    conn = sqlite3.connect(db)
    conn.execute("update meta set value='999' where key='schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(RecorderError, match="newer"):
        Recorder(db)


def test_unknown_cached_tokens_stay_null(tmp_path):
    db = tmp_path / "t.db"
    with Recorder(db) as rec:
        rec.record(make_turn(0, cached_tokens=None, prompt_tokens=10))
        rec.record(make_turn(1, cached_tokens=0, prompt_tokens=10))
    rows = sqlite3.connect(db).execute("select request_id, cached_tokens from turns order by request_id").fetchall()
    assert rows == [("req-0", None), ("req-1", 0)]
    assert [t.cached_tokens for t in iter_turns(db)] == [None, 0]


def test_record_does_not_wait_for_a_stalled_writer(tmp_path):
    tracer = BlockingTracer()
    rec = Recorder(tmp_path / "t.db", tracer=tracer)
    try:
        rec.record(make_turn(0))
        assert tracer.entered.wait(10)  # the writer is now stuck mid-write
        rec.record(make_turn(1))  # ...and record still returns
        assert rec.pending == 2
        assert rec.flush(timeout=0.05) is False
    finally:
        tracer.release.set()
        rec.close()
    assert len(list(iter_turns(tmp_path / "t.db"))) == 2


def test_record_returns_fast_relative_to_writing_a_huge_turn(tmp_path):
    huge = {"model": "m", "messages": [{"role": "user", "content": "x" * 8_000_000}]}
    with Recorder(tmp_path / "t.db") as rec:
        t0 = time.perf_counter()
        rec.record(make_turn(0, request_body=huge))
        t_record = time.perf_counter() - t0
        rec.flush()
        t_total = time.perf_counter() - t0
    assert t_record * 20 < t_total


def test_full_queue_applies_back_pressure(tmp_path):
    tracer = BlockingTracer()
    rec = Recorder(tmp_path / "t.db", max_queue=2, tracer=tracer)
    try:
        rec.record(make_turn(0))
        assert tracer.entered.wait(10)  # turn 0 dequeued, writer stalled
        rec.record(make_turn(1))
        rec.record(make_turn(2))  # queue now full
        returned = threading.Event()

        def producer():
            rec.record(make_turn(3))
            returned.set()

        th = threading.Thread(target=producer)
        th.start()
        assert not returned.wait(0.3)  # blocked, not dropped
        tracer.release.set()
        assert returned.wait(10)
        th.join()
        assert rec.flush(timeout=10)
    finally:
        tracer.release.set()
        rec.close()
    assert [t.request_id for t in iter_turns(tmp_path / "t.db")] == [f"req-{i}" for i in range(4)]


def test_record_after_close_raises(tmp_path):
    rec = Recorder(tmp_path / "t.db")
    rec.close()
    rec.close()  # idempotent
    with pytest.raises(RecorderError):
        rec.record(make_turn(0))


def test_bad_path_fails_at_construction(tmp_path):
    with pytest.raises(RecorderError):
        Recorder(tmp_path / "no-such-dir" / "t.db")


def test_failed_write_is_reported_by_flush(tmp_path):
    with Recorder(tmp_path / "t.db") as rec:
        rec.record(make_turn(0, request_body={"bad": object()}))  # not JSON-serialisable
        rec.record(make_turn(1))
        with pytest.raises(RecorderError, match="could not be written"):
            rec.flush()
    assert [t.request_id for t in iter_turns(tmp_path / "t.db")] == ["req-1"]


def test_finished_turns_survive_kill_9(tmp_path):
    db = tmp_path / "t.db"
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r})
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_recorder import make_turn
from recorder import Recorder
rec = Recorder({str(db)!r})
for i in range(5):
    rec.record(make_turn(i))
rec.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert proc.returncode == -9
    assert len(list(iter_turns(db))) == 5


def test_iter_turns_filters_by_session(tmp_path):
    db = tmp_path / "t.db"
    with Recorder(db) as rec:
        rec.record(make_turn(0, session="a"))
        rec.record(make_turn(1, session="b"))
        rec.record(make_turn(2, session="a"))
        rec.record(make_turn(3, session=None))
    assert [t.request_id for t in iter_turns(db, session="a")] == ["req-0", "req-2"]


def test_db_info(tmp_path):
    db = tmp_path / "t.db"
    with Recorder(db) as rec:
        rec.record(make_turn(0, session="a"))
        rec.record(make_turn(1, session="b"))
        rec.record(make_turn(2, session=None))
    info = db_info(db)
    assert info["turns"] == 3
    assert info["sessions"] == 2
    assert info["unlabelled_turns"] == 1
    assert info["schema_version"] == SCHEMA_VERSION
    assert info["size_bytes"] >= os.path.getsize(db) > 0
    assert (info["first_ts"], info["last_ts"]) == (1700000000.0, 1700000002.0)
    assert info["first"].startswith("2023-11-14")


def test_reading_a_missing_db_raises(tmp_path):
    with pytest.raises(RecorderError):
        iter_turns(tmp_path / "missing.db")
    with pytest.raises(RecorderError):
        db_info(tmp_path / "missing.db")


def test_a_new_database_and_its_wal_files_are_owner_only_whatever_the_umask(tmp_path):
    """The database holds every prompt (docs/SECURITY.md): 0600 for a new one, not the umask's 0644."""
    old = os.umask(0o022)
    try:
        path = tmp_path / "traffic.db"
        with Recorder(path) as rec:
            rec.record(make_turn(1))
            assert rec.flush(10)
            modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
        assert {"traffic.db", "traffic.db-wal", "traffic.db-shm"} <= set(modes)  # WAL mode, files still open
        assert set(modes.values()) == {0o600}, modes
        assert [t.request_id for t in iter_turns(path)] == ["req-1"]
    finally:
        os.umask(old)


def test_an_existing_database_keeps_the_mode_its_owner_gave_it(tmp_path):
    path = tmp_path / "shared.db"
    with Recorder(path) as rec:
        rec.record(make_turn(1))
        assert rec.flush(10)
    os.chmod(path, 0o640)  # e.g. shared with a group on purpose
    with Recorder(path) as rec:
        rec.record(make_turn(2))
        assert rec.flush(10)
    assert path.stat().st_mode & 0o777 == 0o640
    assert len(list(iter_turns(path))) == 2
