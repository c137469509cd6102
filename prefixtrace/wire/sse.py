"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n`, ending in `data: [DONE]`."""

from __future__ import annotations

import json
import json.scanner
from typing import AsyncIterator, Callable, Iterator

DONE = b"data: [DONE]\n\n"
# The most one event may hold before its end arrives: a stream that never ends its event would
# otherwise be buffered until memory runs out (a Responses `response.completed` event carries the
# whole reply, so this is far above any real one).
MAX_EVENT_BYTES = 64 << 20


class EventTooLarge(ValueError):
    """An event grew past `MAX_EVENT_BYTES` without its end."""


def encode(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _payload(event: bytes) -> bytes | None:
    """The data of one SSE event (its `data:` lines joined), or None when it has none."""
    data = [line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


_scan_json = json.scanner.make_scanner(json.JSONDecoder())  # the C scanner `json.loads` itself runs
_JSON_SPACE = " \t\n\r"


def decode_data(event: bytes) -> dict | None:
    """The JSON payload of one SSE event, or None for [DONE], comments and non-JSON data.

    The usual event is one `data:` line: its JSON is scanned where it stands, without splitting
    the event into lines, by the C scanner under `json.loads` (whose Python wrapper, encoding
    guess and whitespace regexes cost more than the scan of a short event: issue 25, a stream of
    tiny events), as UTF-8, as SSE is. What it accepts is what `json.loads` accepts."""
    if event.startswith(b"data:") and event.find(b"\n") >= len(event) - 2:
        payload = event[5:]
    else:
        payload = _payload(event)
        if payload is None:
            return None
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        return None
    start = 0
    while start < len(text) and text[start] in _JSON_SPACE:
        start += 1
    if start == len(text) or text[start] != "{":
        return None  # not an object ([DONE], a list, text): nothing to read
    try:
        obj, end = _scan_json(text, start)
    except (StopIteration, json.JSONDecodeError, RecursionError):
        return None
    if end != len(text) and text[end:].strip(_JSON_SPACE):
        return None  # extra data after the object: not JSON
    return obj


def unreadable(event: bytes) -> bool:
    """Whether one SSE event carries data that is neither [DONE] nor a JSON object (a comment, an
    `event:` line alone or a blank keep-alive carry none: those are fine)."""
    payload = _payload(event)
    return payload is not None and payload.strip() != b"[DONE]" and decode_data(event) is None


def is_done(event: bytes) -> bool:
    """Whether one SSE event is the stream's `data: [DONE]`."""
    payload = _payload(event)
    return payload is not None and payload.strip() == b"[DONE]"


async def iter_events_bytes(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Split an upstream's SSE byte stream into whole events (`...\n\n`), each yielded as soon as
    it ends (line ends CRLF, LF or CR, made LF; blank lines between events dropped), without
    decoding the stream to text and back (issue 17: the text layers were ~7 % of the proxy's CPU on a streamed request). Only CR and LF
    end a line, as SSE says: a U+2028 or U+0085 inside a JSON string (legal there, unescaped) is
    data, where a `str.splitlines` reader (httpx's `aiter_lines`) would split the event at it."""
    async for batch in iter_event_batches(chunks):
        for event in batch:
            yield event


def joined(events: list[bytes], alone: Callable[[bytes], bool]) -> Iterator[bytes]:
    """`events` (what one read completed, in order) as few writes to the client as they can be:
    runs of them joined, and each event `alone(event)` says must stand by itself (a stream's end,
    sent only once the turn is committed) yielded by itself. One write per upstream read, not per
    event: the first content usually arrives with the role chunk before it (issue 17)."""
    run: list[bytes] = []
    for event in events:
        if alone(event):
            if run:
                yield b"".join(run)
                run = []
            yield event
        else:
            run.append(event)
    if run:
        yield run[0] if len(run) == 1 else b"".join(run)


async def iter_event_batches(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """`iter_events_bytes`, with the events each chunk completed yielded together, as one list.

    Linear in the bytes (issue 25: a 20 MB reply took minutes, 4 MB of 10-byte events 31 s, all of
    it on the event loop): each chunk's line ends are made LF on the chunk alone, each byte is
    scanned for an event's end once (the search resumes where the last one stopped, not at the
    start of an event still arriving), and consumed bytes leave the front of a bytearray, which
    costs nothing per event (CPython moves its start)."""
    buf = bytearray()
    scan = 0  # where the search for the next event end resumes
    held_cr = False  # the last chunk ended in a CR: maybe the first half of a CRLF
    async for chunk in chunks:
        if held_cr:
            chunk = b"\r" + chunk
            held_cr = False
        if b"\r" in chunk:
            held_cr = chunk.endswith(b"\r")
            if held_cr:
                chunk = chunk[:-1]
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf += chunk
        batch = []
        start = 0
        while True:
            end = buf.find(b"\n\n", scan)
            if end < 0:
                break
            event = bytes(buf[start:end + 1]).lstrip(b"\n")  # blank lines between events end nothing
            if event:
                batch.append(event + b"\n")
            start = scan = end + 2
        if start:
            del buf[:start]
            scan -= start
        # The next chunk may start with the second LF of an event's end.
        scan = max(scan, len(buf) - 1, 0)
        if len(buf) > MAX_EVENT_BYTES:
            raise EventTooLarge(f"sent an SSE event of over {MAX_EVENT_BYTES >> 20} MB without its end")
        if batch:
            yield batch
    event = bytes(buf).rstrip(b"\r\n").lstrip(b"\n")  # a last event the stream did not end with a blank line
    if event:
        yield [event + b"\n\n"]
