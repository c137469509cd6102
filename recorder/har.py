"""HAR 1.2 import/export of recorded turns (format: docs/FORMATS.md).

Export writes one entry per turn that any HAR viewer can show: the request
body is `postData.text` (the stored text, byte for byte), the response content
is the reply rendered as a chat.completion (or SSE for streamed turns), and
`timings.wait` is the TTFT. What HAR has no field for (session, token counts,
chunk times, render facts, the exact original ts) goes in a custom
`_prefixtrace` object (HAR allows `_`-prefixed fields), which is what makes
export -> import -> export lossless.

Import takes HAR from browsers and mitmproxy too: every POST whose body is a
request of an API the proxy serves (chat completions or Messages with a
`messages` list, Responses with an `input`, legacy completions with a `prompt`,
told apart by the URL's path) becomes a turn; other entries (pages, assets,
GETs) are skipped. Without `_prefixtrace`, the reply, usage and finish reason
are read back from the response content, SSE or JSON, by that API's reader
(prefixtrace/wire/), the same the proxy records an upstream's reply with.
Import is all or nothing, like JSONL.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from prefixtrace.common.errors import InvalidRequest
from prefixtrace.wire import messages as messages_wire
from prefixtrace.wire.request import protocol_of, session_id
from prefixtrace.wire.responses_stream import ResponsesReader
from recorder.jsonl import DEFAULT_ENDPOINT, record_to_turn, turn_to_record
from recorder import numbers
from recorder.turn import Turn
from recorder.renderers import from_record, to_record, with_renderer
from recorder.turn_builder import TurnBuilder
from recorder.turn_facts import ChatBody, ChatChunk, Stop, WholeEvents

CREATOR = {"name": "prefixtrace", "version": "1"}
_EXTRA = "_prefixtrace"
_RENDERERS = "_prefixtrace_renderers"
_NO_HOST = "http://prefixtrace.invalid"  # URL base for turns whose upstream is not a URL (embedded engine)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _ms(seconds: float | None) -> float:
    return -1 if seconds is None else round(seconds * 1000, 3)


def _response_content(turn: Turn) -> tuple[str, str]:
    message: dict[str, Any] = {"role": "assistant", "content": turn.response_text}
    if turn.reasoning_text:
        message["reasoning_content"] = turn.reasoning_text
    if turn.tool_calls:
        message["tool_calls"] = turn.tool_calls
    if turn.status >= 400 or turn.status == 0:
        return "application/json", numbers.dumps({"error": {"message": turn.error}}, ensure_ascii=False)
    if not turn.stream:
        body = {"object": "chat.completion", "choices": [{"index": 0, "message": message,
                                                          "finish_reason": turn.finish_reason}]}
        if turn.usage is not None:
            body["usage"] = turn.usage
        return "application/json", numbers.dumps(body, ensure_ascii=False)
    delta = {k: v for k, v in message.items() if k != "tool_calls"}
    if turn.tool_calls:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(turn.tool_calls)]
    chunks = [{"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta,
                                                               "finish_reason": turn.finish_reason}]}]
    if turn.usage is not None:
        chunks.append({"object": "chat.completion.chunk", "choices": [], "usage": turn.usage})
    text = "".join(f"data: {numbers.dumps(c, ensure_ascii=False)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return "text/event-stream", text


def turn_to_entry(turn: Turn) -> dict[str, Any]:
    """One HAR entry; `_prefixtrace` carries everything HAR cannot."""
    is_json = not isinstance(turn.request_body, str)
    raw = turn.request_raw if turn.request_raw is not None and numbers.is_strict_json(turn.request_raw) else None
    body = turn.request_body if not is_json else (raw or numbers.dumps(turn.request_body, ensure_ascii=False))
    base = turn.upstream.rstrip("/") if turn.upstream.startswith(("http://", "https://")) else _NO_HOST
    mime, content = _response_content(turn)
    extra = turn_to_record(turn)
    del extra["request"], extra["request_headers"]  # in request.postData / request.headers
    extra["request_is_json"] = is_json
    ttft = turn.ttft_s
    return {
        "startedDateTime": _iso(turn.started_at),
        "time": max(_ms(turn.total_s), 0),
        "request": {
            "method": "POST", "url": base + turn.endpoint, "httpVersion": "HTTP/1.1", "cookies": [],
            "headers": [{"name": k, "value": v} for k, v in turn.request_headers.items()],
            "queryString": [], "headersSize": -1, "bodySize": len(body.encode()),
            "postData": {"mimeType": "application/json", "text": body},
        },
        "response": {
            "status": turn.status, "statusText": "", "httpVersion": "HTTP/1.1", "cookies": [],
            "headers": [{"name": "content-type", "value": mime}],
            "content": {"size": len(content.encode()), "mimeType": mime, "text": content},
            "redirectURL": "", "headersSize": -1, "bodySize": len(content.encode()),
        },
        "cache": {},
        "timings": {"blocked": -1, "dns": -1, "connect": -1, "ssl": -1, "send": 0, "wait": _ms(ttft),
                    "receive": -1 if ttft is None or turn.total_s is None else _ms(turn.total_s - ttft)},
        _EXTRA: extra,
    }


def write_har(turns: Iterator[Turn], fh: IO[str], renderers: dict | None = None) -> int:
    """Streams a HAR document (entries one by one: a database can be large). The database's recorded
    renderers go in `log._prefixtrace_renderers`, so `analyze`/`check` on the file count as on the database."""
    head: dict[str, Any] = {"version": "1.2", "creator": CREATOR}
    if renderers:
        head[_RENDERERS] = [to_record(info) for info in renderers.values()]
    fh.write(numbers.dumps({"log": head}, ensure_ascii=False)[:-2])
    fh.write(', "entries": [')
    n = 0
    for turn in turns:
        fh.write(("\n" if n == 0 else ",\n") + numbers.dumps(turn_to_entry(turn), ensure_ascii=False))
        n += 1
    fh.write("\n]}}\n")
    return n


# -- import ------------------------------------------------------------------


def read_har(path: str | Path) -> list[Turn]:
    """Parses a HAR file into Turns (chat-completion POSTs only), without a database."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"cannot read {p}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{p}: not valid JSON: {exc.msg} (line {exc.lineno})") from exc
    log = doc.get("log") if isinstance(doc, dict) else None
    entries = log.get("entries") if isinstance(log, dict) else None
    if not isinstance(entries, list):
        raise InvalidRequest(f"{p}: not a HAR file (no log.entries list)")
    renderers = har_renderers(log)  # each goes with the turns that name it (recorder/renderers.py)
    turns = []
    for index, entry in enumerate(entries):
        try:
            turn = entry_to_turn(entry, index=index, source=p.name)
        except InvalidRequest as exc:
            raise InvalidRequest(f"{p}: entry {index}: {exc.message}", entry=index) from exc
        if turn is not None:
            turns.append(with_renderer(turn, renderers))
    return turns


def har_renderers(log: Any) -> dict:
    """The renderers a HAR export carries, by id (none in another tool's HAR)."""
    items = log.get(_RENDERERS) if isinstance(log, dict) else None
    infos = [from_record(item) for item in items] if isinstance(items, list) else []
    return {info.id: info for info in infos if info is not None}


def _text(content: dict) -> str:
    text = content.get("text") or ""
    if content.get("encoding") == "base64":  # mitmproxy, for bodies it did not decode as text
        try:
            text = base64.b64decode(text).decode("utf-8")
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"undecodable base64 content: {exc}") from exc
    return text


def _ts(entry: dict) -> float:
    try:
        return datetime.fromisoformat(entry["startedDateTime"].replace("Z", "+00:00")).timestamp()
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"bad or missing startedDateTime: {exc}") from exc


def entry_to_turn(entry: Any, *, index: int = 0, source: str = "") -> Turn | None:
    """One HAR entry as a Turn, or None when it is not a chat-completion POST."""
    if not isinstance(entry, dict) or not isinstance(entry.get("request"), dict):
        raise InvalidRequest("entry has no request object")
    request = entry["request"]
    post = request.get("postData") if isinstance(request.get("postData"), dict) else {}
    body_text = _text(post)
    extra = entry.get(_EXTRA)
    headers = {h["name"]: h["value"] for h in request.get("headers") or [] if isinstance(h, dict) and "name" in h}
    if isinstance(extra, dict):  # our own export: lossless
        is_json = extra.get("request_is_json", True)
        try:
            body = json.loads(body_text) if is_json else body_text
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"postData.text is not JSON: {exc.msg}") from exc
        record = {k: v for k, v in extra.items() if k != "request_is_json"}
        return record_to_turn({**record, "request": body, "request_headers": headers},
                              request_raw=body_text if is_json else None)
    if str(request.get("method", "")).upper() != "POST":
        return None
    try:
        body = json.loads(body_text)
    except json.JSONDecodeError:
        return None
    if not _is_request(urlsplit(str(request.get("url", ""))).path, body):
        return None
    return _foreign_turn(entry, body, body_text, headers, index, source)


def _is_request(path: str, body: Any) -> bool:
    if not isinstance(body, dict):
        return False
    protocol = protocol_of(path)
    if protocol == "responses":
        return isinstance(body.get("input"), (str, list))
    if protocol == "completions":
        return isinstance(body.get("prompt"), (str, list))
    return isinstance(body.get("messages"), list) and not path.rstrip("/").endswith("/count_tokens")


def _foreign_turn(entry: dict, body: dict, body_text: str, headers: dict, index: int, source: str) -> Turn:
    url = urlsplit(str(entry["request"].get("url", "")))
    session = session_id(url.path, body, headers)
    digest = hashlib.sha256(f"{source}\0{index}\0{entry.get('startedDateTime')}\0".encode() + body_text.encode())
    timings = entry.get("timings") if isinstance(entry.get("timings"), dict) else {}
    wait, total = timings.get("wait"), entry.get("time")
    turn = Turn(
        request_id=f"har-{digest.hexdigest()[:16]}",
        started_at=_ts(entry),
        endpoint=url.path or DEFAULT_ENDPOINT,
        upstream=f"{url.scheme}://{url.netloc}" if url.netloc else "import",
        request_body=body,
        request_headers=headers,
        session_id=session if isinstance(session, str) else None,
        stream=bool(body.get("stream")),
        # HAR times are milliseconds; -1 means "not measured". A browser's wait
        # (time to first byte) is the closest thing to TTFT it records.
        ttft_s=wait / 1000 if isinstance(wait, (int, float)) and wait >= 0 else None,
        total_s=total / 1000 if isinstance(total, (int, float)) and total >= 0 else None,
        request_raw=body_text,
    )
    response = entry.get("response") if isinstance(entry.get("response"), dict) else {}
    builder = TurnBuilder(turn, timed=False)  # the HAR's times, not the import's
    content = _text(response.get("content") or {})
    read = _ReplyReader(protocol_of(url.path), builder)
    if "data:" in content:
        for line in content.splitlines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if data and data != "[DONE]":
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    continue
                if isinstance(chunk, dict):
                    read.event(chunk)
    elif content:
        try:
            parsed = json.loads(content)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            read.whole(parsed)
    status = response.get("status") if isinstance(response.get("status"), int) else 0
    return builder.finish(status, None if status < 400 else content[:500] or None)


class _ReplyReader:
    """A recorded reply (stream events or a whole body) read into the turn by its API's reader,
    as the proxy reads an upstream's (prefixtrace/wire/)."""

    def __init__(self, protocol: str, builder):
        self.protocol, self.builder = protocol, builder
        self.messages = messages_wire.MessagesReader()
        self.responses = ResponsesReader()
        self._usage: dict = {}

    def event(self, data: dict) -> None:
        if self.protocol == "messages":
            for event in self.messages.feed(data):
                self.builder.feed(event)
            kind = data.get("type")
            usage = (data.get("message") or {}).get("usage") if kind == "message_start" else data.get("usage")
            if kind in ("message_start", "message_delta") and isinstance(usage, dict):
                self._usage.update({k: v for k, v in usage.items() if v is not None})
                self.builder.feed(messages_wire.usage_counts(self._usage))
            if kind == "message_delta":
                self.builder.feed(Stop(messages_wire.finish_reason((data.get("delta") or {}).get("stop_reason"))))
        elif self.protocol == "responses":
            for event in self.responses.feed(data):  # a terminal event's ReplyDone carries its usage
                self.builder.feed(event)
        else:
            self.builder.feed(ChatChunk.read(data))

    def whole(self, body: dict) -> None:
        if self.protocol == "messages":
            self.builder.feed(WholeEvents(list(self.messages.whole(body))))
            self.builder.feed(Stop(messages_wire.finish_reason(body.get("stop_reason"))))
            usage = body.get("usage")
            if isinstance(usage, dict):
                self.builder.feed(messages_wire.usage_counts(usage))
        elif self.protocol == "responses":
            self.builder.feed(WholeEvents(list(self.responses.whole(body))))  # its ReplyDone carries the usage
        else:
            self.builder.feed(ChatBody.read(body))
