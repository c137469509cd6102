"""`serve --fix`: the named fixes (analyzer/fixes, docs/FIXES.md) applied to each request in flight.

`fix_request` runs once per turn, after the body is read and before the adapter parses it: a request no
fix touches goes on as the very bytes the client sent; a fixed one goes on re-serialised, and its turn
records the body as sent upstream with one entry per fix (name, fired or why not, bytes before and
after). `FixLearner`, a tap on the recorder, feeds each finished turn's reply (tool
calls, reasoning) to the fixes' session records, which `tool-args` and `thinking` read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

from analyzer.fixes.sessions import FixSessions
from proxy.run_session import session_of
from recorder.turn import Turn
from prefixtrace.wire.request import session_id

log = logging.getLogger("prefixtrace.proxy")


@dataclass(slots=True)
class FixedRequest:
    """A request as it goes on: its body, that body's JSON bytes, the headers it is sent with, and one
    entry per fix that looked at it (None: no fix did; the turn records them)."""
    body: Any
    raw: bytes
    headers: dict[str, str]
    fixes: list[dict] | None = None


def fix_request(fixes: FixSessions | None, endpoint: str, body: Any, raw: bytes, headers: dict[str, str],
                request_id: str) -> FixedRequest:
    """The request to send on: the client's own when no fix fired, the fixed body and its JSON otherwise.
    Never raises: a failure here is told in the entries and the request goes on as it came."""
    if fixes is None or not fixes.names:
        return FixedRequest(body, raw, headers)
    try:
        session = session_of(headers) or session_id(endpoint, body, headers)
        applied = fixes.apply(endpoint, body, session)
        if applied is None:
            return FixedRequest(body, raw, headers)
        if not applied.fired:
            return FixedRequest(body, raw, headers, applied.entries)
        lower = {k.lower() for k in headers}
        added = {name: value for name, value in applied.headers.items()  # a router's session header,
                 if name.lower() not in lower}                             # where the client sent none
        return FixedRequest(applied.body, json.dumps(applied.body, ensure_ascii=False).encode(),
                            {**headers, **added}, applied.entries)
    except Exception as exc:  # the fixes' own bookkeeping failed: the request is not theirs to lose
        log.exception("fixes failed on request %s", request_id)
        return FixedRequest(body, raw, headers, [{"name": "*", "fired": False, "error": True,
                                                  "note": f"the fixes failed: {type(exc).__name__}: {exc}",
                                                  "bytes_before": len(raw), "bytes_after": len(raw)}])


REASONING_PROBE = "prefixtrace-reasoning-probe"


def reasoning_probe(backend) -> Callable[[], bool | None]:
    """Whether the embedded engine renders the reasoning of an earlier assistant turn in a tool loop
    (its chat template and `--thinking-retention` together), found by rendering one: what the `thinking`
    fix needs to know before it puts stripped reasoning back. None until the model is loaded."""
    failed = False

    def probe() -> bool | None:
        nonlocal failed
        engine = backend.engine
        if failed or not engine.ready:
            return None
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
        messages = [{"role": "user", "content": "q"},
                    {"role": "assistant", "content": "", "reasoning_content": REASONING_PROBE,
                     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "r"}]
        try:
            return REASONING_PROBE in engine.render(messages, tools=tools).text
        except Exception:  # a template that cannot render this shape: not known, and not asked again
            log.warning("could not tell whether the chat template keeps earlier reasoning", exc_info=True)
            failed = True
            return None
    return probe


class FixLearner:
    """A tap on the recorder (recorder/sink.py `TappedSink`): tells the fixes what each finished reply said."""

    def __init__(self, fixes: FixSessions):
        self.fixes = fixes

    def __call__(self, turn: Turn) -> None:
        if turn.status and turn.status < 400:
            session = session_of(turn.request_headers) or turn.session_id
            self.fixes.learn(session, turn.response_text, turn.reasoning_text, turn.tool_calls)
