"""The FastAPI app: OpenAI- and Anthropic-compatible endpoints in front of one backend.

A backend is the embedded engine (`EngineBackend`) or an upstream server or pool
(`UpstreamBackend`, `UpstreamPool`), all of them a `proxy.backend.Backend`. This module only
assembles: each wire protocol's route comes from its adapter (proxy/chat_completions.py,
anthropic.py, responses.py, completions.py), and a request's path through them is walked in
docs/ARCHITECTURE.md "The path of one request". Every request, failed ones included, leaves
exactly one `Turn` with the recorder.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from prefixtrace.common.errors import PrefixtraceError, http_status, to_openai_error
from proxy.anthropic import MESSAGES_PATH, add_messages_route, to_anthropic_error
from proxy.responses import RESPONSES_PATH, add_responses_route
from proxy.responses_compact import add_compact_route
from proxy.completions import COMPLETIONS_PATH, add_completions_route
from proxy.fallback import add_fallback_routes
from proxy.backend import Backend
from proxy.chat_completions import CHAT_PATH, add_chat_route
from proxy.guard import RequestGuard, refusal_recorder
from proxy.live_fixes import FixLearner, reasoning_probe
from analyzer.fixes.sessions import FixSessions
from proxy.relay import record_durably
from proxy.dashboard import observe
from recorder.sink import TappedSink, TurnSink
from proxy.disconnect import CancelOnDisconnect
from proxy.request_limits import DEFAULT_MAX_REQUEST_MB
from proxy.turn_routes import MaxContextHeader, TurnRoutes
from prefixtrace.common.instance_proof import PROOF_PATH, proof
from proxy.run_session import HEADER as SESSION_HEADER, PREFIX as SESSION_PREFIX, SESSION_ID
from prefixtrace.wire.messages import COUNT_TOKENS_PATH
from prefixtrace.wire.responses import COMPACT_PATH

log = logging.getLogger("prefixtrace.proxy")
TURN_PATHS = (CHAT_PATH, MESSAGES_PATH, COUNT_TOKENS_PATH, RESPONSES_PATH, COMPACT_PATH, COMPLETIONS_PATH)


def create_app(backend: Backend, recorder: TurnSink, *, allowed_hosts: list[str] | None = None,
               max_request_mb: float = DEFAULT_MAX_REQUEST_MB, turn_feed=None, worker_name: str | None = None,
               fixes: FixSessions | None = None) -> FastAPI:
    """`allowed_hosts`: names the Host header may carry (None: loopback only; "*": any), see proxy/guard.py;
    `max_request_mb`: the largest body accepted (proxy/request_limits.py); `turn_feed`: every analysed
    turn also goes there (`serve --otlp-endpoint`, prefixtrace/otel.py LiveFeed); `worker_name`: sent as
    `X-Prefixtrace-Worker` on every response, so a proxy in front of a router records which worker
    served each turn (`served_by`, docs/FLEET.md); `fixes`: `serve --fix`, applied to every request
    (proxy/live_fixes.py, docs/FIXES.md)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await backend.aclose()

    app = ProxyApp(title="prefixtrace", lifespan=lifespan)
    app.state.backend = backend
    app.state.recorder = recorder
    app.state.max_request_mb = max_request_mb  # proxy/request_limits.py
    # Every recorded turn then passes these taps, in this order, once its response is out (docs/ARCHITECTURE.md
    # "Where state lives"): each reply's tool calls and reasoning, for the fixes of later requests (serve --fix);
    # /ui, /metrics (and OTLP). They read the turn; none writes it.
    taps = []
    app.state.fixes = fixes
    if fixes is not None:
        taps.append(FixLearner(fixes))
        if backend.embedded and fixes.reasoning_probe is None:
            fixes.reasoning_probe = reasoning_probe(backend)
    taps.append(observe(app, backend, recorder, turn_feed))
    recorder = TappedSink(recorder, taps)
    # A loopback Host on every request and JSON on every POST; refused turns are recorded.
    error_bodies = {CHAT_PATH: to_openai_error, RESPONSES_PATH: to_openai_error, MESSAGES_PATH: to_anthropic_error}
    app.add_middleware(RequestGuard, allowed_hosts=allowed_hosts,
                       refuse=refusal_recorder(recorder, backend.label, error_bodies, record_durably))

    app.add_middleware(MaxContextHeader, backend=backend, worker_name=worker_name)  # every response, refusals too
    # An accepted turn POST skips all of the above and FastAPI's request path: the same checks,
    # headers and hang-up watch in one layer (proxy/turn_routes.py, issue 17).
    app.turn_routes = TurnRoutes(fastapi_app=app, paths=TURN_PATHS, guard=RequestGuard(None, allowed_hosts=allowed_hosts),
                                 context_header=MaxContextHeader(None, backend=backend, worker_name=worker_name))

    @app.get("/health")
    async def health():
        stalled = recorder_trouble(app.state.recorder)
        if stalled is not None:
            return stalled
        if await backend.ready():
            body = {"status": "ok", "backend": backend.label}
            spool = app.state.recorder.spool_state()
            if spool["dropped"]:  # turns lost to a full spool stay reported
                body["recorder"] = spool
            if backend.embedded:
                body["engine"] = await backend.capacity()
            return body
        return JSONResponse({"status": "loading", "backend": backend.label}, status_code=503)

    @app.get(PROOF_PATH)
    async def instance_proof(nonce: str = ""):
        """The answer `prefixtrace run` checks before reusing this proxy (prefixtrace/common/instance_proof.py);
        404 where serve keeps no secret (an app built without one, as tests build it)."""
        kept = getattr(app.state, "instance_secret", None)
        if kept is None or not 16 <= len(nonce) <= 128:
            return JSONResponse({"error": {"message": "no instance proof here", "type": "not_found"}}, status_code=404)
        secret, db = kept
        return {"proof": proof(secret, nonce, db), "db": db}

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

    @app.get("/props")
    async def props():
        """The chat template the embedded engine renders with, where llama.cpp publishes its own, so a
        proxy in front of this one records it with its turns (docs/ANALYZER.md "The server's renderer")."""
        identity = backend.renderer_identity()
        if identity is None or not identity.get("chat_template"):
            return JSONResponse({"error": {"message": "no chat template published here", "type": "not_found"}},
                                status_code=404)
        special = {k: v for k, v in identity["special"].items() if k in ("bos_token", "eos_token") and isinstance(v, str)}
        return {"chat_template": identity["chat_template"], "model_alias": identity["model"], **special}

    add_chat_route(app, backend, recorder)  # POST /v1/chat/completions (OpenAI)
    add_messages_route(app, backend, recorder)  # POST /v1/messages (Anthropic)
    add_responses_route(app, backend, recorder)  # POST /v1/responses (OpenAI Responses)
    add_compact_route(app, backend, recorder)  # POST /v1/responses/compact (OpenAI's remote compaction)
    add_completions_route(app, backend, recorder)  # POST /v1/completions (raw prompt)
    add_fallback_routes(app, backend, recorder)  # last: every other path, in the API's error shape
    app.add_middleware(CancelOnDisconnect)  # the hang-up watch TurnRoutes also runs (proxy/disconnect.py)
    return app


class ProxyApp(FastAPI):
    """FastAPI, with a run's `/s/<id>` path prefix taken off first (`_strip_session_prefix`) and the
    turn endpoints' accepted POSTs served before Starlette's middleware stack by `turn_routes`
    (proxy/turn_routes.py); everything else as FastAPI serves it."""

    turn_routes: TurnRoutes | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            _strip_session_prefix(scope)  # /s/<id>/v1/...: served as /v1/..., filed under <id>
        routes = self.turn_routes
        if routes is not None and scope["type"] == "http" and scope["method"] == "POST":
            handler = routes.handler_for(scope)
            if handler is not None:
                return await routes.serve(handler, scope, receive, send)
        await super().__call__(scope, receive, send)


def _strip_session_prefix(scope: dict) -> None:
    """`/s/<id>/rest` -> `/rest` in an HTTP scope, with `<id>` as the session header (`prefixtrace
    run`'s session, proxy/run_session.py); any other path (or an id of other characters) is left alone."""
    path = scope.get("path", "")
    if not path.startswith(SESSION_PREFIX):
        return
    sid, slash, rest = path[len(SESSION_PREFIX):].partition("/")
    if not SESSION_ID.fullmatch(sid):
        return
    new_path = slash + rest or "/"
    scope["path"] = new_path
    raw = scope.get("raw_path")
    if raw is not None:
        cut = len(SESSION_PREFIX) + len(sid.encode())
        scope["raw_path"] = raw[cut:] or b"/"
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != SESSION_HEADER.encode()]
    headers.append((SESSION_HEADER.encode(), sid.encode()))
    scope["headers"] = headers


def recorder_trouble(recorder: TurnSink) -> JSONResponse | None:
    """A 503 naming the reason when the recorder cannot record (writer stuck,
    gone or closed): a proxy that answers but stores nothing must not look healthy."""
    ok, reason = recorder.health()
    if ok:
        return None
    spool = recorder.spool_state()
    if not spool["writable"]:
        status = "recorder_unwritable"  # turns are kept in the recorder's spool until the database takes writes
    else:
        status = "recorder_stuck" if "stuck" in (reason or "") else "recorder_down"
    body = {"status": status, "reason": reason, "pending": recorder.pending, "recorder": spool}
    return JSONResponse(body, status_code=503)
