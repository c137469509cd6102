"""The recorder's SQLite schema and its migrations.

The schema is versioned: `meta.schema_version` says how many entries of
`MIGRATIONS` have been applied. To change the schema, append a function to
`MIGRATIONS`; never edit an existing one (databases in the field already ran
it). Opening a database written by a newer prefixtrace fails loudly instead of
guessing.

Layout since version 2 (docs/FORMATS.md has the columns):

    messages   one row per distinct message text, addressed by its hash
    body_parts one row per distinct body head / tail (everything but the messages)
    prefixes   one row per distinct message-list prefix: (parent prefix, message)
    turn_log   one row per turn: metadata, response, and the request body as
               head + messages of prefix `body_prefix` joined by `body_sep` + tail
    renderers  one row per chat template + tokenizer that rendered recorded prompts (since version 3;
               `turn_log.renderer_id` points at it, `turn_log.served_by` names the member that answered)
    turns      a view with the version-1 columns, `request_body` rebuilt in SQL,
               so ad-hoc queries and older scripts keep working
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

import sqlite_utils

from prefixtrace.common.errors import RecorderError

# Metadata columns shared by v1 `turns` and v2 `turn_log`, in v1 order.
META_COLUMNS = (
    "request_id", "started_at", "session_id", "endpoint", "upstream", "client_addr", "stream",
    "status", "error", "model",
)
RESULT_COLUMNS = (
    "request_headers", "response_text", "reasoning_text", "tool_calls", "finish_reason",
    "prompt_tokens", "completion_tokens", "cached_tokens", "usage", "ttft_s", "total_s",
    "chunk_times", "render",
)
PAGE_SIZE = 512
BODY_COLUMNS = ("body_json", "body_head", "body_sep", "body_tail", "body_prefix")


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


# The request body rebuilt from its parts, for the `turns` view. The recursive
# walk goes from the turn's prefix up to the root; ordering by depth descending
# puts the messages back in request order. Library code rebuilds bodies in
# Python (`recorder.rows.BodyStore`) and does not depend on group_concat's order.
_VIEW_BODY = """
CASE WHEN t.body_prefix IS NULL THEN (
  SELECT CASE WHEN t.body_json THEN b.body ELSE json_quote(b.body) END FROM body_parts b WHERE b.id = t.body_head)
ELSE (SELECT b.body FROM body_parts b WHERE b.id = t.body_head) || (
  WITH RECURSIVE walk(id, depth) AS (
    SELECT t.body_prefix, 0
    UNION ALL SELECT p.parent, walk.depth + 1 FROM walk JOIN prefixes p ON p.id = walk.id WHERE p.parent != 0)
  SELECT group_concat(body, t.body_sep) FROM (
    SELECT m.body AS body FROM walk JOIN prefixes p ON p.id = walk.id
    JOIN messages m ON m.id = p.message_id ORDER BY walk.depth DESC)
) || (SELECT b.body FROM body_parts b WHERE b.id = t.body_tail) END
"""


def _m002_content_addressed(db: sqlite_utils.Database) -> None:
    # Imported here: the body codec lives with the row code, which imports this module.
    from recorder.rows import BodyStore

    db.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, hash BLOB NOT NULL UNIQUE, body TEXT NOT NULL)")
    db.execute("CREATE TABLE body_parts (id INTEGER PRIMARY KEY, hash BLOB NOT NULL UNIQUE, body TEXT NOT NULL)")
    db.execute(
        "CREATE TABLE prefixes (id INTEGER PRIMARY KEY, parent INTEGER NOT NULL, message_id INTEGER NOT NULL,"
        " UNIQUE (parent, message_id))"
    )
    db.execute(
        "CREATE TABLE turn_log (request_id TEXT PRIMARY KEY NOT NULL, started_at REAL NOT NULL, session_id TEXT,"
        " endpoint TEXT NOT NULL, upstream TEXT NOT NULL, client_addr TEXT, stream INTEGER, status INTEGER,"
        " error TEXT, model TEXT, body_json INTEGER NOT NULL, body_head INTEGER NOT NULL, body_sep TEXT,"
        " body_tail INTEGER, body_prefix INTEGER, request_headers TEXT, response_text TEXT, reasoning_text TEXT,"
        " tool_calls TEXT, finish_reason TEXT, prompt_tokens INTEGER, completion_tokens INTEGER,"
        " cached_tokens INTEGER, usage TEXT, ttft_s REAL, total_s REAL, chunk_times TEXT, render TEXT)"
    )
    bodies = BodyStore(db)
    columns = META_COLUMNS + RESULT_COLUMNS
    for row in db.query("SELECT * FROM turns"):
        value = json.loads(row["request_body"]) if row["request_body"] is not None else ""
        if isinstance(value, str):  # v1 kept a body that was not JSON as a JSON string
            parts = bodies.put(value, is_json=False)
        else:
            parts = bodies.put(row["request_body"], is_json=True)
        db["turn_log"].insert({**{c: row[c] for c in columns}, **parts})
    db.execute("DROP TABLE turns")
    db.execute("CREATE INDEX idx_turn_log_session_started ON turn_log (session_id, started_at)")
    db.execute("CREATE INDEX idx_turn_log_started ON turn_log (started_at)")
    create_turns_view(db)


def create_turns_view(db) -> None:
    """The version-1 `turns` view over `turn_log` (a sqlite3 connection or a sqlite-utils Database)."""
    meta = ", ".join(f"t.{c}" for c in META_COLUMNS)
    rest = ", ".join(f"t.{c}" for c in RESULT_COLUMNS)
    db.execute(f"CREATE VIEW turns AS SELECT {meta}, {_VIEW_BODY} AS request_body, {rest} FROM turn_log t")


def _m003_renderers(db: sqlite_utils.Database) -> None:
    """What rendered each prompt (recorder/renderers.py) and which upstream member served it."""
    from recorder.renderers import create_table

    create_table(db)
    db.execute("ALTER TABLE turn_log ADD COLUMN renderer_id TEXT")
    db.execute("ALTER TABLE turn_log ADD COLUMN served_by TEXT")


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_m001_initial, _m002_content_addressed, _m003_renderers]
SCHEMA_VERSION = len(MIGRATIONS)


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


def _refuse_if_damaged(db: sqlite_utils.Database, p: Path) -> None:
    """A database about to be written must pass SQLite's `quick_check` (the b-trees and
    their pages, not the index contents): recording into a damaged file spreads the
    damage and may lose what it still holds. Readers skip this (a read reports what it
    cannot read, in one line)."""
    problems = [" ".join(row[0].split()) for row in db.execute("pragma quick_check(5)").fetchall()]
    if problems != ["ok"]:
        db.close()
        raise RecorderError(f"{p} is damaged (SQLite quick_check: {'; '.join(problems)[:300]}); nothing was "
                            f"written to it. Move it aside (mv {p} {p}.damaged) or pass another --db; "
                            f"`sqlite3 {p} .recover` may save its turns.")


def _create_owner_only(p: Path) -> None:
    """An empty database file, 0600 whatever the umask.

    The database holds every prompt a client sent (secrets redacted, the rest of the
    code and conversation not), so a new one is readable by its owner only. SQLite
    gives its -wal and -shm files the database file's mode, so they follow. An empty
    file is a valid empty database. An existing database keeps the mode it has: it is
    the user's file, and a mode they chose is not ours to change."""
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    except FileExistsError:  # created between the check and here: SQLite opens it as it is
        return
    except OSError as exc:
        raise RecorderError(f"cannot create recorder database {p}: {exc.strerror}") from exc
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def open_db(path: str | Path, *, tracer: Callable | None = None, create: bool = True) -> sqlite_utils.Database:
    """Opens (and migrates) a recorder database in WAL mode.

    A file that is not a SQLite database, or not a recorder database, raises
    `RecorderError` before anything is written to it; so does, when opened for
    writing (`create`), an existing database that fails `pragma quick_check`.
    """
    p = Path(path)
    if not create and not p.exists():
        raise RecorderError(f"no recorder database at {p}")
    try:
        if create and not p.exists():
            _create_owner_only(p)
        db = sqlite_utils.Database(p, tracer=tracer)
        # Read before any write: a corrupt or foreign file must fail here,
        # not after WAL mode or a migration has touched it.
        tables = set(db.table_names())
        if tables and "meta" not in tables:
            db.close()
            raise RecorderError(f"{p} is a SQLite database but not a prefixtrace recorder database")
        if tables and create:
            _refuse_if_damaged(db, p)
        if not tables:
            # Small pages pack the message store tighter: a message larger
            # than a page goes to full overflow pages, and what is left over
            # per leaf page is at most about one small cell. On the synthetic
            # field log the file is ~1.15x the unique message bytes at 512 B
            # pages, ~1.2x at 1-4 KiB (docs/PERFORMANCE.md). The size can only
            # be set before the first table exists.
            db.execute(f"pragma page_size = {PAGE_SIZE}")
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
