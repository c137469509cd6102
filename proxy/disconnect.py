"""Cancel a request whose client hung up before its response began.

Starlette notices a disconnect only while it streams a response (its
`StreamingResponse` listens for `http.disconnect`). A non-streamed chat request
sits in `await chat.whole()` until the model is done, so a client that gave up
still cost a generation to `max_tokens` and was recorded as a normal 200
(issue 14, finding 11).

The turn endpoints' accepted POSTs get the same watch from `TurnRoutes.serve`
(proxy/turn_routes.py) without this layer; this one serves everything else.

`CancelOnDisconnect` is a pure ASGI middleware: once the app has read the whole
request body it keeps one task waiting on the ASGI receive channel. When that
returns `http.disconnect` before the response has started, it cancels the
app's task; the route's `except asyncio.CancelledError` then cancels the engine
sequence (or closes the upstream request) and records the turn as cancelled: 499,
with the stage it had reached (proxy/relay.py, `abandoned`).
Later `receive()` calls from the app (Starlette's own disconnect listener while
streaming) get the same message, so there is only ever one reader of the channel.
"""

from __future__ import annotations

import asyncio


class CancelOnDisconnect:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        watcher: asyncio.Task | None = None
        started = False
        app_task: asyncio.Task | None = None

        async def watch() -> dict:
            message = await receive()
            while message["type"] != "http.disconnect":  # nothing else is expected after the body
                message = await receive()
            if not started and app_task is not None and not app_task.done():
                app_task.cancel()
            return message

        async def wrapped_receive() -> dict:
            nonlocal watcher
            if watcher is not None:
                return await asyncio.shield(watcher)
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                watcher = asyncio.create_task(watch())
            return message

        async def wrapped_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        app_task = asyncio.create_task(self.app(scope, wrapped_receive, wrapped_send))
        try:
            await app_task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # the server cancelled us (shutdown): not a hang-up
            # The client hung up before the response began; the route has recorded
            # the turn as cancelled. Nothing can be sent to a closed connection.
        finally:
            if watcher is not None and not watcher.done():
                watcher.cancel()
