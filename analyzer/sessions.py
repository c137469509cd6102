"""Grouping requests into sessions (one agent conversation each).

Requests recorded with a session id are grouped by it. The rest are
inferred online, in time order, at the payload level (canonical message
keys, which is what decides the rendered prefix, and cheap): a request joins
the session whose *latest* request shares the longest message prefix with
it, provided that prefix reaches past the leading system messages (which
unrelated conversations of one agent share) through the first conversation
message; otherwise it starts a new session. Interleaved orchestrator and
subagent traffic separates because each subagent's first task message
differs.

Fallback: agents that rewrite their system prompt every turn (the very
problem this tool exists to show) share nothing past message 0, so when no
session qualifies we compare again with the leading system messages set
aside and require the first conversation message to match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from analyzer.canon import first_changed
from analyzer.causes import HEAD_ROLES

UNRENDERABLE_SESSION = "unrenderable"


@dataclass
class Session:
    id: str
    inferred: bool
    indices: list[int] = field(default_factory=list)  # into the request list
    latest_keys: list[str] | None = None
    latest_roles: list[str] | None = None


def _head(roles: list[str]) -> int:
    n = 0
    while n < len(roles) and roles[n] in HEAD_ROLES:
        n += 1
    return n


def _score(s: Session, keys: list[str], roles: list[str]) -> tuple[int, int] | None:
    a_head, b_head = _head(s.latest_roles), _head(roles)
    shared = first_changed(s.latest_keys, keys)
    if shared > a_head and shared > b_head:
        return (1, shared)
    if a_head < len(s.latest_keys) and b_head < len(keys):
        shared = first_changed(s.latest_keys[a_head:], keys[b_head:])
        if shared >= 1:
            return (0, shared)
    return None


class SessionGrouper:
    """Feed requests in time order with `add`; `sessions` in order of first request."""

    def __init__(self) -> None:
        self.sessions: list[Session] = []
        self._explicit: dict[str, Session] = {}
        self._inferred: list[Session] = []  # most recently active last

    def _named(self, name: str, index: int, *, inferred: bool) -> Session:
        s = self._explicit.get(name)
        if s is None:
            s = self._explicit[name] = Session(name, inferred=inferred)
            self.sessions.append(s)
        s.indices.append(index)
        return s

    def add(self, index: int, session_id: str | None, keys: list[str] | None, roles: list[str] | None) -> Session:
        if session_id is not None:
            return self._named(session_id, index, inferred=False)
        if keys is None:
            return self._named(UNRENDERABLE_SESSION, index, inferred=True)
        best, best_score = None, None
        for s in self._inferred:
            score = _score(s, keys, roles)
            # `>=` so that on a tie the most recently active session wins.
            if score is not None and (best_score is None or score >= best_score):
                best, best_score = s, score
        if best is None:
            best = Session(f"inferred-{len(self._inferred) + 1}", inferred=True)
            self.sessions.append(best)
        else:
            self._inferred.remove(best)
        self._inferred.append(best)
        best.indices.append(index)
        best.latest_keys, best.latest_roles = keys, roles
        return best
