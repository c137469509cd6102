"""The recorder's SQLite schema, its migrations, and Turn <-> row conversion.

The schema is versioned: `meta.schema_version` says how many entries of
`MIGRATIONS` have been applied. To change the schema, append a function to
`MIGRATIONS`; never edit an existing one (databases in the field already ran
it). Opening a database written by a newer prefixtrace fails loudly instead of
guessing.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import sqlite_utils

from prefixtrace.errors import RecorderError
from recorder.redact import DEFAULT_REDACTOR, Redactor
from recorder.turn import Turn


def _m001_initial(db: sqlite_utils.Database) -> None:
    db["turns"].create(
        {
            "request_id": str,
            "started_at": float,
            "session_id": str,
            "endpoint": str,
            "upstream": str,
            "client_addr": str,
            "stream": int,
            "status": int,
            "error": str,
            "model": str,
            "request_body": str,  # JSON text, redacted
            "request_headers": str,  # JSON text, credential headers dropped
            "response_text": str,
            "reasoning_text": str,
            "tool_calls": str,  # JSON text or NULL
            "finish_reason": str,
            "prompt_tokens": int,
            "completion_tokens": int,
            "cached_tokens": int,  # NULL = unknown, never 0 for unknown
            "usage": str,  # JSON text or NULL
            "ttft_s": float,
            "total_s": float,
            "chunk_times": str,  # JSON list
            "render": str,  # JSON text or NULL
        },
        pk="request_id",
        not_null={"request_id", "started_at", "endpoint", "upstream"},
    )
    db["turns"].create_index(["session_id", "started_at"], index_name="idx_turns_session_started")
    db["turns"].create_index(["started_at"], index_name="idx_turns_started")


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_m001_initial]
SCHEMA_VERSION = len(MIGRATIONS)

JSON_COLUMNS = ("request_body", "request_headers", "tool_calls", "usage", "chunk_times", "render")


def schema_version(db: sqlite_utils.Database) -> int:
    if "meta" not in db.table_names():
        return 0
    row = db.execute("select value from meta where key = 'schema_version'").fetchone()
    return int(row[0]) if row else 0


def migrate(db: sqlite_utils.Database) -> int:
    """Brings `db` up to `SCHEMA_VERSION`; returns the version it ends at."""
    try:
        version = schema_version(db)
        if version > SCHEMA_VERSION:
            raise RecorderError(
                f"database schema version {version} is newer than this prefixtrace "
                f"supports ({SCHEMA_VERSION}); upgrade prefixtrace"
            )
        for step in range(version, SCHEMA_VERSION):
            # One transaction per step, so a crash mid-migration leaves the
            # previous version intact rather than a half-built schema.
            with db.atomic():
                if step == 0:
                    db["meta"].create({"key": str, "value": str}, pk="key", if_not_exists=True)
                MIGRATIONS[step](db)
                db["meta"].upsert({"key": "schema_version", "value": str(step + 1)}, pk="key")
        return SCHEMA_VERSION
    except sqlite3.DatabaseError as exc:
        raise RecorderError(f"cannot open recorder database: {exc}") from exc


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def turn_to_row(turn: Turn, redactor: Redactor = DEFAULT_REDACTOR) -> dict[str, Any]:
    """The `turns` row for `turn`, redacted. Everything stored passes through
    here, so this is the one place secrets are stopped."""
    body = redactor.value(turn.request_body)
    model = body.get("model") if isinstance(body, dict) else None
    return {
        "request_id": turn.request_id,
        "started_at": float(turn.started_at),
        "session_id": turn.session_id,
        "endpoint": turn.endpoint,
        "upstream": turn.upstream,
        "client_addr": turn.client_addr,
        "stream": int(bool(turn.stream)),
        "status": turn.status,
        "error": redactor.text(turn.error) if turn.error is not None else None,
        "model": model if isinstance(model, str) else None,
        "request_body": _dumps(body),
        "request_headers": _dumps(redactor.headers(turn.request_headers)),
        "response_text": redactor.text(turn.response_text or ""),
        "reasoning_text": redactor.text(turn.reasoning_text or ""),
        "tool_calls": None if turn.tool_calls is None else _dumps(redactor.value(turn.tool_calls)),
        "finish_reason": turn.finish_reason,
        "prompt_tokens": turn.prompt_tokens,
        "completion_tokens": turn.completion_tokens,
        "cached_tokens": turn.cached_tokens,
        "usage": None if turn.usage is None else _dumps(turn.usage),
        "ttft_s": turn.ttft_s,
        "total_s": turn.total_s,
        "chunk_times": _dumps(list(turn.chunk_times or [])),
        "render": None if turn.render is None else _dumps(turn.render),
    }


_TURN_FIELDS = {f.name for f in fields(Turn)}


def row_to_turn(row: dict[str, Any]) -> Turn:
    data = dict(row)
    for col in JSON_COLUMNS:
        if data.get(col) is not None:
            data[col] = json.loads(data[col])
    data["stream"] = bool(data.get("stream"))
    data["request_headers"] = data.get("request_headers") or {}
    data["chunk_times"] = data.get("chunk_times") or []
    data["response_text"] = data.get("response_text") or ""
    data["reasoning_text"] = data.get("reasoning_text") or ""
    # Columns without a Turn field (e.g. `model`, derived from the body) are
    # query conveniences only.
    return Turn(**{k: v for k, v in data.items() if k in _TURN_FIELDS})


def write_turns(db: sqlite_utils.Database, turns: list[Turn], redactor: Redactor = DEFAULT_REDACTOR) -> None:
    """Writes `turns` in one transaction (all or nothing). A request_id that is
    already stored is replaced, so re-importing a file is idempotent."""
    rows = [turn_to_row(t, redactor) for t in turns]
    try:
        with db.atomic():
            db["turns"].insert_all(rows, pk="request_id", replace=True)
    except sqlite3.DatabaseError as exc:
        raise RecorderError(f"writing turns failed: {exc}") from exc


def open_db(path: str | Path, *, tracer: Callable | None = None, create: bool = True) -> sqlite_utils.Database:
    """Opens (and migrates) a recorder database in WAL mode."""
    p = Path(path)
    if not create and not p.exists():
        raise RecorderError(f"no recorder database at {p}")
    try:
        db = sqlite_utils.Database(p, tracer=tracer)
        # WAL: readers (the analyzer) never block the writer. synchronous=NORMAL
        # in WAL mode still survives kill -9 of the process (committed frames
        # are in the OS page cache); only power loss can drop the last commits.
        db.enable_wal()
        db.execute("pragma synchronous = normal")
        db.execute("pragma busy_timeout = 5000")
    except sqlite3.DatabaseError as exc:
        raise RecorderError(f"cannot open recorder database {p}: {exc}") from exc
    migrate(db)
    return db
