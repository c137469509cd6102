"""A session id in the URL: `/s/<id>/v1/...` is served as `/v1/...` and every turn of it is
recorded under `<id>`.

`prefixtrace run` (prefixtrace/run.py) gives a harness a base URL such as
`http://127.0.0.1:8765/s/<id>`: every client can be given a base URL, while only some can be
made to send a header, and each sends its own session id (or none) in its own place. The
prefix is taken off before routing, so every route (turns, `/v1/models`, `HEAD /`, the
fallback) serves it unchanged, and the id rides along as the `X-Prefixtrace-Session` request
header, which a client may also send itself. Every turn is filed under it (`filed_under`, asked where the
turn's session is set), ahead of the one the client sent (the run is the session the user asked about).
"""

from __future__ import annotations

import re

PREFIX = "/s/"
HEADER = "x-prefixtrace-session"
_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def strip_session_prefix(scope: dict) -> None:
    """`/s/<id>/rest` -> `/rest` in an HTTP scope, with `<id>` as the session header; any
    other path (or an id of other characters) is left alone."""
    path = scope.get("path", "")
    if not path.startswith(PREFIX):
        return
    sid, slash, rest = path[len(PREFIX):].partition("/")
    if not _ID.fullmatch(sid):
        return
    new_path = slash + rest or "/"
    scope["path"] = new_path
    raw = scope.get("raw_path")
    if raw is not None:
        cut = len(PREFIX) + len(sid.encode())
        scope["raw_path"] = raw[cut:] or b"/"
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != HEADER.encode()]
    headers.append((HEADER.encode(), sid.encode()))
    scope["headers"] = headers


def session_of(headers: dict | None) -> str | None:
    for key, value in (headers or {}).items():
        if key.lower() == HEADER and value and _ID.fullmatch(value):
            return value
    return None


def filed_under(headers: dict | None, found: str | None) -> str | None:
    """The session a turn is filed under: the run's (the session header), ahead of the one the client
    sent (`found`): the run is the session the user asked about."""
    return session_of(headers) or found
