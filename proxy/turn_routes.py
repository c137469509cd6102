"""The turn endpoints' POSTs served ahead of Starlette's middleware stack (issue 17).

Every turn route (`POST /v1/chat/completions`, `/v1/messages`, `/v1/responses`, ...) is one
function `(request) -> response` that does all its own work (`proxy.relay.serve_turn`): it reads
its body, answers every error in its API's shape and never raises for a bad request. FastAPI's
request path around it (exception middleware, async exit stack, router match, dependency solving,
the endpoint wrapper) and the app's own middleware (request guard, context-limit header, cancel on
disconnect, each wrapping `send` and `receive` again)
add nothing to such a function but their cost, paid on every chunk sent too. So `ProxyApp`
(proxy/app.py) hands an accepted turn POST to `TurnRoutes.serve`, which does what those layers
did for it in one place: the guard's check (a request it refuses takes the full stack, where
`RequestGuard` answers and records it), the `X-Max-Context-Tokens` header (added as the head
goes out through the watch's `send`), and the hang-up watch: the same `HangUpWatch` the full
stack's `CancelOnDisconnect` runs (proxy/disconnect.py), which cancels the request's own task
when its client hangs up before the last byte is out. It calls the function the FastAPI route
holds, so there is one handler per endpoint, registered once (and still in the OpenAPI schema);
every other request, and every method but POST, goes through FastAPI as before.

The headers every response carries (`MaxContextHeader`) are defined here too: `TurnRoutes` adds
them to the head it sends, and the full stack runs the same class as its middleware.
"""

from __future__ import annotations

import asyncio
import inspect

from fastapi.routing import APIRoute
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request

from proxy.disconnect import HangUpWatch

class TurnRoutes:
    """POSTs to `paths` served by the app's own route functions for them.

    Args:
        fastapi_app: the app whose routes hold the functions (read at the first request:
            routes are added after this is made).
        paths: the turn endpoints; a path whose route function is not `async def f(request)`
            is left to FastAPI.
        guard: the app's `RequestGuard`; a request it would refuse is left to the full stack.
        context_header: the app's `MaxContextHeader`, whose header goes on every response.
    """

    def __init__(self, *, fastapi_app, paths, guard=None, context_header=None):
        self.fastapi_app = fastapi_app
        self.paths = frozenset(paths)
        self.guard = guard
        self.context_header = None if context_header is None or context_header.never else context_header
        self.handlers = None  # path -> route function

    def _find(self) -> dict:
        handlers = {}
        for route in self.fastapi_app.router.routes:
            if (isinstance(route, APIRoute) and route.path in self.paths and "POST" in route.methods
                    and route.path not in handlers and _takes_only_a_request(route.endpoint)):
                handlers[route.path] = route.endpoint
        return handlers

    def handler_for(self, scope):
        """The route function that serves this POST here, or None (then the full stack serves it)."""
        if self.handlers is None:
            self.handlers = self._find()
        handler = self.handlers.get(scope["path"])
        if handler is None or scope.get("root_path"):
            return None
        if self.guard is not None and self.guard.check("POST", Headers(scope=scope)) is not None:
            return None
        return handler

    async def serve(self, handler, scope, receive, send) -> None:
        header = self.context_header
        watch = HangUpWatch(receive, send, on_start=None if header is None else header.add_to)
        scope["app"] = self.fastapi_app  # what Starlette sets: `request.app` (its state) reads it
        try:
            response = await handler(Request(scope, watch.receive))
            await response(scope, watch.receive, watch.send)
        except asyncio.CancelledError:
            if not watch.took_back_its_cancel():
                raise  # the server is stopping (or someone else cancelled us): not ours to swallow
            # The client hung up: the route has recorded the turn; nothing can be sent to it.
        finally:
            watch.close()


class MaxContextHeader:
    """ASGI middleware: `X-Max-Context-Tokens` on every response whose backend has a limit,
    which lets a harness compact before it hits the wall, and `X-Prefixtrace-Worker` when the
    server has a worker name. Pure ASGI (it only edits the `http.response.start` message):
    Starlette's `BaseHTTPMiddleware` would run every response through an extra task and memory
    stream, ~ms per request (issue 17). `TurnRoutes` calls `add_to` on the heads it sends."""

    def __init__(self, app, *, backend, worker_name: str | None = None):
        self.app = app
        self.backend = backend
        self.worker = worker_name
        # The engine's limit is known once its model has loaded, and fixed from then on (its memory
        # model is made once, at load): read until it is known, then kept. An upstream's limits are
        # its own (`max_context_tokens` is None for good): no limit to add.
        self.reads_limit = backend.embedded
        self.limit: int | None = None
        self.never = not self.reads_limit and self.worker is None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.never:
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                self.add_to(message)
            await send(message)

        await self.app(scope, receive, send_with_header)

    def add_to(self, start: dict) -> None:
        """The headers on one `http.response.start` message: the context limit when the backend
        has one now, the worker's name when it has one."""
        headers = MutableHeaders(scope=start)
        limit = self.limit
        if limit is None and self.reads_limit:
            limit = self.limit = self.backend.max_context_tokens
        if limit is not None:
            headers["X-Max-Context-Tokens"] = str(limit)
        if self.worker is not None:
            headers["X-Prefixtrace-Worker"] = self.worker


def _takes_only_a_request(fn) -> bool:
    if not inspect.iscoroutinefunction(fn):
        return False
    params = list(inspect.signature(fn).parameters.values())
    return len(params) == 1 and params[0].annotation in (Request, "Request")
