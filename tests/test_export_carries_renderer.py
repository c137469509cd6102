"""`export` carries the renderer the server recorded (a JSONL `renderer` line, HAR's
`log._prefixtrace_renderers`; each turn names it by `renderer_id`), so `export -> check` and
`export -> import -> analyze` count with the server's chat template and tokenizer, as `analyze DB`
does, not with the generic fallback."""

from __future__ import annotations

import json
import sqlite3

import pytest
from click.testing import CliRunner

from analyzer import analyze
from conftest import TINY_MODEL
from prefixtrace.cli import cli
from recorder.renderers import from_model_dir
from recorder.store import Recorder
from recorder.turn import Turn

SYSTEM = "You are a careful coding assistant. Time: 10:00:0{n}."


@pytest.fixture
def db(tmp_path):
    """Four turns of one session recorded as the proxy records them: each naming the served model's renderer."""
    config = json.loads((TINY_MODEL / "tokenizer_config.json").read_text())
    info = from_model_dir("tiny-llama", TINY_MODEL, config["chat_template"],
                          {k: config[k] for k in ("bos_token", "eos_token", "pad_token") if config.get(k)})
    path = tmp_path / "traffic.db"
    messages = [{"role": "user", "content": "What does calc.py do? " + "It adds numbers. " * 30}]
    with Recorder(path) as rec:
        for n in range(4):
            body = {"model": "tiny-llama", "messages": [{"role": "system", "content": SYSTEM.format(n=n)}, *messages]}
            rec.record(Turn(f"r{n}", 1000.0 + n, "/v1/chat/completions", "embedded:tiny-llama", body,
                            session_id="s1", status=200, ttft_s=0.5, renderer_id=info.id, renderer=info))
            messages = messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"and {n}?"}]
        rec.flush()
    return path


def _numbers(report) -> list:
    return [(t.prompt_tokens, t.lost_tokens, t.brk.cause if t.brk else None) for s in report.sessions for t in s.turns]


@pytest.mark.parametrize("fmt", ["jsonl", "har"])
def test_export_then_check_and_import_count_as_the_database(db, tmp_path, fmt):
    want = analyze(db)
    assert want.renderer == "recorded:tiny-llama"
    out = tmp_path / f"traffic.{fmt}"
    assert CliRunner().invoke(cli, ["export", str(db), "--format", fmt, "--out", str(out)]).exit_code == 0
    got = analyze(out)
    assert (got.renderer, got.tokenizer, got.renderer_source) == (want.renderer, want.tokenizer, "recorded")
    assert _numbers(got) == _numbers(want)
    checked = CliRunner().invoke(cli, ["check", str(out)])
    first = next(t for t in want.sessions[0].turns if t.brk)
    assert checked.exit_code == 1 and f"{first.lost_tokens:,} tokens" in checked.output and "note:" not in checked.output
    copy = tmp_path / "copy.db"
    assert CliRunner().invoke(cli, ["import", str(out), "--db", str(copy)]).exit_code == 0
    assert _numbers(analyze(copy)) == _numbers(want) and analyze(copy).renderer == want.renderer
    with sqlite3.connect(copy) as con:
        assert con.execute("SELECT model, tokenizer IS NOT NULL FROM renderers").fetchall() == [("tiny-llama", 1)]


def test_the_generic_fallback_counts_otherwise(db, tmp_path):
    """What the renderer line prevents: the same file without it falls back to other numbers."""
    out = tmp_path / "traffic.jsonl"
    CliRunner().invoke(cli, ["export", str(db), "--out", str(out)])
    lines = out.read_text().splitlines()
    assert json.loads(lines[0]).keys() == {"renderer"} and all('"renderer_id"' in line for line in lines[1:])
    bare = tmp_path / "bare.jsonl"
    bare.write_text("\n".join(lines[1:]) + "\n")
    fallback = analyze(bare)
    assert fallback.renderer_source == "fallback" and _numbers(fallback) != _numbers(analyze(db))


def test_a_renderer_line_names_no_file_to_open(tmp_path):
    """An exported renderer's tokenizer path is not taken from the file (it would name what the reader opens)."""
    from recorder.renderers import from_record

    info = from_record({"id": "x", "model": "m", "chat_template": "{{ messages }}", "tokenizer_json": None,
                        "tokenizer_path": "/etc/passwd", "tokenizer_sha256": "0" * 64})
    assert info.tokenizer_path is None and info.id == "x"
