"""`Spool`: finished turns waiting while the database cannot be written.

A full disk, a filesystem turned read-only, or a lock held past SQLite's busy timeout
makes a write fail; the recorder then keeps the turns' rows here (already redacted: the
spool holds nothing the database would not) and writes them once the database accepts
writes again. Rows go to memory first, up to `max_memory_bytes`, then to a file beside the
database (`<db>.spool`, one JSON row a line, 0600), up to `max_file_bytes`. A row that fits
neither (the file cannot be written either: the same full or read-only disk) is dropped,
counted in `dropped` and logged with its request id: never silently.

Rows are keyed by request id and written with replace, so a row written twice (a drain
cut off half-way, a spool file left by a killed server and read back at the next start)
is still one turn in the database. Only the recorder's writer thread touches a spool;
other threads read its counters.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from recorder import numbers
from recorder.files import open_private

log = logging.getLogger("prefixtrace.recorder")

DEFAULT_MAX_MEMORY_BYTES = 64 << 20
DEFAULT_MAX_FILE_BYTES = 1 << 30


def spool_path(db_path: str | Path) -> Path:
    p = Path(db_path)
    return p.with_name(p.name + ".spool")


# The keys of a spooled row (recorder/rows.py `redacted_row`) that must be there, and their types;
# every value is a plain JSON scalar.
_REQUIRED = {"request_id": str, "started_at": (int, float), "endpoint": str, "upstream": str, "_body": str,
             "_body_json": (bool, int)}


def parse_row(line: bytes) -> tuple[dict[str, Any] | None, str]:
    """A spool line as the row it holds, or (None, why): not UTF-8, not JSON (or nested past the
    parser's limit), not an object of plain values with the keys every row has."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError:
        return None, "not JSON"
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not a row"
    for key, kind in _REQUIRED.items():
        if not isinstance(row.get(key), kind):
            return None, f"no valid {key!r}"
    if not all(v is None or isinstance(v, (str, int, float, bool)) for v in row.values()):
        return None, "a value that is not a plain one"
    return row, ""


def _size(row: dict[str, Any]) -> int:
    return 64 + sum(len(v) for v in row.values() if isinstance(v, str))


class Spool:
    """Rows (as `recorder.rows.redacted_row` makes them) in memory, then in a file."""

    def __init__(self, path: str | Path, *, max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES):
        self.path = Path(path)
        self.max_memory_bytes = max_memory_bytes
        self.max_file_bytes = max_file_bytes
        self.memory: deque[dict[str, Any]] = deque()
        self.memory_bytes = 0
        self.file_rows = 0
        self.file_bytes = 0
        self.dropped = 0
        self._adopt_file()

    def __len__(self) -> int:
        return len(self.memory) + self.file_rows

    def _adopt_file(self) -> None:
        """A spool file left by a server that stopped before it could write it: its rows are
        written at the first chance, like any spooled row. What is there but is no spool this
        recorder wrote is moved aside with one warning, never read in a loop: a special file (a
        FIFO would block the start, a symlink to /dev/zero read without end), or a file with lines
        that are not rows (its valid rows are kept in a fresh spool file)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return
        except OSError as exc:  # ELOOP: a symlink (O_NOFOLLOW); or unreadable
            self._move_aside("refused", f"it cannot be opened as a file ({exc.strerror or exc})")
            return
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self._move_aside("refused", "it is not a regular file")
                return
            if os.fstat(fd).st_size > self.max_file_bytes:
                self._move_aside("refused", f"it is larger than the spool's {self.max_file_bytes:,} bytes")
                return
            os.set_blocking(fd, True)
            valid, damaged = [], []
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                row, why = parse_row(line)
                if row is None:
                    damaged.append(f"line {lineno}: {why}")
                else:
                    valid.append(line if line.endswith(b"\n") else line + b"\n")
        if damaged:
            aside = self._move_aside("damaged", f"{len(damaged)} line(s) are not spooled turns ({damaged[0]})",
                                     f"; its {len(valid)} valid turn(s) are kept")
            if aside is not None and valid:
                try:
                    with open_private(self.path, "wb") as out:
                        out.write(b"".join(valid))
                except OSError as exc:
                    log.error("cannot rewrite the recorder spool %s: %s; its turns stay in %s", self.path, exc, aside)
                    return
            elif aside is None:
                return
        self.file_rows = len(valid)
        self.file_bytes = sum(map(len, valid))
        if self.file_rows:
            log.warning("found %d spooled turn(s) in %s from an earlier run; writing them to the database",
                        self.file_rows, self.path)

    def _move_aside(self, why_kind: str, why: str, then: str = "") -> Path | None:
        """Renames the spool path to `<db>.spool.<kind>-<time>` (a link is moved, not followed)."""
        aside = self.path.with_name(f"{self.path.name}.{why_kind}-{int(time.time())}")
        try:
            os.rename(self.path, aside)
        except OSError as exc:
            log.error("the recorder spool %s is unusable (%s) and cannot be moved aside (%s); no spool file is used",
                      self.path, why, exc.strerror or exc)
            self.max_file_bytes = 0  # nothing is appended to it
            return None
        log.warning("the recorder spool %s was moved aside to %s: %s%s", self.path, aside.name, why, then)
        return aside

    def add(self, row: dict[str, Any]) -> bool:
        """Keeps `row`; False when it fit nowhere (counted in `dropped`, logged)."""
        size = _size(row)
        if self.memory_bytes + size <= self.max_memory_bytes:
            self.memory.append(row)
            self.memory_bytes += size
            return True
        why = self._append([row])
        if why is None:
            return True
        self.dropped += 1
        log.error("turn %s was not recorded: the database cannot be written and the spool is full (%s); "
                  "%d turn(s) dropped so far", row.get("request_id"), why, self.dropped)
        return False

    def _append(self, rows: list[dict[str, Any]]) -> str | None:
        """Appends `rows` to the spool file; None, or why not (then the file is as it was)."""
        text = "".join(numbers.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
        if self.file_bytes + len(text) > self.max_file_bytes:
            return f"{self.path} holds {self.file_bytes} bytes, its limit is {self.max_file_bytes}"
        try:
            with open_private(self.path, "ab") as fh:
                start = fh.tell()
                try:
                    fh.write(text)
                    fh.flush()
                    os.fsync(fh.fileno())
                except OSError:
                    fh.truncate(start)  # no half line for the next append to run into
                    raise
        except OSError as exc:
            return f"{self.path}: {exc.strerror or exc}"
        self.file_rows += len(rows)
        self.file_bytes += len(text)
        return None

    def memory_batches(self, size: int) -> Iterator[list[dict[str, Any]]]:
        """The oldest memory rows, `size` at a time; take each from the spool with `written`."""
        while self.memory:
            yield [self.memory[i] for i in range(min(size, len(self.memory)))]

    def written(self, n: int) -> None:
        """The first `n` memory rows are in the database."""
        for _ in range(n):
            self.memory_bytes -= _size(self.memory.popleft())

    def file_batches(self, size: int) -> Iterator[list[dict[str, Any]]]:
        """The file's rows, `size` at a time (`clear_file` once all are written). A line that
        does not parse (cut short by a crash while it was written) is skipped and counted."""
        if not self.file_rows:
            return
        batch: list[dict[str, Any]] = []
        if not self.path.exists():  # removed by someone else (or a volume unmounted under it)
            self.dropped += self.file_rows
            log.error("the recorder spool %s is gone; %d turn(s) in it are lost", self.path, self.file_rows)
            self.file_rows = self.file_bytes = 0
            return
        with open(self.path, "rb") as fh:
            for line in fh:
                if not line.strip():
                    continue
                row, _ = parse_row(line)
                if row is None:
                    self.dropped += 1
                    log.error("a line of the recorder spool %s is damaged; its turn is lost", self.path)
                    continue
                batch.append(row)
                if len(batch) == size:
                    yield batch
                    batch = []
        if batch:
            yield batch

    def clear_file(self) -> None:
        self.path.unlink(missing_ok=True)
        self.file_rows = self.file_bytes = 0

    def persist(self) -> int:
        """At shutdown: memory rows to the file, for the next start to write. Returns how many
        could not be kept (counted in `dropped`)."""
        if not self.memory:
            return 0
        rows = list(self.memory)
        why = self._append(rows)
        self.memory.clear()
        self.memory_bytes = 0
        if why is None:
            log.warning("%d spooled turn(s) kept in %s; the next start writes them to the database",
                        len(rows), self.path)
            return 0
        self.dropped += len(rows)
        log.error("%d spooled turn(s) lost at shutdown: the database and %s cannot be written (%s)",
                  len(rows), self.path, why)
        return len(rows)

    def state(self) -> dict[str, Any]:
        return {"spooled": len(self), "spooled_in_memory": len(self.memory), "spooled_in_file": self.file_rows,
                "dropped": self.dropped, "spool_file": str(self.path)}
