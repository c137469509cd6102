"""Who may drive the proxy: requests that name an allowed host, and JSON bodies on POST.

The proxy listens on loopback, but a web page on any origin can still reach
it through the developer's browser, two ways:
- a "simple" cross-origin POST (`Content-Type: text/plain`, no preflight) is
  sent even though its answer cannot be read: it would run a turn and plant
  whatever it likes in the recording;
- DNS rebinding: the page's own host name, re-resolved to 127.0.0.1, makes
  the proxy same-origin to it, so it could read `/ui/api/sessions` (prompts).
So every request's Host header must name an allowed host (loopback names with
any port, by default) and every POST must say `application/json`, which a
browser sends cross-origin only after a CORS preflight that this server never
approves. A refused turn is answered in its API's error shape and recorded,
like any other refusal (`refusal_recorder`).

Two refusals about the request's framing come through here too, so that they are
recorded the same way (issue 25, findings 3 and 14): a request head over its limit
(431; the protocol stops reading it and marks the request, proxy/connections.py)
and a transfer-coding other than `chunked` (501: `gzip, chunked` was read as plain
chunked, the gzip layer taken for the body). Neither body is read.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Iterable

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from proxy.connections import HEAD_REFUSED
from prefixtrace.common.errors import (ForbiddenHost, PrefixtraceError, RequestHeadersTooLarge, UnsupportedMediaType,
                                UnsupportedTransferCoding, http_status, to_openai_error)
from prefixtrace.wire.request import session_id
from proxy.request_limits import parse_body, read_request_body
from proxy.run_session import filed_under
from recorder.turn import Turn

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
Refuse = Callable[[Request, PrefixtraceError], Awaitable[Response]]


def host_name(header: str) -> str:
    """The host of a Host header, without its port, lower-cased: `[::1]:8765` -> `::1`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def is_json(content_type: str | None) -> bool:
    """`application/json`, with or without parameters (`; charset=utf-8`)."""
    return (content_type or "").split(";", 1)[0].strip().lower() == "application/json"


class RequestGuard:
    """ASGI middleware: refuses a request whose Host is not allowed (403) and a POST
    that is not JSON (415); everything else passes untouched.

    Args:
        allowed_hosts: host names (no port) accepted in the Host header; None means
            loopback only; a "*" among them accepts any host.
        refuse: builds the response to a refused request (default: an OpenAI-shaped error).
    """

    def __init__(self, app, *, allowed_hosts: Iterable[str] | None = None, refuse: Refuse | None = None):
        self.app = app
        hosts = {h.strip().lower().strip("[]") for h in (allowed_hosts or LOOPBACK_HOSTS) if h.strip()}
        self.allowed = None if "*" in hosts else frozenset(hosts)
        self.refuse = refuse

    def check(self, method: str, headers: Headers) -> PrefixtraceError | None:
        refused_head = headers.get(HEAD_REFUSED)
        if refused_head is not None:  # set by the server's protocol only (proxy/connections.py)
            return RequestHeadersTooLarge(refused_head)
        codings = ",".join(headers.getlist("transfer-encoding"))
        if codings and [c.strip().lower() for c in codings.split(",")] != ["chunked"]:
            return UnsupportedTransferCoding(f"Transfer-Encoding {codings!r} is not supported: only chunked "
                                             "(compress the body with Content-Encoding instead)")
        host = host_name(headers.get("host", ""))
        if self.allowed is not None and host not in self.allowed:
            return ForbiddenHost(f"Host {host!r} is not allowed: this proxy answers to {', '.join(sorted(self.allowed))} "
                                 "(serve --allowed-hosts to add names; see docs/SECURITY.md)")
        if method == "POST" and not is_json(headers.get("content-type")):
            return UnsupportedMediaType(f"Content-Type must be application/json, got "
                                        f"{headers.get('content-type') or 'none'!r}")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self.check(scope["method"], Headers(scope=scope))
        if error is None:
            return await self.app(scope, receive, send)
        request = Request(scope, receive)
        if self.refuse is not None:
            response = await self.refuse(request, error)
        else:
            response = JSONResponse(to_openai_error(error), status_code=http_status(error))
        await response(scope, receive, send)


def refusal_recorder(recorder, upstream: str, error_bodies: dict[str, Callable[[PrefixtraceError], dict]],
                     record: Callable[[object, Turn], Awaitable[None]]) -> Refuse:
    """A `refuse` that answers a turn endpoint (a path in `error_bodies`) in its API's
    error shape and records the turn through `record(recorder, turn)`; other paths get
    an OpenAI-shaped error and nothing is recorded (they are not turns)."""

    async def refuse(request: Request, exc: PrefixtraceError) -> Response:
        status = http_status(exc)
        error_body = error_bodies.get(request.url.path)
        if error_body is None:
            return JSONResponse(to_openai_error(exc), status_code=status)
        endpoint = request.url.path
        headers = {k: v for k, v in request.headers.items() if k != HEAD_REFUSED}
        body, raw_text = await _refused_body(request, exc)
        turn = Turn(request_id=uuid.uuid4().hex, started_at=time.time(), endpoint=endpoint, upstream=upstream,
                    request_body=body, request_raw=raw_text, request_headers=headers, status=status,
                    error=exc.message, session_id=filed_under(headers, session_id(endpoint, body, headers)),
                    client_addr=f"{request.client.host}:{request.client.port}" if request.client else None)
        await record(recorder, turn)
        return JSONResponse(error_body(exc), status_code=status)

    return refuse


async def _refused_body(request: Request, exc: PrefixtraceError) -> tuple[object, str | None]:
    """(what a refused turn records as its body, the body's exact text when it parsed): read within
    --max-request-mb like any turn's (past it, or too slow, or a hang-up: the marker it left), and not
    read at all after a refusal of the request's framing (no body to read, or not one to trust)."""
    if isinstance(exc, (RequestHeadersTooLarge, UnsupportedTransferCoding)):
        return f"[request body not read: {exc.message}]", None
    try:
        raw = await read_request_body(request)
    except PrefixtraceError as unread:  # still refused as it was
        return unread.stored_body, None
    text = raw.decode("utf-8", errors="replace")
    try:
        return parse_body(raw), text
    except PrefixtraceError:
        return text, None  # stored as the text it was
