import io
import json
from pathlib import Path

import pytest

from prefixtrace.common.errors import InvalidRequest
from recorder import Recorder, Turn, db_info, export_jsonl, import_jsonl, iter_turns, read_jsonl

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sessions"


def rich_turn(i: int) -> Turn:
    return Turn(
        request_id=f"req-{i}",
        started_at=1700000000.25 + i,
        endpoint="/v1/chat/completions",
        upstream="embedded:tiny",
        request_body={"model": "m", "messages": [{"role": "user", "content": f"héllo {i}"}], "stream": True},
        request_headers={"Content-Type": "application/json", "Authorization": "Bearer x"},
        session_id="s" if i % 2 else None,
        client_addr="127.0.0.1",
        stream=True,
        status=200,
        response_text="ok",
        reasoning_text="thinking",
        tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        finish_reason="tool_calls",
        prompt_tokens=12,
        completion_tokens=3,
        cached_tokens=None if i == 0 else 8,
        usage={"prompt_tokens": 12, "completion_tokens": 3},
        ttft_s=0.01,
        total_s=0.5,
        chunk_times=[0.01, 0.2],
        render={"prompt_token_ids": [1, 2, 3]},
    )


def test_round_trip_is_identical(tmp_path):
    db1, db2 = tmp_path / "a.db", tmp_path / "b.db"
    with Recorder(db1) as rec:
        for i in range(3):
            rec.record(rich_turn(i))
    out1, out2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert export_jsonl(db1, out1) == 3
    assert import_jsonl(out1, db2) == 3
    export_jsonl(db2, out2)
    assert out1.read_bytes() == out2.read_bytes()
    assert list(iter_turns(db1)) == list(iter_turns(db2))
    first = json.loads(out1.read_text().splitlines()[0])
    assert set(first) >= {"session", "ts", "request", "response", "usage"}
    assert first["tokens"]["cached"] is None


def test_export_to_file_object_and_session_filter(tmp_path):
    db = tmp_path / "a.db"
    with Recorder(db) as rec:
        for i in range(4):
            rec.record(rich_turn(i))
    buf = io.StringIO()
    assert export_jsonl(db, buf, session="s") == 2
    assert [json.loads(line)["id"] for line in buf.getvalue().splitlines()] == ["req-1", "req-3"]


def test_import_bare_request_bodies(tmp_path):
    src = tmp_path / "bodies.jsonl"
    bodies = [{"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    src.write_text("\n".join(json.dumps(b) for b in bodies) + "\n\n")
    db = tmp_path / "t.db"
    assert import_jsonl(src, db, base_ts=1000.0) == 3
    turns = list(iter_turns(db))
    assert [t.request_body for t in turns] == bodies  # file order kept
    assert all(t.session_id is None and t.cached_tokens is None for t in turns)
    # idempotent: same ids on re-import
    import_jsonl(src, db, base_ts=1000.0)
    assert db_info(db)["turns"] == 3


def test_a_leading_byte_order_mark_is_not_part_of_line_one(tmp_path):
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode() + b"\n")
    assert import_jsonl(src, tmp_path / "t.db", base_ts=1000.0) == 1


def test_wrapped_line_without_tokens_derives_counts_from_usage(tmp_path):
    src = tmp_path / "w.jsonl"
    line = {
        "session": "s",
        "ts": 5.0,
        "request": {"messages": []},
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 6}},
    }
    nocache = dict(line, ts=6.0, usage={"prompt_tokens": 11, "completion_tokens": 2})
    src.write_text(json.dumps(line) + "\n" + json.dumps(nocache) + "\n")
    a, b = read_jsonl(src)
    assert (a.prompt_tokens, a.completion_tokens, a.cached_tokens) == (10, 2, 6)
    assert b.cached_tokens is None  # unknown, not 0


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"model": "m"}', "messages"),
        ('{"request": {"messages": []}, "ts": "yesterday"}', "'ts'"),
        ('{"request": {"messages": []}, "tokens": {"cached": 1.5}}', "'cached'"),
    ],
)
def test_bad_line_names_line_number_and_imports_nothing(tmp_path, bad, message):
    src = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    src.write_text(f"{good}\n{good}\n{bad}\n{good}\n")
    db = tmp_path / "t.db"
    with pytest.raises(InvalidRequest, match=message) as info:
        import_jsonl(src, db)
    assert ":3:" in info.value.message
    assert info.value.details["line"] == 3
    assert not db.exists() or db_info(db)["turns"] == 0


def test_fixture_sessions_parse():
    for name in ("append_only.jsonl", "todo_stale.jsonl"):
        turns = read_jsonl(FIXTURES / name)
        assert len(turns) == 4 and len({t.session_id for t in turns}) == 1
