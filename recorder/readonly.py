"""Opening a recorder database to read it, as a file someone may have handed you.

Reading must never write, and must run nothing the file itself defines: SQLite runs a view's
query when a name that is a view is read, and a trigger when a write touches its table, so a
database crafted with `turn_log` as a view over an endless recursive CTE hangs every reader,
and one whose schema is older fires its own triggers when a migration writes to it. So:

- the file is opened with `mode=ro` and `query_only`, and `trusted_schema` off: no write can
  happen and no trigger can fire;
- before any query, the objects a reader queries (`meta`, `turn_log`, `messages`,
  `body_parts`, `prefixes`, `renderers`) must be plain tables as prefixtrace creates them: not
  views, not virtual tables, no generated columns (whose expressions would run on every read);
- a database of an older schema is migrated into a private copy (its triggers and views dropped
  first), never in place: migration is a write, which only `serve` and `import` do.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from pathlib import Path
from urllib.parse import quote

import sqlite_utils

from prefixtrace.common.errors import RecorderError
from recorder.schema import SCHEMA_VERSION, migrate

# The tables each schema version reads from; all must be plain tables.
_TABLES = {1: ("meta", "turns"), 2: ("meta", "messages", "body_parts", "prefixes", "turn_log")}
_TABLES[3] = _TABLES[2] + ("renderers",)


def open_db_readonly(path: str | Path) -> sqlite_utils.Database:
    """A read-only connection to the recorder database at `path` (docstring above). An older
    schema is read through a migrated private copy. Raises RecorderError in one line."""
    p = Path(path)
    if not p.exists():
        raise RecorderError(f"no recorder database at {p}")
    if not p.is_file():
        raise RecorderError(f"{p} is not a regular file")
    conn = _connect_ro(p)
    try:
        version = _checked_version(conn, p)
    except BaseException:
        conn.close()
        raise
    if version == SCHEMA_VERSION:
        return sqlite_utils.Database(conn)
    return _migrated_copy(conn, p, version)


def _connect_ro(p: Path) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(f"file:{quote(str(p.resolve()))}?mode=ro", uri=True, check_same_thread=False)
        conn.execute("pragma query_only = 1")
        conn.execute("pragma trusted_schema = 0")
        conn.execute("pragma busy_timeout = 5000")
        return conn
    except sqlite3.DatabaseError as exc:
        raise RecorderError(f"cannot open recorder database {p}: {exc}") from exc


def _checked_version(conn: sqlite3.Connection, p: Path) -> int:
    """The schema version, once every object it reads is known to be a plain table."""
    try:
        objects = {name: (kind, sql or "") for kind, name, sql in
                   conn.execute("select type, name, sql from sqlite_master")}
        if not objects:
            raise RecorderError(f"{p} is an empty SQLite file, not a recorder database")
        if "meta" not in objects:
            raise RecorderError(f"{p} is a SQLite database but not a prefixtrace recorder database")
        _require_table(conn, p, "meta", objects)
        row = conn.execute("select value from meta where key = 'schema_version'").fetchone()
        try:
            version = int(row[0]) if row else 0
        except (TypeError, ValueError):
            raise RecorderError(f"{p}: its schema version {str(row[0])[:40]!r} is not a number") from None
        if version > SCHEMA_VERSION:
            raise RecorderError(f"database schema version {version} is newer than this prefixtrace supports "
                                f"({SCHEMA_VERSION}); upgrade prefixtrace")
        if version < 1:
            raise RecorderError(f"{p}: schema version {version} is not one prefixtrace wrote")
        for name in _TABLES[version]:
            _require_table(conn, p, name, objects)
        return version
    except sqlite3.DatabaseError as exc:
        raise RecorderError(f"cannot open recorder database {p}: {exc}") from exc


def _require_table(conn: sqlite3.Connection, p: Path, name: str, objects: dict[str, tuple[str, str]]) -> None:
    kind, sql = objects.get(name, (None, ""))
    if kind is None:
        raise RecorderError(f"{p} is not a recorder database prefixtrace wrote: it has no {name!r} table")
    if kind != "table" or not sql.lstrip().upper().startswith("CREATE TABLE"):
        what = "a virtual table" if kind == "table" else f"a {kind}"
        raise RecorderError(f"{p} is not a recorder database prefixtrace wrote: {name!r} is {what}, not a table; "
                            "nothing was read from it")
    if any(col[6] != 0 for col in conn.execute(f"pragma table_xinfo({name!r})")):
        raise RecorderError(f"{p} is not a recorder database prefixtrace wrote: {name!r} has generated or hidden "
                            "columns; nothing was read from it")


def _migrated_copy(conn: sqlite3.Connection, p: Path, version: int) -> sqlite_utils.Database:
    """The database at `p` copied (SQLite's backup: a consistent snapshot) into a private temporary
    file, stripped of triggers and of views other than prefixtrace's, migrated there, then opened
    read-only. The file is unlinked once open: nothing is left behind however the reader ends."""
    fd, tmp = tempfile.mkstemp(prefix="prefixtrace-migrated-", suffix=".db")
    os.close(fd)
    try:
        copy = sqlite3.connect(tmp)
        try:
            conn.backup(copy)
        finally:
            conn.close()
        for kind, name in copy.execute("select type, name from sqlite_master where type in ('trigger', 'view')"
                                       ).fetchall():
            copy.execute(f'drop {kind} if exists "{name.replace(chr(34), chr(34) * 2)}"')
        copy.commit()
        if version >= 2:  # the v1 -> v2 step creates `turns`; later steps expect it
            from recorder.schema import create_turns_view

            create_turns_view(copy)
        copy.execute("pragma journal_mode = delete")
        db = sqlite_utils.Database(copy)
        migrate(db)
        copy.close()
        out = _connect_ro(Path(tmp))
        _checked_version(out, p)
        return sqlite_utils.Database(out)
    except sqlite3.DatabaseError as exc:
        raise RecorderError(f"cannot read recorder database {p} (schema version {version}, migrated into a "
                            f"copy): {exc}") from exc
    finally:
        Path(tmp).unlink(missing_ok=True)
