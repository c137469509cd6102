"""Live analysis of the turns this proxy serves, for the dashboard and /metrics.

`LiveSessions.observe(turn)` runs on the event loop for every recorded turn
and only appends it to a pending list. `refresh()` (called by readers, in a
worker thread) analyses what is pending incrementally: sessions are grouped
online (`SessionGrouper`, the analyzer's own), and each new turn is compared
with its session's previous turn only (`Analyzer.walk` over the pair), so the
cost of a refresh is the new turns' renderings, never the whole history.

Memory is bounded: per session only the last request is kept for comparison,
and at most `max_turns` analysed turns (oldest sessions dropped first) are kept
for display.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from analyzer.canon import Payload
from analyzer.chains import Analyzer
from analyzer.clients import KNOWN, client_of, is_side_request, title_of
from analyzer.costing import price_breaks
from analyzer.divergence import SegmentCounter
from analyzer.load import Request
from prefixtrace.wire.request import is_remote_compaction
from analyzer.results import SessionResult, TurnResult
from analyzer.rule_breaks import RuleBreaks, request_facts
from analyzer.advice import SIDE_REQUEST
from analyzer.server_renderer import recorded_choice
from analyzer.sessions import SessionGrouper, side_reason
from recorder.renderers import RendererInfo
from recorder.replay_mark import is_replay
from recorder.redact import DEFAULT_REDACTOR, Redactor
from recorder.turn import Turn

PENDING_MAX_TURNS = 256
PENDING_MAX_CHARS = 16 << 20
LIVE_MAX_BODY_CHARS = 8 << 20
log = logging.getLogger("prefixtrace.dashboard")
_COUNTER_CACHE_MAX = 100_000  # token-count cache entries before it is rebuilt
_PRICED_TURNS = 64  # per session, the recent results a break's seconds are priced against (price_breaks)


@dataclass
class LiveTurn:
    """One served turn as the dashboard shows it."""

    index: int
    request_id: str
    started_at: float
    endpoint: str
    upstream: str
    status: int
    prompt_tokens: int | None  # as the server reported (None: not reported)
    cached_tokens: int | None  # as the server reported (None: unknown, not a miss)
    completion_tokens: int | None
    ttft_s: float | None
    total_s: float | None
    analysis: dict[str, Any]  # the analyzer's TurnResult.to_dict()
    policy: dict[str, Any] | None = None  # render policies the engine applied (docs/RENDER_POLICIES.md)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class LiveSession:
    id: str
    inferred: bool
    turns: list[LiveTurn] = field(default_factory=list)
    last: tuple[Request, Payload] | None = None
    rules: RuleBreaks | None = None  # the session's cache writes, kept across its pairs of turns (lookback)
    updated_at: float = 0.0
    client: str | None = None  # the harness, from its User-Agent (analyzer/clients.py)
    title: str | None = None  # its first user message, trimmed and redacted
    title_from_side: bool = False  # the title came from a side request: the main chain's replaces it
    recent: deque = field(default_factory=lambda: deque(maxlen=_PRICED_TURNS))  # TurnResults, for lost_seconds
    parent: str | None = None  # a side request chain (a title, a summary) of this session, as `analyze` names it
    side_reason: str | None = None

    def cost(self) -> tuple[float, int, int]:
        """(seconds, tokens, breaks) its kept breaks lost: what orders the dashboard's sessions."""
        breaks = [t.analysis for t in self.turns if t.analysis.get("break")]
        return (round(sum(b.get("lost_seconds") or 0 for b in breaks), 2),
                sum(b.get("lost_tokens") or 0 for b in breaks), len(breaks))

    def to_dict(self, max_turns: int | None = None) -> dict[str, Any]:
        turns = self.turns if max_turns is None else self.turns[-max_turns:]
        seconds, tokens, breaks = self.cost()
        return {"id": self.id, "inferred": self.inferred, "updated_at": self.updated_at, "client": self.client,
                "title": self.title, "parent": self.parent, "side_reason": self.side_reason,
                "lost_seconds": seconds, "lost_tokens": tokens, "breaks": breaks,
                "failed": sum(1 for t in self.turns if t.status >= 400),
                "turn_count": len(self.turns), "turns": [t.to_dict() for t in turns]}


def _header(headers: dict[str, str] | None, name: str) -> str | None:
    return next((v for k, v in (headers or {}).items() if k.lower() == name), None)


class LiveSessions:
    """Incremental analyzer state over the turns served since start-up.

    Args:
        max_turns: analysed turns kept for display (oldest sessions dropped first).
        on_break: `callable(cause, reprefill_tokens)` called once per analysed break
            (the metrics' re-prefill-by-cause counter).
        redactor: masks what the dashboard shows (session ids, the break's before/after
            text), as the recorder masks what it stores: turns arrive here unredacted.

    `listeners`: `callable(turn, result, session_id, inferred)` called once per analysed turn
    with the analyzer's TurnResult (the OTLP export, prefixtrace/otel.py), in the refreshing thread.
    """

    def __init__(self, *, max_turns: int = 2000, on_break: Callable[[str, int], None] | None = None,
                 redactor: Redactor | None = None):
        self.analyzer = Analyzer(workers=1)
        self.renderer_id: str | None = None  # the recorded renderer the analyzer counts with (None: generic)
        self.renderer_note = "no renderer recorded yet: generic ChatML and tiktoken o200k_base, estimates"
        self.redactor = redactor or DEFAULT_REDACTOR
        # Forks split as `analyze` splits them: a harness's title or summary request under the session's
        # id is a side request of it, never a break of its main chain.
        self.grouper = SessionGrouper(split_forks=True)
        self.sessions: OrderedDict[str, LiveSession] = OrderedDict()
        self.max_turns = max_turns
        self.on_break = on_break
        self.listeners: list[Callable[[Turn, TurnResult, str, bool], None]] = []
        self.version = 0  # bumps whenever an analysed turn is added
        self._pending: list[Turn] = []
        self._pending_chars = 0
        self._refreshing = False
        self._pending_lock = threading.Lock()
        self._lock = threading.Lock()  # one refresh at a time
        self._seen = 0

    def observe(self, turn: Turn) -> None:
        """Queue a recorded turn for analysis; cheap, no I/O (runs on the event loop). Pending turns hold
        their whole bodies: past `PENDING_MAX_TURNS` or `PENDING_MAX_CHARS` of raw body with no reader
        polling, they are analysed in a thread of their own (issue 25: without a dashboard open, every
        turn stayed in memory, a 30 MB prompt as ~60 MB for good). A body over `LIVE_MAX_BODY_CHARS` is not
        kept at all: the turn is listed without a prompt comparison (analysing it would cost ~15x its size)."""
        if is_replay(turn.request_headers):  # `prefixtrace replay`'s measurement, not the user's traffic
            return
        if is_remote_compaction(turn.endpoint):  # the server's rewrite of the history, no call of the loop
            return
        chars = len(turn.request_raw) if isinstance(turn.request_raw, str) else 0
        if chars > LIVE_MAX_BODY_CHARS:
            turn, chars = dataclasses.replace(turn, request_body=None, request_raw=None), 0
        with self._pending_lock:
            self._pending.append(turn)
            self._pending_chars += chars
            due = (len(self._pending) >= PENDING_MAX_TURNS or self._pending_chars >= PENDING_MAX_CHARS) \
                and not self._refreshing
            if due:
                self._refreshing = True
        if due:
            threading.Thread(target=self._refresh_in_background, name="prefixtrace-live", daemon=True).start()

    def _refresh_in_background(self) -> None:
        try:
            self.refresh()
        except Exception:
            log.exception("live analysis failed")
        finally:
            self._refreshing = False

    @property
    def pending(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    def refresh(self) -> int:
        """Analyse the pending turns; returns how many were analysed."""
        with self._lock:
            with self._pending_lock:
                turns, self._pending, self._pending_chars = self._pending, [], 0
            for turn in sorted(turns, key=lambda t: t.started_at):
                try:
                    self._add(turn)
                except Exception:  # one unanalysable turn must not cost the poll (and the batch) a 500
                    log.exception("live analysis skipped turn %s", turn.request_id)
            if turns:
                self.version += 1
                self._trim()
            return len(turns)

    def snapshot(self, since: float = 0.0) -> dict[str, Any]:
        """Sessions (costliest first) updated after `since`."""
        with self._lock:
            return {
                "version": self.version,
                "renderer": self.analyzer.renderer.name,
                "tokenizer": self.analyzer.tokenizer.name,
                "sessions": [s.to_dict() for s in self._by_cost() if s.updated_at > since],
            }

    def page(self, offset: int = 0, limit: int = 25, max_turns: int = 200, since: float = 0.0) -> dict[str, Any]:
        """One page of sessions (costliest first: seconds lost, then tokens, then the most recent), each with
        its last `max_turns` turns, and the headline over all of them: what a poll costs stays bounded
        however many sessions the proxy has seen."""
        with self._lock:
            sessions = [s for s in self._by_cost() if s.updated_at > since]
            return {"version": self.version, "renderer": self.analyzer.renderer.name,
                    "tokenizer": self.analyzer.tokenizer.name, "renderer_note": self.renderer_note,
                    "headline": self._headline(), "total_sessions": len(sessions), "offset": offset, "limit": limit,
                    "sessions": [s.to_dict(max_turns) for s in sessions[offset:offset + limit]]}

    def _by_cost(self) -> list[LiveSession]:
        return sorted(self.sessions.values(), key=lambda s: (-s.cost()[0], -s.cost()[1], -s.updated_at))

    def _headline(self) -> dict[str, Any] | None:
        """What cost the most, and where: the breaks' total, the costliest cause and the session and turn of
        its costliest break (None before the first break)."""
        breaks = [(s, t) for s in self.sessions.values() for t in s.turns if t.analysis.get("break")]
        if not breaks:
            return None
        by_cause: dict[str, list[float]] = {}
        for _, t in breaks:
            c = by_cause.setdefault(t.analysis["break"]["cause"], [0.0, 0, 0])
            c[0] += t.analysis.get("lost_seconds") or 0
            c[1] += t.analysis.get("lost_tokens") or 0
            c[2] += 1
        cause = max(by_cause, key=lambda k: (by_cause[k][0], by_cause[k][1]))
        s, t = max(((s, t) for s, t in breaks if t.analysis["break"]["cause"] == cause),
                   key=lambda st: (st[1].analysis.get("lost_seconds") or 0, st[1].analysis.get("lost_tokens") or 0))
        return {"breaks": len(breaks), "lost_seconds": round(sum(v[0] for v in by_cause.values()), 2),
                "lost_tokens": sum(v[1] for v in by_cause.values()), "cause": cause,
                "cause_seconds": round(by_cause[cause][0], 2), "cause_tokens": by_cause[cause][1],
                "cause_breaks": by_cause[cause][2], "session": s.id, "title": s.title, "client": s.client,
                "turn": t.analysis.get("number") or t.index + 1, "where": t.analysis["break"].get("where"),
                "brk": t.analysis["break"], "fix": t.analysis["break"].get("suggestion")}

    def find(self, session_id: str) -> dict[str, Any] | None:
        """One session, all its kept turns (the dashboard's per-session report)."""
        with self._lock:
            session = next((s for s in self.sessions.values() if s.id == session_id), None)
            return session.to_dict() if session else None

    # --- analysis (under self._lock) ---------------------------------------------

    def _use_renderer(self, info: RendererInfo | None) -> None:
        """Counts with the renderer the server recorded for its turns (its chat template and tokenizer), as
        `analyze` does on the database, so the dashboard's numbers are the CLI's; the first one seen stays
        (one proxy serves one model; `analyze` too picks one renderer for a recording). `info`: the
        renderer the turn carries (None: not known)."""
        if info is None or self.renderer_id is not None:
            return
        choice = recorded_choice(info)
        if choice is None:
            return
        self.renderer_id = info.id
        self.analyzer = Analyzer(choice.renderer, choice.tokenizer, workers=1)
        self.analyzer.exact_counts = choice.exact
        self.renderer_note = choice.note
        for s in self.sessions.values():  # payloads came from the old analyzer's canonicaliser
            s.last, s.rules = None, None

    def _add(self, turn: Turn) -> None:
        self._seen += 1
        self._use_renderer(turn.renderer)
        body = turn.request_body if isinstance(turn.request_body, dict) else None
        # What only the body as sent and its headers say (the parameters a provider keys its cache on, the
        # Messages blocks and their breakpoints), read as `analyze` reads it, before anything else does.
        request = Request(turn.request_id, turn.started_at, body, turn.session_id, None,
                          turn.prompt_tokens, turn.cached_tokens, endpoint=turn.endpoint, ttft_s=turn.ttft_s,
                          upstream=turn.upstream, total_s=turn.total_s, headers=turn.request_headers)
        request_facts(request)
        body = request.body if isinstance(request.body, dict) else None
        payload = self.analyzer.canon.payload(body) if body is not None else None
        roles = None
        if payload is not None:
            roles = [str(m.get("role")) if isinstance(m, dict) else "" for m in payload.messages]
        grouped = self.grouper.add(self._seen, turn.session_id, payload.keys if payload else None, roles,
                                   payload.tools_key if payload else None, payload.chars if payload else 0)
        session = self.sessions.get(grouped.id)
        if session is None:
            session = self.sessions[grouped.id] = LiveSession(self.redactor.text(grouped.id), grouped.inferred)
            main = next((g for g in self.grouper.sessions if grouped.family and g.id == grouped.family), None)
            if main is not None and main is not grouped:
                session.parent, session.side_reason = self.redactor.text(main.id), side_reason(grouped, main)
        if session.client not in KNOWN:  # a side request's SDK name gives way to the harness's
            session.client = client_of(_header(turn.request_headers, "user-agent"), body) or session.client
        # The first request names the session, unless it was a side request (a title generator that
        # opencode sends first): then the main chain's first request does.
        if body is not None and (session.title is None or session.title_from_side) and not (
                session.title is not None and is_side_request(body)):
            title = title_of(body)
            if title:
                session.title, session.title_from_side = self.redactor.text(title), is_side_request(body)
        result = self._compare(session, request, payload)
        if session.parent is not None and result.note == "first":  # as `analyze` words it (analyzer/chains.py)
            result.note = (f"side request of {session.parent}: re-prefilled {result.reprefill_tokens or 0:,} tokens "
                           f"because it {session.side_reason}; {SIDE_REQUEST}")
        session.recent.append(result)
        if any(r.brk is not None for r in session.recent):  # seconds lost, as `analyze` prices them
            price_breaks([SessionResult(session.id, session.inferred, list(session.recent))], None)
        if payload is not None and turn.status < 400:
            session.last = (request, payload)
        session.turns.append(LiveTurn(
            len(session.turns), turn.request_id, turn.started_at, turn.endpoint, turn.upstream, turn.status,
            turn.prompt_tokens, turn.cached_tokens, turn.completion_tokens, turn.ttft_s, turn.total_s,
            self.redactor.value(result.to_dict()), (turn.render or {}).get("policy"),
        ))
        self._repriced(session)
        session.updated_at = time.time()
        if result.brk is not None and self.on_break is not None:
            self.on_break(result.brk.cause, result.reprefill_tokens or 0)
        for listener in self.listeners:
            listener(turn, result, session.id, session.inferred)

    @staticmethod
    def _repriced(session: LiveSession) -> None:
        """Earlier breaks' seconds as the turns since price them (a later cache hit nearest in size is what
        `analyze` compares a break's TTFT with), so the page shows what `analyze` says of the same turns."""
        for r in session.recent:
            if r.brk is not None and r.index < len(session.turns):
                a = session.turns[r.index].analysis
                a["lost_seconds"], a["lost_seconds_basis"], a["lost_tokens"] = \
                    r.lost_seconds, r.lost_seconds_basis, r.lost_tokens

    def _compare(self, session: LiveSession, request: Request, payload: Payload | None) -> TurnResult:
        session.rules = session.rules or RuleBreaks(self.analyzer.tokenizer)
        if payload is None or session.last is None:
            result = self.analyzer.walk([request], [payload], session.rules)[0]
        else:
            prev_request, prev_payload = session.last
            result = self.analyzer.walk([prev_request, request], [prev_payload, payload], session.rules)[1]
        result.index = len(session.turns)
        return result

    def _trim(self) -> None:
        total = sum(len(s.turns) for s in self.sessions.values())
        dropped: set[str] = set()
        while total > self.max_turns and len(self.sessions) > 1:
            key = min(self.sessions, key=lambda k: self.sessions[k].updated_at)  # by key: the id shown is redacted
            total -= len(self.sessions.pop(key).turns)
            dropped.add(key)
        if dropped:  # the grouper keeps each chain's last prompt: forget those too, or memory grows for good
            self.grouper.drop(dropped)
        # Per-message caches: keep only what the live comparisons still need.
        self.analyzer.canon.forget([s.last[1] for s in self.sessions.values() if s.last])
        if len(self.analyzer.counter._cache) > _COUNTER_CACHE_MAX:
            self.analyzer.counter = SegmentCounter(self.analyzer.tokenizer)
