"""Harness transcripts in: the session files Claude Code, Codex, pi and opencode keep on disk,
rebuilt into the requests the harness sent, as far as each file allows (docs/FORMATS.md "Transcripts").

`sniff_transcript(path)` names the harness of a file or directory (None: not a transcript);
`read_transcripts(path)` reads a file, a harness's session directory, or a whole harness home
(e.g. `~/.claude/projects`), into one `Transcript` per session; `transcript_turns` flattens them
into recorder Turns, ready for `store_turns` or the analyzer.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from prefixtrace.common.errors import InvalidRequest
from recorder.transcripts import claude_code, codex, opencode, opencode_json, pi
from recorder.transcripts.common import UPSTREAM_PREFIX, Transcript
from recorder.turn import Turn

HARNESSES = {"claude-code": claude_code, "codex": codex, "pi": pi}  # one JSONL file per session
SNIFF_LINES = 40
SNIFF_BYTES = 8 << 20

__all__ = ["HARNESSES", "Transcript", "Transcripts", "UPSTREAM_PREFIX", "read_transcripts",
           "sniff_transcript", "transcript_turns"]


def _head_objects(path: Path) -> list[dict]:
    """The first JSON-object lines of a file: SNIFF_LINES lines, reading at most SNIFF_BYTES of each.
    A line longer than that (Claude Code may open a session with one long pasted prompt, a Codex
    `session_meta` holds the whole base instructions) is passed over, not taken for the end of the
    JSON lines: the lines after it still name the harness."""
    out: list[dict] = []
    try:
        with open(path, "rb") as fh:
            for _ in range(SNIFF_LINES):
                raw = fh.readline(SNIFF_BYTES)
                if not raw:
                    break
                if not raw.endswith(b"\n") and len(raw) == SNIFF_BYTES:
                    _skip_line(fh)
                    continue
                try:
                    obj = json.loads(raw.decode("utf-8-sig"))
                except (UnicodeDecodeError, ValueError, RecursionError):
                    if not raw.strip():
                        continue
                    break  # not JSON lines: stop looking
                if isinstance(obj, dict):
                    out.append(obj)
    except OSError:
        return []
    return out


def _skip_line(fh) -> None:
    while True:
        chunk = fh.readline(SNIFF_BYTES)
        if not chunk or chunk.endswith(b"\n"):
            return


def sniff_transcript(path: str | Path) -> str | None:
    """The harness whose session file (or storage directory) `path` is, else None. Only a regular
    file is opened: a FIFO or a device would block the read or never end."""
    p = Path(path)
    if p.is_dir():
        if opencode.looks_like_dir(p):
            return opencode.HARNESS
        return None
    if not p.is_file():
        return None
    if opencode.looks_like_file(p):
        return opencode.HARNESS
    objs = _head_objects(p)
    if not objs or any("request" in o for o in objs):  # prefixtrace's own JSONL
        return None
    for name, module in HARNESSES.items():
        if module.looks_like(objs):
            return name
    return None


class Transcripts(list):
    """The sessions read (a list of `Transcript`) and, for a directory, the files passed over:
    `skipped` holds (path, why) for each, so nothing is left out without a word."""

    def __init__(self, items=(), skipped: list[tuple[str, str]] | None = None):
        super().__init__(items)
        self.skipped = skipped or []
        self.deferred: list[tuple[Path, str]] = []  # (file, harness) left to the caller to stream

    def poorly_rebuilt(self) -> list[Transcript]:
        """Sessions that rebuilt fewer than half of the calls their file holds: an analysis of them
        would answer for calls it does not have."""
        return [t for t in self if t.calls and t.rebuilt_count * 2 < t.calls]


def _special(p: Path) -> str | None:
    """Why `p` is not read as a file (a FIFO, socket or device: opening it would block or never end)."""
    if p.is_symlink() and not p.exists():
        return "a dangling symbolic link"
    mode = p.stat().st_mode
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe), not a file"
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        return "a special file (socket or device), not a regular file"
    return None


def read_transcripts(path: str | Path, defer: frozenset[str] = frozenset()) -> Transcripts:
    """Every session under `path`: one transcript file, a harness's session directory (searched
    recursively for session files), or opencode's storage. Raises InvalidRequest when nothing
    there is a transcript of a known harness; a directory's other files are listed in `skipped`.
    A directory's session files of a harness in `defer` are not read but listed in `deferred`
    (an import streams them one by one: recorder/transcripts/streamed.py)."""
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise InvalidRequest(f"{p} does not exist")
    if (why := _special(p)) is not None:
        raise InvalidRequest(f"{p} is {why}")
    if p.is_dir():
        found: list[Transcript] = []
        skipped: list[tuple[str, str]] = []
        deferred: list[tuple[Path, str]] = []
        for db in sorted(p.rglob(opencode.DB_NAME)):
            if _special(db) is None and opencode.looks_like_file(db):
                if opencode.HARNESS in defer:
                    deferred.append((db, opencode.HARNESS))
                else:
                    found.extend(opencode.read(db))
        storage = opencode_json.find_storage(p)
        if storage is not None:  # one without messages is read here: the error below names it
            if opencode.HARNESS in defer and any((storage / "message").rglob("*.json")):
                deferred.append((storage, opencode.HARNESS))
            else:
                found.extend(opencode_json.read(storage))
        for f in sorted(p.rglob("*.jsonl")):
            if (why := _special(f)) is not None:
                skipped.append((str(f), why))
                continue
            if not f.is_file():
                continue
            name = sniff_transcript(f)
            if name not in HARNESSES:
                skipped.append((str(f), "not a session file of Claude Code, Codex or pi"))
                continue
            if name in defer:
                deferred.append((f, name))
                continue
            try:
                found.extend(HARNESSES[name].read(f))
            except InvalidRequest as exc:  # one bad file does not hide the others: it is named
                skipped.append((str(f), exc.message))
        if found or deferred:
            out = Transcripts(_once(found, skipped), skipped)
            out.deferred = deferred
            return out
        hint = f" ({storage}: opencode's JSON storage, holding no session with a model call)" if storage else ""
        hint += f"; passed over {len(skipped)} file(s), e.g. {skipped[0][0]}: {skipped[0][1]}" if skipped else ""
        raise InvalidRequest(f"no Claude Code, Codex, pi or opencode session found under {p}{hint}")
    kind = sniff_transcript(p)
    if kind == opencode.HARNESS:
        return Transcripts(opencode.read(p))
    if kind is not None:
        return Transcripts(HARNESSES[kind].read(p))
    if p.name == opencode.DB_NAME or _starts_with(p, opencode.SQLITE_MAGIC):
        raise InvalidRequest(f"{p} is an SQLite database but not a readable opencode database "
                             "(damaged, or without opencode's session, message and part tables)")
    raise InvalidRequest(f"{p} is not a Claude Code, Codex, pi or opencode session file")


def _once(found: list[Transcript], skipped: list[tuple[str, str]]) -> list[Transcript]:
    """Each call once: a resumed Claude Code session's new file repeats the calls of the file it
    resumed (same session id, same reply ids); counted twice they would read as breaks. The first
    file (in path order) keeps them; the later one says how many it gave up."""
    seen: dict[tuple[str, str, str], str] = {}
    out = []
    for t in found:
        kept, first_dropped = [], None
        for turn in t.turns:
            first = first_file(seen, t, turn)
            if first == t.source:
                kept.append(turn)
            else:
                first_dropped = first_dropped or first
        if len(kept) < len(t.turns):
            t.note(counted_there(len(t.turns) - len(kept), first_dropped))
            t.calls -= len(t.turns) - len(kept)
            t.turns = kept
            t.stamp_notes()  # the notes travel on every turn
        if t.turns:
            out.append(t)
        elif first_dropped:
            skipped.append((t.source, all_counted_there(t, first_dropped)))
    return out


def first_file(seen: dict[tuple[str, str, str], str], t: Transcript, turn: Turn) -> str:
    """The file that keeps `turn`'s call: the first (in path order) of those read so far that holds it
    (`seen`: (harness, session, call key) -> file; a call without a key is its own file's)."""
    key = t.call_keys.get(turn.request_id)
    return seen.setdefault((t.harness, t.session_id, key), t.source) if key else t.source


def counted_there(n: int, first: str) -> str:
    return f"{n} call(s) also in {Path(first).name}: counted there once"


def all_counted_there(t: Transcript, first: str) -> str:
    return f"every call of session {t.session_id} is also in {Path(first).name}"


def _starts_with(p: Path, magic: bytes) -> bool:
    try:
        with open(p, "rb") as fh:
            return fh.read(len(magic)) == magic
    except OSError:
        return False


def transcript_turns(path: str | Path) -> tuple[list, Transcripts]:
    """(every rebuilt turn, ordered by time, and the transcripts they came from)."""
    transcripts = read_transcripts(path)
    turns = [turn for t in transcripts for turn in t.turns]
    return sorted(turns, key=lambda t: (t.started_at, t.request_id)), transcripts
