"""The turn endpoints' requests handed straight to their route functions (issue 17).

Every turn route (`POST /v1/chat/completions`, `/v1/messages`, `/v1/responses`, ...) is one
function `(request) -> response` that does all its own work (`proxy.relay.serve_turn`): it reads
its body, answers every error in its API's shape and never raises for a bad request. FastAPI's
request path around it (exception middleware, async exit stack, router match, dependency solving,
the endpoint wrapper) adds nothing to such a function but its cost, paid on every chunk sent too
(each layer wraps `send`). `TurnRoutes` sits inside the request guard and calls the function the
FastAPI route holds, so there is one handler per endpoint, registered once (and still listed in
the OpenAPI schema); every other request, and every method but POST, goes through FastAPI as
before.
"""

from __future__ import annotations

import inspect

from fastapi.routing import APIRoute
from starlette.requests import Request


class TurnRoutes:
    """ASGI middleware: POSTs to `paths` served by the app's own route functions for them.

    Args:
        paths: the turn endpoints; a path whose route function is not `async def f(request)`
            is left to FastAPI.
    """

    def __init__(self, app, *, fastapi_app, paths):
        self.app = app
        self.fastapi_app = fastapi_app
        self.paths = frozenset(paths)
        self.handlers = None  # path -> route function, read at the first request (routes are added after us)

    def _find(self) -> dict:
        handlers = {}
        for route in self.fastapi_app.router.routes:
            if (isinstance(route, APIRoute) and route.path in self.paths and "POST" in route.methods
                    and route.path not in handlers and _takes_only_a_request(route.endpoint)):
                handlers[route.path] = route.endpoint
        return handlers

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            if self.handlers is None:
                self.handlers = self._find()
            handler = self.handlers.get(scope["path"])
            if handler is not None:
                response = await handler(Request(scope, receive))
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def _takes_only_a_request(fn) -> bool:
    if not inspect.iscoroutinefunction(fn):
        return False
    params = list(inspect.signature(fn).parameters.values())
    return len(params) == 1 and params[0].annotation in (Request, "Request")
