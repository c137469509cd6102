"""The end of every proxied request, whatever its API: stream it or send it whole, and
record the turn so that it survives a crash once the client has seen the end."""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixtrace.errors import PrefixtraceError, http_status
from proxy.turn_builder import TurnBuilder
from recorder.turn import Turn

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class TurnSink(Protocol):
    def record(self, turn: Turn) -> None: ...


async def record_durably(recorder: TurnSink, turn: Turn) -> None:
    """Hands `turn` over and waits until it is committed, so a client that has
    seen the end of its response can rely on the turn surviving a crash of the
    proxy. Only this response waits, for its own commit; the event loop does
    not (`Recorder.record_async` waits for queue room in a worker thread)."""
    record_async = getattr(recorder, "record_async", None)
    if record_async is None:
        recorder.record(turn)
    else:
        await record_async(turn)


async def respond(chat, builder: TurnBuilder, recorder: TurnSink, stream, error_body: Callable[[PrefixtraceError], dict]):
    """`stream` is the SSE generator to send when the chat streams; otherwise the whole
    body goes out, recorded first. `error_body` renders an error in the API's shape."""
    if chat.streams_events:
        return StreamingResponse(stream, status_code=chat.status, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        data, content_type = await chat.whole()
    except PrefixtraceError as exc:
        status = http_status(exc)
        await record_durably(recorder, builder.finish(status, exc.message))
        return JSONResponse(error_body(exc), status_code=status)
    except asyncio.CancelledError:
        chat.cancel()
        recorder.record(builder.finish(499, "client disconnected"))
        raise
    await record_durably(recorder, builder.finish(chat.status))
    return Response(data, status_code=chat.status, media_type=content_type)
