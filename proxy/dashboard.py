"""Observability routes: `GET /ui` (live dashboard), `GET /ui/api/sessions` (its JSON, a page of
sessions at a time), `GET /ui/report/<session>` (one session's full HTML report), `GET /metrics`.

`observe(app, backend, recorder)` wires them in: it returns the tap
(`TurnObservers`) that the app puts behind the recorder, so every recorded
turn also reaches the live analysis (`proxy/live.py`) and the metrics
(`proxy/metrics.py`). The page (`proxy/static/dashboard.html`, plain HTML/JS, no
build step) polls the JSON endpoint; analysis runs on the poll, in a worker
thread, over the turns recorded since the previous poll only.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query
from fastapi.encoders import jsonable_encoder
from fastapi.responses import HTMLResponse, Response

from analyzer.report_html import render as render_report
from analyzer.report_view import APPEND, CACHED, COLOURS, LABELS
from prefixtrace.common.errors import PrefixtraceError
from proxy.live import LiveSessions
from proxy.metrics import CONTENT_TYPE, Metrics, engine_state
from recorder import numbers
from recorder.sink import TurnSink
from recorder.turn import Turn

log = logging.getLogger("prefixtrace.dashboard")
PAGE = Path(__file__).with_name("static") / "dashboard.html"
MAX_PAGE = 100  # sessions per poll at most: 2,000 sessions in one answer took 1.4 MB and 2 s
MAX_TURNS = 500  # turns per session per poll at most (the session's report has them all)


class TurnObservers:
    """A tap on the recorder (recorder/sink.py `TappedSink`) that hands every turn to observers (cheap
    callables, run on the event loop, in the order given).

    Observers see the turn's counts as numbers they can add up: a usage count a backend
    reported as NaN, Infinity or 1e29 reaches them as None (unknown), and `on_unusable` hears
    of it (the recorder stores the same: NULL counts, the usage as sent; recorder/numbers.py)."""

    def __init__(self, observers, on_unusable=None):
        self.observers = list(observers)
        self.on_unusable = on_unusable

    def __call__(self, turn: Turn) -> None:
        seen = numbers.usable(turn)
        if seen is not turn:
            bad = numbers.unusable_counts(turn)
            if bad:
                log.warning("turn %s: the backend reported %s, no token count; recorded as unknown, the usage as sent",
                            turn.request_id, ", ".join(f"{name}={getattr(turn, name)!r:.40}" for name in bad))
                if self.on_unusable is not None:
                    self.on_unusable(turn, bad)
        for observer in self.observers:
            try:
                observer(seen)
            except Exception:  # observability must never cost a response or a recorded turn
                log.exception("observer %r failed on turn %s", observer, turn.request_id)


def observe(app: FastAPI, backend, recorder: TurnSink, turn_feed=None) -> TurnObservers:
    """Add /ui, /ui/api/sessions and /metrics to `app`; returns the tap every recorded turn must pass.
    `turn_feed` (prefixtrace/otel.py LiveFeed, with `serve --otlp-endpoint`): attached to the live
    analysis, and woken by every recorded turn."""
    metrics = Metrics()
    live = LiveSessions(on_break=metrics.on_break, redactor=recorder.redactor)
    observers = [metrics.observe, live.observe]
    if turn_feed is not None:
        turn_feed.attach(live)
        observers.append(turn_feed.wake)
    app.state.metrics, app.state.live = metrics, live
    engine = backend.engine if backend.embedded else None

    def backend_state() -> dict[str, Any]:
        state: dict[str, Any] = {"backend": backend.label, "engine": None, "upstreams": None}
        if engine is not None and engine.ready:
            try:
                state["engine"] = engine_state(engine)
            except PrefixtraceError:
                pass
        state["upstreams"] = backend.stats()
        return state

    @app.get("/ui", response_class=HTMLResponse, include_in_schema=False)
    async def ui():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers={"Cache-Control": "no-cache"})

    @app.get("/ui/api/sessions")
    async def ui_sessions(since: float = 0.0, offset: int = Query(0, ge=0), limit: int = Query(25, ge=1, le=MAX_PAGE),
                          turns: int = Query(200, ge=1, le=MAX_TURNS), version: int | None = None):
        if live.pending:
            await asyncio.to_thread(live.refresh)
        # The page sends the version it shows: while nothing new was analysed, a poll is the live gauges only.
        sessions = {"version": live.version, "unchanged": True} if version == live.version else \
            live.page(offset, limit, turns, since)
        body = {
            **sessions,
            **backend_state(),
            "proxy": {"cache_hit_ratio": metrics.cache_hit_ratio, "requests": sum(metrics.requests.values()),
                      "reported_prompt_tokens": metrics.reported_prompt_tokens,
                      "fixes": {f: n for (f, outcome), n in metrics.fixes.items() if outcome == "applied"}},
            "colours": {**COLOURS, "cached": CACHED, "appended": APPEND},
            "labels": LABELS,
        }
        # Strict JSON whatever a backend reported: a NaN anywhere once made every poll a 500.
        return Response(numbers.dumps(jsonable_encoder(body), ensure_ascii=False, separators=(",", ":")),
                        media_type="application/json")

    @app.get("/ui/report/{session_id:path}", response_class=HTMLResponse, include_in_schema=False)
    async def ui_report(session_id: str):
        if live.pending:
            await asyncio.to_thread(live.refresh)
        session = live.find(session_id)
        if session is None:
            return HTMLResponse("<!doctype html><title>no such session</title><p>No session with this id is kept: the "
                                "dashboard keeps the most recent 2,000 turns. Run <code>prefixtrace analyze</code> on "
                                "the database for the history.</p>", status_code=404)
        page = await asyncio.to_thread(render_report, _report_dict(session, live), f"prefixtrace: {session['id']}")
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/metrics", include_in_schema=False)
    async def prometheus():
        if live.pending:
            await asyncio.to_thread(live.refresh)
        upstreams = backend.stats()
        text = metrics.render(engine=engine, upstreams=upstreams, recorder=recorder.spool_state())
        return Response(text, media_type=CONTENT_TYPE)

    return TurnObservers(observers, on_unusable=metrics.on_unusable_usage)


def _report_dict(session: dict[str, Any], live: LiveSessions) -> dict[str, Any]:
    """A live session in the analysis's dict form (docs/ANALYZER.md), with the served facts the
    analysis does not carry (TTFT, the server's cached count) put where the report reads them."""
    turns = []
    for t in session["turns"]:
        a = dict(t["analysis"])
        if a.get("ttft_s") is None:
            a["ttft_s"] = t.get("ttft_s")
        if a.get("reported_cached_tokens") is None:
            a["reported_cached_tokens"] = t.get("cached_tokens")
        a["index"] = t["index"]
        turns.append(a)
    return {"renderer": live.analyzer.renderer.name, "tokenizer": live.analyzer.tokenizer.name,
            "renderer_note": live.renderer_note, "prefill_rate": None, "warnings": [],
            "sessions": [{"id": session["id"], "client": session.get("client"), "title": session.get("title"),
                          "parent": session.get("parent"), "side_reason": session.get("side_reason"),
                          "turns": turns}]}
