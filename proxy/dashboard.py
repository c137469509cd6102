"""Observability routes: `GET /ui` (live dashboard), `GET /ui/api/sessions` (its JSON), `GET /metrics`.

`observe(app, backend, recorder)` wires them in: it wraps the recorder so
every recorded turn also reaches the live analysis (`proxy/live.py`) and the
metrics (`proxy/metrics.py`), and returns the wrapped recorder for the chat
routes to use. The page (`proxy/static/dashboard.html`, plain HTML/JS, no
build step) polls the JSON endpoint; analysis runs on the poll, in a worker
thread, over the turns recorded since the previous poll only.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.responses import HTMLResponse, Response

from analyzer.html import CACHED, COLOURS
from prefixtrace.errors import PrefixtraceError
from proxy.live import LiveSessions
from proxy.metrics import CONTENT_TYPE, Metrics, engine_state
from recorder import numbers
from recorder.turn import Turn

log = logging.getLogger("prefixtrace.dashboard")
PAGE = Path(__file__).with_name("static") / "dashboard.html"


class ObservedSink:
    """A recorder that also hands every turn to observers (cheap callables, run on the event loop).

    Observers see the turn's counts as numbers they can add up: a usage count a backend
    reported as NaN, Infinity or 1e29 reaches them as None (unknown), and `on_unusable` hears
    of it (the recorder stores the same: NULL counts, the usage as sent; recorder/numbers.py)."""

    def __init__(self, sink, observers, on_unusable=None):
        self.sink = sink
        self.observers = list(observers)
        self.on_unusable = on_unusable
        if hasattr(sink, "record_async"):
            self.record_async = self._record_async

    def _observe(self, turn: Turn) -> None:
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

    def record(self, turn: Turn):
        self._observe(turn)
        return self.sink.record(turn)

    async def _record_async(self, turn: Turn) -> None:
        self._observe(turn)
        await self.sink.record_async(turn)

    def __getattr__(self, name: str):
        return getattr(self.sink, name)


def observe(app: FastAPI, backend, recorder, turn_feed=None):
    """Add /ui, /ui/api/sessions and /metrics to `app`; returns the recorder the routes must record through.
    `turn_feed` (prefixtrace/otel.py LiveFeed, with `serve --otlp-endpoint`): attached to the live
    analysis, and woken by every recorded turn."""
    metrics = Metrics()
    live = LiveSessions(on_break=metrics.on_break, redactor=getattr(recorder, "redactor", None))
    observers = [metrics.observe, live.observe]
    if turn_feed is not None:
        turn_feed.attach(live)
        observers.append(turn_feed.wake)
    app.state.metrics, app.state.live = metrics, live
    engine = getattr(backend, "engine", None)

    def backend_state() -> dict[str, Any]:
        state: dict[str, Any] = {"backend": backend.label, "engine": None, "upstreams": None}
        if engine is not None and engine.ready:
            try:
                state["engine"] = engine_state(engine)
            except PrefixtraceError:
                pass
        if hasattr(backend, "stats"):
            state["upstreams"] = backend.stats()
        return state

    @app.get("/ui", response_class=HTMLResponse, include_in_schema=False)
    async def ui():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers={"Cache-Control": "no-cache"})

    @app.get("/ui/api/sessions")
    async def ui_sessions(since: float = 0.0):
        if live.pending:
            await asyncio.to_thread(live.refresh)
        body = {
            **live.snapshot(since),
            **backend_state(),
            "proxy": {"cache_hit_ratio": metrics.cache_hit_ratio,
                      "requests": sum(metrics.requests.values())},
            "colours": {**COLOURS, "cached": CACHED},
        }
        # Strict JSON whatever a backend reported: a NaN anywhere once made every poll a 500.
        return Response(numbers.dumps(jsonable_encoder(body), ensure_ascii=False, separators=(",", ":")),
                        media_type="application/json")

    @app.get("/metrics", include_in_schema=False)
    async def prometheus():
        if live.pending:
            await asyncio.to_thread(live.refresh)
        upstreams = backend.stats() if hasattr(backend, "stats") else None
        spool = getattr(recorder, "spool_state", None)
        text = metrics.render(engine=engine, upstreams=upstreams, recorder=spool() if spool is not None else None)
        return Response(text, media_type=CONTENT_TYPE)

    return ObservedSink(recorder, observers, on_unusable=metrics.on_unusable_usage)
