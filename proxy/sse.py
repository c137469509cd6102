"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n`, ending in `data: [DONE]`."""

from __future__ import annotations

import json
from typing import AsyncIterator

DONE = b"data: [DONE]\n\n"


def encode(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def decode_data(event: bytes) -> dict | None:
    """The JSON payload of one SSE event, or None for [DONE], comments and non-JSON data."""
    data = [line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:")]
    if not data:
        return None
    payload = b"\n".join(data)
    if payload.strip() == b"[DONE]":
        return None
    try:
        obj = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def is_done(event: bytes) -> bool:
    """Whether one SSE event is the stream's `data: [DONE]`."""
    return any(line[5:].strip() == b"[DONE]" for line in event.splitlines() if line.startswith(b"data:"))


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
