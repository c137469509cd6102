"""The FastAPI app: OpenAI-compatible endpoints in front of one backend.

A backend is either the embedded engine (`EngineBackend`) or an upstream
server (`UpstreamBackend`); both expose `open(request) -> chat` whose chat
object streams SSE (`sse()`) or returns a whole body (`whole()`). Every request,
failed ones included, leaves exactly one `Turn` with the recorder.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from prefixtrace.errors import PrefixtraceError, http_status, to_openai_error
from prefixtrace.wire import sse
from proxy.anthropic import MESSAGES_PATH, add_messages_route, to_anthropic_error
from proxy.responses import RESPONSES_PATH, add_responses_route
from proxy.completions import add_completions_route
from proxy.fallback import add_fallback_routes
from proxy.chat_request import parse_chat_request
from proxy.guard import RequestGuard, refusal_recorder
from proxy.relay import TurnSink, record_durably, serve_turn
from proxy.dashboard import observe
from proxy.disconnect import CancelOnDisconnect
from proxy.request_limits import DEFAULT_MAX_REQUEST_MB
from prefixtrace.wire.turn_builder import TurnBuilder

log = logging.getLogger("prefixtrace.proxy")
CHAT_PATH = "/v1/chat/completions"


def create_app(backend, recorder: TurnSink, *, allowed_hosts: list[str] | None = None,
               max_request_mb: float = DEFAULT_MAX_REQUEST_MB) -> FastAPI:
    """`allowed_hosts`: names the Host header may carry (None: loopback only; "*": any), see proxy/guard.py;
    `max_request_mb`: the largest body accepted (proxy/request_limits.py)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if hasattr(backend, "aclose"):
            await backend.aclose()

    app = FastAPI(title="prefixtrace", lifespan=lifespan)
    app.state.backend = backend
    app.state.recorder = recorder
    app.state.max_request_mb = max_request_mb  # proxy/request_limits.py
    recorder = observe(app, backend, recorder)  # /ui, /metrics: every turn also feeds them
    # A loopback Host on every request and JSON on every POST; refused turns are recorded.
    error_bodies = {CHAT_PATH: to_openai_error, RESPONSES_PATH: to_openai_error, MESSAGES_PATH: to_anthropic_error}
    app.add_middleware(RequestGuard, allowed_hosts=allowed_hosts,
                       refuse=refusal_recorder(recorder, backend.label, error_bodies, record_durably))

    @app.middleware("http")
    async def max_context_header(request: Request, call_next):
        response = await call_next(request)
        limit = getattr(backend, "max_context_tokens", None)
        if limit is not None:
            # Lets a harness compact before it hits the wall, on every response.
            response.headers["X-Max-Context-Tokens"] = str(limit)
        return response

    @app.get("/health")
    async def health():
        stalled = recorder_trouble(app.state.recorder)
        if stalled is not None:
            return stalled
        if await backend.ready():
            body = {"status": "ok", "backend": backend.label}
            if hasattr(backend, "engine"):
                body["engine"] = await backend.capacity()
            return body
        return JSONResponse({"status": "loading", "backend": backend.label}, status_code=503)

    @app.get("/v1/capacity")
    async def capacity():
        try:
            return await backend.capacity()
        except PrefixtraceError as exc:
            return JSONResponse(to_openai_error(exc), status_code=http_status(exc))

    @app.get("/v1/models")
    async def models():
        try:
            return await backend.models()
        except PrefixtraceError as exc:
            return JSONResponse(to_openai_error(exc), status_code=http_status(exc))

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request):
        return await serve_turn(request, endpoint=CHAT_PATH, upstream=backend.label, recorder=recorder,
                                parse=parse_chat_request, open_reply=backend.open, stream=_stream_and_record,
                                error_body=to_openai_error)

    add_messages_route(app, backend, recorder)  # POST /v1/messages (Anthropic)
    add_responses_route(app, backend, recorder)  # POST /v1/responses (OpenAI Responses)
    add_completions_route(app, backend, recorder, _stream_and_record)  # POST /v1/completions (raw prompt)
    add_fallback_routes(app, backend, recorder)  # last: every other path, in the API's error shape
    app.add_middleware(CancelOnDisconnect)  # a hung-up non-streamed request stops generating
    return app


def recorder_trouble(recorder) -> JSONResponse | None:
    """A 503 naming the reason when the recorder cannot record (writer stuck,
    gone or closed): a proxy that answers but stores nothing must not look healthy."""
    health = getattr(recorder, "health", None)
    if health is None:
        return None
    ok, reason = health()
    if ok:
        return None
    status = "recorder_stuck" if "stuck" in (reason or "") else "recorder_down"
    return JSONResponse({"status": status, "reason": reason, "pending": getattr(recorder, "pending", None)},
                        status_code=503)


async def _stream_and_record(chat, builder: TurnBuilder, recorder: TurnSink):
    recorded = False

    def record(error: str | None = None) -> None:
        nonlocal recorded
        if not recorded:
            recorded = True
            recorder.record(builder.finish(chat.status, error))

    async def record_committed(error: str | None = None) -> None:
        nonlocal recorded
        if not recorded:
            recorded = True
            await record_durably(recorder, builder.finish(chat.status, error))

    try:
        async for event in chat.sse():
            if event == sse.DONE:
                # Commit before the client can see the end of the stream, so a
                # client that reads [DONE] can rely on the turn being stored.
                await record_committed()
            yield event
    except PrefixtraceError as exc:  # failed after the headers went out: tell the client in-band
        await record_committed(exc.message)
        yield sse.encode(to_openai_error(exc))
        yield sse.DONE
    except (asyncio.CancelledError, GeneratorExit):
        chat.cancel()
        record("client disconnected")
        raise
    finally:
        record()
