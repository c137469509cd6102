"""A transcript imported as a stream: turns written in batches as the file is read, memory bounded.

A Codex rollout, a Claude Code or pi session file of gigabytes is read line by line
(recorder/transcripts/lines.py) and its calls are rebuilt one at a time (each reader's `stream`);
every BATCH_TURNS turns (or BATCH_BYTES of file) are written in one transaction, with the memos that
make a shared history cheap to store (item texts, redacted objects, body ids) kept across batches and
bounded. opencode's database or JSON storage is read session by session, message by message
(`opencode.stream`, `opencode_json.stream`). In a directory, a resumed
Claude Code session's new file repeats the calls of the file it resumed: the first file (in path
order) keeps them, as a whole read does (`recorder/transcripts/__init__.py` `_once`).

What was committed stays: a file cut off mid-line, a line that is not JSON, Ctrl-C or SIGTERM stop
the import with what it stored and where it stopped (`ImportStopped`), and running the same import
again replaces those turns (ids are per session, file and call number), never duplicating them.
Turns an older prefixtrace stored under its id form (session and call number, no file) are
replaced too (`forget_older_ids`).
"""

from __future__ import annotations

import hashlib
import json
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sqlite_utils

from prefixtrace.common.errors import InvalidRequest, PrefixtraceError
from recorder.item_texts import SharedItemTexts
from recorder.rows import BodyStore, redacted_row, renderers_of, write_rows
from recorder.schema import open_db
from recorder.transcripts import (Transcripts, all_counted_there, claude_code, codex, counted_there, first_file,
                                  opencode, opencode_json, pi, read_transcripts)
from recorder.transcripts.common import Stream, Transcript
from recorder.transcripts.lines import JsonLines
from recorder.transcripts.store import RedactOnce
from recorder.turn import Turn

BATCH_TURNS = 64
BATCH_BYTES = 32 << 20  # of file read: a batch of few calls with huge outputs is still written soon
BODY_CACHE_ENTRIES = 50_000  # per body-id cache: a miss costs one indexed lookup, a hit saves it


def _codex(path: Path) -> Stream:
    lines = JsonLines(path)
    t, turns = codex.stream(path, lines)
    return Stream([t], turns, lines)


def _opencode(path: Path) -> Stream:
    """opencode's database, or its JSON storage (a directory)."""
    return opencode_json.stream(path) if path.is_dir() else opencode.stream(path)


STREAMED = {codex.HARNESS: _codex, claude_code.HARNESS: claude_code.stream, pi.HARNESS: pi.stream,
            opencode.HARNESS: _opencode}


@dataclass
class Progress:
    """Where an import stands, for a progress line."""

    read_bytes: int
    total_bytes: int
    turns: int  # turns written (committed)


class ImportStopped(PrefixtraceError):
    """The import stopped partway (bad line, interrupt); what it committed stays."""

    code = "import_stopped"

    def __init__(self, message: str, *, interrupted: bool = False):
        super().__init__(message)
        self.interrupted = interrupted


def older_id_prefix(t: Transcript) -> str:
    """The id form transcript turns had before ids named the file: session and call number only."""
    digest = hashlib.sha256(f"{t.harness}\0{t.session_id}".encode()).hexdigest()[:12]
    return f"transcript-{t.harness}-{digest}-"


def forget_older_ids(db: sqlite_utils.Database, t: Transcript) -> int:
    """Deletes the turns an older prefixtrace stored for this session and file under the older id
    form (its turns' `render` names the file): re-importing the file writes them under today's ids,
    so keeping them would count every call twice. Returns how many."""
    prefix = older_id_prefix(t)
    cur = db.execute("DELETE FROM turn_log WHERE request_id >= ? AND request_id < ? AND "
                     "json_extract(render, '$.transcript.file') = ?",
                     [prefix, prefix[:-1] + chr(ord("-") + 1), Path(t.source).name])
    return cur.rowcount


class _HeldSignals:
    """Ctrl-C and SIGTERM noted, not acted on, between `hold` and `release`, which then acts on them
    as their handlers would. Python runs signal handlers in the main thread only (elsewhere: no-op),
    and a mask would not do: the kernel may hand the signal to another thread."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.handlers: dict = {}
        self.noted: int | None = None

    def hold(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.handlers = {s: signal.signal(s, self._note) for s in self.SIGNALS}

    def _note(self, signum, frame) -> None:
        self.noted = signum

    def release(self) -> None:
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        handler = self.handlers.get(self.noted)
        if callable(handler):
            handler(self.noted, None)
        elif self.noted is not None:
            raise KeyboardInterrupt


class BatchWriter:
    """Writes turns in batches to one database, keeping the shared-history memos across batches."""

    def __init__(self, db_path: str | Path, redact_patterns=None):
        self.db = open_db(db_path)
        self.redactor = RedactOnce(redact_patterns)
        self.shared = SharedItemTexts(self.redactor)
        self.bodies = BodyStore(self.db)
        self.bodies.cache_limit = BODY_CACHE_ENTRIES
        self.written = 0

    def write(self, turns: list[Turn], before: Callable[[], None] | None = None) -> None:
        """One transaction: `before` (e.g. forgetting older ids), then the turns."""
        rows = [redacted_row(t, self.redactor, self.shared) for t in turns]
        self.redactor.forget()  # the batch's objects: later calls' shared items are the item-text memo's
        # The commit and its count go together: Ctrl-C or SIGTERM lands before the commit (the batch
        # rolled back) or after the count, never between them (a stop message one batch short).
        held = _HeldSignals()
        try:
            with self.db.atomic():
                if before is not None:
                    before()
                write_rows(self.db, rows, self.bodies, renderers_of(turns))
                held.hold()
            self.written += len(turns)
        finally:
            held.release()

    def restamp_notes(self, t: Transcript, first_id: str) -> None:
        """The session's final notes on its turns written before the last note was known: every id
        of this session and file (today's form: `first_id` less its call number), by key range."""
        prefix = first_id.rsplit("-", 1)[0] + "-"
        with self.db.atomic():
            self.db.execute(
                "UPDATE turn_log SET render = json_set(render, '$.transcript.not_rebuilt', json(?)) "
                "WHERE request_id >= ? AND request_id < ?",
                [json.dumps(t.notes, ensure_ascii=False), prefix, prefix[:-1] + chr(ord("-") + 1)])

    def close(self) -> None:
        self.db.close()


def import_transcript_file(path: Path, harness: str, db_path: str | Path, *, redact_patterns=None,
                           on_progress: Callable[[Progress], None] | None = None) -> tuple[int, list[Transcript]]:
    """Imports one session file of `harness` in batches; returns (turns written, its transcripts)."""
    writer = BatchWriter(db_path, redact_patterns)
    try:
        stream = STREAMED[harness](path)  # every harness of one session file
        _write_stream(writer, stream, on_progress)
        return writer.written, [t for t in stream.sessions if t.calls]
    finally:
        writer.close()


def import_read(transcripts: Transcripts, db_path: str | Path, *, redact_patterns=None) -> int:
    """Sessions already read whole (opencode's database) written session by session, in batches."""
    writer = BatchWriter(db_path, redact_patterns)
    try:
        for t in transcripts:
            _write_batches(writer, [t], iter(t.turns), lambda: 0, lambda: None, None, 0)
    finally:
        writer.close()
    return writer.written


def import_directory(path: Path, db_path: str | Path, *, redact_patterns=None,
                     on_progress: Callable[[Progress], None] | None = None) -> tuple[int, Transcripts]:
    """Every session under the directory `path`: those read whole written in batches, then each
    streamed harness's file streamed. A file that stops partway (a bad line) keeps what it wrote and
    is listed in `skipped` with where it stopped; an interrupt stops the whole import."""
    found = read_transcripts(path, defer=frozenset(STREAMED))
    writer = BatchWriter(db_path, redact_patterns)
    total = sum(f.stat().st_size for f, _ in found.deferred)
    done = 0
    seen: dict[tuple[str, str, str], str] = {}  # (harness, session, call key) -> the file that keeps it

    def moved(p: Progress) -> None:
        if on_progress is not None:
            on_progress(Progress(done + p.read_bytes, total, p.turns))

    try:
        for t in found:
            _write_batches(writer, [t], iter(t.turns), lambda: done, lambda: None, moved, total)
        for f, harness in found.deferred:
            try:
                stream = _counted_once(STREAMED[harness](f), seen, found.skipped)
                _write_stream(writer, stream, moved)
            except ImportStopped as exc:
                if exc.interrupted:
                    raise
                found.skipped.append((str(f), exc.message))
            except InvalidRequest as exc:  # before its first turn: nothing of it written
                found.skipped.append((str(f), exc.message))
            else:
                found.extend(t for t in stream.sessions if t.rebuilt_count)
            done += f.stat().st_size
    finally:
        writer.close()
    if not found:
        why = f"; passed over {len(found.skipped)} file(s), e.g. {found.skipped[0][0]}: {found.skipped[0][1]}" \
            if found.skipped else ""
        raise InvalidRequest(f"no Claude Code, Codex, pi or opencode session with a model call found under {path}{why}")
    return writer.written, found


def _counted_once(stream: Stream, seen: dict[tuple[str, str, str], str],
                  skipped: list[tuple[str, str]]) -> Stream:
    """`stream` less the calls an earlier file of the directory already holds (a resumed Claude Code
    session's new file repeats them: same session, same reply ids): counted in the first file once,
    noted in this one, and a session left with none is listed in `skipped`."""
    by_id: dict[str, Transcript] = {}
    dropped: dict[str, tuple[int, str]] = {}

    def turns() -> Iterator[Turn]:
        nonlocal by_id
        for turn in stream.turns:
            if turn.session_id not in by_id:  # sessions listed once the reader's first pass is done
                by_id = {t.session_id: t for t in stream.sessions}
            t = by_id[turn.session_id]
            first = first_file(seen, t, turn)
            if first == t.source:
                yield turn
            else:
                dropped[t.session_id] = (dropped.get(t.session_id, (0, ""))[0] + 1, first)
        for sid, (n, first) in dropped.items():
            t = by_id[sid]
            t.note(counted_there(n, first))
            t.calls, t.rebuilt = t.calls - n, t.rebuilt - n
            if not t.rebuilt:
                skipped.append((t.source, all_counted_there(t, first)))

    return Stream(stream.sessions, turns(), stream.where)


def _write_stream(writer: BatchWriter, stream: Stream, on_progress: Callable[[Progress], None] | None) -> None:
    stamped = {t.session_id: list(t.notes) for t in stream.sessions}
    where = stream.where
    firsts = _write_batches(writer, stream.sessions, stream.turns, lambda: where.position, lambda: where.lineno,
                            on_progress, where.size)
    for t in stream.sessions:
        t.end_stream()
        if t.session_id in firsts and t.notes != stamped.get(t.session_id):
            writer.restamp_notes(t, firsts[t.session_id])


def _write_batches(writer: BatchWriter, sessions: list[Transcript], turns: Iterator[Turn],
                   position: Callable[[], int], lineno: Callable[[], int | None], on_progress,
                   total: int) -> dict[str, str]:
    """Writes `turns` (of `sessions`) in batches; returns each session's first turn id. A stop (bad
    line, interrupt) raises ImportStopped saying what was kept."""
    start = writer.written  # the writer counts a batch with its commit: what this call kept is the difference
    first_ids: dict[str, str] = {}
    batch: list[Turn] = []
    first = True
    mark = 0

    def forget() -> None:
        for t in sessions:
            forget_older_ids(writer.db, t)

    def flush() -> None:
        nonlocal batch, first, mark
        if batch or first:
            writer.write(batch, forget if first else None)
            for turn in batch:
                first_ids.setdefault(turn.session_id, turn.request_id)
            batch, first, mark = [], False, position()
        if on_progress is not None:
            on_progress(Progress(position(), total, writer.written))

    try:
        for turn in turns:
            batch.append(turn)
            if len(batch) >= BATCH_TURNS or position() - mark >= BATCH_BYTES:
                flush()
        flush()
    except InvalidRequest as exc:
        kept = writer.written - start
        if not kept:  # refused before anything was written: the file's one-line error as it is
            raise
        raise ImportStopped(f"{exc.message}; {_kept(sessions, kept)}") from exc
    except KeyboardInterrupt as exc:
        kept = writer.written - start
        where = f"line {lineno():,}, " if lineno() else ""
        source = sessions[0].source if sessions else "the file"
        raise ImportStopped(f"import of {source} interrupted at {where}{position() / 1e6:,.1f} of "
                            f"{total / 1e6:,.1f} MB read; {_kept(sessions, kept)}", interrupted=True) from exc
    return first_ids


def _kept(sessions: list[Transcript], kept: int) -> str:
    if not kept:
        return "nothing of the file was written; running the same import again reads it from the start"
    which = f"session {sessions[0].session_id}" if len(sessions) == 1 else f"the file's {len(sessions)} sessions"
    return (f"{kept:,} turn(s) of {which} written before it are kept; running the same "
            "import again redoes the file safely (its turns are replaced, never duplicated)")
