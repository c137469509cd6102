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
    InvalidRequest as `path:line: why`."""

    def __init__(self, path: str | Path, max_line: int = MAX_LINE_BYTES):
        self.path = Path(path)
        self.max_line = max_line
        self.position = 0  # bytes read so far
        self.lineno = 0  # the last line read
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
                self.position += len(raw)
                if len(raw) > self.max_line:
                    raise InvalidRequest(f"{self.path}:{self.lineno}: a line longer than {self.max_line >> 20} MiB: "
                                         "not read (a session line is far shorter; is the file damaged?)",
                                         line=self.lineno)
                obj = self._parse(raw)
                if isinstance(obj, dict):
                    yield self.lineno, obj

    def _parse(self, raw: bytes):
        try:
            text = raw.decode("utf-8-sig" if self.lineno == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"{self.path}:{self.lineno}: not UTF-8 text (byte {exc.start + 1} of the line)",
                                 line=self.lineno) from exc
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            cut = "" if raw.endswith(b"\n") else " (the line is cut off: the file ends inside it)"
            raise InvalidRequest(f"{self.path}:{self.lineno}: not valid JSON{cut}: "
                                 f"{exc.msg.removesuffix(' at')} at column {exc.colno}", line=self.lineno) from exc
