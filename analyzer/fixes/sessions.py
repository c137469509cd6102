"""The records the fixes read, one per session, fed from the replies that went through.

The proxy (live) and the offline proposal both hold one `FixSessions`: `apply` fixes one request with
its session's record, `learn` keeps what a finished turn's reply said (each tool call's arguments as
the model emitted them, the reasoning beside each reply). Sessions and their entries are bounded, the
least recently used going first, so a long-running proxy holds a fixed amount.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from analyzer.fixes import Applied, SessionRecord, apply_fixes, reply_key
from prefixtrace.wire.request import protocol_of

MAX_SESSIONS = 256
MAX_ENTRIES = 4096  # tool calls / replies remembered per session


def _trim(d: dict) -> None:
    while len(d) > MAX_ENTRIES:
        d.pop(next(iter(d)))


class FixSessions:
    def __init__(self, names: list[str], template_keeps_reasoning: bool | None = None,
                 reasoning_probe: Callable[[], bool | None] | None = None):
        """`template_keeps_reasoning`: whether the server renders earlier turns' reasoning, when known;
        `reasoning_probe`: asks the server instead (None while it cannot tell), until it answers."""
        self.names = names
        self.template_keeps_reasoning = template_keeps_reasoning
        self.reasoning_probe = reasoning_probe
        self._records: OrderedDict[str, SessionRecord] = OrderedDict()

    def _keeps_reasoning(self) -> bool | None:
        if self.template_keeps_reasoning is None and self.reasoning_probe is not None and "thinking" in self.names:
            self.template_keeps_reasoning = self.reasoning_probe()
        return self.template_keeps_reasoning

    def record_of(self, session: str | None) -> SessionRecord:
        key = session or ""
        record = self._records.pop(key, None)
        if record is None:
            record = SessionRecord(session_id=session, template_keeps_reasoning=self.template_keeps_reasoning)
        self._records[key] = record
        while len(self._records) > MAX_SESSIONS:
            self._records.popitem(last=False)
        return record

    def apply(self, endpoint: str, body: Any, session: str | None) -> Applied | None:
        """The named fixes over one request body; None when there is nothing to fix (no fix named, or
        a body that is not a JSON object: the request goes on as it came)."""
        if not self.names or not isinstance(body, dict):
            return None
        record = self.record_of(session)
        record.template_keeps_reasoning = self._keeps_reasoning()
        return apply_fixes(self.names, body, protocol_of(endpoint), record)

    def learn(self, session: str | None, response_text: str, reasoning_text: str, tool_calls: list | None) -> None:
        """Keeps what one reply said, for the fixes of the session's later requests."""
        record = self.record_of(session)
        ids = []
        for call in tool_calls or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(call.get("id"), str) and isinstance(fn.get("arguments"), str):
                record.tool_args[call["id"]] = fn["arguments"]
                ids.append(call["id"])
        _trim(record.tool_args)
        if reasoning_text:
            record.reasoning[reply_key(response_text or "", ids)] = reasoning_text
            _trim(record.reasoning)
