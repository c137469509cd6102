"""Transcript turns into a database, and the checks an import or analysis of transcripts makes first.

Rebuilt turns share their history's message objects (each call's list holds the previous call's
messages, the same objects), so a session of n calls holds n messages, not n²/2. The redactor is
run once per message object (`RedactOnce`), not once per message per call: a 1,000-call session
redacts 1,000 messages, not half a million.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from prefixtrace.common.errors import InvalidRequest
from recorder.jsonl import store_turns
from recorder.redact import Redactor


class RedactOnce(Redactor):
    """A Redactor that remembers what it made of each dict or list object it was given whole (by
    identity: the objects are kept alive here, so an id is never reused while remembered). Past
    `limit` objects it forgets them all: a streamed import must not hold every message of a multi-GB
    file, and forgetting costs only a second redaction of an object met again."""

    def __init__(self, *args: Any, limit: int = 20_000, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._done: dict[int, tuple[Any, Any]] = {}
        self.limit = limit

    def forget(self) -> None:
        self._done.clear()

    def value(self, value: Any, skip: frozenset = frozenset()) -> Any:
        if skip or not isinstance(value, dict):
            return super().value(value, skip)
        hit = self._done.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1]
        out = super().value(value, skip)
        if len(self._done) >= self.limit:
            self._done.clear()
        self._done[id(value)] = (value, out)
        return out


def store_transcript_turns(db_path: str | Path, turns: list, redact_patterns=None) -> int:
    """`store_turns` for rebuilt turns: one transaction, each shared message redacted once."""
    return store_turns(db_path, turns, redactor=RedactOnce(redact_patterns))


def refuse_special(p: Path) -> None:
    """A FIFO, socket or device named as the input: reading it would block or never end."""
    try:
        mode = p.stat().st_mode
    except OSError:
        return  # absent or unreadable: the reader says so in its own words
    if stat.S_ISFIFO(mode):
        raise InvalidRequest(f"{p} is a FIFO (named pipe), not a file: give a file or a directory")
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise InvalidRequest(f"{p} is a special file (socket or device), not a file or a directory")


def refuse_poorly_rebuilt(transcripts: list) -> None:
    """An analysis of sessions that rebuilt fewer than half of their file's calls would answer for
    calls it does not have: refused, naming each (import stores them and then exits non-zero)."""
    poor = transcripts.poorly_rebuilt() if hasattr(transcripts, "poorly_rebuilt") else []
    if poor:
        raise InvalidRequest("; ".join(
            f"{t.source} ({t.harness} {t.version}) rebuilt {t.rebuilt_count} of its {t.calls} call(s), fewer than half "
            f"({'; '.join(n for n in t.notes if 'left out' in n or 'missing' in n) or 'see import'}): not analysed"
            for t in poor))
