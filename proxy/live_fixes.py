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
from typing import Any, Callable

from analyzer.fixes.sessions import FixSessions
from proxy.run_session import session_of
from recorder.turn import Turn
from prefixtrace.wire.request import session_id

log = logging.getLogger("prefixtrace.proxy")


def fix_request(fixes: FixSessions | None, endpoint: str, body: Any, raw: bytes, turn: Turn) -> tuple[Any, bytes]:
    """(body, raw) to send on: the client's own when no fix fired, the fixed body and its JSON otherwise.
    Never raises: a failure here is recorded in the turn and the request goes on as it came."""
    if fixes is None or not fixes.names:
        return body, raw
    try:
        session = session_of(turn.request_headers) or session_id(endpoint, body, turn.request_headers)
        applied = fixes.apply(endpoint, body, session)
        if applied is None:
            return body, raw
        turn.fixes = applied.entries
        if not applied.fired:
            return body, raw
        lower = {k.lower() for k in turn.request_headers}
        for name, value in applied.headers.items():  # a router's session header, where the client sent none
            if name.lower() not in lower:
                turn.request_headers[name] = value
        return applied.body, json.dumps(applied.body, ensure_ascii=False).encode()
    except Exception as exc:  # the fixes' own bookkeeping failed: the request is not theirs to lose
        log.exception("fixes failed on request %s", turn.request_id)
        turn.fixes = [{"name": "*", "fired": False, "error": True, "note": f"the fixes failed: {type(exc).__name__}: {exc}",
                       "bytes_before": len(raw), "bytes_after": len(raw)}]
        return body, raw


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
