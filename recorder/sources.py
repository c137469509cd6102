"""One entry point per direction over every format: database, JSONL, HAR.

`load_turns` reads any source (sniffed by content, not extension), `export`
writes a database out as JSONL or HAR, `import_file` reads JSONL or HAR into a
database, all or nothing.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path
from typing import IO

from prefixtrace.common.errors import InvalidRequest
from recorder.files import open_private
from recorder.har import read_har, write_har
from recorder.jsonl import _write as write_jsonl_lines
from recorder.jsonl import read_jsonl, store_turns
from recorder.reader import iter_turns, read_renderers
from recorder.turn import Turn

SQLITE_MAGIC = b"SQLite format 3\x00"
FORMATS = ("jsonl", "har")
_HAR_START = re.compile(rb'^\s*\{\s*"log"\s*:')


def sniff(path: str | Path) -> str:
    """"sqlite", "har" or "jsonl", from the file's first bytes."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            head = fh.read(4096)
    except OSError as exc:
        raise InvalidRequest(f"cannot read {p}: {exc}") from exc
    if head.startswith(SQLITE_MAGIC):
        return "sqlite"
    if _HAR_START.match(head.lstrip(b"\xef\xbb\xbf")) or p.suffix.lower() == ".har":
        return "har"
    return "jsonl"


def load_turns(source: str | Path, session: str | None = None) -> list[Turn]:
    """Every turn of a database, JSONL or HAR file or harness transcript, ordered by start time.
    With `session`, only turns recorded with that session id."""
    from recorder.transcripts import sniff_transcript, transcript_turns

    from recorder.transcripts.store import refuse_special

    refuse_special(Path(source))
    if Path(source).is_dir() or sniff_transcript(source) is not None:
        turns = transcript_turns(source)[0]
    elif (kind := sniff(source)) == "sqlite":
        return list(iter_turns(source, session=session))
    else:
        turns = read_har(source) if kind == "har" else read_jsonl(source)
    if session is not None:
        turns = [t for t in turns if t.session_id == session]
    return sorted(turns, key=lambda t: (t.started_at, t.request_id))


def export(db_path: str | Path, out: str | Path | IO[str], fmt: str = "jsonl", session: str | None = None,
           request_ids: Collection[str] | None = None) -> int:
    """Writes the turns of a database as `fmt` ("jsonl" or "har") to a path
    or an open text file; returns how many. `request_ids` keeps only those
    turns (an inferred session is a set of requests, not a stored id). A path
    is written only once the whole export succeeded (temporary file, then rename)."""
    if fmt not in FORMATS:
        raise InvalidRequest(f"unknown export format {fmt!r}; expected one of {', '.join(FORMATS)}")
    writer = write_har if fmt == "har" else write_jsonl_lines
    turns = iter_turns(db_path, session=session)
    if request_ids is not None:
        wanted = set(request_ids)
        turns = (t for t in turns if t.request_id in wanted)
    renderers = read_renderers(db_path)  # carried along, so the file is counted as the database is
    if hasattr(out, "write"):
        return writer(turns, out, renderers)
    target = Path(out)
    tmp = target.with_name(f".{target.name}.partial")
    try:
        with open_private(tmp) as fh:  # 0600, like the database it comes from
            count = writer(turns, fh, renderers)
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return count


def import_path(path: str | Path, db_path: str | Path, *, redact_patterns: list[str] | None = None,
                on_progress=None):
    """`import_file` for JSONL and HAR; a harness transcript (a file, or a directory of them) is
    rebuilt into turns first. One session file is imported as a stream, in batches, `on_progress`
    called after each (recorder/transcripts/streamed.py). Returns (turns imported, the transcripts
    read; empty for JSONL/HAR)."""
    from recorder.transcripts import Transcripts, read_transcripts, sniff_transcript
    from recorder.transcripts.store import refuse_special
    from recorder.transcripts.streamed import STREAMED, import_directory, import_read, import_transcript_file

    p = Path(path)
    refuse_special(p)
    harness = None if p.is_dir() else sniff_transcript(p)
    if harness in STREAMED:  # one session file: written in batches as it is read (a rollout may be GBs)
        count, transcripts = import_transcript_file(p, harness, db_path, redact_patterns=redact_patterns,
                                                    on_progress=on_progress)
        return count, Transcripts(transcripts)
    if p.is_dir():  # each session in batches, each streamed harness's file streamed
        return import_directory(p, db_path, redact_patterns=redact_patterns, on_progress=on_progress)
    # opencode's database by name too: a damaged one is then said to be that, not "a database"
    if p.name == "opencode.db" or harness is not None:
        transcripts = read_transcripts(p)
        return import_read(transcripts, db_path, redact_patterns=redact_patterns), transcripts
    return import_file(p, db_path, redact_patterns=redact_patterns), []


def import_file(path: str | Path, db_path: str | Path, *, redact_patterns: list[str] | None = None) -> int:
    """Imports a JSONL or HAR file into the database at `db_path` (created if
    missing): the whole file is parsed first, then written in one
    transaction. Returns the number of turns imported."""
    from recorder.transcripts import sniff_transcript, transcript_turns

    if Path(path).is_dir() or sniff_transcript(path) is not None:
        return store_turns(db_path, transcript_turns(path)[0], redact_patterns)
    kind = sniff(path)
    if kind == "sqlite":
        raise InvalidRequest(f"{path} is a database; import takes a JSONL or HAR file")
    return store_turns(db_path, read_har(path) if kind == "har" else read_jsonl(path), redact_patterns)
