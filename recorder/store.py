"""`Recorder`: writes Turns to SQLite off the response path.

The proxy calls `record(turn)` from its event loop, so `record` must never do
I/O. It only puts the turn on a bounded queue; one writer thread owns the
SQLite connection (sqlite connections are not shared across threads) and
commits what is queued as soon as it is dequeued (several waiting turns share
one transaction: group commit), so a `kill -9` loses at most the turns still
queued, never a written one.

`record` returns a `concurrent.futures.Future` that resolves once the turn is
committed. The proxy awaits it (`record_async`) right before the client sees
the end of its response, so a client that got a whole response can rely on the
turn surviving a crash; only that response waits, and only for its own commit.
A refusal of a body over 1 MB does not wait (proxy/relay.py `record_refusal`):
its turn is queued before the answer, and `close` writes what is queued.

A full queue makes `record` block rather than drop: losing turns silently
would make the analysis lie, and a full queue means the disk is far behind,
which back-pressure surfaces. Size the queue so this never happens in normal
operation (the default holds 10,000 turns).

Ownership: after `record(turn)` the recorder owns `turn`; the caller must not
mutate it (it is serialised later, on the writer thread).

The writer cannot be stopped by what it writes or by who waits: a failing
batch fails only its own turns, a waiter that gave up (a client that hung up
while its turn committed cancels its future) is skipped. `health()` says when
the writer is stuck (one write running longer than `stuck_after_s`) or gone,
which `/health` reports; `close(timeout)` always returns.

A database that cannot be written (disk full, filesystem read-only, an I/O
error, a lock held past SQLite's busy timeout) loses no turn: the failed
turns' rows, and every turn after them, wait in a bounded spool (memory, then
a file beside the database: recorder/spool.py), and the writer retries every
`retry_s`, reopening the database, until it accepts writes; then the spool is
written and recording goes on. A spooled turn's future resolves (its response
need not wait for the disk); `health()` is not ok from the first failed write
until the spool is written, naming the reason; a turn that fits no spool is
counted (`spool_state()["dropped"]`), logged, and fails its future.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any

from prefixtrace.common.errors import RecorderError
from prefixtrace.common.heap import trim_heap
from recorder.redact import Redactor
from recorder.renderers import RendererInfo
from recorder.rows import BodyStore, redacted_row, write_rows
from recorder.schema import open_db
from recorder.spool import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_MEMORY_BYTES, Spool, spool_path
from recorder.turn import Turn

log = logging.getLogger("prefixtrace.recorder")
_STOP = object()
# Turns committed in one transaction at most; bounds the latency one commit adds.
_MAX_BATCH = 64
# SQLite result codes (and their extended forms, `SQLITE_IOERR_WRITE`) that say the database
# cannot be written now, not that a turn is bad: its turns are spooled and the write retried.
_UNWRITABLE = ("SQLITE_FULL", "SQLITE_READONLY", "SQLITE_IOERR", "SQLITE_CANTOPEN", "SQLITE_BUSY",
               "SQLITE_LOCKED", "SQLITE_PROTOCOL")


# After a batch whose request bodies are this big, the heap's free pages go back to the OS: the
# copies a 30 MB body's write makes (its lower-cased text for redaction, the parsed candidate, the
# message slice, SQLite's own copy) are freed when it is written, but glibc keeps freed heap memory
# and, past its mmap threshold, serves the next big body from it. The proxy trims after each big
# request (proxy/connections.py); a refusal's turn may be written after that, so here too.
_TRIM_AFTER_CHARS = 1 << 20


def _log_lost(turn: Turn, done: Future) -> None:
    if not done.cancelled() and isinstance(done.exception(), RecorderError):
        log.error("turn %s was not recorded: %s", turn.request_id, done.exception().message)


def unwritable_reason(exc: BaseException) -> str | None:
    """Why the database cannot be written, when `exc` (or its cause) says so; None for
    an error of the turn itself."""
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, sqlite3.DatabaseError):
            name = getattr(exc, "sqlite_errorname", "") or ""
            if any(name == code or name.startswith(code + "_") for code in _UNWRITABLE):
                return f"{exc} ({name})"
        elif isinstance(exc, OSError):
            return f"{exc.strerror or exc}"
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


class Recorder:
    """Records Turns into the SQLite database at `path` (created if missing).

    Args:
        path: database file.
        max_queue: turns that may wait for the writer before `record` blocks.
        redact_patterns: regexes for secret-shaped strings; None = defaults.
        tracer: `callable(sql, params)` called for every query the writer runs.
        stuck_after_s: a write running longer than this makes `health()` not ok;
            `record_async` also stops holding its response back after this long
            (the turn stays queued and is written when the writer gets going).
        spool_memory_bytes, spool_file_bytes: bounds of the spool that keeps turns
            while the database cannot be written (memory first, then `<db>.spool`).
        retry_s: seconds between attempts at an unwritable database.

    Example::

        with Recorder("traffic.db") as rec:
            rec.record(turn)
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_queue: int = 10_000,
        redact_patterns: Iterable[str] | None = None,
        tracer: Callable | None = None,
        stuck_after_s: float = 30.0,
        spool_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
        spool_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        retry_s: float = 1.0,
        hasher: Any = None,
    ):
        if max_queue < 1:
            raise RecorderError(f"max_queue must be >= 1, got {max_queue}")
        if not stuck_after_s > 0:
            raise RecorderError(f"stuck_after_s must be > 0, got {stuck_after_s}")
        self.stuck_after_s = float(stuck_after_s)
        self.path = Path(path)
        self.redactor = Redactor(redact_patterns)  # also what the live dashboard masks its output with
        self.hasher = hasher  # recorder/hashing.Hasher: `serve --store hashes` stores no text
        self._tracer = tracer
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        # Progress counters, guarded by `_cond`: flush() waits for `_done` to
        # reach the `_enqueued` value it saw, so turns recorded after the flush
        # began do not extend it.
        self._cond = threading.Condition()
        self._enqueued = 0
        self._done = 0
        self._errors: list[BaseException] = []
        self._closed = False
        self._busy_since: float | None = None  # time.monotonic() the write in progress began
        self._ready = threading.Event()
        self._open_error: BaseException | None = None
        self.retry_s = float(retry_s)
        self._spool = Spool(spool_path(self.path), max_memory_bytes=spool_memory_bytes,
                            max_file_bytes=spool_file_bytes)
        self._unwritable: str | None = None  # why the last write failed, until the spool is written
        # The renderers the recorded turns carried, by id (one per model served): the writer thread's own,
        # so a row written later (from the spool) still finds the renderer it names.
        self._renderers: dict[str, RendererInfo] = {}
        self._next_retry = 0.0  # time.monotonic() of the next attempt at an unwritable database
        self._thread = threading.Thread(target=self._run, name="prefixtrace-recorder", daemon=True)
        self._thread.start()
        # Open (and migrate) synchronously so a bad path fails here, at start-up,
        # rather than silently on the writer thread.
        self._ready.wait()
        if self._open_error is not None:
            raise self._open_error

    # -- public API ---------------------------------------------------------

    def record(self, turn: Turn) -> Future:
        """Enqueues `turn` and returns a Future that resolves (to None) once the
        turn is committed (or spooled, while the database cannot be written), or
        with the `RecorderError` that lost it. Blocks only while the queue is full."""
        return self._put(turn, block=True)

    async def enqueue(self, turn: Turn) -> Future:
        """`record` without blocking the event loop: a full queue makes this caller wait for room
        in a worker thread instead of dropping the turn. A write that fails is logged (the Future
        carries the `RecorderError` too)."""
        try:
            done = self._put(turn, block=False)
        except queue.Full:
            done = await asyncio.to_thread(self._put, turn, True)
        done.add_done_callback(lambda f: _log_lost(turn, f))
        return done

    async def record_async(self, turn: Turn) -> None:
        """Records `turn` and waits, without blocking the event loop, until it
        is committed. A failed write is logged, not raised: the response it
        belongs to was served; `flush` reports it."""
        done = await self.enqueue(turn)
        try:
            # shield: a response cancelled while it waits (the client hung up)
            # must not cancel the writer's future; the turn is written anyway.
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(done)), self.stuck_after_s)
        except RecorderError:
            pass  # logged by `enqueue`'s callback
        except TimeoutError:
            log.error("turn %s not committed after %.0f s (recorder stuck); answering anyway, it stays queued",
                      turn.request_id, self.stuck_after_s)

    def _put(self, turn: Turn, block: bool) -> Future:
        if not isinstance(turn, Turn):
            raise RecorderError(f"record() takes a Turn, got {type(turn).__name__}")
        done: Future = Future()
        with self._cond:
            if self._closed:
                raise RecorderError("recorder is closed")
            if not block:
                self._queue.put_nowait((turn, done))  # raises queue.Full; nothing counted yet
                self._enqueued += 1
                return done
            self._enqueued += 1
        self._queue.put((turn, done))
        return done

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every turn recorded so far is written.

        Returns False if `timeout` expired first (spooled turns are not written until
        the database accepts writes again). Raises `RecorderError` if any write
        failed since the last flush (the failed turns are lost; the writer keeps
        going with the rest).
        """
        with self._cond:
            target = self._enqueued
            self._cond.wait_for(lambda: (self._done >= target and not len(self._spool))
                                or not self._thread.is_alive(), timeout)
            flushed = self._done >= target and not len(self._spool)
            errors, self._errors = self._errors, []
        if errors:
            raise RecorderError(
                f"{len(errors)} turn(s) could not be written: {errors[0]}", failed=len(errors)
            ) from errors[0]
        return flushed

    def close(self, timeout: float | None = None) -> None:
        """Flushes, then stops the writer thread. Idempotent. With a `timeout`
        it returns by then even if the writer is stuck, logging how many turns
        were still unwritten (the writer is a daemon thread: they are lost at exit)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.error("recorder writer did not finish within %.0f s; %d turn(s) not written", timeout, self.pending)
        with self._cond:
            errors, self._errors = self._errors, []
        if errors:
            raise RecorderError(
                f"{len(errors)} turn(s) could not be written: {errors[0]}", failed=len(errors)
            ) from errors[0]

    def health(self) -> tuple[bool, str | None]:
        """`(True, None)`, or `(False, reason)` when the writer is closed, gone,
        has been inside one write for longer than `stuck_after_s`, or the database
        cannot be written (turns are spooled until it can)."""
        with self._cond:
            pending = self._enqueued - self._done
            if self._closed:
                return False, "recorder is closed"
        if not self._thread.is_alive():
            return False, f"recorder writer thread is not running; {pending} turn(s) waiting"
        unwritable = self._unwritable
        if unwritable is not None:
            spool = self._spool
            return False, (f"database cannot be written: {unwritable}; {len(spool)} turn(s) spooled"
                           f" ({len(spool.memory)} in memory, {spool.file_rows} in {spool.path.name}),"
                           f" {spool.dropped} dropped; retrying every {self.retry_s:g} s")
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > self.stuck_after_s:
            return False, (f"recorder writer stuck: one write has taken {time.monotonic() - busy:.0f} s;"
                           f" {pending} turn(s) waiting")
        return True, None

    @property
    def pending(self) -> int:
        """Turns recorded but not yet written (queued or spooled)."""
        with self._cond:
            return self._enqueued - self._done + len(self._spool)

    def spool_state(self) -> dict:
        """Whether the database takes writes, why not, and the spool's counts (`/health`, `/metrics`)."""
        return {"writable": self._unwritable is None, "reason": self._unwritable, **self._spool.state()}

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- writer thread --------------------------------------------------------

    def _run(self) -> None:
        try:
            db = open_db(self.path, tracer=self._tracer)
        except BaseException as exc:  # reported to the constructor
            self._open_error = exc if isinstance(exc, RecorderError) else RecorderError(str(exc))
            self._ready.set()
            return
        self._ready.set()
        self._db = db  # None while the database cannot be written (reopened for each attempt)
        self._bodies = BodyStore(db)
        try:
            stop = False
            while not stop:
                batch = self._next_batch()
                if batch and batch[-1] is _STOP:
                    batch.pop()
                    stop = True
                if self._spooling() and (stop or time.monotonic() >= self._next_retry):
                    self._drain()
                if batch:
                    self._busy_since = time.monotonic()
                    try:
                        results = self._write(batch)
                    except BaseException as exc:  # nothing a batch does may end the writer
                        log.exception("recorder batch of %d turn(s) failed", len(batch))
                        self._bodies.reset()
                        results = [RecorderError(f"writing turns failed: {type(exc).__name__}: {exc}")] * len(batch)
                    finally:
                        self._busy_since = None
                    self._settle(batch, results)
                    big = sum(len(turn.request_raw or "") for turn, _ in batch) > _TRIM_AFTER_CHARS
                    batch = results = None  # not held while the writer waits for the next turn
                    if big:
                        trim_heap()
        finally:
            self._spool.persist()  # what the database never took waits in the spool file for the next start
            if self._db is not None:
                self._db.close()
            with self._cond:
                self._cond.notify_all()

    def _spooling(self) -> bool:
        """Turns are spooled, or the database is closed until it takes writes again: new turns go to
        the spool, behind the spooled ones, and the writer tries the database every `retry_s`."""
        return bool(len(self._spool)) or self._db is None

    def _next_batch(self) -> list:
        """Up to `_MAX_BATCH` queued turns (and `_STOP`); waits for the first, or, while turns
        are spooled, only until the next attempt at the database is due ([] then)."""
        try:
            if self._spooling():
                first = self._queue.get(timeout=max(0.0, self._next_retry - time.monotonic()))
            else:
                first = self._queue.get()
        except queue.Empty:
            return []
        batch = [first]
        while len(batch) < _MAX_BATCH and batch[-1] is not _STOP:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _write(self, batch: list[tuple[Turn, Future]]) -> list[Exception | None]:
        """Each turn's outcome: None (committed, or spooled) or the error that lost it."""
        results: list[Exception | None] = [None] * len(batch)
        rows: list[tuple[int, dict]] = []
        for i, (turn, _) in enumerate(batch):
            if turn.renderer is not None:  # kept for as long as the recorder runs: spooled rows name it too
                self._renderers.setdefault(turn.renderer.id, turn.renderer)
            try:  # the CPU work (redaction, serialising), outside the transaction; a bad turn fails alone
                stored = self.hasher.turn(turn) if self.hasher is not None else turn
                rows.append((i, redacted_row(stored, self.redactor)))
            except Exception as exc:
                results[i] = exc if isinstance(exc, RecorderError) else RecorderError(
                    f"writing turns failed: {type(exc).__name__}: {exc}")
        if self._spooling():  # turns wait behind the spooled ones
            self._spool_rows(rows, results)
            return results
        try:
            write_rows(self._db, [row for _, row in rows], self._bodies, self._renderers)
            return results
        except Exception as exc:
            if self._unwritable_now(exc):
                self._spool_rows(rows, results)
                return results
        # One bad turn must not take the others with it: retry one by one.
        for k, (i, row) in enumerate(rows):
            try:
                write_rows(self._db, [row], self._bodies, self._renderers)
            except Exception as exc:
                if self._unwritable_now(exc):
                    self._spool_rows(rows[k:], results)
                    break
                results[i] = exc if isinstance(exc, RecorderError) else RecorderError(str(exc))
        return results

    def _unwritable_now(self, exc: BaseException) -> bool:
        """When `exc` says the database cannot be written: `health()` says so from now on,
        the connection is closed (a read-only or failing disk may need a fresh one; no file
        stays open on it) and the next attempt is scheduled. False for a turn's own error."""
        reason = unwritable_reason(exc)
        if reason is None:
            return False
        if self._unwritable is None:
            log.error("recorder database %s cannot be written: %s; spooling turns until it can", self.path, reason)
        self._unwritable = reason
        self._next_retry = time.monotonic() + self.retry_s
        if self._db is not None:
            try:
                self._db.close()
            except Exception:  # closing a connection on a failed disk may fail too; it is dropped either way
                pass
            self._db = None
        return True

    def _spool_rows(self, rows: list[tuple[int, dict]], results: list[Exception | None]) -> None:
        for i, row in rows:
            if not self._spool.add(row):
                results[i] = RecorderError("the database cannot be written and the recorder spool is full: "
                                           f"turn dropped ({self._unwritable})")

    def _drain(self) -> None:
        """One attempt at writing the spool: reopen the database if needed, write the rows
        oldest first, and on success say the database is writable again."""
        if self._db is None:
            try:
                # create=False: a database gone from its path (a volume unmounted under it) is not
                # replaced by an empty one that would hide where the turns went.
                self._db = open_db(self.path, tracer=self._tracer, create=False)
                self._bodies = BodyStore(self._db)
            except Exception as exc:
                self._unwritable = unwritable_reason(exc) or str(exc)
                self._next_retry = time.monotonic() + self.retry_s
                return
        written = 0
        self._busy_since = time.monotonic()
        try:
            for rows in self._spool.memory_batches(_MAX_BATCH):
                written += self._write_spooled(rows)
                self._spool.written(len(rows))
            for rows in self._spool.file_batches(_MAX_BATCH):
                written += self._write_spooled(rows)
            self._spool.clear_file()
        except Exception as exc:
            if not self._unwritable_now(exc):  # the disk's errors, or something unforeseen: try again later
                log.exception("writing %d spooled turn(s) failed", len(self._spool))
                self._unwritable = f"writing spooled turns failed: {type(exc).__name__}: {exc}"
                self._next_retry = time.monotonic() + self.retry_s
            return
        finally:
            self._busy_since = None
            with self._cond:
                self._cond.notify_all()
        log.warning("recorder database %s accepts writes again: %d spooled turn(s) written", self.path, written)
        self._unwritable = None
        with self._cond:
            self._cond.notify_all()

    def _write_spooled(self, rows: list[dict]) -> int:
        """Writes spooled rows; raises only when the database cannot be written. A row the
        database refuses for itself (rare: it was prepared before it was spooled) is dropped,
        counted and logged, so one row cannot hold the spool back for ever. Returns how many
        were written."""
        try:
            write_rows(self._db, rows, self._bodies, self._renderers)
            return len(rows)
        except Exception as exc:
            if unwritable_reason(exc) is not None:
                raise
        written = 0
        for row in rows:
            try:
                write_rows(self._db, [row], self._bodies, self._renderers)
                written += 1
            except Exception as exc:
                if unwritable_reason(exc) is not None:
                    raise
                self._spool.dropped += 1
                log.error("spooled turn %s could not be written and is lost: %s", row.get("request_id"), exc)
        return written

    def _settle(self, batch: list[tuple[Turn, Future]], results: list[Exception | None]) -> None:
        with self._cond:
            self._errors.extend(r for r in results if r is not None)
            self._done += len(batch)
            self._cond.notify_all()
        for (turn, done), result in zip(batch, results):
            try:
                if result is None:
                    done.set_result(None)
                else:
                    done.set_exception(result)
            except InvalidStateError:  # its waiter cancelled it: the turn is written all the same
                log.debug("turn %s: its waiter had gone", turn.request_id)
