"""Grouping turns into sessions (one agent conversation each).

Turns recorded with a session_id are grouped by it. The rest are inferred,
in time order: a request joins the session whose *latest* request shares the
longest rendered prefix with it, provided that prefix reaches past the system
prompt (which unrelated conversations of one agent share) through the end of
the first conversation message; otherwise it starts a new session.

Fallback: agents that rewrite their system prompt every turn (the very
problem this tool exists to show) share nothing past message 0, so when no
session qualifies we compare again with the leading system message(s)
removed and require the shared part to cover the first conversation message.
Without this, every turn of such an agent would look like a new session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from analyzer.divergence import common_prefix_len
from analyzer.render import Rendered, render_request
from prefixtrace.errors import InvalidRequest
from recorder.turn import Turn

UNRENDERABLE_SESSION = "unrenderable"


@dataclass
class Session:
    id: str
    inferred: bool
    turns: list[Turn] = field(default_factory=list)
    rendered: list[Rendered | None] = field(default_factory=list)  # parallel to turns; None = could not render

    def add(self, turn: Turn, rendered: Rendered | None) -> None:
        self.turns.append(turn)
        self.rendered.append(rendered)

    @property
    def latest(self) -> Rendered | None:
        return next((r for r in reversed(self.rendered) if r is not None), None)


def _try_render(turn: Turn, renderer: Callable[[Any], Rendered]) -> Rendered | None:
    try:
        return renderer(turn.request_body)
    except InvalidRequest:
        return None


def _conversation_start(r: Rendered) -> tuple[int, int] | None:
    """(offset where the non-system conversation starts, end of its first
    message), skipping the tools block and leading system messages."""
    for span in r.spans:
        header = r.text[span.start : span.body_start]
        if not header.startswith("<|im_start|>system") and not header.startswith("<|im_start|>developer"):
            return span.start, span.end
    return None


def _match_score(latest: Rendered, new: Rendered) -> tuple[int, int] | None:
    """Higher is a better match; None = not the same conversation."""
    a, b = _conversation_start(latest), _conversation_start(new)
    shared = common_prefix_len(latest.text, new.text)
    # Past the system prompt *and* through the whole first conversation
    # message: every conversation shares the next role line, and many share
    # the first words of their first user message.
    if shared >= (a[1] if a is not None else latest.prompt_end):
        return (1, shared)
    if a is None or b is None:
        return None
    shared = common_prefix_len(latest.text[a[0] :], new.text[b[0] :])
    if shared >= a[1] - a[0]:
        return (0, shared)
    return None


def group_sessions(
    turns: Iterable[Turn], *, renderer: Callable[[Any], Rendered] = render_request
) -> list[Session]:
    """Sessions in order of their first turn; turns keep their input order
    (pass them sorted by started_at)."""
    sessions: list[Session] = []
    explicit: dict[str, Session] = {}
    inferred: list[Session] = []  # most recently active last
    unrenderable: Session | None = None

    for turn in turns:
        rendered = _try_render(turn, renderer)
        if turn.session_id is not None:
            session = explicit.get(turn.session_id)
            if session is None:
                session = explicit[turn.session_id] = Session(turn.session_id, inferred=False)
                sessions.append(session)
            session.add(turn, rendered)
            continue
        if rendered is None:
            if unrenderable is None:
                unrenderable = Session(UNRENDERABLE_SESSION, inferred=True)
                sessions.append(unrenderable)
            unrenderable.add(turn, None)
            continue

        best, best_score = None, None
        for session in inferred:
            score = _match_score(session.latest, rendered)
            # `>=` so that on a tie the most recently active session wins.
            if score is not None and (best_score is None or score >= best_score):
                best, best_score = session, score
        if best is None:
            best = Session(f"inferred-{len(inferred) + 1}", inferred=True)
            sessions.append(best)
        else:
            inferred.remove(best)
        inferred.append(best)
        best.add(turn, rendered)
    return sessions
