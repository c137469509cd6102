"""Every request to a path this server does not serve: answered in the API's error shape
(Anthropic's under /v1/messages, OpenAI's elsewhere) and recorded as a turn, never FastAPI's
bare `{"detail": "Not Found"}`. A known path asked with another method is a 405.

`HEAD /` and `GET /` are liveness probes (Claude Code sends `HEAD /` before its first request
and only needs an answer): 200, not recorded, like `/health`; so is a browser's `/favicon.ico`
(204), which the dashboard's page asks for. An `OPTIONS` request is a browser's CORS preflight, not
an API call: refused (405, no CORS headers, so the page's request never goes out) and not recorded.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Route

from prefixtrace.common.errors import MethodNotAllowed, PrefixtraceError, UnknownEndpoint, http_status, to_openai_error
from prefixtrace.wire.messages import to_anthropic_error
from prefixtrace.wire.messages import PATH as MESSAGES_PREFIX  # /v1/messages and everything under it
from proxy.relay import TurnSink, record_durably
from proxy.request_limits import read_request_body
from proxy.run_session import filed_under
from recorder.turn import Turn

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


def add_fallback_routes(app: FastAPI, backend, recorder: TurnSink) -> None:
    """Register last: the catch-all matches whatever no other route did."""

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root(request: Request):
        if request.method == "HEAD":
            return Response(status_code=200)
        return {"status": "ok", "service": "prefixtrace", "backend": backend.label}

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():
        return Response(status_code=204)

    def methods_of(path: str) -> set[str]:
        return {m for r in app.routes if isinstance(r, Route) and r.path == path for m in (r.methods or ())}

    @app.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def unknown(request: Request, path: str):
        route = "/" + path
        allowed = methods_of(route) - {"HEAD"}
        if allowed:
            exc = MethodNotAllowed(f"{request.method} is not allowed on {route}; use {', '.join(sorted(allowed))}")
        else:
            exc = UnknownEndpoint(f"unknown endpoint: {request.method} {route} (this server serves "
                                  "/v1/chat/completions, /v1/responses, /v1/responses/compact, /v1/messages, "
                                  "/v1/completions, /v1/messages/count_tokens, /v1/models)")
        body = to_anthropic_error(exc) if route.startswith(MESSAGES_PREFIX) else to_openai_error(exc)
        headers = {"Allow": ", ".join(sorted(allowed))} if allowed else None
        status = http_status(exc)
        if request.method == "OPTIONS":
            return JSONResponse(body, status_code=405, headers=headers)
        started = time.time()
        try:  # bounded as on every route (--max-request-mb): an unknown path is no way around the limit
            stored = (await read_request_body(request)).decode("utf-8", errors="replace")
        except PrefixtraceError as unread:  # too large, too slow, a hang-up, a coding not read (request_limits.py)
            exc, status, stored = unread, http_status(unread), unread.stored_body or ""
            body = to_anthropic_error(exc) if route.startswith(MESSAGES_PREFIX) else to_openai_error(exc)
        request_headers = dict(request.headers)
        turn = Turn(request_id=uuid.uuid4().hex, started_at=started, endpoint=route, upstream=backend.label,
                    request_body=stored, request_headers=request_headers, session_id=filed_under(request_headers, None),
                    client_addr=f"{request.client.host}:{request.client.port}" if request.client else None,
                    status=status, error=exc.message, total_s=time.time() - started)
        await record_durably(recorder, turn)
        if request.method == "HEAD":
            return Response(status_code=status, headers=headers)
        return JSONResponse(body, status_code=status, headers=headers)
