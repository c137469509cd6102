"""Read-side API over a recorder database, for the analyzer and the CLI.

Readers open their own connection; WAL mode lets them run while a `Recorder`
is writing.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefixtrace.common.errors import RecorderError
from recorder.rows import BodyStore, row_to_turn
from recorder.readonly import open_db_readonly
from recorder.turn import Turn


def iter_turns(db_path: str | Path, session: str | None = None) -> Iterator[Turn]:
    """Yields stored turns ordered by `started_at` (then request_id, so ties
    are stable). With `session`, only turns recorded with that session_id."""
    # Opened eagerly (not inside the generator) so a missing or foreign file
    # fails at the call, not at the first next().
    db = open_db_readonly(db_path)
    return _iter_rows(db, session, Path(db_path))


def _iter_rows(db, session: str | None, path: Path) -> Iterator[Turn]:
    try:
        bodies = BodyStore(db)
        where, params = ("session_id = ?", [session]) if session is not None else (None, None)
        rows = db["turn_log"].rows_where(where, params, order_by="started_at, request_id")
        while True:
            try:
                row = next(rows, None)
                if row is None:
                    return
                turn = row_to_turn(row, bodies)
            except sqlite3.DatabaseError as exc:
                raise RecorderError(damaged(path, exc)) from exc
            except RecursionError as exc:  # JSON nested past the parser's recursion limit
                raise RecorderError(f"{path}: turn {row.get('request_id')!r} cannot be read: its JSON is nested "
                                    "too deeply (the file is damaged or crafted)") from exc
            except (ValueError, TypeError, KeyError) as exc:  # a stored JSON text that no longer parses
                raise RecorderError(f"{path}: turn {row.get('request_id')!r} cannot be read: "
                                    f"{type(exc).__name__}: {str(exc)[:200]} (the file is damaged?)") from exc
            yield turn
    finally:
        db.close()


_UNDECODABLE = re.compile(r"Could not decode to UTF-8 column '([^']*)'")


def damaged(path: Path, exc: sqlite3.Error) -> str:
    """One line for a database SQLite can open but not read through; never the damaged bytes
    themselves (sqlite3 quotes the whole undecodable text, control characters and all)."""
    undecodable = _UNDECODABLE.search(str(exc))
    what = f"a stored {undecodable.group(1)!r} text is not valid UTF-8" if undecodable else str(exc)[:200]
    return (f"{path} cannot be read: {what}; the file is damaged: move it aside, or try "
            f"`sqlite3 {path} .recover`")


def session_ids(db_path: str | Path) -> list[str]:
    """The session ids stored in a database (inferred sessions are not stored: the analyzer names them)."""
    p = Path(db_path)
    db = open_db_readonly(p)
    try:
        return [row[0] for row in db.execute("select distinct session_id from turn_log where session_id is not null"
                                             " order by session_id")]
    except sqlite3.DatabaseError as exc:
        raise RecorderError(damaged(p, exc)) from exc
def read_renderers(db_path: str | Path) -> dict:
    """The database's recorded renderers by id (recorder/renderers.py); none in an older database."""
    from recorder.renderers import load_all

    db = open_db_readonly(db_path)
    try:
        return load_all(db)
    except sqlite3.DatabaseError as exc:
        raise RecorderError(f"{db_path} cannot be read: {exc} (the file is damaged?)") from exc
    finally:
        db.close()


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="seconds")


def db_info(db_path: str | Path) -> dict[str, Any]:
    """Summary of a recorder database.

    Keys: path, schema_version, turns, sessions (distinct explicit
    session_ids), unlabelled_turns (no session_id: grouped by inference at
    analysis time), size_bytes (main file plus WAL), first_ts / last_ts (unix
    seconds or None), first / last (ISO 8601 UTC), unique_messages and
    unique_message_bytes (the content-addressed store) and message_refs (how
    many messages all stored requests list: what raw bodies would repeat).
    """
    p = Path(db_path)
    db = open_db_readonly(p)
    try:
        return _db_info(db, p)
    except sqlite3.DatabaseError as exc:
        raise RecorderError(damaged(p, exc)) from exc
    finally:
        db.close()


def _db_info(db, p: Path) -> dict[str, Any]:
    version = int(db["meta"].get("schema_version")["value"])
    turns, sessions, unlabelled, first, last = db.execute(
        "select count(*), count(distinct session_id), sum(session_id is null),"
        " min(started_at), max(started_at) from turn_log"
    ).fetchone()
    messages, message_bytes = db.execute("select count(*), coalesce(sum(length(cast(body as blob))), 0)"
                                         " from messages").fetchone()
    refs = db.execute(
        "with recursive depth(id, n) as (select id, 1 from prefixes where parent = 0 union all"
        " select p.id, depth.n + 1 from prefixes p join depth on p.parent = depth.id)"
        " select coalesce(sum(depth.n), 0) from turn_log t join depth on depth.id = t.body_prefix"
    ).fetchone()[0]
    size = sum(os.path.getsize(f) for f in (p, Path(f"{p}-wal")) if f.exists())
    return {
        "path": str(p),
        "schema_version": version,
        "turns": turns,
        "sessions": sessions,
        "unlabelled_turns": unlabelled or 0,
        "size_bytes": size,
        "first_ts": first,
        "last_ts": last,
        "first": _iso(first),
        "last": _iso(last),
        "unique_messages": messages,
        "unique_message_bytes": message_bytes,
        "message_refs": refs,
    }
