"""The end of every proxied request, whatever its API: stream it or send it whole, and
record the turn so that it survives a crash once the client has seen the end."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator, Callable, Iterable, NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from prefixtrace.common.errors import PrefixtraceError, http_status
from prefixtrace.wire.request import session_id
from proxy.backend import Backend
from proxy.live_fixes import fix_request
from proxy.run_session import filed_under
from proxy.request_limits import parse_body, read_request_body
from recorder.sink import TurnSink  # the adapters import it from here
from recorder.turn_builder import TurnBuilder
from recorder.turn_facts import Fact, RenderedBy
from recorder.turn import Turn

log = logging.getLogger("prefixtrace.proxy")


# Where an abandoned request had got to, recorded in its turn's error ("client disconnected (queued)"):
# the engine's stages (`Sequence.stage`: queued, prefilling, decoding) and, for an upstream, what the
# proxy was waiting for.
QUEUED = "queued"
UPSTREAM_HEADERS, UPSTREAM_BODY = "upstream_headers", "upstream_body"


def hang_up_error(stage: str | None) -> str:
    """The error recorded for a request abandoned at `stage` (None: not known)."""
    return "client disconnected" if stage is None else f"client disconnected ({stage})"


def stage_of(chat) -> str | None:
    """The stage an opened reply has reached (the adapters that wrap the engine's `EngineChat`
    report its stage as their own)."""
    return chat.stage


def abandoned(chat, builder: TurnBuilder) -> Turn:
    """The turn of a request whose client hung up (or that the server cancelled) once its reply was
    open: the backend is told to stop (an engine sequence leaves at its next step, an upstream
    response is closed by its reader) and the turn ends as 499 with the stage it had reached."""
    chat.cancel()
    return builder.cancelled(hang_up_error(stage_of(chat)))


async def record_durably(recorder: TurnSink, turn: Turn) -> None:
    """Hands `turn` over and waits until it is committed, so a client that has
    seen the end of its response can rely on the turn surviving a crash of the
    proxy. Only this response waits, for its own commit; the event loop does
    not (`Recorder.record_async` waits for queue room in a worker thread)."""
    await recorder.record_async(turn)


# A refused request whose body is over this many bytes is answered without waiting for its
# turn's commit: redacting and writing a 30 MB body takes ~1.5 s on two cores, which the refusal
# (a provable token bound, 0.15 s) need not add to its answer. Its turn is queued before the answer
# goes out, so a graceful stop still writes it (`Recorder.close` drains the queue).
REFUSAL_COMMIT_WAIT_BYTES = 1 << 20


async def record_refusal(recorder: TurnSink, turn: Turn, body_bytes: int) -> None:
    """Records a refused request's `turn`: committed before the answer (`record_durably`), unless
    its body is over `REFUSAL_COMMIT_WAIT_BYTES`; then handed to the recorder's queue without
    blocking the event loop (`Recorder.enqueue`, which logs a write that fails) and answered at
    once: only a crash in the moment before its commit could lose it."""
    if body_bytes <= REFUSAL_COMMIT_WAIT_BYTES:
        await record_durably(recorder, turn)
        return
    await recorder.enqueue(turn)


class Framing(NamedTuple):
    """How a protocol ends its stream: `is_end`, the event the turn is committed before (chat's `[DONE]`,
    Messages' `message_stop`, a Responses terminal event); `in_band_error`, a failure after the
    headers went out, in the protocol's shape."""
    is_end: Callable[[bytes], bool]
    in_band_error: Callable[[PrefixtraceError], list[bytes]]


def feed(builder: TurnBuilder, facts: Iterable[Fact]) -> None:
    """The facts a reply (or its opening) told, fed to the turn in the order they came."""
    for fact in facts:
        builder.feed(fact)


async def serve_turn(request: Request, *, endpoint: str, backend: Backend, recorder: TurnSink, parse, open_reply,
                     framing: Framing, error_body: Callable[[PrefixtraceError], dict]):
    """One proxied request, whatever its API, to `backend`: a `Turn` for it, the body parsed into a
    request (`parse(body, headers)`), the backend's reply opened (`open_reply(req, headers, learnt)`,
    which appends to `learnt` the facts it learns on the way), then `respond`, a stream framed by
    the protocol's `framing`. The turn's builder is this module's alone: it is fed what the request
    is, the facts learnt while opening (whether the open succeeds, is refused or is abandoned) and
    then those the reply carries. A bad body or a refusing backend is answered in the API's error
    shape and recorded; a request whose client hangs up is recorded as 499 with the stage it
    reached (`abandoned`)."""
    turn = Turn(
        request_id=uuid.uuid4().hex,
        started_at=time.time(),
        endpoint=endpoint,
        upstream=backend.label,
        request_body=None,
        request_headers=dict(request.headers),
        client_addr=f"{request.client.host}:{request.client.port}" if request.client else None,
    )
    builder = TurnBuilder(turn)
    raw = b""
    learnt: list[Fact] = []  # what the backend learns while it opens the reply, told whatever the outcome

    def refused_request(stored: str | None) -> None:
        """What a request the reply never opened for is recorded with: its body as far as it was
        taken in (`stored`: the marker of one not kept), and the session it still belongs to."""
        if turn.request_body is None:
            builder.on_request(stored or raw.decode("utf-8", errors="replace"))
        if turn.session_id is None:
            headers = turn.request_headers
            builder.on_session(filed_under(headers, session_id(endpoint, turn.request_body, headers)))

    try:
        raw = await read_request_body(request)  # 413 past --max-request-mb
        body = parse_body(raw)
        fixed = fix_request(getattr(request.app.state, "fixes", None), endpoint, body, raw, turn.request_headers,
                            turn.request_id)  # serve --fix
        body, raw = fixed.body, fixed.raw
        builder.on_request(body, raw.decode("utf-8", errors="replace"), headers=fixed.headers, fixes=fixed.fixes)
        req = parse(body, turn.request_headers)
        if req.body is body:
            req.raw = raw
        req.query = request.scope.get("query_string", b"").decode("latin-1")  # forwarded upstream
        builder.on_session(filed_under(turn.request_headers, req.session_id), stream=req.stream)
        chat = await open_reply(req, turn.request_headers, learnt)
    except asyncio.CancelledError:
        # The client hung up (the hang-up watch, proxy/disconnect.py) or the server is stopping
        # while the reply was being opened: queued or prefilling in the engine (which cancelled its
        # sequence and named the stage in the turn's error), or waiting for the upstream's headers
        # (the upstream request is closed as the cancel unwinds it). Recorded now, without waiting:
        # nothing more can be sent, and this task must end.
        feed(builder, learnt)
        refused_request(None)  # stopped while the body was read (a server shutting down)
        recorder.record(builder.cancelled(hang_up_error(QUEUED if backend.embedded else UPSTREAM_HEADERS)))
        raise
    except Exception as exc:
        if not isinstance(exc, PrefixtraceError):
            # A bug, not a refusal: still answered in the API's shape and recorded,
            # so that every request leaves its turn.
            log.exception("request %s failed", turn.request_id)
            exc = PrefixtraceError(f"internal error: {type(exc).__name__}: {exc}")
        feed(builder, learnt)
        refused_request(exc.stored_body)  # a refused request still belongs to its session
        status = http_status(exc)
        await record_refusal(recorder, builder.finish(status, exc.message), len(raw))
        return JSONResponse(error_body(exc), status_code=status)
    feed(builder, learnt)
    turn.upstream = chat.url or turn.upstream  # the upstream (or pool member) that answered
    if chat.url is not None:  # its renderer, as the backend instance that read it knows it
        builder.feed(RenderedBy(backend.renderer_of(chat.url)))
    return await respond(chat, builder, recorder, framing, error_body)


async def stream_and_record(chat, builder: TurnBuilder, recorder: TurnSink, framing: Framing) -> AsyncIterator[bytes]:
    """A streamed reply's SSE as sent, its turn recorded once, the same way for every protocol.

    The reply's `sse()` yields the bytes to send and, before them, the facts they tell the turn
    (recorder/turn_facts.py): the bytes go to the client, the facts to the builder, in the order
    they came. The turn is committed before the protocol's end marker (`framing.is_end`: chat's
    `[DONE]`, Messages' `message_stop`, a Responses terminal event) goes out, so a client that has
    read the end can rely on the turn surviving a crash. A reply that knows its turn is complete
    earlier (an upstream's usage chunk, `UpstreamChat.on_final`) starts the commit then, and the
    end marker waits for it. A failure after the headers went out is recorded and told in band
    (`framing.in_band_error`, in the protocol's shape); a hang-up is recorded as 499 with the
    stage reached (`abandoned`)."""
    recorded = False
    early_commit: asyncio.Task | None = None
    is_end = framing.is_end

    def finish(error: str | None = None) -> Turn:
        nonlocal recorded
        recorded = True
        return builder.finish(chat.status, error)

    def commit_now() -> None:
        nonlocal early_commit
        if not recorded:
            early_commit = asyncio.ensure_future(record_durably(recorder, finish()))

    chat.on_final = commit_now  # a reply that can tell its turn is complete before the end marker calls it
    try:
        async for event in chat.sse():
            if type(event) is not bytes:
                if not recorded:  # after an early commit the turn is the recorder's: nothing more is told
                    builder.feed(event)
                continue
            if is_end(event):
                if early_commit is not None:
                    await asyncio.shield(early_commit)
                if not recorded:
                    await record_durably(recorder, finish())
            yield event
    except PrefixtraceError as exc:  # failed after the headers went out: tell the client in band
        if not recorded:
            await record_durably(recorder, finish(exc.message))
        for out in framing.in_band_error(exc):
            yield out
    except (asyncio.CancelledError, GeneratorExit):  # the client hung up: 499, with the stage reached
        chat.cancel()
        if not recorded:
            recorded = True
            recorder.record(abandoned(chat, builder))
        raise
    finally:
        if not recorded:
            recorder.record(finish())


async def respond(chat, builder: TurnBuilder, recorder: TurnSink, framing: Framing,
                  error_body: Callable[[PrefixtraceError], dict]):
    """A streaming reply goes out as its SSE events (`stream_and_record`, framed by `framing`);
    otherwise the whole body goes out, recorded first, with the facts it tells. `error_body` renders
    an error in the API's shape."""
    if chat.streams_events:
        return EventStreamResponse(stream_and_record(chat, builder, recorder, framing), status_code=chat.status)
    try:
        whole = await chat.whole()
    except PrefixtraceError as exc:
        status = http_status(exc)
        await record_durably(recorder, builder.finish(status, exc.message))
        return JSONResponse(error_body(exc), status_code=status)
    except asyncio.CancelledError:  # the client hung up (proxy/disconnect.py) or the server is stopping
        recorder.record(abandoned(chat, builder))
        raise
    feed(builder, whole.facts)
    await record_durably(recorder, builder.finish(chat.status))
    return Response(whole.data, status_code=chat.status, media_type=whole.content_type)


# The response that carries a turn's SSE stream to the client (every protocol, every backend).
#
# Starlette's `StreamingResponse` does the same job through an anyio task group: a second task
# streams while the first listens for `http.disconnect`, with cancel-scope bookkeeping around
# every chunk, a few percent of the proxy's CPU on a short streamed request (issue 17). This one
# streams in the request's own task and listens for nothing: every path it is sent on runs inside
# the app's hang-up watch (`HangUpWatch`, proxy/disconnect.py: `TurnRoutes` for the turn POSTs,
# the `CancelOnDisconnect` middleware on the full stack), which cancels that task when the client
# hangs up. What the stream's generator sees is a `CancelledError` where it waits (for the
# upstream, or the engine) or, when it was suspended at a `yield`, a `GeneratorExit` from
# `aclose()`; either way it records the turn as the client saw it and tells its backend to stop.
SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
           (b"content-type", b"text/event-stream; charset=utf-8")]


class EventStreamResponse(Response):
    """An ASGI response: `status`, the SSE headers, then each of `events` as it comes. Sent inside a
    hang-up watch (proxy/disconnect.py), which cancels it when the client leaves. A Starlette
    `Response` (whose `__init__` it skips: no body to render) so that where FastAPI's route wrapper
    serves it (the full stack) it is passed on as a response, its `background` run after it as
    Starlette's are, rather than serialized as JSON."""

    def __init__(self, events: AsyncIterator[bytes], status_code: int = 200):
        self.events = events
        self.status_code = status_code
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": SSE_HEADERS})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()  # a generator left at a `yield` records the hang-up now
        if self.background is not None:
            await self.background()
