"""A session file's JSON lines read as a stream: one line in memory at a time, however large the file.

Real Codex rollouts reach gigabytes; reading one whole (`read_text`, then a list of every object)
holds the file several times over. Here each line is read in binary, bounded by MAX_LINE_BYTES,
decoded and parsed on its own, and the bytes read so far are counted (`position`) for a progress
line. A line past the bound is refused in one line naming its number: holding it would be the
unbounded read this module exists to avoid, and skipping it would rebuild calls without one of
their items (docs/FORMATS.md "Streamed import").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from prefixtrace.common.errors import InvalidRequest

MAX_LINE_BYTES = 256 << 20  # a Codex `compacted` line holds a whole replacement history (a few MB in real files)


class JsonLines:
    """Iterates (line number, object) over the JSON-object lines of `path`; other JSON values and
    blank lines are passed over. Errors (unreadable, not UTF-8, not JSON, a line too long) raise
    InvalidRequest as `path:line: why`. `start` and `part` say where the object last yielded lies, for
    reading it back later (`LinesAt`) instead of holding it.

    With `glued`, a line holding several JSON values written without a newline between them (pi
    appends an entry to a line that lost its newline) yields each of them (`glued_lines` counts
    those lines); without it such a line is not valid JSON."""

    def __init__(self, path: str | Path, max_line: int = MAX_LINE_BYTES, *, glued: bool = False):
        self.path = Path(path)
        self.max_line = max_line
        self.glued = glued
        self.glued_lines = 0
        self.position = 0  # bytes read so far
        self.lineno = 0  # the last line read
        self.start = 0  # byte offset of the last line read
        self.part = 0  # which value of that line (0 but on a glued line)
        try:
            self.size = self.path.stat().st_size
        except OSError as exc:
            raise InvalidRequest(f"cannot read {self.path}: {exc.strerror or exc}") from exc

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        try:
            fh = open(self.path, "rb")
        except OSError as exc:
            raise InvalidRequest(f"cannot read {self.path}: {exc.strerror or exc}") from exc
        with fh:
            while True:
                raw = fh.readline(self.max_line + 1)
                if not raw:
                    return
                self.lineno += 1
                self.start = self.position
                self.position += len(raw)
                if len(raw) > self.max_line:
                    raise InvalidRequest(f"{self.path}:{self.lineno}: a line longer than {self.max_line >> 20} MiB: "
                                         "not read (a session line is far shorter; is the file damaged?)",
                                         line=self.lineno)
                values = parse_line(self.path, self.lineno, raw, self.glued)
                self.glued_lines += len(values) > 1
                for self.part, obj in enumerate(values):
                    if isinstance(obj, dict):
                        yield self.lineno, obj


def parse_line(path: Path, lineno: int, raw: bytes, glued: bool = False) -> list:
    """The JSON values of one line (none for a blank line; several only `glued`)."""
    try:
        text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{path}:{lineno}: not UTF-8 text (byte {exc.start + 1} of the line)",
                             line=lineno) from exc
    text = text.strip()
    values, at = [], 0
    try:
        if not glued:
            return [json.loads(text)] if text else []
        while at < len(text):  # the stdlib decoder's raw_decode splits values written end to end
            value, at = _DECODER.raw_decode(text, at)
            values.append(value)
            while at < len(text) and text[at].isspace():
                at += 1
    except json.JSONDecodeError as exc:
        cut = "" if raw.endswith(b"\n") else " (the line is cut off: the file ends inside it)"
        raise InvalidRequest(f"{path}:{lineno}: not valid JSON{cut}: "
                             f"{exc.msg.removesuffix(' at')} at column {exc.colno}", line=lineno) from exc
    return values


_DECODER = json.JSONDecoder()


class LinesAt:
    """Reads back a line `JsonLines` passed (by its `start` and `part`): a reader keeps where each line
    lies, not the line, and reads again only the lines a later call's history needs."""

    def __init__(self, path: str | Path, glued: bool = False):
        self.path = Path(path)
        self.glued = glued
        self._fh = None

    def get(self, start: int, part: int = 0) -> dict:
        if self._fh is None:
            try:
                self._fh = open(self.path, "rb")
            except OSError as exc:
                raise InvalidRequest(f"cannot read {self.path}: {exc.strerror or exc}") from exc
        self._fh.seek(start)
        raw = self._fh.readline(MAX_LINE_BYTES + 1)
        # line 1 only matters for its BOM: any other number reads the line alike
        values = parse_line(self.path, 1 if start == 0 else 2, raw, self.glued)
        if len(values) <= part or not isinstance(values[part], dict):
            raise InvalidRequest(f"{self.path} changed while it was read (byte {start:,} no longer starts the "
                                 "line read there): import it again")
        return values[part]

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
