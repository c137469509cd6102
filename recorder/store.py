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

A full queue makes `record` block rather than drop: losing turns silently
would make the analysis lie, and a full queue means the disk is far behind,
which back-pressure surfaces. Size the queue so this never happens in normal
operation (the default holds 10,000 turns).

Ownership: after `record(turn)` the recorder owns `turn`; the caller must not
mutate it (it is serialised later, on the writer thread).

The writer cannot be stopped by what it writes or by who waits: a failing
batch fails only its own turns, a waiter that gave up (a client that hung up
while its turn committed cancels its future) is skipped, and a database
another process has locked is retried, not given up on. `health()` says when
the writer is stuck (one write running longer than `stuck_after_s`) or gone,
which `/health` reports; `close(timeout)` always returns.
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

from prefixtrace.errors import RecorderError
from recorder.redact import Redactor
from recorder.rows import BodyStore, write_turns
from recorder.schema import open_db
from recorder.turn import Turn

log = logging.getLogger("prefixtrace.recorder")
_STOP = object()
# Turns committed in one transaction at most; bounds the latency one commit adds.
_MAX_BATCH = 64
# Pause between attempts at a batch while another connection holds the write lock.
_BUSY_RETRY_S = 0.25


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
    ):
        if max_queue < 1:
            raise RecorderError(f"max_queue must be >= 1, got {max_queue}")
        if not stuck_after_s > 0:
            raise RecorderError(f"stuck_after_s must be > 0, got {stuck_after_s}")
        self.stuck_after_s = float(stuck_after_s)
        self.path = Path(path)
        self.redactor = Redactor(redact_patterns)  # also what the live dashboard masks its output with
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
        self._stopping = False  # close() gave up waiting: stop retrying a locked database
        self._busy_since: float | None = None  # time.monotonic() the write in progress began
        self._ready = threading.Event()
        self._open_error: BaseException | None = None
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
        turn is committed, or with the `RecorderError` that lost it. Blocks
        only while the queue is full."""
        return self._put(turn, block=True)

    async def record_async(self, turn: Turn) -> None:
        """Records `turn` and waits, without blocking the event loop, until it
        is committed. A full queue makes this caller wait for room (in a worker
        thread) instead of dropping the turn. A failed write is logged, not
        raised: the response it belongs to was served; `flush` reports it."""
        try:
            done = self._put(turn, block=False)
        except queue.Full:
            done = await asyncio.to_thread(self._put, turn, True)
        try:
            # shield: a response cancelled while it waits (the client hung up)
            # must not cancel the writer's future; the turn is written anyway.
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(done)), self.stuck_after_s)
        except RecorderError as exc:
            log.error("turn %s was not recorded: %s", turn.request_id, exc.message)
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

        Returns False if `timeout` expired first. Raises `RecorderError` if any
        write failed since the last flush (the failed turns are lost; the
        writer keeps going with the rest).
        """
        with self._cond:
            target = self._enqueued
            self._cond.wait_for(lambda: self._done >= target or not self._thread.is_alive(), timeout)
            flushed = self._done >= target
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
            self._stopping = True
            log.error("recorder writer did not finish within %.0f s; %d turn(s) not written", timeout, self.pending)
        with self._cond:
            errors, self._errors = self._errors, []
        if errors:
            raise RecorderError(
                f"{len(errors)} turn(s) could not be written: {errors[0]}", failed=len(errors)
            ) from errors[0]

    def health(self) -> tuple[bool, str | None]:
        """`(True, None)`, or `(False, reason)` when the writer is closed, gone,
        or has been inside one write for longer than `stuck_after_s`."""
        with self._cond:
            pending = self._enqueued - self._done
            if self._closed:
                return False, "recorder is closed"
        if not self._thread.is_alive():
            return False, f"recorder writer thread is not running; {pending} turn(s) waiting"
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > self.stuck_after_s:
            return False, (f"recorder writer stuck: one write has taken {time.monotonic() - busy:.0f} s;"
                           f" {pending} turn(s) waiting")
        return True, None

    @property
    def pending(self) -> int:
        """Turns recorded but not yet written."""
        with self._cond:
            return self._enqueued - self._done

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
        bodies = BodyStore(db)
        try:
            stop = False
            while not stop:
                batch = [self._queue.get()]
                while len(batch) < _MAX_BATCH and batch[-1] is not _STOP:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                if batch[-1] is _STOP:
                    batch.pop()
                    stop = True
                if batch:
                    self._busy_since = time.monotonic()
                    try:
                        results = self._write(db, bodies, batch)
                    except BaseException as exc:  # nothing a batch does may end the writer
                        log.exception("recorder batch of %d turn(s) failed", len(batch))
                        bodies.reset()
                        results = [RecorderError(f"writing turns failed: {type(exc).__name__}: {exc}")] * len(batch)
                    finally:
                        self._busy_since = None
                    self._settle(batch, results)
        finally:
            db.close()
            with self._cond:
                self._cond.notify_all()

    def _write(self, db, bodies: BodyStore, batch: list[tuple[Turn, Future]]) -> list[Exception | None]:
        """Each turn's outcome: None (committed) or the error that lost it."""
        try:
            self._write_retrying(db, bodies, [turn for turn, _ in batch])
            return [None] * len(batch)
        except Exception:
            # One bad turn must not take the others with it: retry one by one.
            results: list[Exception | None] = []
            for turn, _ in batch:
                try:
                    self._write_retrying(db, bodies, [turn])
                    results.append(None)
                except Exception as exc:
                    results.append(exc if isinstance(exc, RecorderError) else RecorderError(str(exc)))
            return results

    def _write_retrying(self, db, bodies: BodyStore, turns: list[Turn]) -> None:
        """`write_turns`, waiting out another connection's write lock (an analyzer
        or `sqlite3` shell holding a transaction) instead of losing the turns;
        `health()` reports the wait once it passes `stuck_after_s`."""
        while True:
            try:
                write_turns(db, turns, self.redactor, bodies)
                return
            except RecorderError as exc:
                cause = exc.__cause__
                busy = isinstance(cause, sqlite3.OperationalError) and getattr(
                    cause, "sqlite_errorname", "") in ("SQLITE_BUSY", "SQLITE_LOCKED")
                if not busy or self._stopping:
                    raise
                time.sleep(_BUSY_RETRY_S)

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
