"""The session a turn is filed under: the run's, ahead of the one its client sent.

`prefixtrace run` (prefixtrace/run.py) gives a harness a base URL such as
`http://127.0.0.1:8765/s/<id>`: every client can be given a base URL, while only some can be
made to send a header, and each sends its own session id (or none) in its own place. The app
takes the prefix off before routing (`ProxyApp`, proxy/app.py), so every route (turns,
`/v1/models`, `HEAD /`, the fallback) serves it unchanged, and the id rides along as the
`X-Prefixtrace-Session` request header (`HEADER`), which a client may also send itself. Every turn
is filed under it (`filed_under`, asked where the turn's session is set), ahead of the one the
client sent (the run is the session the user asked about).
"""

from __future__ import annotations

import re

PREFIX = "/s/"  # of the path that carries a run's session id: /s/<id>/v1/...
HEADER = "x-prefixtrace-session"
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def session_of(headers: dict | None) -> str | None:
    for key, value in (headers or {}).items():
        if key.lower() == HEADER and value and SESSION_ID.fullmatch(value):
            return value
    return None


def filed_under(headers: dict | None, found: str | None) -> str | None:
    """The session a turn is filed under: the run's (the session header), ahead of the one the client
    sent (`found`): the run is the session the user asked about."""
    return session_of(headers) or found
