"""The hang-up watch: a request whose client hangs up is cancelled, whatever it is waiting for.

Starlette notices a disconnect only while it streams a response, and a non-streamed chat request
sits in `await chat.whole()` until the model is done: a client that gave up would still cost a
generation to `max_tokens` and be recorded as a normal 200. So every request is served inside one
`HangUpWatch`: `TurnRoutes.serve` (proxy/turn_routes.py) puts the turn endpoints' accepted POSTs in
one, and the `CancelOnDisconnect` middleware everything else the full stack serves.

Once the app has read the whole request body, the watch keeps one task waiting on the ASGI receive
channel. When that returns `http.disconnect` before the response's last byte is out, it cancels the
request's task: the route's `except asyncio.CancelledError` then cancels the engine sequence (or
closes the upstream request) and records the turn as cancelled, 499 with the stage it had reached
(proxy/relay.py, `abandoned`); a streamed reply's generator does the same where it waits or yields
(`EventStreamResponse`, proxy/relay.py, which therefore listens for nothing itself). Later
`receive()` calls from the app get the watcher's message, so the channel has one reader. The owner
of the watch tells a hang-up's cancel from the server's (`took_back_its_cancel`): only the first is
absorbed; a shutdown still propagates.
"""

from __future__ import annotations

import asyncio
from typing import Callable


class HangUpWatch:
    """The ASGI `receive`/`send` of one request, watched for its client's hang-up.

    Args:
        receive, send: the server's channel for the request.
        on_start: called with the `http.response.start` message before it goes out (to add headers:
            one wrapper of `send`, not two).

    The task that makes the watch is the one cancelled. Use it as
    `try: await app(scope, watch.receive, watch.send) except CancelledError: if not
    watch.took_back_its_cancel(): raise  finally: watch.close()`.
    """

    __slots__ = ("_receive", "_send", "_on_start", "_task", "_reader", "_finished", "_hung_up")

    def __init__(self, receive, send, on_start: Callable[[dict], None] | None = None):
        self._receive = receive
        self._send = send
        self._on_start = on_start
        self._task = asyncio.current_task()
        self._reader: asyncio.Future | None = None  # the one reader of the channel once the body is in
        self._finished = False  # the last byte is out: a disconnect now is the connection's own end
        self._hung_up = False

    async def receive(self) -> dict:
        if self._reader is not None:  # later callers get the reader's answer
            return await asyncio.shield(self._reader)
        message = await self._receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            self._reader = asyncio.ensure_future(self._until_disconnect())
        return message

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.body" and not message.get("more_body", False):
            self._finished = True
        elif kind == "http.response.start" and self._on_start is not None:
            self._on_start(message)
        await self._send(message)

    async def _until_disconnect(self) -> dict:
        message = await self._receive()
        while message["type"] != "http.disconnect":  # nothing else is expected after the body
            message = await self._receive()
        if not self._finished:
            self._hung_up = True
            self._task.cancel()
        return message

    def took_back_its_cancel(self) -> bool:
        """Called while a `CancelledError` unwinds the watched task: True when the cancel was the
        watch's alone (a hang-up), now taken back so the task can end normally; False when the
        server (or anyone else) cancelled it too, which the caller must let propagate."""
        return self._hung_up and self._task.uncancel() == 0

    def close(self) -> None:
        """The request is done: a disconnect from now on cancels nothing, and the reader stops."""
        self._finished = True
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()


class CancelOnDisconnect:
    """ASGI middleware: every HTTP request the full stack serves runs inside a `HangUpWatch`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        watch = HangUpWatch(receive, send)
        try:
            await self.app(scope, watch.receive, watch.send)
        except asyncio.CancelledError:
            if not watch.took_back_its_cancel():
                raise  # the server is stopping (or someone else cancelled us): not a hang-up
            # The client hung up: the route has recorded the turn; nothing can be sent to it.
        finally:
            watch.close()
