"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n`, ending in `data: [DONE]`."""

from __future__ import annotations

import json
from typing import AsyncIterator

DONE = b"data: [DONE]\n\n"


def encode(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _payload(event: bytes) -> bytes | None:
    """The data of one SSE event (its `data:` lines joined), or None when it has none."""
    data = [line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


def decode_data(event: bytes) -> dict | None:
    """The JSON payload of one SSE event, or None for [DONE], comments and non-JSON data."""
    payload = _payload(event)
    if payload is None or payload.strip() == b"[DONE]":
        return None
    try:
        obj = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def is_done(event: bytes) -> bool:
    """Whether one SSE event is the stream's `data: [DONE]`."""
    payload = _payload(event)
    return payload is not None and payload.strip() == b"[DONE]"


async def iter_events(lines: AsyncIterator[str]) -> AsyncIterator[bytes]:
    """Group an upstream's SSE lines into whole events (`...\n\n`), each yielded as soon as it ends."""
    event = bytearray()
    async for line in lines:
        if line:
            event += line.encode() + b"\n"
        elif event:
            yield bytes(event) + b"\n"
            event.clear()
    if event:
        yield bytes(event) + b"\n"
