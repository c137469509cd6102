"""What one request may be: its body's size and its JSON's nesting.

Both limits answer in the API's error shape and leave a recorded turn, so a
client cannot hide from the recorder by sending something it cannot store:

* size (`--max-request-mb`, default 32): a 100k-token prompt with tools is
  ~0.5-1 MB of JSON, a base64 image a few MB; 32 MB leaves room for several and
  stops the 50-300 MB bodies of issue 14 (finding 7), which each cost GBs of
  memory and their size again in the database. Past it: 413, and the turn is
  recorded with a marker instead of the body (a truncated body could end inside
  a secret the patterns no longer recognise). A Content-Length over the limit is
  refused before the body is read; a chunked body as soon as it passes it. The
  rest is read and thrown away (up to `DRAIN_FACTOR` x the limit) so the client
  gets to read its 413 rather than a reset connection.
* nesting (`MAX_JSON_DEPTH` = 100 arrays/objects): real tool schemas nest ~10-20
  deep. Deeper JSON was answered but lost by the recorder (recursion while
  redacting, ~500-900 deep), broke the dashboard's analysis (~450) or was a 500
  (~990, the parser's own recursion). Past it: 400, recorded with the body as text.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from prefixtrace.errors import InvalidRequest, RequestTooLarge
from recorder.turn import Turn

DEFAULT_MAX_REQUEST_MB = 32.0
MAX_JSON_DEPTH = 100
DRAIN_FACTOR = 4


def max_request_bytes(request: Request) -> int:
    mb = getattr(request.app.state, "max_request_mb", DEFAULT_MAX_REQUEST_MB)
    return int(mb * (1 << 20))


async def read_request_body(request: Request, turn: Turn) -> bytes:
    """The whole body, or `RequestTooLarge` (with `turn.request_body` set to a marker)."""
    limit = max_request_bytes(request)
    declared = request.headers.get("content-length", "")
    size = int(declared) if declared.isdigit() else None
    chunks: list[bytes] = []
    total = 0
    over = size is not None and size > limit
    if not over:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                over = True
                break
            chunks.append(chunk)
    if not over:
        return b"".join(chunks)
    chunks.clear()
    if size is None or size <= DRAIN_FACTOR * limit:
        async for chunk in request.stream():  # discard: the client must be able to read the 413
            total += len(chunk)
            if total > DRAIN_FACTOR * limit:
                break
    shown = f"{size / (1 << 20):.1f} MB" if size is not None else f"over {limit / (1 << 20):g} MB"
    turn.request_body = f"[request body not stored: {shown}, over the {limit / (1 << 20):g} MB limit]"
    raise RequestTooLarge(f"the request body is {shown}, over this proxy's limit of {limit / (1 << 20):g} MB "
                          "(prefixtrace serve --max-request-mb)", param=None)


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """`InvalidRequest` if `value` (`json.loads`'s output: plain dicts and lists) nests
    arrays/objects deeper than `limit`.

    A recursive walk that stops `limit` levels down, so it uses at most `limit` + 1 frames
    whatever it is given (well inside Python's 1000 at the default of 100). It replaced an
    explicit stack of (node, depth) tuples, filled through a generator with an `isinstance`
    per value: 3-5x the time on a 270 KB, 330-message agent body (bench/bench_body_check.py,
    issue 17), spent on the request's way to the upstream."""
    if isinstance(value, (dict, list)):
        try:
            _within(value, limit)
        except _TooDeep:
            raise InvalidRequest(f"the request body nests arrays/objects more than {limit} deep") from None


class _TooDeep(Exception):
    pass


def _within(node: dict | list, budget: int) -> None:
    """`node` is one level; `budget` the levels it may have, itself included."""
    if budget <= 0:
        raise _TooDeep
    budget -= 1
    for child in (node.values() if isinstance(node, dict) else node):
        kind = type(child)  # `type is`, not isinstance: the parser makes exact dicts and lists
        if kind is dict or kind is list:
            _within(child, budget)
