"""Content-addressed storage: byte-exact bodies, one copy per message, the v1 -> v2 migration, bad files."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest
import sqlite_utils

from prefixtrace.common.errors import RecorderError
from recorder import SCHEMA_VERSION, Recorder, Turn, db_info, export_jsonl, import_jsonl, iter_turns, read_jsonl
from recorder.bodies import scan_object, split_body
from recorder.schema import MIGRATIONS

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "sessions").glob("*.jsonl"))

ODD_BODY = (
    '{ "messages" :[ {"content":"caf\\u00e9 \\"q\\"","role":"user"} ,\n  {"role": "assistant", "content": 1.50}'
    ' ,\n  {"role":"user","content":[{"type":"text","text":"x"}]} ] , "model":"m","temperature":0.0E0 }'
)


def turn(i: int, body: dict, raw: str | None = None, session: str = "s") -> Turn:
    t = Turn(request_id=f"r{i}", started_at=1700000000.0 + i, endpoint="/v1/chat/completions", upstream="u",
             request_body=body, session_id=session, status=200)
    t.request_raw = raw
    return t


def test_split_body_rebuilds_the_text_exactly():
    split = split_body(ODD_BODY)
    assert split.join() == ODD_BODY
    assert split.messages[0] == '{"content":"caf\\u00e9 \\"q\\"","role":"user"}'
    assert split.sep == " ,\n  "
    assert scan_object(ODD_BODY)[0] == json.loads(ODD_BODY)
    assert split_body('{"messages": []}') is None
    assert split_body('{"messages": [1, 2],[3]}') is None
    assert split_body("[1]") is None


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.name)
def test_every_fixture_body_comes_back_byte_for_byte(fixture, tmp_path):
    db = tmp_path / "t.db"
    import_jsonl(fixture, db)
    stored = {t.request_id: t for t in iter_turns(db)}
    for line in fixture.read_text().splitlines():
        obj, spans = scan_object(line)
        start, end = spans["request"]
        assert stored[obj["id"]].request_raw == line[start:end]
        assert stored[obj["id"]].request_body == obj["request"]
    # Export writes the same bytes for each body, and is a fixed point.
    out, db2, out2 = tmp_path / "out.jsonl", tmp_path / "t2.db", tmp_path / "out2.jsonl"
    export_jsonl(db, out)
    exported = {}
    for line in out.read_text().splitlines():
        obj, spans = scan_object(line)
        exported[obj["id"]] = line[slice(*spans["request"])]
    assert exported == {t.request_id: t.request_raw for t in stored.values()}
    import_jsonl(out, db2)
    export_jsonl(db2, out2)
    assert out2.read_bytes() == out.read_bytes()
    if all(len(json.loads(line)) == 13 for line in fixture.read_text().splitlines()):  # every key present
        assert out.read_bytes() == fixture.read_bytes()


def test_odd_spelling_survives_record_and_export(tmp_path):
    db = tmp_path / "t.db"
    with Recorder(db) as rec:
        rec.record(turn(0, json.loads(ODD_BODY), ODD_BODY))
        pretty = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, indent=2)
        rec.record(turn(1, json.loads(pretty), pretty))
    first, second = iter_turns(db)
    assert first.request_raw == ODD_BODY and second.request_raw == pretty
    # pretty-printed text cannot sit in a JSONL line: it rides in request_raw
    out, db2, out2 = tmp_path / "a.jsonl", tmp_path / "b.db", tmp_path / "b.jsonl"
    export_jsonl(db, out)
    assert len(out.read_text().splitlines()) == 2
    import_jsonl(out, db2)
    export_jsonl(db2, out2)
    assert out.read_bytes() == out2.read_bytes()
    assert [t.request_raw for t in iter_turns(db2)] == [ODD_BODY, pretty]


def test_raw_text_that_disagrees_with_the_body_is_not_trusted(tmp_path):
    db = tmp_path / "t.db"
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}]}
    with Recorder(db) as rec:
        rec.record(turn(0, body, '{"model": "other", "messages": []}'))
    (stored,) = iter_turns(db)
    assert stored.request_body == body


def test_each_message_is_stored_once(tmp_path):
    db = tmp_path / "t.db"
    tools = [{"type": "function", "function": {"name": f"tool{i}", "description": "x" * 500}} for i in range(10)]
    messages = [{"role": "system", "content": "S" * 2000}]
    with Recorder(db) as rec:
        for i in range(30):
            messages = messages + [{"role": "user", "content": f"question {i} " * 50},
                                   {"role": "assistant", "content": f"answer {i} " * 50}]
            rec.record(turn(i, {"model": "m", "messages": messages, "tools": tools, "stream": True}))
    info = db_info(db)
    assert info["unique_messages"] == 61
    assert info["message_refs"] == sum(1 + 2 * (i + 1) for i in range(30))
    con = sqlite3.connect(db)
    assert con.execute("select count(*) from body_parts").fetchone()[0] == 2  # one head, one tail
    assert con.execute("select count(*) from prefixes").fetchone()[0] == 61
    stored = list(iter_turns(db))
    assert stored[-1].request_body["messages"] == messages
    # the `turns` view rebuilds the same text in SQL
    view = dict(con.execute("select request_id, request_body from turns"))
    assert all(view[t.request_id] == t.request_raw for t in stored)


def test_a_version_1_database_is_migrated_in_place(tmp_path):
    path = tmp_path / "v1.db"
    db = sqlite_utils.Database(path)
    db["meta"].create({"key": str, "value": str}, pk="key")
    MIGRATIONS[0](db)
    db["meta"].insert({"key": "schema_version", "value": "1"})
    bodies = [{"model": "m", "messages": [{"role": "user", "content": "hi"}]},
              {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    for i, body in enumerate(bodies):
        db["turns"].insert({"request_id": f"r{i}", "started_at": float(i), "endpoint": "/v1/chat/completions",
                            "upstream": "u", "session_id": "s", "status": 200, "request_body": json.dumps(body),
                            "request_headers": "{}", "chunk_times": "[0.1]", "cached_tokens": 3})
    db["turns"].insert({"request_id": "r2", "started_at": 2.0, "endpoint": "/v1/chat/completions", "upstream": "u",
                        "request_body": json.dumps("not json {"), "request_headers": "{}", "chunk_times": "[]"})
    db.close()

    turns = list(iter_turns(path))
    assert [t.request_body for t in turns] == [*bodies, "not json {"]
    assert turns[0].cached_tokens == 3 and turns[0].chunk_times == [0.1]
    info = db_info(path)
    assert info["schema_version"] == SCHEMA_VERSION == 3
    assert info["unique_messages"] == 2
    con = sqlite3.connect(path)
    assert [json.loads(r[0]) for r in con.execute("select request_body from turns order by started_at")] == [
        *bodies, "not json {"]


def test_record_resolves_once_the_turn_is_committed(tmp_path):
    db = tmp_path / "t.db"
    with Recorder(db) as rec:
        rec.record(turn(0, {"messages": []})).result(10)
        assert sqlite3.connect(db).execute("select count(*) from turn_log").fetchone() == (1,)
        asyncio.run(rec.record_async(turn(1, {"messages": []})))
        assert sqlite3.connect(db).execute("select count(*) from turn_log").fetchone() == (2,)
        bad = rec.record(turn(2, {"bad": object()}))
        assert isinstance(bad.exception(10), RecorderError)
        with pytest.raises(RecorderError):
            rec.flush()


@pytest.mark.parametrize("content", [b"this is not a database" * 100, b"SQLite format 3\x00" + b"\xff" * 4000])
def test_a_corrupt_file_is_a_clear_error_and_left_untouched(tmp_path, content):
    path = tmp_path / "bad.db"
    path.write_bytes(content)
    with pytest.raises(RecorderError, match="bad.db"):
        Recorder(path)
    with pytest.raises(RecorderError):
        db_info(path)
    good = tmp_path / "in.jsonl"
    good.write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(RecorderError):
        import_jsonl(good, path)
    assert path.read_bytes() == content
    assert not Path(f"{path}-wal").exists()


def test_a_foreign_sqlite_database_is_refused_untouched(tmp_path):
    path = tmp_path / "other.db"
    con = sqlite3.connect(path)
    con.execute("create table notes (x)")
    con.commit()
    con.close()
    before = path.read_bytes()
    with pytest.raises(RecorderError, match="not a prefixtrace recorder database"):
        Recorder(path)
    assert path.read_bytes() == before


def test_read_jsonl_keeps_the_raw_request_text(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"model":"m","messages":[{"role":"user","content":"x"}]}\n'
                   '{"id": "w", "request": {"messages" :[{"content":"y","role":"user"}]}}\n')
    bare, wrapped = read_jsonl(src)
    assert bare.request_raw == '{"model":"m","messages":[{"role":"user","content":"x"}]}'
    assert wrapped.request_raw == '{"messages" :[{"content":"y","role":"user"}]}'
