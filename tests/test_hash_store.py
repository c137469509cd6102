"""`serve --store hashes`: no text is recorded, only keyed hashes and token counts of each text, and every
analysis that needs no text (where prompts part, the cost, compaction, parameters, races) comes out as it
does from the full recording; what needs text says it cannot tell."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from analyzer.analysis import analyze
from analyzer.tokens import as_tokenizer
from recorder.hashing import Hasher, load_key
from recorder.jsonl import read_jsonl
from recorder.store import Recorder

TRAFFIC = Path("/work/shared/traffic")
TOKENIZER = as_tokenizer(None)


def _store(db: Path, turns, hasher=None) -> Path:
    with Recorder(db, hasher=hasher) as rec:
        for t in turns:
            rec.record(t)
        rec.flush()
    return db


def _breaks(report) -> list[tuple]:
    return [(s.id, t.number, t.brk.cause, t.brk.message_index, t.opened_by)
            for s in report.sessions for t in s.turns if t.brk is not None]


def _all_text(db: Path) -> str:
    """Everything the database holds, as text (every table, every column)."""
    con = sqlite3.connect(db)
    out = []
    for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
        for row in con.execute(f"SELECT * FROM {table}"):  # noqa: S608  (names from sqlite_master)
            out.extend(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in row)
    con.close()
    return "\n".join(out)


@pytest.mark.parametrize("name", ["claude_tiny", "qwen_tiny", "pi_tiny"])
def test_real_traffic_same_breaks_without_any_text(tmp_path, name):
    turns = read_jsonl(TRAFFIC / f"{name}.jsonl")
    full = _store(tmp_path / "full.db", turns)
    hashed_db = tmp_path / "hashed.db"
    hashed = _store(hashed_db, read_jsonl(TRAFFIC / f"{name}.jsonl"),
                    Hasher(load_key(hashed_db), lambda text: len(TOKENIZER(text))))
    a, b = analyze(full), analyze(hashed)
    assert _breaks(a) == _breaks(b) and (_breaks(a) or name == "pi_tiny")  # pi's session has no break
    lost_a = sum(t.lost_tokens or 0 for s in a.sessions for t in s.turns)
    lost_b = sum(t.lost_tokens or 0 for s in b.sessions for t in s.turns)
    assert abs(lost_a - lost_b) <= 0.1 * lost_a, (lost_a, lost_b)
    prompt_a = sum(t.prompt_tokens or 0 for s in a.sessions for t in s.turns)
    prompt_b = sum(t.prompt_tokens or 0 for s in b.sessions for t in s.turns)
    assert abs(prompt_a - prompt_b) <= 0.1 * prompt_a, (prompt_a, prompt_b)
    # No text of the conversation is in the database: not the question, not a tool's description.
    stored = _all_text(hashed)
    question = "Read README.md and then list the files"
    assert question in _all_text(full) and question not in stored
    assert "⟦h:" in stored
    # What it cannot tell, it says.
    assert any("--store hashes" in w for w in b.warnings())
    assert all(t.brk.before == "(hash-only recording: the text was not kept)" for s in b.sessions for t in s.turns
               if t.brk is not None and t.brk.cause not in ("param_change", "server_miss"))


def test_parameters_and_races_survive_hashing(tmp_path):
    records = [json.loads(line) for line in (TRAFFIC / "claude_tiny.jsonl").read_text().splitlines()]
    chain = [r for r in records if isinstance(r.get("session"), str) and '"session_id"' in r["session"]
             and len((r.get("request") or {}).get("messages", [])) >= 3][:3]
    for r in chain:
        r["upstream"] = "https://api.anthropic.com"
    chain[2]["request"]["tool_choice"] = {"type": "tool", "name": "Read"}
    chain[1]["timing"] = {**chain[1].get("timing", {}), "ttft_s": 1e6}  # its first token came very late
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in chain) + "\n")
    db = tmp_path / "h.db"
    _store(db, read_jsonl(path), Hasher(load_key(db)))
    brk = analyze(db).sessions[0].turns[2].brk
    assert (brk.cause, brk.subtype) == ("param_change", "tool_choice")
    chain[2]["request"].pop("tool_choice")
    # A race: the third request adds a user message to the second's, sent before the second's first token.
    chain[2]["request"]["messages"] = [*chain[1]["request"]["messages"],
                                       {"role": "user", "content": [{"type": "text", "text": "and the tests?"}]}]
    path.write_text("\n".join(json.dumps(r) for r in chain) + "\n")
    db2 = tmp_path / "h2.db"
    _store(db2, read_jsonl(path), Hasher(load_key(db2)))
    assert analyze(db2).sessions[0].turns[2].brk.cause == "concurrent"


def test_the_key_is_owner_only_and_stable(tmp_path):
    db = tmp_path / "x.db"
    key = load_key(db)
    assert load_key(db) == key and (Path(f"{db}.hashkey").stat().st_mode & 0o077) == 0
    one, other = Hasher(key), Hasher(load_key(tmp_path / "y.db"))
    assert one.text("yes") == Hasher(key).text("yes") != other.text("yes")


def test_serve_flag_reaches_the_recorder(tmp_path):
    from click.testing import CliRunner

    from prefixtrace.cli import cli
    from prefixtrace.serve import ServeConfig, _hasher

    shown = CliRunner().invoke(cli, ["serve", "--store", "hashes", "--upstream", "http://127.0.0.1:9/v1",
                                     "--db", str(tmp_path / "p.db"), "--print-config"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["options"]["store"] == {"value": "hashes", "source": "flag"}
    hasher = _hasher(ServeConfig(db=tmp_path / "p.db", store="hashes"))
    assert hasher.text("hello world") == hasher.text("hello world") and hasher.text("hello world").endswith(":2⟧")
    assert _hasher(ServeConfig(db=tmp_path / "p.db")) is None
