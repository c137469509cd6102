"""What one request may be: its body's size and its JSON's nesting.

Both limits answer in the API's error shape and leave a recorded turn, so a
client cannot hide from the recorder by sending something it cannot store:

* size (`--max-request-mb`, default 32): a 100k-token prompt with tools is
  ~0.5-1 MB of JSON, a base64 image a few MB; 32 MB leaves room for several and
  stops the 50-300 MB bodies of issue 14 (finding 7), which each cost GBs of
  memory and their size again in the database. Past it: 413, and the turn is
  recorded with a marker instead of the body (a truncated body could end inside
  a secret the patterns no longer recognise). A Content-Length over the limit is
  refused before the body is read; a chunked body as soon as it passes it. The
  rest is read and thrown away (up to `DRAIN_FACTOR` x the limit) so the client
  gets to read its 413 rather than a reset connection. A gzip- or deflate-encoded
  body (`Content-Encoding`) is decoded as it arrives, and the limit is on what it
  decodes to: a 1 MB gzip bomb of 1 GB stops at the limit's worth (issue 25,
  finding 7). Other codings are a 415.
* time (`--request-body-timeout-s`, default 60): the whole body must arrive within
  it, or 408 (issue 25, finding 9: 19,900 trickled bodies held their sockets and
  tasks until a normal request timed out). A client that hangs up while sending is
  recorded as 499, not as an internal error.
* nesting (`MAX_JSON_DEPTH` = 100 arrays/objects): real tool schemas nest ~10-20
  deep. Deeper JSON was answered but lost by the recorder (recursion while
  redacting, ~500-900 deep), broke the dashboard's analysis (~450) or was a 500
  (~990, the parser's own recursion). Past it: 400, recorded with the body as text.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from prefixtrace.common.errors import (ClientGaveUp, InvalidRequest, PrefixtraceError, RequestTimeout,
                                       RequestTooLarge, UnsupportedMediaType)

DEFAULT_MAX_REQUEST_MB = 32.0
DEFAULT_BODY_TIMEOUT_S = 60.0
MAX_JSON_DEPTH = 100
DRAIN_FACTOR = 4
DECODED = ("gzip", "x-gzip", "deflate")  # Content-Encodings read (zlib's auto-detected gzip or zlib stream)


def max_request_bytes(request: Request) -> int:
    mb = getattr(request.app.state, "max_request_mb", DEFAULT_MAX_REQUEST_MB)
    return int(mb * (1 << 20))


def body_timeout_s(request: Request) -> float | None:
    return getattr(request.app.state, "request_body_timeout_s", DEFAULT_BODY_TIMEOUT_S)


async def read_request_body(request: Request) -> bytes:
    """The whole body (decoded, if it came gzip- or deflate-encoded), or a `PrefixtraceError` whose
    `stored_body` is the marker its turn records in place of the body: `RequestTooLarge` (413),
    `RequestTimeout` (408, not all of it within `--request-body-timeout-s`), `ClientGaveUp` (499, the
    client hung up while sending it), `UnsupportedMediaType` (415, a coding not read here),
    `InvalidRequest` (400, a compressed body that does not decode)."""
    timeout = body_timeout_s(request)
    reader = _BodyReader(request, max_request_bytes(request))
    try:
        async with asyncio.timeout(timeout if timeout and timeout > 0 else None):
            return await reader.read()
    except TimeoutError:
        raise _not_stored(RequestTimeout(f"the request body did not arrive within {timeout:g} s ({reader.received} "
                                         "bytes received; prefixtrace serve --request-body-timeout-s)"),
                          f"{reader.received} bytes arrived in {timeout:g} s, not all of it") from None
    except ClientDisconnect:
        raise _not_stored(ClientGaveUp(f"client disconnected while sending the request body ({reader.received} "
                                       "bytes received)"),
                          f"the client hung up after {reader.received} bytes") from None


def _not_stored(error: PrefixtraceError, why: str) -> PrefixtraceError:
    """`error`, carrying the marker its turn records instead of the body (a truncated body could end
    inside a secret the redaction patterns no longer recognise)."""
    error.stored_body = f"[request body not stored: {why}]"
    return error


class _BodyReader:
    """Reads a request's body within `limit` bytes, decoded as it arrives."""

    def __init__(self, request: Request, limit: int):
        self.request, self.limit = request, limit
        self.received = 0  # bytes off the wire
        coding = request.headers.get("content-encoding", "").strip().lower()
        if coding not in ("", "identity", *DECODED):
            raise _not_stored(UnsupportedMediaType(f"Content-Encoding {coding!r} is not supported: send the body as "
                                                   "it is, or gzip- or deflate-encoded"),
                              f"Content-Encoding {coding!r} is not read here")
        self.coding = coding if coding in DECODED else None
        self.decoder = zlib.decompressobj(zlib.MAX_WBITS | 32) if self.coding else None

    async def read(self) -> bytes:
        limit = self.limit
        declared = self.request.headers.get("content-length", "")
        size = int(declared) if declared.isdigit() else None
        chunks: list[bytes] = []
        total = 0  # bytes of the body once decoded
        over = size is not None and size > limit
        stream = self.request.stream()
        if not over:
            async for chunk in stream:
                self.received += len(chunk)
                if self.decoder is not None:
                    chunk = self._decode(chunk, limit - total)
                total += len(chunk)
                if total > limit:
                    over = True
                    break
                chunks.append(chunk)
        if not over:
            if self.decoder is not None and not self.decoder.eof:
                raise _not_stored(InvalidRequest(f"the request body is not a whole {self.coding} stream "
                                                 f"(Content-Encoding: {self.coding})"),
                                  f"a {self.coding} stream cut short")
            return b"".join(chunks)
        chunks.clear()
        if size is None or size <= DRAIN_FACTOR * limit:
            async for chunk in stream:  # discard: the client must be able to read the 413
                self.received += len(chunk)
                if self.received > DRAIN_FACTOR * limit:
                    break
        mb = limit / (1 << 20)
        if size is not None and size > limit:
            shown = f"{size / (1 << 20):.1f} MB"
        else:
            shown = f"over {mb:g} MB" + (f" once {self.coding}-decoded" if self.decoder is not None else "")
        raise _not_stored(RequestTooLarge(f"the request body is {shown}, over this proxy's limit of {mb:g} MB "
                                          "(prefixtrace serve --max-request-mb)", param=None),
                          f"{shown}, over the {mb:g} MB limit")

    def _decode(self, chunk: bytes, room: int) -> bytes:
        """What `chunk` decodes to, at most `room` + 1 bytes of it: a bomb stops at the limit, not in memory."""
        try:
            out = self.decoder.decompress(chunk, room + 1)
            while self.decoder.unconsumed_tail and len(out) <= room:
                out += self.decoder.decompress(self.decoder.unconsumed_tail, room + 1 - len(out))
        except zlib.error as exc:
            raise _not_stored(InvalidRequest(f"the request body is not valid {self.coding} (Content-Encoding: "
                                             f"{self.coding}): {exc}"),
                              f"not a valid {self.coding} stream") from None
        if self.decoder.eof and self.decoder.unused_data:
            raise _not_stored(InvalidRequest(f"the request body has bytes after the end of its {self.coding} stream"),
                              f"bytes after the end of the {self.coding} stream")
        return out


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """`InvalidRequest` if `value` (`json.loads`'s output: plain dicts and lists) nests
    arrays/objects deeper than `limit`.

    A recursive walk that stops `limit` levels down, so it uses at most `limit` + 1 frames
    whatever it is given (well inside Python's 1000 at the default of 100). It replaced an
    explicit stack of (node, depth) tuples, filled through a generator with an `isinstance`
    per value: 3-5x the time on a 270 KB, 330-message agent body (bench/bench_body_check.py,
    issue 17), spent on the request's way to the upstream."""
    if isinstance(value, (dict, list)):
        try:
            _within(value, limit)
        except _TooDeep:
            raise InvalidRequest(f"the request body nests arrays/objects more than {limit} deep") from None


class _TooDeep(Exception):
    pass


def _within(node: dict | list, budget: int) -> None:
    """`node` is one level; `budget` the levels it may have, itself included."""
    if budget <= 0:
        raise _TooDeep
    budget -= 1
    for child in (node.values() if isinstance(node, dict) else node):
        kind = type(child)  # `type is`, not isinstance: the parser makes exact dicts and lists
        if kind is dict or kind is list:
            _within(child, budget)


def parse_body(raw: bytes) -> dict:
    if not raw.strip():
        raise InvalidRequest("the request body is empty; expected a JSON object")
    try:
        body = _loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # ~990 deep: the parser's own recursion
        raise InvalidRequest(f"the request body nests arrays/objects more than {MAX_JSON_DEPTH} deep") from exc
    check_depth(body)  # deeper than the recorder and the analyzer can walk (proxy/request_limits.py)
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _no_constant(name: str):
    # Python's json accepts NaN and Infinity; JSON does not (and nothing downstream can send them on).
    raise ValueError(f"{name} is not allowed in JSON")


# `json.loads(raw, parse_constant=...)` builds a new decoder (and its C scanner) on every call, as any
# keyword does; one made once does the same parse (issue 17: a few µs before every upstream POST).
_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def _loads(raw: bytes | str):
    """`json.loads(raw, parse_constant=_no_constant)`, step for step (its bytes decoding, its BOM
    refusal), with `_DECODER`."""
    if isinstance(raw, str):
        if raw.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", raw, 0)
    else:
        raw = raw.decode(json.detect_encoding(raw), "surrogatepass")
    return _DECODER.decode(raw)
