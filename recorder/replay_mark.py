"""The mark `prefixtrace replay` puts on the requests it re-sends: a header the proxy records with the
turn like any other. A replayed turn is a measurement, not the user's traffic: `analyze`, `check`, the
exports' readers and the dashboard leave it out (and say how many), so a replay through the proxy that
recorded the original never shows up later as the user's cache breaks."""

from __future__ import annotations

from typing import Any

REPLAY_HEADER = "X-Prefixtrace-Replay"


def is_replay(headers: Any) -> bool:
    """Whether recorded request headers (a dict, any case) carry the replay mark."""
    if not isinstance(headers, dict):
        return False
    name = REPLAY_HEADER.lower()
    return any(isinstance(k, str) and k.lower() == name for k in headers)
