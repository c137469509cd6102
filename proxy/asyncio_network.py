"""httpcore's network layer on plain asyncio, for the upstream client (issue 17).

httpcore (under httpx) reads and writes sockets through a "network backend"; its default on
asyncio is anyio's, which puts a cancel scope and a deadline around every read and write, and
answers "is this idle connection still good?" with a `select()` call before each request: about
a tenth of the proxy's CPU on a short streamed turn. This backend does the same job with an
asyncio `Protocol`: bytes land in a buffer as they arrive; a read waits on one future under
`asyncio.timeout`; the idle check is the buffer's state (a closed or talking idle connection has
something in it), with no system call. Errors map onto httpcore's exceptions exactly as the anyio
backend maps them, so httpx reports the same failures (ConnectError, ReadTimeout, ...).
Written by hand because httpcore ships no asyncio backend of its own, only anyio's and trio's.
Used for plain-http upstreams only (the local case, where this overhead is a visible share of a
turn): it has no TLS; an https upstream keeps anyio's backend.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

import httpcore
from httpcore import ConnectError, ConnectTimeout, ReadError, ReadTimeout, WriteError, WriteTimeout

READ_LIMIT = 1 << 20  # bytes buffered before the socket stops being read (flow control)


class _Buffer(asyncio.Protocol):
    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.data = bytearray()
        self.eof = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.drained: asyncio.Future | None = None
        self.reading_paused = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data += data
        if len(self.data) > READ_LIMIT and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close our side too

    def connection_lost(self, exc: BaseException | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def pause_writing(self) -> None:
        self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class AsyncioStream(httpcore.AsyncNetworkStream):
    def __init__(self, transport: asyncio.Transport, protocol: _Buffer):
        self.transport = transport
        self.protocol = protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        p = self.protocol
        if not p.data and not p.eof:
            p.waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout):
                    await p.waiter
            except TimeoutError as exc:
                raise ReadTimeout(str(exc) or "read timed out") from exc
            finally:
                p.waiter = None
        if p.data:
            out = bytes(p.data[:max_bytes])
            del p.data[:max_bytes]
            if p.reading_paused and len(p.data) <= READ_LIMIT // 2 and not self.transport.is_closing():
                p.reading_paused = False
                self.transport.resume_reading()
            return out
        if p.error is not None:
            raise ReadError(str(p.error)) from p.error
        return b""  # the peer closed: httpcore decides whether that ended the message or broke it

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        if self.transport.is_closing():
            raise WriteError("the connection is closed")
        self.transport.write(buffer)
        drained = self.protocol.drained
        if drained is not None:
            try:
                async with asyncio.timeout(timeout):
                    await drained
            except TimeoutError as exc:
                raise WriteTimeout(str(exc) or "write timed out") from exc
        if self.protocol.error is not None:
            raise WriteError(str(self.protocol.error)) from self.protocol.error

    async def aclose(self) -> None:
        self.transport.close()

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object":
            return self.transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return self.transport.get_extra_info("sockname")
        if info == "server_addr":
            return self.transport.get_extra_info("peername")
        if info == "socket":
            return self.transport.get_extra_info("socket")
        if info == "is_readable":
            # httpcore asks this of an idle kept-alive connection: anything there (data, EOF, an
            # error) means the server has closed it or broken the protocol, so it is not reused.
            p = self.protocol
            return bool(p.data) or p.eof or self.transport.is_closing()
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable | None = None) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                transport, protocol = await loop.create_connection(
                    _Buffer, host, port, local_addr=None if local_address is None else (local_address, 0))
        except TimeoutError as exc:
            raise ConnectTimeout(str(exc) or "connect timed out") from exc
        except OSError as exc:
            raise ConnectError(str(exc)) from exc
        sock = transport.get_extra_info("socket")
        for option in socket_options or ():  # asyncio already sets TCP_NODELAY
            sock.setsockopt(*option)
        return AsyncioStream(transport, protocol)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable | None = None) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                transport, protocol = await loop.create_unix_connection(_Buffer, path)
        except TimeoutError as exc:
            raise ConnectTimeout(str(exc) or "connect timed out") from exc
        except OSError as exc:
            raise ConnectError(str(exc)) from exc
        for option in socket_options or ():
            transport.get_extra_info("socket").setsockopt(*option)
        return AsyncioStream(transport, protocol)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def use_asyncio_network(client) -> bool:
    """Put `client`'s own connection pool (the transport for URLs no proxy mount takes) on this
    backend, keeping every other setting; True when done. httpx takes no network backend as an
    argument: the pool's is set in place, before it has opened a connection. Where this
    httpx/httpcore has other internals, or the transport is not a plain pool (an injected one, a
    proxy), the client keeps what it had."""
    pool = getattr(getattr(client, "_transport", None), "_pool", None)
    if type(pool) is not httpcore.AsyncConnectionPool or not hasattr(pool, "_network_backend") \
            or getattr(pool, "_connections", None):
        return False
    pool._network_backend = AsyncioBackend()
    return True
