"""How many sockets the server can hold, and how long an idle one may stay.

Issue 14 (finding 9): ~2,100 connections that never sent a request exhausted
the open-file limit (mlx-lm's import sets it to 2048 soft / 4096 hard), and
every new request timed out until they closed. uvicorn closes a kept-alive
connection 5 s after its last response (`timeout_keep_alive`), but has no
timeout for a connection that has not sent a whole request head yet (a fresh
one, or a slow-loris trickling header bytes). `with_head_timeout` adds one (to httptools, or h11): a
connection waiting for a request head gets `HEAD_TIMEOUT_S` from the moment it
began waiting (trickled bytes do not extend it), then is closed. What remains is
the limit itself (docs/SECURITY.md): more than that many connections opened
within one timeout still starve the server until the timeout frees them.

Also here, because it is the same protocol class: uvicorn writes its access line
(`127.0.0.1:5 - "POST /v1/chat/completions HTTP/1.1" 200`) inside its send of the
response head, so every response's first bytes wait for a log record to be
formatted and written (issue 17: 0.2-0.3 ms on the proxy's path to the first byte
on a loaded 2-core machine). `_AccessLineAtTheEnd` holds that same line, with the
same logger, arguments and filters (the query values masked: `QueryValuesMasked`, below),
until the response's last bytes have gone out, or the connection ends first: the
line of a streamed turn comes when it ends, as nginx's does. Not after the first
body bytes: a streamed turn's first body is often its role chunk, one read before
the first content, so the line would still be written in front of it.

And: a response's head is written together with the body bytes the app
sends in the same step, not by itself. uvicorn writes the head the moment the app sends
`http.response.start`; a streamed turn's first event (the role chunk, `message_start`, a whole
JSON body) usually follows in the same step of the app's task, so head and body went out as two
writes, two segments and two wake-ups of the client, which on a 2-core machine shares the cores
with the server. `_HeadHeld` keeps the head bytes until the cycle's next write (then one write
carries both), the response's end, a close, or the end of the step (the app's task waits for
something: the head goes out then, by itself). It never waits for bytes that are not there yet:
a client that has the head early reads it while the first content is still on its way (tried in
this session: holding the head and the role chunk up to 2 ms for the first content made the
added TTFT worse). Nothing else changes: the same bytes in the same order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from prefixtrace.common import heap

log = logging.getLogger("prefixtrace.serve")

KEEP_ALIVE_S = 5  # uvicorn's own default, stated: idle kept-alive connections close after this
HEAD_TIMEOUT_S = 15.0  # a client that connects sends its request head at once
MAX_HEAD_KB = 64  # request line + headers; uvicorn's h11 stops at 16 KB, nginx at 4 x 8 KB, Node at 16 KB
LINGER_S = 2.0  # after a 431, the rest of the head is read and dropped this long, so the client reads its answer
# The header the protocol adds (and no client can: one it sends is dropped) to a request whose head it
# stopped reading; proxy/guard.py answers it 431 and records it.
HEAD_REFUSED = "x-prefixtrace-head-refused"
NOFILE_CAP = 65536  # open files asked for at most: room for tens of thousands of sockets


class _HeadDeadline:
    """Mixin for a uvicorn HTTP protocol: a deadline for each request head."""

    head_timeout_s = HEAD_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_pending = False
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()  # waiting for the next request head on this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_received()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._head_received()
        self._head_pending = True
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_received(self) -> None:
        self._head_pending = False
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._head_pending and not self.transport.is_closing():
            self.transport.close()


class _HeldAccessLine:
    """Stands in for a request cycle's access logger: keeps the one line uvicorn logs at the
    response head, to log it on the real logger when `flush` is called."""

    __slots__ = ("line", "logger")

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self.line: tuple | None = None

    def info(self, msg, *args) -> None:
        self.line = (msg, args)

    def flush(self) -> None:
        line, self.line = self.line, None
        if line is not None:
            self.logger.info(line[0], *line[1])


class QueryValuesMasked(logging.Filter):
    """uvicorn's access log prints the request target; a client that put its key in
    the query string (`?key=...`, `?api-key=...`, Azure's and Google's habit) would
    have it in the log. Keep the names, mask every value."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            path, query = args[2].split("?", 1)
            record.args = (*args[:2], f"{path}?{_MASKED_VALUE.sub('=***', query)}", *args[3:])
        return True


_MASKED_VALUE = re.compile(r"=[^&]*")


class _HeadHeld:
    """Stands in for a request cycle's transport: the write that carries the response head
    (`holding`) is kept and goes out with the next write, or by itself on `flush` (the response's
    end, a close, the end of the current step of the loop). Everything else is the transport's."""

    __slots__ = ("_transport", "_loop", "_held", "_flush_soon", "holding")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._flush_soon: asyncio.Handle | None = None
        self.holding = False  # the next write is the head: keep it

    def write(self, data: bytes) -> None:
        if self.holding:
            self.holding = False
            self._held = bytes(data)
            self._flush_soon = self._loop.call_soon(self.flush)  # once the app's task waits for something
            return
        if self._held is not None:
            data = self._take() + data
        self._transport.write(data)

    def _take(self) -> bytes:
        held, self._held = self._held, None
        if self._flush_soon is not None:
            self._flush_soon.cancel()
            self._flush_soon = None
        return held

    def flush(self) -> None:
        self.holding = False
        if self._held is not None:
            held = self._take()
            if not self._transport.is_closing():  # the client went away: nothing to send it
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def writelines(self, lines) -> None:
        self.write(b"".join(lines))

    def abort(self) -> None:
        self.flush()
        self._transport.abort()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class _AccessLineAtTheEnd:
    """Mixin for a uvicorn HTTP protocol: each request cycle's access line is written after the
    response's last bytes (or when the connection ends before them), not before its head; and
    the head goes out with the body bytes sent in the same step (`_HeadHeld`). Both through one
    wrapper of the cycle's `send`, put on by `_hold_access_line`, which is called where the protocol
    has just made a cycle, before the cycle's task has run (it reads `cycle.send` when it starts)."""

    def _hold_access_line(self) -> None:
        cycle = getattr(self, "cycle", None)
        if cycle is None or self.__dict__.get("_wrapped_cycle") is cycle:
            return  # no cycle, or one whose send is wrapped already (h11 calls this on every read)
        self._wrapped_cycle = cycle
        line = None
        if cycle.access_log:
            line = cycle.access_logger = _HeldAccessLine(cycle.access_logger)
            unsent = self.__dict__.setdefault("_unsent_access_lines", set())  # cycles of this connection
            unsent.add(line)
        held = cycle.transport = _HeadHeld(cycle.transport, self.loop)
        send = cycle.send

        async def send_held(message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                self._response_starts(cycle)
                held.holding = True  # uvicorn writes the head inside this send: that write is kept
                try:
                    await send(message)
                finally:
                    held.holding = False
                return
            await send(message)
            if kind == "http.response.body" and not message.get("more_body", False):
                held.flush()  # a response with no body bytes to carry its head (HEAD, 204, an empty body)
                if line is not None and line in unsent:
                    unsent.discard(line)
                    line.flush()  # the whole response is out: now the line

        cycle.send = send_held

    def _response_starts(self, cycle) -> None:
        """Called as a cycle's response head is sent (before uvicorn writes it)."""

    def connection_lost(self, exc: Exception | None) -> None:
        unsent = self.__dict__.get("_unsent_access_lines")
        while unsent:
            unsent.pop().flush()  # a head went out, not the whole body (a hang-up, an app that failed)
        super().connection_lost(exc)


class H11WithHeadTimeout(_AccessLineAtTheEnd, _HeadDeadline, H11Protocol):
    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in: the deadline is met
            self._head_received()
        self._hold_access_line()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._hold_access_line()  # a request already buffered gets its cycle in there


TRIM_AFTER_BODY_BYTES = 1 << 20  # a request body this big: its memory is given back to the OS after it


_trim_pending = False


def give_memory_back(loop: asyncio.AbstractEventLoop) -> None:
    """Hands the heap's free pages back to the OS (glibc's `malloc_trim`), once, in a worker thread.

    A big request's copies (its body, the decoded text, the parsed JSON, the rendered prompt, the
    recorder's row: ~30 MB each for a 30 MB prompt) are freed when it ends, but glibc keeps freed
    heap memory for reuse, and raises its mmap threshold to the largest block freed (up to 32 MB),
    so the next big request's copies come from the heap too: issue 25 measured 1.6 GB never returned
    after one 30 MB prompt. Trimming after each big request returns it; it costs a few ms of a
    worker thread, only after bodies over `TRIM_AFTER_BODY_BYTES`."""
    global _trim_pending
    if not heap.AVAILABLE or _trim_pending:
        return
    _trim_pending = True

    def trim() -> None:
        global _trim_pending
        _trim_pending = False
        heap.trim_heap()

    loop.run_in_executor(None, trim)


class _Lingering:
    """Stands in for a refused request's transport: its `close` sends what is buffered, shuts the
    write side and closes `LINGER_S` later (or when the client does), so a client still sending the
    head it was refused for gets to read the answer rather than a reset."""

    def __init__(self, transport, loop: asyncio.AbstractEventLoop):
        self._transport, self._loop = transport, loop

    def close(self) -> None:
        transport = self._transport
        if transport.is_closing():
            return
        if transport.can_write_eof():
            transport.write_eof()
        self._loop.call_later(LINGER_S, transport.close)

    def __getattr__(self, name):
        return getattr(self._transport, name)


def _httptools_protocol():
    """uvicorn's "auto" picks httptools when it is installed (a dependency since issue 17; h11 where it is
    missing): the same deadline on it, and the limits below, which h11 has of its own (a head over 16 KB
    is h11's 400) or does not need (it ignores trailers and closes a connection whose body was not read).

    Issue 25: httptools reads a head of any size (a 30 MB header was answered 200 and stored, findings
    3) and passes chunked trailers on as headers, which uvicorn appends to the request's headers (finding
    14). Here a head over `max_head_bytes` is read no further: the request goes to the app with the
    headers complete so far and `HEAD_REFUSED`, to be answered 431 and recorded (proxy/guard.py), and the
    connection closes after it; trailers are dropped. A response sent before its request's body was all
    read (413, 408, 501) closes the connection too, which would otherwise go on reading that body."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class HttpToolsWithHeadTimeout(_AccessLineAtTheEnd, _HeadDeadline, HttpToolsProtocol):
        max_head_bytes = MAX_HEAD_KB * 1024
        _in_head = False  # between a message's start and its head's end
        _head_bytes = 0
        _head_cut = False  # the head was cut off: what follows is dropped
        _head_refused = False  # this request's head is over the limit: the app answers it 431
        _body_bytes = 0  # of the request being answered (a pipelined one's would add: a trim sooner, no harm)

        def data_received(self, data: bytes) -> None:
            if self._head_cut:
                return
            was_in_head = self._in_head
            super().data_received(data)
            if self._in_head and was_in_head:  # a head that began in this chunk is counted from the next
                self._head_bytes += len(data)
                if self._head_bytes > self.max_head_bytes and self.parser is not None:
                    self._refuse_head()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes, self._head_refused = True, 0, False

        def on_header(self, name: bytes, value: bytes) -> None:
            if not self._in_head or name.lower() == _HEAD_REFUSED_BYTES:
                return  # a trailer (after a chunked body), or a header only this protocol may set
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._head_received()
            self._keep_head_within_limit()
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None:
                if self._head_refused:
                    cycle.keep_alive = False
                    cycle.transport = _Lingering(cycle.transport, self.loop)
            self._hold_access_line()

        def _response_starts(self, cycle) -> None:
            """A response that starts before its request's body is all in says `connection: close` (uvicorn
            adds it when the cycle is not kept alive), and the connection closes after it, lingering."""
            if cycle.more_body and cycle.keep_alive:
                cycle.keep_alive = False
                cycle.transport = _Lingering(cycle.transport, self.loop)

        def on_body(self, body: bytes) -> None:
            self._body_bytes += len(body)
            super().on_body(body)

        def on_response_complete(self) -> None:
            cycle = self.cycle
            if cycle is not None and cycle.more_body and not self.transport.is_closing():
                # The rest of the body would be read for nothing, at the client's pace: dropped, and the
                # connection closed once the client had a moment to read the answer.
                self._head_cut = True
                _Lingering(self.transport, self.loop).close()
            if self._body_bytes > TRIM_AFTER_BODY_BYTES:
                give_memory_back(self.loop)
            self._body_bytes = 0
            super().on_response_complete()

        def _keep_head_within_limit(self) -> None:
            """A head that was cut (`_head_cut`) or is over the limit keeps the headers that fit within it, and
            gets the `HEAD_REFUSED` marker."""
            size = len(self.url)
            kept = len(self.headers)
            for i, (name, value) in enumerate(self.headers):
                size += len(name) + len(value) + 4  # ": " and CRLF
                if size > self.max_head_bytes:
                    kept = i
                    break
            else:
                if not self._head_cut:
                    return
            size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers[:kept])
            del self.headers[kept:]
            self.headers.append((_HEAD_REFUSED_BYTES, (
                f"the request head is over this server's limit of {self.max_head_bytes // 1024} KB (prefixtrace serve "
                f"--max-header-kb): the request line and the {kept} headers within it ({size} bytes) were kept, the "
                "rest of the head was not").encode()))
            self._head_refused = True

        def _refuse_head(self) -> None:
            self._head_cut, self._in_head = True, False
            self._head_received()
            if self.parser.get_http_version() not in ("1.0", "1.1") or not self.url \
                    or len(self.url) > self.max_head_bytes:
                # Still in the request line, or a request line over the limit: no path to answer in an API's shape.
                self.send_431_response(f"request line over {self.max_head_bytes // 1024} KB")
                return
            self.on_headers_complete()  # uvicorn's: the app runs on what was read, marked
            if self.cycle is not None:
                self.on_message_complete()  # no body

        def send_431_response(self, msg: str) -> None:
            body = msg.encode()
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; "
                                 b"charset=utf-8\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(body), body))
            _Lingering(self.transport, self.loop).close()

    return HttpToolsWithHeadTimeout


_HEAD_REFUSED_BYTES = HEAD_REFUSED.encode()


def with_head_timeout(seconds: float, max_head_kb: int = MAX_HEAD_KB) -> type:
    """The protocol uvicorn's "auto" would use (httptools, else h11), with a request-head deadline
    and the access line after the response's last bytes; on httptools also a limit on the head
    (`max_head_kb`, 431 past it) and no trailers taken for headers."""
    base = _httptools_protocol() or H11WithHeadTimeout
    return type(base.__name__, (base,), {"head_timeout_s": seconds, "max_head_bytes": int(max_head_kb * 1024)})


@contextlib.contextmanager
def open_file_limit_not_lowered():
    """Around the first import of mlx-lm: `mlx_lm/utils.py` calls
    `resource.setrlimit(RLIMIT_NOFILE, (2048, 4096))` at import time, which lowers
    the hard limit for good in a process that may not raise it back (any
    unprivileged one, and root in most containers). For the length of the import,
    a call that would lower the open-file limit keeps the higher value instead;
    every other call goes through unchanged."""
    real = resource.setrlimit

    def never_lower(which, limits):
        if which == resource.RLIMIT_NOFILE:
            soft, hard = resource.getrlimit(which)
            new_soft, new_hard = limits
            if hard == resource.RLIM_INFINITY or (new_hard != resource.RLIM_INFINITY and new_hard < hard):
                new_hard = hard
            new_soft = max(soft, new_soft) if new_soft != resource.RLIM_INFINITY else new_soft
            limits = (min(new_soft, new_hard) if new_hard != resource.RLIM_INFINITY else new_soft, new_hard)
        return real(which, limits)

    resource.setrlimit = never_lower
    try:
        yield
    finally:
        resource.setrlimit = real


def raise_open_file_limit(before_mlx: tuple[int, int] | None = None) -> tuple[int, int]:
    """Soft open-file limit -> hard (at most `NOFILE_CAP`), where the OS allows;
    returns (soft, hard) after.

    mlx-lm's import sets (2048, 4096), and a process re-executed after it (the
    OpenBLAS re-exec) inherits that. A privileged process may raise the hard limit
    again: first to what it was before the import (`before_mlx`), else to the
    cap; an unprivileged one cannot, and keeps 4096."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    candidates = [hard]
    if before_mlx is not None:
        candidates.insert(0, NOFILE_CAP if before_mlx[1] == resource.RLIM_INFINITY else min(before_mlx[1], NOFILE_CAP))
    candidates.insert(1, NOFILE_CAP)
    for new_hard in dict.fromkeys(candidates):
        if new_hard < hard and hard != resource.RLIM_INFINITY:
            continue  # never lower it
        new_soft = min(new_hard if new_hard != resource.RLIM_INFINITY else NOFILE_CAP, NOFILE_CAP)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, new_soft), max(new_hard, hard)
                                                        if hard != resource.RLIM_INFINITY else hard))
            break
        except (ValueError, OSError):
            continue
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    log.debug("open files: up to %d (hard limit %s); idle connections close after %d s, a request head is "
             "due within %.0f s", soft, "unlimited" if hard == resource.RLIM_INFINITY else hard,
             KEEP_ALIVE_S, HEAD_TIMEOUT_S)
    return soft, hard
