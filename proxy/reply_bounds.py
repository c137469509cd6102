"""How much of an upstream's reply the proxy reads: a bound on its size once decoded.

An upstream (or anything answering at its address) can send a small gzip body that inflates to
gigabytes, or a stream that never ends: read whole, it is held in the proxy's memory and stored
in the turn's row (a 0.5 MB gzip reply inflated to 512 MiB: 2.7 GB of proxy, a 541 MB row). Past
MAX_REPLY_BYTES of decoded body the read stops: the client gets the upstream's fault as an error
(a 502, or an error event once a stream is under way) and the turn is recorded with what was read
before it. /props (the chat template an upstream publishes) is read within MAX_PROPS_BYTES.
Sizes in docs/CONFIG.md "Bounds on what is read".
"""

from __future__ import annotations

from typing import AsyncIterator

import httpx

MAX_REPLY_BYTES = 64 << 20  # as prefixtrace/wire/sse.py's MAX_EVENT_BYTES: far above any real reply
MAX_PROPS_BYTES = 4 << 20  # a /props document: its template is bounded again (recorder/renderers.py)


class ReplyTooLarge(ValueError):
    """A reply passed MAX_REPLY_BYTES once decoded."""

    def __init__(self, limit: int):
        super().__init__(f"sent a reply of over {limit >> 20} MB (decoded): the rest was not read")


async def bounded(chunks: AsyncIterator[bytes], limit: int | None = None) -> AsyncIterator[bytes]:
    """`chunks` until they pass `limit` bytes in all (default MAX_REPLY_BYTES), then ReplyTooLarge."""
    limit = MAX_REPLY_BYTES if limit is None else limit
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise ReplyTooLarge(limit)
        yield chunk


async def read_bounded(response: httpx.Response, limit: int) -> bytes | None:
    """A streamed httpx response's body, or None past `limit` bytes (decoded)."""
    out = bytearray()
    async for chunk in response.aiter_bytes():
        out += chunk
        if len(out) > limit:
            return None
    return bytes(out)
