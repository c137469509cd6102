"""JSONL import/export of recorded turns (format: docs/FORMATS.md).

Import is all-or-nothing: the whole file is parsed and validated first, and
only then written in a single transaction, so a bad line 900 never leaves lines
1-899 half-imported. Re-importing the same file is idempotent (rows are keyed
by request id; bare request lines get an id derived from their content and
line number).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from prefixtrace.common.errors import InvalidRequest
from recorder.reader import iter_turns, read_renderers
from recorder.renderers import RECORD_KEY, from_record, to_record, with_renderer
from recorder.redact import Redactor
from recorder.bodies import scan_object
from recorder.files import open_private
from recorder.rows import write_turns
from recorder.schema import open_db
from recorder import numbers
from recorder.turn import Turn

DEFAULT_ENDPOINT = "/v1/chat/completions"
DEFAULT_UPSTREAM = "import"
# Bare lines carry no time; they are spaced this far apart after `base_ts` so
# that ordering by time keeps file order.
BARE_LINE_SPACING_S = 0.001


def turn_to_record(turn: Turn) -> dict[str, Any]:
    """The wrapped JSONL object for one turn. Every key is always present, so
    export -> import -> export is byte-identical; `served_by` (the member that answered) only when
    recorded, so exports of turns recorded without it stay as they were."""
    record = _record(turn)
    if turn.served_by is not None:
        record["served_by"] = turn.served_by
    if turn.renderer_id is not None:  # what rendered and counted it: a `renderer` line of the same file
        record["renderer_id"] = turn.renderer_id
    return record


def _record(turn: Turn) -> dict[str, Any]:
    return {
        "id": turn.request_id,
        "session": turn.session_id,
        "ts": turn.started_at,
        "endpoint": turn.endpoint,
        "upstream": turn.upstream,
        "client": turn.client_addr,
        "stream": turn.stream,
        "request": turn.request_body,
        "request_headers": turn.request_headers,
        "response": {
            "status": turn.status,
            "error": turn.error,
            "text": turn.response_text,
            "reasoning": turn.reasoning_text,
            "tool_calls": turn.tool_calls,
            "finish_reason": turn.finish_reason,
        },
        "usage": turn.usage,
        "tokens": {
            "prompt": turn.prompt_tokens,
            "completion": turn.completion_tokens,
            "cached": turn.cached_tokens,
        },
        "timing": {"ttft_s": turn.ttft_s, "total_s": turn.total_s, "chunk_times": turn.chunk_times},
        "render": turn.render,
    }


def record_line(turn: Turn) -> str:
    """One exported line (no newline). The request body is written as the
    exact text that was stored, so a body's own spelling (key order, spacing,
    escapes) survives export. A body whose text spans lines (pretty-printed)
    cannot sit in a JSONL line as is: it goes in as parsed JSON, and its exact
    text rides along in an extra `request_raw` key."""
    record = turn_to_record(turn)
    raw = turn.request_raw if not isinstance(turn.request_body, str) else None
    if raw is not None and not numbers.is_strict_json(raw):
        raw = None  # a body stored before bodies were kept strict: written as parsed, strictly
    if raw is None:
        return numbers.dumps(record, ensure_ascii=False)
    if "\n" in raw or "\r" in raw:
        record["request_raw"] = raw
        return numbers.dumps(record, ensure_ascii=False)
    keys = list(record)
    cut = keys.index("request")
    before = numbers.dumps({k: record[k] for k in keys[:cut]}, ensure_ascii=False)
    after = numbers.dumps({k: record[k] for k in keys[cut + 1 :]}, ensure_ascii=False)
    return f"{before[:-1]}, \"request\": {raw}, {after[1:]}"


def export_jsonl(db_path: str | Path, out: str | Path | IO[str], session: str | None = None) -> int:
    """Writes one line per stored turn (ordered by time) to `out`, a path or
    an open text file. Returns the number of lines written."""
    turns = iter_turns(db_path, session=session)
    renderers = read_renderers(db_path)
    if hasattr(out, "write"):
        return _write(turns, out, renderers)
    with open_private(out) as fh:
        return _write(turns, fh, renderers)


def _write(turns: Iterator[Turn], fh: IO[str], renderers: dict | None = None) -> int:
    """The turns' lines; before the first turn that names a recorded renderer, that renderer's own line
    (`{"renderer": {...}}`), so `analyze`/`check` on the file count as on the database. Returns the
    number of turns written."""
    n = 0
    written: set[str] = set()
    for turn in turns:
        rid = turn.renderer_id
        if rid is not None and rid not in written and renderers and rid in renderers:
            fh.write(numbers.dumps({RECORD_KEY: to_record(renderers[rid])}, ensure_ascii=False) + "\n")
            written.add(rid)
        fh.write(record_line(turn) + "\n")
        n += 1
    return n


def import_jsonl(
    path: str | Path,
    db_path: str | Path,
    *,
    base_ts: float | None = None,
    redact_patterns: list[str] | None = None,
) -> int:
    """Imports a JSONL file into the database at `db_path` (created if
    missing). All lines or none; returns the number of turns imported.

    Raises `InvalidRequest` naming the first bad line.
    """
    return store_turns(db_path, read_jsonl(path, base_ts=base_ts), redact_patterns)


def store_turns(db_path: str | Path, turns: list[Turn], redact_patterns=None, redactor: Redactor | None = None) -> int:
    """Write `turns` into the database in one transaction (redacted, by `redactor` if given); how many."""
    db = open_db(db_path)
    try:
        write_turns(db, turns, redactor or Redactor(redact_patterns))
    finally:
        db.close()
    return len(turns)


def read_jsonl(path: str | Path, *, base_ts: float | None = None) -> list[Turn]:
    """Parses a JSONL file into Turns without touching any database (the
    analyzer uses this to analyse a file directly). Blank lines are skipped."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # a leading BOM (Windows editors) is not part of line 1
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"cannot read {p}: not UTF-8 text (byte {exc.start + 1}): neither a JSONL file nor a "
                             "readable database (one whose header is damaged?)") from exc
    except OSError as exc:
        raise InvalidRequest(f"cannot read {p}: {exc}") from exc
    base = time.time() if base_ts is None else base_ts
    turns = []
    renderers = {}  # the file's renderer lines, by id: each goes with the turns that name it
    for lineno, line, obj in json_lines(text, p):
        if isinstance(obj, dict) and RECORD_KEY in obj and "request" not in obj:
            info = from_record(obj[RECORD_KEY])
            if info is None:
                raise InvalidRequest(f"{p}:{lineno}: a renderer line without its id and model", line=lineno)
            renderers[info.id] = info
            continue
        try:
            turn = record_to_turn(obj, lineno=lineno, base_ts=base, source=p.name,
                                  request_raw=_raw_request(line, obj))
        except InvalidRequest as exc:
            raise InvalidRequest(f"{p}:{lineno}: {exc.message}", line=lineno) from exc
        turns.append(with_renderer(turn, renderers))
    return turns


def json_lines(text: str, where: Path | str) -> Iterator[tuple[int, str, Any]]:
    """(line number, line, value) of every non-blank line of a JSONL `text`; a line that is not JSON
    raises InvalidRequest naming `where:line` and the column. Lines end at "\n" only: `splitlines`
    also breaks at U+2028, U+0085 and other characters that `json.dumps(ensure_ascii=False)` leaves
    raw inside strings."""
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{where}:{lineno}: not valid JSON: {exc.msg.removesuffix(' at')} at column {exc.colno}",
                                 line=lineno) from exc
        yield lineno, line, value


def _raw_request(line: str, obj: Any) -> str | None:
    """The request body's exact text inside `line`, kept so the database
    stores the body byte for byte (the recorder checks it against the parsed
    body before trusting it)."""
    if not isinstance(obj, dict):
        return None
    if "request" not in obj:  # a bare body: the line is the body
        return line.strip(" \t\r\n")
    if isinstance(obj.get("request_raw"), str):
        return obj["request_raw"]
    if not isinstance(obj["request"], dict):
        return None
    scanned = scan_object(line.strip(" \t\r\n"))
    if scanned is None:
        return None
    start, end = scanned[1]["request"]
    return line.strip(" \t\r\n")[start:end]


def _derived_id(source: str, lineno: int, obj: Any) -> str:
    digest = hashlib.sha256(f"{source}\0{lineno}\0".encode() + json.dumps(obj, sort_keys=True).encode())
    return f"import-{digest.hexdigest()[:16]}"


def _get(obj: dict, key: str, types: tuple[type, ...], default: Any = None) -> Any:
    value = obj.get(key, default)
    if value is not None and not isinstance(value, types):
        raise InvalidRequest(f"{key!r} must be {' or '.join(t.__name__ for t in types)}, got {type(value).__name__}")
    return value


def _int(obj: dict, key: str) -> int | None:
    value = obj.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidRequest(f"{key!r} must be an integer or null, got {value!r}")
    return value


def _usage_counts(usage: dict | None) -> tuple[int | None, int | None, int | None]:
    # Only used when a line has no "tokens" block (hand-written or third-party
    # files). Missing cached count stays None: unknown is not zero.
    if not usage:
        return None, None, None
    if "input_tokens" in usage and "prompt_tokens" not in usage:  # a Responses usage object
        details = usage.get("input_tokens_details") or {}
        cached = _int(details, "cached_tokens") if isinstance(details, dict) else None
        return _int(usage, "input_tokens"), _int(usage, "output_tokens"), cached
    details = usage.get("prompt_tokens_details") or {}
    cached = _int(details, "cached_tokens") if isinstance(details, dict) else None
    return _int(usage, "prompt_tokens"), _int(usage, "completion_tokens"), cached


def record_to_turn(obj: Any, *, lineno: int = 0, base_ts: float = 0.0, source: str = "",
                   request_raw: str | None = None) -> Turn:
    """One JSONL object (wrapped form, or a bare chat-completions request
    body) as a Turn; `request_raw`: the body's exact text, where the file keeps it."""
    if not isinstance(obj, dict):
        raise InvalidRequest(f"expected a JSON object, got {type(obj).__name__}")
    if "request" not in obj:
        # A bare body: chat completions (`messages`) or Responses (`input`, no `messages`).
        responses = not isinstance(obj.get("messages"), list) and isinstance(obj.get("input"), (str, list))
        if not isinstance(obj.get("messages"), list) and not responses:
            raise InvalidRequest('expected a wrapped turn (with "request") or a request body (with "messages" '
                                 'or a Responses "input")')
        return Turn(
            request_id=_derived_id(source, lineno, obj),
            started_at=base_ts + lineno * BARE_LINE_SPACING_S,
            endpoint="/v1/responses" if responses else DEFAULT_ENDPOINT,
            upstream=DEFAULT_UPSTREAM,
            request_body=obj,
            stream=bool(obj.get("stream", False)),
            request_raw=request_raw,
        )

    request = obj["request"]
    if not isinstance(request, (dict, str)):
        raise InvalidRequest(f'"request" must be an object (or raw text), got {type(request).__name__}')
    response = _get(obj, "response", (dict,)) or {}
    tokens = _get(obj, "tokens", (dict,))
    timing = _get(obj, "timing", (dict,)) or {}
    usage = _get(obj, "usage", (dict,))
    ts = _get(obj, "ts", (int, float))
    if isinstance(ts, bool):
        raise InvalidRequest('"ts" must be a number')
    if tokens is not None:
        counts = (_int(tokens, "prompt"), _int(tokens, "completion"), _int(tokens, "cached"))
    else:
        counts = _usage_counts(usage)
    chunk_times = _get(timing, "chunk_times", (list,)) or []
    return Turn(
        request_id=_get(obj, "id", (str,)) or _derived_id(source, lineno, obj),
        started_at=float(ts) if ts is not None else base_ts + lineno * BARE_LINE_SPACING_S,
        endpoint=_get(obj, "endpoint", (str,)) or DEFAULT_ENDPOINT,
        upstream=_get(obj, "upstream", (str,)) or DEFAULT_UPSTREAM,
        request_body=request,
        request_headers=_get(obj, "request_headers", (dict,)) or {},
        session_id=_get(obj, "session", (str,)),
        client_addr=_get(obj, "client", (str,)),
        stream=bool(_get(obj, "stream", (bool,), False)),
        status=_int(response, "status") or 0,
        error=_get(response, "error", (str,)),
        response_text=_get(response, "text", (str,)) or "",
        reasoning_text=_get(response, "reasoning", (str,)) or "",
        tool_calls=_get(response, "tool_calls", (list,)),
        finish_reason=_get(response, "finish_reason", (str,)),
        prompt_tokens=counts[0],
        completion_tokens=counts[1],
        cached_tokens=counts[2],
        usage=usage,
        ttft_s=_get(timing, "ttft_s", (int, float)),
        total_s=_get(timing, "total_s", (int, float)),
        chunk_times=chunk_times,
        render=_get(obj, "render", (dict,)),
        served_by=_get(obj, "served_by", (str,)),
        renderer_id=_get(obj, "renderer_id", (str,)),
        request_raw=request_raw,
    )
