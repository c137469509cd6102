"""Harness transcripts in: the session files Claude Code, Codex, pi and opencode keep on disk,
rebuilt into the requests the harness sent, as far as each file allows (docs/FORMATS.md "Transcripts").

`sniff_transcript(path)` names the harness of a file or directory (None: not a transcript);
`read_transcripts(path)` reads a file, a harness's session directory, or a whole harness home
(e.g. `~/.claude/projects`), into one `Transcript` per session; `transcript_turns` flattens them
into recorder Turns, ready for `store_turns` or the analyzer.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.errors import InvalidRequest
from recorder.transcripts import claude_code, codex, opencode, pi
from recorder.transcripts.common import UPSTREAM_PREFIX, Transcript

HARNESSES = {"claude-code": claude_code, "codex": codex, "pi": pi}  # one JSONL file per session
SNIFF_LINES = 40
SNIFF_BYTES = 8 << 20

__all__ = ["HARNESSES", "Transcript", "UPSTREAM_PREFIX", "read_transcripts",
           "sniff_transcript", "transcript_turns"]


def _head_objects(path: Path) -> list[dict]:
    """The first JSON-object lines of a file: SNIFF_LINES lines or SNIFF_BYTES, whichever ends
    first (Claude Code may open a session with bookkeeping lines, or one long pasted prompt)."""
    out: list[dict] = []
    try:
        with open(path, "rb") as fh:
            read = 0
            for _ in range(SNIFF_LINES):
                raw = fh.readline(SNIFF_BYTES - read)
                if not raw:
                    break
                read += len(raw)
                try:
                    obj = json.loads(raw.decode("utf-8-sig"))
                except (UnicodeDecodeError, ValueError, RecursionError):
                    if not raw.strip():
                        continue
                    break  # not JSON lines (or a line past the byte budget): stop looking
                if isinstance(obj, dict):
                    out.append(obj)
                if read >= SNIFF_BYTES:
                    break
    except OSError:
        return []
    return out


def sniff_transcript(path: str | Path) -> str | None:
    """The harness whose session file (or storage directory) `path` is, else None."""
    p = Path(path)
    if p.is_dir():
        if opencode.looks_like_dir(p):
            return opencode.HARNESS
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


def read_transcripts(path: str | Path) -> list[Transcript]:
    """Every session under `path`: one transcript file, a harness's session directory (searched
    recursively for session files), or opencode's storage. Raises InvalidRequest when nothing
    there is a transcript of a known harness."""
    p = Path(path)
    if not p.exists():
        raise InvalidRequest(f"{p} does not exist")
    if p.is_dir():
        found: list[Transcript] = []
        for db in sorted(p.rglob(opencode.DB_NAME)):
            if opencode.looks_like_file(db):
                found.extend(opencode.read(db))
        for f in sorted(p.rglob("*.jsonl")):
            name = sniff_transcript(f)
            if name in HARNESSES:
                found.extend(HARNESSES[name].read(f))
        if found:
            return found
        legacy = next((d for d in p.rglob("storage") if (d / "session").is_dir() and (d / "message").is_dir()), None)
        hint = f" ({legacy} looks like an older opencode's JSON storage, which is not read)" if legacy else ""
        raise InvalidRequest(f"no Claude Code, Codex, pi or opencode session found under {p}{hint}")
    kind = sniff_transcript(p)
    if kind == opencode.HARNESS:
        return opencode.read(p)
    if kind is not None:
        return HARNESSES[kind].read(p)
    raise InvalidRequest(f"{p} is not a Claude Code, Codex, pi or opencode session file")


def transcript_turns(path: str | Path) -> tuple[list, list[Transcript]]:
    """(every rebuilt turn, ordered by time, and the transcripts they came from)."""
    transcripts = read_transcripts(path)
    turns = [turn for t in transcripts for turn in t.turns]
    return sorted(turns, key=lambda t: (t.started_at, t.request_id)), transcripts
