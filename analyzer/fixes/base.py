"""What every fix takes and gives: a request body, its protocol and the session's record in; a new
body (or None) and one line saying what changed, or why it stood aside, out."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Outcome:
    """One fix's answer for one request. `body` is the fixed copy, None when the fix did not fire;
    `note` says what changed or why it stood aside; `memo` is what the fix wants to find in the
    session's record next time (None: keep what is there)."""
    body: dict | None
    note: str
    memo: Any = None
    headers: dict[str, str] = field(default_factory=dict)  # headers to add upstream (session-key)

    @property
    def fired(self) -> bool:
        return self.body is not None


@dataclass
class SessionRecord:
    """What the proxy knows of one session beyond the request in hand.

    `tool_args`: call id -> the arguments exactly as the model emitted them (from the replies the
    proxy relayed); `reasoning`: reply key (`reply_key`) -> the reasoning the model emitted with that
    reply; `template_keeps_reasoning`: whether the server's chat template renders the reasoning of
    earlier assistant turns (None: not known, an upstream that publishes no template); `session_id`:
    the session as the proxy names it; `memos`: each fix's own notes from earlier requests."""
    session_id: str | None = None
    tool_args: dict[str, str] = field(default_factory=dict)
    reasoning: dict[str, str] = field(default_factory=dict)
    template_keeps_reasoning: bool | None = None
    memos: dict[str, Any] = field(default_factory=dict)


Fix = Callable[[dict, str, SessionRecord], Outcome]


def stands_aside(note: str) -> Outcome:
    return Outcome(None, note)


def reply_key(content: str, call_ids: list[str]) -> str:
    """The key under which an assistant reply's reasoning is kept: its visible text and the ids of its
    tool calls, which the client sends back unchanged when it replays the reply in history."""
    raw = json.dumps([content, sorted(call_ids)], ensure_ascii=False)
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def digest(value: Any) -> str:
    """A short stable hash of a JSON value (for memos that recognise a message again)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:24]
