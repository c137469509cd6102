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
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefixtrace.common.errors import InvalidRequest
from prefixtrace.wire.messages import plain_session_id
from prefixtrace.wire.request import is_remote_compaction

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
    endpoint: str | None = None  # e.g. "/v1/messages": says which API the body is
    status: int | None = None  # HTTP status the client got; >= 400 = failed, listed but not chained
    error: str | None = None
    ts_given: bool = True  # False: the record had no time; `ts` only keeps it in file order
    unreadable: str | None = None  # why the body could not be read as a request of any API
    ttft_s: float | None = None  # recorded time to first token: what the turn cost in seconds
    # What the server recorded beside the prompt (docs/ANALYZER.md "The server's renderer"):
    renderer_id: str | None = None  # the `renderers` row that rendered and counted it
    upstream: str | None = None  # "embedded:<model>" or the upstream URL (names the fallback's fix)
    served_by: str | None = None  # the member that answered (routing)
    reply_token_ids: list[int] | None = None  # the engine's reply tokens, cached after the prompt
    cache_evictions: int | None = None  # the engine's prefix-cache evictions so far when it arrived
    usage: dict | None = None  # the usage object as the server sent it (cache read/write, diagnostics)
    total_s: float | None = None
    cache_miss_reason: str | None = None  # Anthropic cache diagnostics, when the response carried them
    cache_ttl_1h: bool = False  # an Anthropic request that asked for the 1 hour cache lifetime
    transcript: dict | None = None  # rebuilt from a harness transcript: harness, file, what was not rebuilt
    headers: dict | None = None  # the recorded request headers (credentials already dropped by the recorder)
    cache_params: dict | None = None  # analyzer/param_breakers.cache_params of the body as sent
    cache_blocks: Any = None  # analyzer/lookback.cache_blocks of a Messages body as sent
    harness: str | None = None  # analyzer/versions.harness_version: who sent it, at which version
    harness_version: str | None = None
    hashed: bool = False  # recorded with `serve --store hashes` (analyzer/hashed.py)
    proxy_fixes: list[dict] | None = None  # `serve --fix`: the fixes that fired on it (analyzer/fixes)
    reply: dict | None = None  # {"text", "reasoning", "tool_calls"} as the server answered (the fixes' record)
    compactions: frozenset = frozenset()  # server `compaction` items and compaction summaries it opens with


@dataclass
class Loaded:
    requests: list[Request] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"line": N, "error": "..."}
    renderers: dict[str, Any] = field(default_factory=dict)  # id -> recorder.renderers.RendererInfo (databases)
    replayed: int = 0  # turns `prefixtrace replay` sent (recorder/replay_mark.py): left out, counted
    remote_compactions: int = 0  # POST /v1/responses/compact turns: no call of the loop, left out, counted


def _server_facts(req: Request, render: Any, usage: Any, served_by: Any = None, renderer_id: Any = None) -> Request:
    """Fills what the server recorded beside the prompt into `req` (each fact only when well-formed)."""
    if isinstance(render, dict):
        ids = render.get("reply_token_ids")
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            req.reply_token_ids = ids
        req.cache_evictions = _int_or_none(render.get("cache_evictions"))
        fixes = render.get("fixes")
        if isinstance(fixes, list):
            req.proxy_fixes = [f for f in fixes if isinstance(f, dict) and f.get("fired") is True
                               and isinstance(f.get("name"), str) and isinstance(f.get("note"), str)] or None
    if isinstance(usage, dict):
        req.usage = usage
        diagnostics = usage.get("diagnostics")
        reason = diagnostics.get("cache_miss_reason") if isinstance(diagnostics, dict) else None
        if isinstance(reason, dict):
            reason = reason.get("type")
        req.cache_miss_reason = reason if isinstance(reason, str) else None
    req.served_by = served_by if isinstance(served_by, str) else None
    if "anthropic.com" in (req.upstream or "") and isinstance(req.body, dict):
        req.cache_ttl_1h = '"ttl":"1h"' in json.dumps(req.body, separators=(",", ":"))
    req.renderer_id = renderer_id if isinstance(renderer_id, str) else None
    return req


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


MS_THRESHOLD = 1e11  # epoch seconds reach 1e11 in the year 5138; a larger number is milliseconds
TS_KEYS = ("ts", "timestamp", "time", "created_at", "startedDateTime")
SESSION_KEYS = ("session", "session_id", "conversation_id")


def parse_ts(value: Any) -> float | None:
    """A record's time as epoch seconds: a number of seconds or milliseconds, a numeric string, or
    ISO-8601 with any offset (`Z`, `+02:00`; without one, UTC). None when absent. Raises
    InvalidRequest naming the value when it is none of these."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidRequest(f'"ts" must be a time, got {value!r}')
    if isinstance(value, (int, float)):
        ts = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            ts = float(text)
        except ValueError:
            try:
                moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
            except ValueError:
                raise InvalidRequest(f'"ts" {value[:40]!r} is neither epoch seconds/ms nor ISO-8601') from None
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=timezone.utc)
            return moment.timestamp()
    else:
        raise InvalidRequest(f'"ts" must be a number or an ISO-8601 string, got {type(value).__name__}')
    if not math.isfinite(ts):
        raise InvalidRequest(f'"ts" must be finite, got {value!r}')
    return ts / 1000.0 if abs(ts) >= MS_THRESHOLD else ts


def session_of(value: Any) -> str | None:
    """A session id as harnesses send it: Claude Code's JSON `metadata.user_id` (recorded as the
    session) names its conversation by `session_id` (prefixtrace.wire.messages.plain_session_id)."""
    if value is None:
        return None
    return plain_session_id(str(value))


def _first(obj: dict, keys: tuple[str, ...]) -> Any:
    for k in keys:
        if obj.get(k) is not None:
            return obj[k]
    return None


def _is_body(obj: dict) -> bool:
    return isinstance(obj.get("messages"), list) or "input" in obj or "instructions" in obj


def request_from_record(obj: Any, lineno: int, source: str) -> Request:
    """A wrapped record (this project's export, or any `{"request": …}` envelope) or a bare request
    body of any of the three APIs as a Request (docs/ANALYZER.md "Inputs"). Raises InvalidRequest
    with the reason when it is neither."""
    if not isinstance(obj, dict):
        raise InvalidRequest(f"expected a JSON object, got {type(obj).__name__}")
    if "request" not in obj:
        if not _is_body(obj):
            raise InvalidRequest('expected a wrapped turn (with "request") or a request body '
                                 '(with "messages", or "input" for the Responses API)')
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        session = session_of(meta.get("user_id")) if isinstance(meta.get("user_id"), str) and \
            '"session_id"' in meta["user_id"] else None
        return Request(f"{source}:{lineno}", float(lineno), obj, session, lineno, ts_given=False)
    body = obj["request"]
    endpoint = obj.get("endpoint") if isinstance(obj.get("endpoint"), str) else None
    if isinstance(body, dict) and not _is_body(body) and isinstance(body.get("body"), (dict, str)):
        # an HTTP-exchange envelope: {"request": {"url", "method", "body"}, "response": {...}}
        inner = body["body"]
        if isinstance(inner, str):
            try:
                inner = json.loads(inner)
            except ValueError:
                raise InvalidRequest('"request.body" is a string that is not JSON') from None
        if isinstance(body.get("url"), str) and endpoint is None:
            endpoint = "/" + body["url"].split("://", 1)[-1].split("/", 1)[-1].split("?", 1)[0]
        body = inner
    ts = parse_ts(_first(obj, TS_KEYS))
    session = session_of(_first(obj, SESSION_KEYS))
    tokens = obj.get("tokens") if isinstance(obj.get("tokens"), dict) else None
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    if tokens is not None:
        prompt, cached = _int_or_none(tokens.get("prompt")), _int_or_none(tokens.get("cached"))
    else:
        details = usage.get("prompt_tokens_details")
        prompt = _int_or_none(usage.get("prompt_tokens"))
        cached = _int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None
        if prompt is None and isinstance(usage.get("input_tokens"), int):  # Anthropic usage
            read = _int_or_none(usage.get("cache_read_input_tokens"))
            prompt = usage["input_tokens"] + (read or 0) + (_int_or_none(usage.get("cache_creation_input_tokens")) or 0)
            cached = read
    response = obj.get("response") if isinstance(obj.get("response"), dict) else {}
    status = _int_or_none(response.get("status")) or _int_or_none(obj.get("status"))
    error = response.get("error") if isinstance(response.get("error"), str) else None
    timing = obj.get("timing") if isinstance(obj.get("timing"), dict) else {}
    ttft = timing.get("ttft_s")
    ttft = float(ttft) if isinstance(ttft, (int, float)) and not isinstance(ttft, bool) and math.isfinite(ttft) \
        and ttft >= 0 else None
    req = Request(
        str(obj.get("id") or f"{source}:{lineno}"),
        ts if ts is not None else float(lineno),
        body,
        session,
        lineno,
        prompt,
        cached,
        endpoint,
        status,
        error,
        ts is not None,
    )
    req.ttft_s = ttft
    req.reply = _reply(response.get("text"), response.get("reasoning"), response.get("tool_calls"))
    render = obj.get("render")
    if isinstance(render, dict) and isinstance(render.get("transcript"), dict):  # exported from a transcript import
        req.transcript = render["transcript"]
    req.upstream = obj.get("upstream") if isinstance(obj.get("upstream"), str) else None
    req.headers = obj.get("request_headers") if isinstance(obj.get("request_headers"), dict) else None
    timing = obj.get("timing") if isinstance(obj.get("timing"), dict) else {}
    total = timing.get("total_s")
    req.total_s = float(total) if isinstance(total, (int, float)) and not isinstance(total, bool) else None
    return _server_facts(req, obj.get("render"), usage or None, obj.get("served_by"), obj.get("renderer_id"))


@dataclass
class _ArrayState:
    text: str  # the raw messages array, "[" to "]"
    ends: list[int]  # end offset (in text) of each element
    items: list[Any]


class IncrementalParser:
    """json.loads for JSONL lines whose `messages` arrays repeat earlier lines'."""

    RECENT = 8  # arrays kept for lines without a session id (interleaved sessions of one harness)

    def __init__(self) -> None:
        self._last: dict[str | None, _ArrayState] = {}
        self._recent: list[_ArrayState] = []  # most recent last

    def _best_prev(self, line: str, arr: int, hint: str | None) -> _ArrayState | None:
        """The earlier array this line most likely repeats: its session's, else (no id) whichever of
        the recent ones shares the longest prefix with it (without this, two interleaved sessions
        without ids would re-parse and re-key their whole history every turn)."""
        if hint is not None and hint in self._last:
            return self._last[hint]
        best, best_common = None, 1
        for prev in reversed(self._recent):
            n = min(len(prev.text), len(line) - arr)
            common = _common_prefix(prev.text, line[arr : arr + n])
            if common > best_common:
                best, best_common = prev, common
        return best

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
        parsed = self._parse_array(line, arr, self._best_prev(line, arr, hint))
        if parsed is None:
            return json.loads(line)
        state, end = parsed
        obj = json.loads(line[:arr] + "null" + line[end:])
        # The key we found must be the request's own "messages", else parse in full.
        holder = obj.get("request") if isinstance(obj, dict) and "request" in obj else obj
        if not isinstance(holder, dict) or "messages" not in holder or holder["messages"] is not None:
            return json.loads(line)
        holder["messages"] = list(state.items)
        if hint is not None:
            self._last[hint] = state
        self._recent.append(state)
        if len(self._recent) > self.RECENT:
            del self._recent[0]
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
    """Requests of a JSONL file in file order; bad lines go to `skipped`.

    Read as bytes and decoded line by line, so a line that is not UTF-8 (or a
    file that is not text at all, like a damaged database) is reported with its
    number and the rest still read."""
    from recorder.replay_mark import is_replay

    out = Loaded()
    parser = IncrementalParser()
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path}: {exc}") from exc
    with fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                out.skipped.append({"line": lineno, "error": f"not UTF-8: {exc.reason} at byte {exc.start + 1}"})
                continue
            if not line.strip():
                continue
            try:
                obj = parser.loads(line)
                if isinstance(obj, dict) and "renderer" in obj and "request" not in obj:  # an export's renderer
                    _renderer_line(out, obj["renderer"], lineno)
                    continue
                if isinstance(obj, dict) and is_replay(obj.get("request_headers")):  # a replay's, not the user's
                    out.replayed += 1
                    continue
                if isinstance(obj, dict) and is_remote_compaction(obj.get("endpoint")):
                    out.remote_compactions += 1
                    continue
                out.requests.append(request_from_record(obj, lineno, path.name))
            except json.JSONDecodeError as exc:
                out.skipped.append({"line": lineno, "error": f"not valid JSON: {exc.msg.removesuffix(' at')} at column {exc.colno}"})
            except InvalidRequest as exc:
                out.skipped.append({"line": lineno, "error": exc.message})
            except RecursionError:  # nesting past the parser's recursion limit: one line, like any bad line
                out.skipped.append({"line": lineno, "error": "not readable: JSON nested too deeply"})
    return out


def _renderer_line(out: Loaded, obj: Any, lineno: int) -> None:
    """A renderer an export carries (recorder/renderers.py `to_record`), kept as a database's would be."""
    from recorder.renderers import from_record

    info = from_record(obj)
    if info is None:
        out.skipped.append({"line": lineno, "error": "a renderer line without its id and model"})
    else:
        out.renderers[info.id] = info


def _from_turns(turns: Iterable[Any]) -> Loaded:
    from recorder.replay_mark import is_replay

    out = Loaded()
    for t in turns:
        if is_replay(getattr(t, "request_headers", None)):  # a replay's measurement, not the user's traffic
            out.replayed += 1
            continue
        if is_remote_compaction(getattr(t, "endpoint", None)):
            out.remote_compactions += 1
            continue
        req = Request(t.request_id, t.started_at, t.request_body, session_of(t.session_id), None,
                      t.prompt_tokens, t.cached_tokens, getattr(t, "endpoint", None),
                      getattr(t, "status", None) or None, getattr(t, "error", None),
                      ttft_s=getattr(t, "ttft_s", None), transcript=_transcript_of(t))
        req.upstream = getattr(t, "upstream", None)
        headers = getattr(t, "request_headers", None)
        req.headers = headers if isinstance(headers, dict) else None
        req.total_s = getattr(t, "total_s", None)
        req.reply = _reply(getattr(t, "response_text", None), getattr(t, "reasoning_text", None),
                           getattr(t, "tool_calls", None))
        out.requests.append(_server_facts(req, getattr(t, "render", None), getattr(t, "usage", None),
                                          getattr(t, "served_by", None), getattr(t, "renderer_id", None)))
    return out


def _reply(text: Any, reasoning: Any, tool_calls: Any) -> dict | None:
    """What the server answered, for the fixes' record of the session (analyzer/fix_report.py)."""
    calls = [c for c in tool_calls if isinstance(c, dict)] if isinstance(tool_calls, list) else None
    if not (isinstance(text, str) and text) and not (isinstance(reasoning, str) and reasoning) and not calls:
        return None
    return {"text": text if isinstance(text, str) else "", "reasoning": reasoning if isinstance(reasoning, str) else "",
            "tool_calls": calls or None}


def _transcript_of(turn: Any) -> dict | None:
    """What a turn rebuilt from a harness transcript says of its origin (recorder/transcripts)."""
    render = getattr(turn, "render", None)
    origin = render.get("transcript") if isinstance(render, dict) else None
    return origin if isinstance(origin, dict) else None


_HAR_START = re.compile(r'\s*\{\s*"log"\s*:')


def read_har(path: Path) -> Loaded:
    """Requests of a HAR file (browser, mitmproxy or this project's export), entry by entry: an entry
    that cannot be read is reported with its index and skipped (`line` holds the entry number)."""
    from recorder.har import entry_to_turn  # one reading of HAR entries, the recorder's

    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{path}: not valid JSON: {exc.msg} (line {exc.lineno})") from exc
    except RecursionError:
        raise InvalidRequest(f"{path}: not readable: its JSON is nested too deeply") from None
    entries = doc.get("log", {}).get("entries") if isinstance(doc, dict) and isinstance(doc.get("log"), dict) else None
    if not isinstance(entries, list):
        raise InvalidRequest(f"{path}: not a HAR file (no log.entries list)")
    out = Loaded()
    from recorder.har import har_renderers

    out.renderers = har_renderers(doc["log"])
    for index, entry in enumerate(entries):
        try:
            turn = entry_to_turn(entry, index=index, source=path.name)
        except InvalidRequest as exc:
            out.skipped.append({"line": index, "entry": index, "error": exc.message})
            continue
        if turn is None:
            continue  # not a chat request (pages, assets, GETs)
        req = _from_turns([turn]).requests[0]
        req.line = index
        out.requests.append(req)
    return out


def _is_har(path: Path) -> bool:
    if path.suffix.lower() == ".har":
        return True
    with open(path, "rb") as fh:
        head = fh.read(4096).decode("utf-8", "replace").lstrip("\ufeff")
    return bool(_HAR_START.match(head))


def load(source: str | Path | Iterable[Any]) -> Loaded:
    """Requests from a recorder database or JSONL path (sniffed by content),
    an iterable of recorder Turns, or of request bodies / Requests. Sorted by
    time (stable, so file order breaks ties)."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        from recorder.transcripts.store import refuse_special

        refuse_special(path)  # a FIFO or device would block the read below
        try:
            with open(path, "rb") as fh:
                head = fh.read(4096)
        except OSError as exc:
            raise InvalidRequest(f"cannot read {path}: {exc}") from exc
        magic = head[:len(SQLITE_MAGIC)]
        if magic != SQLITE_MAGIC and b"\x00" in head:  # no JSONL or HAR file holds a NUL byte
            raise InvalidRequest(f"{path} is neither a recorder database nor a JSONL or HAR file: it holds binary "
                                 "data (a database whose header is damaged?)")
        from recorder.transcripts import sniff_transcript, transcript_turns
        from recorder.transcripts.store import refuse_poorly_rebuilt

        if sniff_transcript(path) is not None:  # a harness's own session file: rebuilt, not recorded
            turns, transcripts = transcript_turns(path)
            refuse_poorly_rebuilt(transcripts)
            loaded = _from_turns(turns)
        elif magic == SQLITE_MAGIC:
            from recorder.reader import iter_turns, read_renderers  # the recorder is only needed for databases

            loaded = _from_turns(iter_turns(path))
            loaded.renderers = read_renderers(path)
        elif _is_har(path):
            loaded = read_har(path)
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
                loaded.requests.append(Request(f"request-{i}", float(i), item, None, None, ts_given=False))
    _order_untimed(loaded.requests)
    loaded.requests.sort(key=lambda r: r.ts)
    return loaded


def _order_untimed(requests: list[Request]) -> None:
    """A request without a time keeps its place in the file: it takes the time of the last timed
    request before it (the sort is stable), or of the first timed one when none came before."""
    if all(r.ts_given for r in requests) or not any(r.ts_given for r in requests):
        return
    last = next(r.ts for r in requests if r.ts_given)
    for r in requests:
        if r.ts_given:
            last = r.ts
        else:
            r.ts = last


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
