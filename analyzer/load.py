"""Reading requests for analysis: JSONL (wrapped or bare) or a recorder database.

Unlike the recorder's import (all-or-nothing), analysis skips a malformed
line and reports it with its line number: one bad line out of a thousand
must not hide the other 999.

Speed: a recorded session resends its whole history every turn, so line N+1
repeats most of line N's bytes. `IncrementalParser` parses only the messages
that are new since the previous line of the same session and reuses the
previous line's parsed message objects for the rest (verified by comparing
the raw bytes, never assumed). Sharing objects also lets later stages cache
per-message work by identity. Whatever the source, `share_prefix` makes equal
leading messages of a session the same objects.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixtrace.errors import InvalidRequest

SQLITE_MAGIC = b"SQLite format 3\x00"
_MESSAGES_KEY = '"messages":'
_SESSION_RE = re.compile(r'"session"\s*:\s*"((?:[^"\\]|\\.)*)"')
_WS = " \t\r\n"
_DECODER = json.JSONDecoder()


@dataclass
class Request:
    """One request to analyse. `reported_*` are what the server said; None = unknown."""

    id: str
    ts: float
    body: Any
    session: str | None = None
    line: int | None = None
    reported_prompt_tokens: int | None = None
    reported_cached_tokens: int | None = None


@dataclass
class Loaded:
    requests: list[Request] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"line": N, "error": "..."}


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def request_from_record(obj: Any, lineno: int, source: str) -> Request:
    """A wrapped record or a bare request body as a Request (rules of
    docs/FORMATS.md). Raises InvalidRequest when it is neither."""
    if not isinstance(obj, dict):
        raise InvalidRequest(f"expected a JSON object, got {type(obj).__name__}")
    if "request" not in obj:
        if not isinstance(obj.get("messages"), list):
            raise InvalidRequest('expected a wrapped turn (with "request") or a request body (with "messages")')
        return Request(f"{source}:{lineno}", float(lineno), obj, None, lineno)
    ts = obj.get("ts")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise InvalidRequest('"ts" must be a number')
    session = obj.get("session")
    tokens = obj.get("tokens") if isinstance(obj.get("tokens"), dict) else None
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    if tokens is not None:
        prompt, cached = _int_or_none(tokens.get("prompt")), _int_or_none(tokens.get("cached"))
    else:
        details = usage.get("prompt_tokens_details")
        prompt = _int_or_none(usage.get("prompt_tokens"))
        cached = _int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Request(
        str(obj.get("id") or f"{source}:{lineno}"),
        float(ts) if ts is not None else float(lineno),
        obj["request"],
        str(session) if session is not None else None,
        lineno,
        prompt,
        cached,
    )


@dataclass
class _ArrayState:
    text: str  # the raw messages array, "[" to "]"
    ends: list[int]  # end offset (in text) of each element
    items: list[Any]


class IncrementalParser:
    """json.loads for JSONL lines whose `messages` arrays repeat earlier lines'."""

    def __init__(self) -> None:
        self._last: dict[str | None, _ArrayState] = {}

    def loads(self, line: str) -> Any:
        start = line.find(_MESSAGES_KEY)
        if start < 0:
            return json.loads(line)
        arr = start + len(_MESSAGES_KEY)
        while arr < len(line) and line[arr] in _WS:
            arr += 1
        if arr >= len(line) or line[arr] != "[":
            return json.loads(line)
        m = _SESSION_RE.search(line, 0, start)
        hint = m.group(1) if m else None
        parsed = self._parse_array(line, arr, self._last.get(hint) or self._last.get(None))
        if parsed is None:
            return json.loads(line)
        state, end = parsed
        obj = json.loads(line[:arr] + "null" + line[end:])
        # The key we found must be the request's own "messages", else parse in full.
        holder = obj.get("request") if isinstance(obj, dict) and "request" in obj else obj
        if not isinstance(holder, dict) or "messages" not in holder or holder["messages"] is not None:
            return json.loads(line)
        holder["messages"] = list(state.items)
        self._last[hint] = state
        self._last[None] = state
        return obj

    def _parse_array(self, line: str, arr: int, prev: _ArrayState | None) -> tuple[_ArrayState, int] | None:
        items: list[Any] = []
        ends: list[int] = []
        pos = arr + 1
        if prev is not None:
            n = min(len(prev.text), len(line) - arr)
            common = _common_prefix(prev.text, line[arr : arr + n])
            for item, end in zip(prev.items, prev.ends):
                if end > common:
                    break
                items.append(item)
                ends.append(end)
            if ends:
                pos = arr + ends[-1]
        try:
            while True:
                while line[pos] in _WS:
                    pos += 1
                if line[pos] == "]":
                    break
                if items:
                    if line[pos] != ",":
                        return None
                    pos += 1
                    while line[pos] in _WS:
                        pos += 1
                item, pos = _DECODER.raw_decode(line, pos)
                items.append(item)
                ends.append(pos - arr)
        except (IndexError, json.JSONDecodeError):
            return None
        return _ArrayState(line[arr : pos + 1], ends, items), pos + 1


def _common_prefix(a: str, b: str, chunk: int = 65536) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + chunk] == b[i : i + chunk]:
        i += chunk
    if i >= n:
        return n
    lo, hi = i, min(i + chunk, n)
    while hi - lo > 64:  # bisect inside the differing chunk
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


def read_jsonl(path: Path) -> Loaded:
    """Requests of a JSONL file in file order; bad lines go to `skipped`."""
    out = Loaded()
    parser = IncrementalParser()
    try:
        fh = open(path, encoding="utf-8", errors="strict")
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path}: {exc}") from exc
    with fh:
        lineno = 0
        while True:
            lineno += 1
            try:
                line = fh.readline()
            except UnicodeDecodeError as exc:
                out.skipped.append({"line": lineno, "error": f"not UTF-8: {exc.reason}"})
                fh.readline()  # cannot resync a text stream reliably; the next line is lost too
                continue
            if not line:
                break
            if not line.strip():
                continue
            try:
                obj = parser.loads(line)
                out.requests.append(request_from_record(obj, lineno, path.name))
            except json.JSONDecodeError as exc:
                out.skipped.append({"line": lineno, "error": f"not valid JSON: {exc.msg}"})
            except InvalidRequest as exc:
                out.skipped.append({"line": lineno, "error": exc.message})
    return out


def _from_turns(turns: Iterable[Any]) -> Loaded:
    out = Loaded()
    for t in turns:
        out.requests.append(Request(t.request_id, t.started_at, t.request_body, t.session_id, None,
                                    t.prompt_tokens, t.cached_tokens))
    return out


def load(source: str | Path | Iterable[Any]) -> Loaded:
    """Requests from a recorder database or JSONL path (sniffed by content),
    an iterable of recorder Turns, or of request bodies / Requests. Sorted by
    time (stable, so file order breaks ties)."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            with open(path, "rb") as fh:
                magic = fh.read(len(SQLITE_MAGIC))
        except OSError as exc:
            raise InvalidRequest(f"cannot read {path}: {exc}") from exc
        if magic == SQLITE_MAGIC:
            from recorder.reader import iter_turns  # the recorder is only needed for databases

            loaded = _from_turns(iter_turns(path))
        else:
            loaded = read_jsonl(path)
    else:
        items = list(source)
        loaded = Loaded()
        for i, item in enumerate(items):
            if isinstance(item, Request):
                loaded.requests.append(item)
            elif hasattr(item, "request_body"):  # a recorder Turn
                loaded.requests.extend(_from_turns([item]).requests)
            else:  # a body; one that is not an object is reported as unrenderable later
                loaded.requests.append(Request(f"request-{i}", float(i), item, None, None))
    loaded.requests.sort(key=lambda r: r.ts)
    return loaded


def share_prefix(prev: list | None, messages: list) -> list:
    """`messages` with its leading messages equal to `prev`'s replaced by
    `prev`'s objects (identity makes later per-message caches hit)."""
    if not prev:
        return messages
    n = min(len(prev), len(messages))
    if messages[:n] == prev[:n]:  # C-speed, identity first (the incremental parser already shares)
        return prev[:n] + messages[n:]
    out = list(messages)
    for i in range(min(len(prev), len(out))):
        if out[i] is prev[i]:
            continue
        if out[i] != prev[i]:
            break
        out[i] = prev[i]
    return out


def iter_bodies(requests: Iterable[Request]) -> Iterator[Any]:
    for r in requests:
        yield r.body
