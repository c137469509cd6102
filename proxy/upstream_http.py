"""The turn's POST to a plain-http upstream: HTTP/1.1 on an asyncio `Protocol`, parsed by httptools.

httpx (→ httpcore → h11, all pure Python) was the largest single cost between a request's arrival
and its first byte out in `--upstream` mode (issue 17: ~1.3 ms of the proxy's CPU to
send the request and read the response head, and a dozen generator layers per SSE chunk on the
way back). This client does only what a turn's POST needs: the request head and body go out in
one write; the response is parsed in C by httptools (llhttp, the parser uvicorn serves with) as
its bytes arrive, and its body chunks are handed to one reader, without copies or decoding
layers. Written by hand because no well-kept asyncio HTTP client exposes a parser-level stream
without its own layers (aiohttp would add a dependency of the same weight as httpx; httpcore
is the pure-Python layer being removed).

What it keeps of httpx's behaviour, so nothing above it changes: failures raise httpx's own
exceptions (`ConnectError`, `ConnectTimeout`, `ReadTimeout`, `WriteTimeout`, `RemoteProtocolError`,
`ReadError`, `WriteError`), which `map_httpx_errors` and the pool's failover read;
kept-alive connections are reused, never once the upstream has closed them or sent anything
unasked (the idle check is the protocol's own state: no system call); idle ones expire; a body
framed by closing the connection ends at EOF; a gzip/deflate body (which an upstream should not
send: we ask for identity) is still decoded; reading pauses past `READ_LIMIT` buffered bytes.
Unlike httpx's pool it puts no cap on open connections (httpx's was 100): each turn in flight
holds one, and the upstream queues its own. Used by `UpstreamBackend` for plain-http
upstreams that no proxy from the environment stands in front of; https and the health checks
keep httpx.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import deque
from typing import AsyncIterator

import httptools
import httpx

from proxy.reply_bounds import MAX_REPLY_BYTES, ReplyTooLarge

# The header a `prefixtrace serve` worker names itself in (prefixtrace/serve.py), lowercased as
# compared here; a front proxy records it as the turn's `served_by` (docs/FLEET.md).
WORKER_HEADER = b"x-prefixtrace-worker"
READ_LIMIT = 1 << 20  # bytes buffered before the socket stops being read (flow control)
# Idle kept-alive connections are closed after this; uvicorn closes its side after 5 s, and a
# request sent on a connection in the same instant the server closes it fails: stay below it.
KEEPALIVE_EXPIRY_S = 4.0
MAX_IDLE = 20  # httpx's default for kept-alive connections
_AS_READ = object()  # `first_byte_timeout` not given: the same as `read_timeout`


class _Connection(asyncio.Protocol):
    """One TCP connection to the upstream and its response parser. `response` is the response
    being read (None while idle); the parser calls the `on_*` methods from `data_received`."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.closed = False  # EOF, an error, or closed by us
        self.broken = False  # bytes nobody asked for, or a parse error: never reused
        self.drained: asyncio.Future | None = None
        self.idle_since = 0.0
        self.reading_paused = False

    # --- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.response is None:
            self.broken = True  # the upstream talks while idle (or after a response): do not reuse
            self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.broken = True
            self._fail(httpx.RemoteProtocolError(f"the upstream's response is not valid HTTP/1.1: {exc}"))
            self.transport.close()

    def eof_received(self) -> bool:
        self._lost(None)
        return False  # close our side too

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost(exc)
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def pause_writing(self) -> None:
        self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    def _lost(self, exc: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        response = self.response
        if response is None:
            return
        if response.head_done and response.framed_by_close and exc is None:
            response.complete()  # a body without a length or chunks ends where the connection does
        elif not response.head_done:
            self._fail(httpx.ReadError(str(exc)) if exc is not None else
                       httpx.RemoteProtocolError("Server disconnected without sending a response."))
        else:
            self._fail(httpx.ReadError(str(exc)) if exc is not None else
                       httpx.RemoteProtocolError("peer closed connection without sending complete message body"))

    def _fail(self, error: Exception) -> None:
        if self.response is not None:
            self.response.fail(error)
            self.response = None

    # --- httptools callbacks ---------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self.response.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            response.raw_headers.clear()
            response.reason = b""
            response.interim = True
            return
        response.head(status, self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        self.response.feed(body)
        if self.response.buffered > READ_LIMIT and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        response = self.response
        if response.interim:
            response.interim = False
            return
        self.response = None
        response.complete()

    def resume(self) -> None:
        if self.reading_paused and not self.transport.is_closing():
            self.reading_paused = False
            self.transport.resume_reading()

    @property
    def reusable(self) -> bool:
        return not (self.closed or self.broken or self.transport.is_closing())


class UpstreamResponse:
    """A response being read: the parts of `httpx.Response` the proxy uses (`status_code`,
    `headers`, `aiter_bytes()`, `aread()`, `aclose()`), filled by its connection's parser."""

    def __init__(self, pool: "UpstreamConnections", conn: _Connection, idle_timeout: float | None,
                 first_byte_timeout: float | None = None):
        self._pool = pool
        self._conn = conn
        self._idle_timeout = idle_timeout
        self._first_byte_timeout = first_byte_timeout
        # Until the body's first byte the wait is for the reply to be ready (prefill, or the whole
        # generation of a non-streamed reply): one deadline from the request's sending; then each
        # silence is bounded by the idle timeout.
        self._first_byte_deadline = None if first_byte_timeout is None else \
            asyncio.get_running_loop().time() + first_byte_timeout
        self.body_started = False
        self.status_code = 0
        self.reason = b""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: httpx.Headers | None = None
        self.content_type_header: str | None = None  # for `Relayed`, read off the raw head
        self.worker_header: str | None = None  # X-Prefixtrace-Worker: the worker behind a router that answered
        self.head_done = False
        self.interim = False
        self.framed_by_close = False
        self.keep_alive = False
        self.done = False  # the whole body has arrived
        self.error: Exception | None = None
        self.closed = False
        self.buffered = 0
        self._chunks: deque[bytes] = deque()
        self._waiter: asyncio.Future | None = None
        self._decoder = None

    # --- from the parser ---------------------------------------------------------------

    @property
    def headers(self) -> httpx.Headers:
        """The response's headers as httpx's (made when first asked for: the path to the first byte
        reads only three of them, `head`)."""
        if self._headers is None:
            self._headers = httpx.Headers(self.raw_headers)
        return self._headers

    def head(self, status: int, keep_alive: bool) -> None:
        self.status_code = status
        self.keep_alive = keep_alive
        # What `httpx.Headers` would say of these three, without making one (~10 µs on the path to
        # the first byte, issue 17): names compared lowercased, repeated values joined with ", ".
        content_type = coding = None
        framed = False
        for name, value in self.raw_headers:
            name = name.lower()
            if name == b"content-type":
                content_type = value if content_type is None else content_type + b", " + value
            elif name == b"content-encoding":
                coding = value if coding is None else coding + b", " + value
            elif name == b"content-length" or name == b"transfer-encoding":
                framed = True
            elif name == WORKER_HEADER:
                self.worker_header = value.decode("latin-1")
        self.framed_by_close = not framed
        if (content_type is None or content_type.isascii()) and (coding is None or coding.isascii()):
            self.content_type_header = None if content_type is None else content_type.decode("ascii")
            coding = "identity" if coding is None else coding.decode("ascii")
        else:  # httpx picks one text encoding for all the values: let it
            self.content_type_header = self.headers.get("content-type")
            coding = self.headers.get("content-encoding", "identity")
        coding = coding.strip().lower()
        if coding in ("gzip", "x-gzip", "deflate"):
            self._decoder = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib, by their headers
        elif coding not in ("identity", ""):
            self._decoder = _Undecodable(coding)
        self.head_done = True
        self._wake()

    def feed(self, body: bytes) -> None:
        self._chunks.append(body)
        self.buffered += len(body)
        self._wake()

    def complete(self) -> None:
        self.done = True
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(conn, reuse=self.keep_alive and not self.framed_by_close and not self.closed)
        self._wake()

    def fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # --- for the reader ----------------------------------------------------------------

    async def _wait(self) -> None:
        """Until the parser has something new; `ReadTimeout` past the first-byte deadline (before
        the body has started) or after the idle timeout's silence (once it has)."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        if self.body_started:
            limit, why = self._idle_timeout, f"the upstream sent nothing for {self._idle_timeout:g} s (idle timeout)"
        elif self._first_byte_deadline is None:
            limit, why = None, ""
        else:
            limit = max(0.0, self._first_byte_deadline - loop.time())
            why = f"no reply from the upstream within {self._first_byte_timeout:g} s (first-byte timeout)"
        timer = None if limit is None else loop.call_later(limit, _time_out, waiter, why)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def read_head(self) -> None:
        while not self.head_done:
            if self.error is not None:
                raise self.error
            await self._wait()

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives (decoded if the upstream compressed it): each time, all that has
        arrived since the last time, as one piece. Not one piece per HTTP chunk: a streamed turn's
        role chunk and its first content often come in one read as two chunks, and each piece
        becomes one write to the client (`sse.iter_event_batches`), so they would go out as two
        writes and two wake-ups of the client where one does (issue 17)."""
        conn = self._conn
        while True:
            if self._chunks:
                self.body_started = True
                if len(self._chunks) == 1:
                    chunk = self._chunks.popleft()
                else:
                    chunk = b"".join(self._chunks)
                    self._chunks.clear()
                self.buffered -= len(chunk)
                if conn is not None and conn.reading_paused and self.buffered <= READ_LIMIT // 2:
                    conn.resume()
                if self._decoder is not None:
                    chunk = self._decode(chunk)
                if chunk:
                    yield chunk
            elif self.error is not None:
                raise self.error
            elif self.done:
                if self._decoder is not None:
                    tail = self._decoder.flush()
                    self._decoder = None
                    if tail:
                        yield tail
                return
            else:
                await self._wait()

    def _decode(self, chunk: bytes) -> bytes:
        # Inflated at most to the reply bound plus one byte: a small body that inflates to gigabytes
        # is stopped here, before it is in memory (the reader, `reply_bounds.bounded`, says so).
        try:
            out = self._decoder.decompress(chunk, MAX_REPLY_BYTES + 1)
        except zlib.error as exc:
            raise httpx.DecodingError(f"the upstream's compressed body is broken: {exc}") from exc
        if getattr(self._decoder, "unconsumed_tail", b""):
            raise ReplyTooLarge(MAX_REPLY_BYTES)
        return out

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aclose(self) -> None:
        """Done with the response: a connection whose response was read whole goes back to the
        pool; one still mid-body is closed, which is how the upstream learns to stop."""
        if self.closed:
            return
        self.closed = True
        conn, self._conn = self._conn, None
        if conn is not None:  # not complete: the rest of the body is not wanted
            conn.response = None
            self._pool.release(conn, reuse=False)


class _Undecodable:
    def __init__(self, coding: str):
        self.coding = coding

    def decompress(self, chunk: bytes, max_length: int = 0) -> bytes:
        raise zlib.error(f"{self.coding!r} is not a coding this proxy decodes (it asks for identity)")

    def flush(self) -> bytes:
        return b""


def _time_out(waiter: asyncio.Future, why: str) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout(why))


class UpstreamConnections:
    """Kept-alive connections to one upstream (`host`, `port`) and the POST that uses them.

    Args:
        host, port: where the upstream listens (plain http).
        connect_timeout, write_timeout: seconds (None: no limit).
        read_timeout: the longest silence once the body has started (the idle timeout).
        first_byte_timeout: from sending the request to the body's first byte; default `read_timeout`.
    """

    def __init__(self, host: str, port: int, *, connect_timeout: float | None, read_timeout: float | None,
                 write_timeout: float | None, first_byte_timeout: float | None | object = _AS_READ):
        self.host, self.port = host, port
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.first_byte_timeout = read_timeout if first_byte_timeout is _AS_READ else first_byte_timeout
        self.write_timeout = write_timeout
        self._idle: list[_Connection] = []
        self.opened = 0  # connections made, for tests and the curious

    async def request(self, head: bytes, body: bytes) -> UpstreamResponse:
        """Send `head` (the request line and headers, ending in a blank line) and `body`; return
        once the response's head has arrived, its body to be read from the returned response."""
        conn = self._idle_connection() or await self._connect()
        response = UpstreamResponse(self, conn, self.read_timeout, self.first_byte_timeout)
        conn.response = response
        try:
            await self._write(conn, head, body)
            await response.read_head()
        except BaseException:
            await response.aclose()  # a half-used connection is closed
            raise
        return response

    def _idle_connection(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable and now - conn.idle_since < KEEPALIVE_EXPIRY_S:
                return conn
            conn.transport.close()
        return None

    def release(self, conn: _Connection, *, reuse: bool) -> None:
        if reuse and conn.reusable and len(self._idle) < MAX_IDLE:
            conn.idle_since = time.monotonic()
            conn.parser = httptools.HttpResponseParser(conn)  # a fresh parser: no state carried over
            self._idle.append(conn)
        else:
            conn.transport.close()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(_Connection, self.host, self.port)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"could not connect to the upstream within {self.connect_timeout:g} s "
                                       "(connect timeout)") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        self.opened += 1
        return conn

    async def _write(self, conn: _Connection, head: bytes, body: bytes) -> None:
        if conn.transport.is_closing():
            raise httpx.WriteError("the connection is closed")
        if len(body) < 65536:
            conn.transport.write(head + body)  # one write, one segment for a small request
        else:  # no copy of a large body: the transport sends what it can and buffers the rest
            conn.transport.write(head)
            conn.transport.write(body)
        if conn.drained is not None:
            try:
                async with asyncio.timeout(self.write_timeout):
                    await conn.drained
            except TimeoutError as exc:
                raise httpx.WriteTimeout(f"the upstream took none of the request for {self.write_timeout:g} s "
                                         "(idle timeout)") from exc

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().transport.close()
