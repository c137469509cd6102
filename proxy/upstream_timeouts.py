"""How long the proxy waits on an upstream (serve --upstream-*-timeout-s, docs/CONFIG.md).

A module of its own, stdlib only: the CLI reads the defaults for its options without importing the
proxy's HTTP stack.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UpstreamTimeouts:
    """Seconds the proxy waits on an upstream before it answers the client 504 (or, once the
    stream's head went out, an error event in the stream) and records the turn; None: no limit.

    connect_s: to open the connection.
    first_byte_s: from sending the request to the reply's first body byte, its head included: a
        non-streamed reply's head comes once the whole reply is generated, a streamed one's first
        event after the prompt's prefill; both can take minutes on a slow server.
    idle_s: silence between two reads once the body has started (a stream that hangs midway).
    """

    connect_s: float | None = 10.0
    first_byte_s: float | None = 600.0
    idle_s: float | None = 120.0
