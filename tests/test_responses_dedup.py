"""Responses (`/v1/responses`) bodies stored like chat messages: each distinct `input` item once, every
body read back exactly as it was sent (recorded Codex traffic, an imported Codex rollout)."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

from recorder import import_jsonl, iter_turns
from recorder.bodies import split_body
from recorder.jsonl import read_jsonl
from recorder.sources import import_path
from recorder.transcripts import transcript_turns

ROOT = Path(__file__).resolve().parents[1]
RECORDED = [ROOT / "fixtures" / "traffic" / "codex_responses_smol.jsonl",
            ROOT / "fixtures" / "transcripts" / "codex" / "recording.jsonl"]
ROLLOUT = next((ROOT / "fixtures" / "transcripts" / "codex").glob("rollout-*.jsonl"))


def _stored_items(db: Path) -> tuple[int, int]:
    """(distinct item rows, item references over all turns' bodies)."""
    con = sqlite3.connect(db)
    try:
        distinct = con.execute("SELECT count(*) FROM messages").fetchone()[0]
        refs = con.execute(
            "WITH RECURSIVE walk(id) AS (SELECT body_prefix FROM turn_log WHERE body_prefix IS NOT NULL"
            " UNION ALL SELECT p.parent FROM walk JOIN prefixes p ON p.id = walk.id WHERE p.parent != 0)"
            " SELECT count(*) FROM walk").fetchone()[0]
    finally:
        con.close()
    return distinct, refs


def test_split_body_splits_responses_input_byte_for_byte():
    for path in RECORDED:
        for line in path.read_text().splitlines():
            raw = json.dumps(json.loads(line)["request"], ensure_ascii=False)
            split = split_body(raw)
            assert split is not None and split.join() == raw
            assert len(split.messages) == len(json.loads(raw)["input"])
    assert split_body('{"input": "a plain prompt"}') is None


def test_recorded_codex_traffic_reads_back_exactly_and_stores_each_item_once(tmp_path):
    sent = [t for path in RECORDED for t in read_jsonl(path)]
    db = tmp_path / "codex.db"
    for path in RECORDED:
        import_jsonl(path, db)
    back = {t.request_id: t for t in iter_turns(db)}
    assert len(back) == len(sent)
    for t in sent:
        assert back[t.request_id].request_raw == t.request_raw  # the text the client sent, byte for byte
        assert back[t.request_id].request_body == t.request_body
    distinct, refs = _stored_items(db)
    items = sum(len(t.request_body["input"]) for t in sent)
    assert refs == items and distinct < items  # every turn's items referenced, the repeated ones stored once


def test_imported_rollout_reads_back_exactly_and_grows_with_the_rollout(tmp_path):
    turns, _ = transcript_turns(ROLLOUT)
    db = tmp_path / "rollout.db"
    import_path(ROLLOUT, db)
    back = {t.request_id: t for t in iter_turns(db)}
    assert [back[t.request_id].request_body for t in turns] == [t.request_body for t in turns]
    distinct, refs = _stored_items(db)
    assert refs == sum(len(t.request_body["input"]) for t in turns)
    assert distinct == len({json.dumps(i, ensure_ascii=False) for t in turns for i in t.request_body["input"]})
    # Exported (what analyze, replay and a later import read): the same bodies again.
    from recorder import export_jsonl

    export_jsonl(db, tmp_path / "rollout.jsonl")
    exported = {t.request_id: t.request_body for t in read_jsonl(tmp_path / "rollout.jsonl")}
    assert [exported[t.request_id] for t in turns] == [t.request_body for t in turns]


def test_a_long_rollout_database_stays_near_the_rollouts_size(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_rollout_import import measure  # the bench's rollout: 286 calls made of the fixture's lines

    result = measure(286, 1.0, tmp_path)
    assert result["calls"] == 286
    assert result["db_to_rollout"] <= 4  # stored whole, each call's history again: 64x


def test_import_redacts_a_secret_inside_a_shared_item(tmp_path):
    turns, _ = transcript_turns(ROLLOUT)
    secret = "sk-proj-" + "A1b2C3d4E5f6G7h8" * 3
    first_input = turns[0].request_body["input"]
    first_input[-1] = {**first_input[-1], "content": [{"type": "input_text", "text": f"key {secret}"}]}
    for t in turns[1:]:  # the later calls share the item object, as the reader builds them
        t.request_body["input"][len(first_input) - 1] = first_input[-1]
    from recorder.jsonl import store_turns

    db = tmp_path / "secret.db"
    store_turns(db, turns)
    assert secret.encode() not in db.read_bytes()
    assert all(secret not in json.dumps(t.request_body) for t in iter_turns(db))


def test_live_responses_traffic_through_the_proxy_stores_each_item_once(engine_server):
    """Codex's loop through the proxy (the embedded tiny engine): every call re-sends the whole `input`;
    the recording keeps each item once and reads every body back as it was sent."""
    import httpx

    url, recorder = engine_server
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You run commands."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}]
    sent = []
    for i in range(4):
        body = {"model": "default", "instructions": "Answer briefly.", "input": list(items), "store": False,
                "max_output_tokens": 4, "temperature": 0, "prompt_cache_key": "live-dedup"}
        r = httpx.post(url + "/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        sent.append(body)
        items += [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"ok {i}"}]},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"Next {i}."}]}]
    recorder.flush()
    back = sorted(iter_turns(recorder.path), key=lambda t: t.started_at)
    assert [t.request_body for t in back] == sent
    distinct, refs = _stored_items(recorder.path)
    assert refs == sum(len(b["input"]) for b in sent) == 2 + 4 + 6 + 8
    assert distinct == 8  # every item once
