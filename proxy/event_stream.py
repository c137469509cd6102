"""The response that carries a turn's SSE stream to the client (every protocol, every backend).

Starlette's `StreamingResponse` does the same job through an anyio task group: a second task
streams while the first listens for `http.disconnect`, with cancel-scope bookkeeping around
every chunk, a few percent of the proxy's CPU on a short streamed request (issue 17). This one
streams in the app's own task and leaves the listening to one plain task, whose only act is to
cancel the streaming task when the client hangs up; where the app's front already watches for
the hang-up and cancels the same task (`TurnRoutes`, proxy/turn_routes.py), it adds none. What
the stream's generator sees is the same as before: a `CancelledError` where it waits (for the
upstream, or the engine) or, when it was suspended at a `yield`, a `GeneratorExit` from
`aclose()`; either way it records the turn as the client saw it and tells its backend to stop.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from proxy.turn_routes import WATCHED

HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
           (b"content-type", b"text/event-stream; charset=utf-8")]


class EventStreamResponse:
    """An ASGI response: `status`, the SSE headers, then each of `events` as it comes."""

    def __init__(self, events: AsyncIterator[bytes], status_code: int = 200):
        self.events = events
        self.status_code = status_code

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        hung_up = False
        finished = False

        async def listen() -> None:
            nonlocal hung_up
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:  # once the last byte is out, a disconnect is the connection's own end
                hung_up = True
                task.cancel()

        # Where the app watches for the hang-up itself (proxy/turn_routes.py), it cancels this task
        # just as `listen` would: no second listener.
        listener = None if scope.get(WATCHED) else asyncio.ensure_future(listen())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": HEADERS})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not hung_up:
                raise  # the server is stopping (or someone else cancelled us): not ours to swallow
            task.uncancel()  # the client went away: the stream's generator has recorded it
        finally:
            finished = True
            if listener is not None:
                listener.cancel()
            await self.events.aclose()  # a generator left at a `yield` records the hang-up now
