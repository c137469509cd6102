"""OpenTelemetry export: one span per turn, with the GenAI semantic conventions' attributes and
prefixtrace's own (why the prompt cache missed, what it cost, the fix). docs/OBSERVABILITY.md.

The only module that imports `opentelemetry`, and only when an exporter is made (`TurnSpans.open`):
without the `[otel]` extra installed, `--otlp-endpoint` fails with one line naming it, and nothing
else changes. Spans are built from what the proxy recorded (`recorder.turn.Turn`) and what the
analyzer found (`analyzer.results.TurnResult`), read by attribute only, so this module imports
neither: `serve` hands it each turn with the live analysis's result (proxy/live.py), `analyze`
each turn of its report. A span is ended with the turn's own recorded start and duration, and
goes to a BatchSpanProcessor: the export happens on the SDK's own thread, never on a response's path.

Nothing a prompt or a reply says is exported (no message content, no break before/after text):
counts, names, the session id as the recorder stored it (redacted) and the break's location.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from prefixtrace.common.errors import InvalidRequest
from prefixtrace.common.urls import display_url
from recorder.redact import DEFAULT_REDACTOR

log = logging.getLogger("prefixtrace.otel")

INSTALL_HINT = "pip install 'prefixtrace[otel]'"
TRACES_PATH = "/v1/traces"
SCOPE = "prefixtrace"
NOTE_CHARS = 300  # a note is cut to this, after redaction (a cut secret matches no pattern)
FLUSH_EVERY = 512  # analyze: spans handed over between two flushes

OPERATIONS = {  # gen_ai.operation.name by recorded endpoint
    "/v1/chat/completions": "chat",
    "/v1/messages": "chat",
    "/v1/responses": "chat",
    "/v1/completions": "text_completion",
}


def traces_url(endpoint: str) -> str:
    """`--otlp-endpoint`: a collector's base URL gets OTLP/HTTP's `/v1/traces` (as the SDK's
    OTEL_EXPORTER_OTLP_ENDPOINT does); a URL with a path is used as given."""
    try:
        parts = urlsplit(endpoint)
    except ValueError as exc:
        raise InvalidRequest(f"--otlp-endpoint {display_url(endpoint)!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidRequest(f"--otlp-endpoint must be an http(s) URL such as http://127.0.0.1:4318, "
                             f"got {display_url(endpoint)!r}")
    if parts.path in ("", "/"):
        parts = parts._replace(path=TRACES_PATH)
    return urlunsplit(parts)


def require_sdk() -> None:
    """One line naming the extra when the OpenTelemetry SDK or its OTLP/HTTP exporter is missing."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise InvalidRequest(f"--otlp-endpoint needs the OpenTelemetry SDK and OTLP exporter ({exc.name or exc} "
                             f"is not installed): {INSTALL_HINT}") from None


def _provider_name(endpoint: str, upstream: str) -> str:
    if upstream.startswith("embedded:"):
        return "prefixtrace"  # the embedded engine answered
    return "anthropic" if endpoint.startswith("/v1/messages") else "openai"


def _number(value: Any) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return value


def turn_attributes(turn: Any, result: Any | None, conversation_id: str | None, *,
                    inferred: bool = False) -> dict[str, Any]:
    """The span's attributes: GenAI semantic conventions, then `prefixtrace.*`. `turn` is a recorded
    `Turn` (or anything with its fields), `result` the analyzer's `TurnResult` for it (None: not
    analysed, e.g. a refused request). Unknown values are left out, never written as 0."""
    body = turn.request_body if isinstance(turn.request_body, dict) else {}
    endpoint = turn.endpoint or ""
    upstream = turn.upstream or ""
    provider = _provider_name(endpoint, upstream)
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": OPERATIONS.get(endpoint, endpoint.rstrip("/").rsplit("/", 1)[-1] or "unknown"),
        "gen_ai.provider.name": provider,
        "gen_ai.system": provider,  # the older name of the same attribute, still read by most backends
        "http.response.status_code": turn.status,
        "prefixtrace.request_id": turn.request_id,
        "prefixtrace.endpoint": endpoint,
        "prefixtrace.upstream": display_url(upstream),
        "prefixtrace.stream": bool(turn.stream),
    }
    if isinstance(body.get("model"), str):
        attrs["gen_ai.request.model"] = body["model"]
    if upstream.startswith("embedded:"):
        attrs["gen_ai.response.model"] = upstream.removeprefix("embedded:")
    for key, name in (("max_tokens", "gen_ai.request.max_tokens"), ("max_completion_tokens", "gen_ai.request.max_tokens"),
                      ("max_output_tokens", "gen_ai.request.max_tokens"), ("temperature", "gen_ai.request.temperature"),
                      ("top_p", "gen_ai.request.top_p")):
        if (value := _number(body.get(key))) is not None:
            attrs[name] = value
    if conversation_id is not None:
        attrs["gen_ai.conversation.id"] = conversation_id
        attrs["session.id"] = conversation_id  # OpenInference's name: Phoenix and Langfuse group sessions by it
        attrs["prefixtrace.session.inferred"] = bool(inferred)
    # Input tokens include the cached ones (the recorded prompt_tokens already does, Messages' too:
    # prefixtrace/wire/messages.py adds cache reads and writes to input_tokens).
    usage = turn.usage if isinstance(turn.usage, dict) else {}
    for name, value in (("gen_ai.usage.input_tokens", turn.prompt_tokens),
                        ("gen_ai.usage.output_tokens", turn.completion_tokens),
                        ("gen_ai.usage.cache_read.input_tokens", turn.cached_tokens),
                        ("gen_ai.usage.cache_creation.input_tokens", usage.get("cache_creation_input_tokens")),
                        ("prefixtrace.ttft_s", turn.ttft_s), ("prefixtrace.total_s", turn.total_s)):
        if (value := _number(value)) is not None:
            attrs[name] = value
    if turn.finish_reason:
        attrs["gen_ai.response.finish_reasons"] = [str(turn.finish_reason)]
    if turn.status >= 400 or turn.error:
        attrs["error.type"] = str(turn.status) if turn.status >= 400 else "error"
    if result is not None:
        attrs.update(result_attributes(result))
    return attrs


def result_attributes(result: Any) -> dict[str, Any]:
    """`prefixtrace.*` from the analyzer's TurnResult: the turn number, its re-prefill, and for a break
    its cause, subtype, where, the one cost (tokens, seconds, dollars when priced) and the fix."""
    attrs: dict[str, Any] = {"prefixtrace.turn.number": result.index + 1,
                             "prefixtrace.prefix_stable": result.brk is None}
    for name, value in (("prefixtrace.prompt_tokens", result.prompt_tokens),
                        ("prefixtrace.common_prefix_tokens", result.common_prefix_tokens),
                        ("prefixtrace.reprefill_tokens", result.reprefill_tokens)):
        if (value := _number(value)) is not None:
            attrs[name] = value
    if result.note:
        attrs["prefixtrace.note"] = result.note  # cut to NOTE_CHARS once redacted (emit)
    brk = result.brk
    if brk is None:
        return attrs
    attrs["prefixtrace.break.cause"] = brk.cause
    if brk.subtype:
        attrs["prefixtrace.break.subtype"] = brk.subtype
    attrs["prefixtrace.break.where"] = brk.location()
    if brk.suggestion:
        attrs["prefixtrace.fix"] = brk.suggestion
    for name, value in (("prefixtrace.lost_tokens", result.lost_tokens),
                        ("prefixtrace.lost_seconds", result.lost_seconds),
                        ("prefixtrace.lost_dollars", getattr(result, "lost_dollars", None))):
        if (value := _number(value)) is not None:
            attrs[name] = value
    if result.lost_seconds_basis:
        attrs["prefixtrace.lost_seconds.basis"] = result.lost_seconds_basis
    return attrs


def span_name(attrs: dict[str, Any]) -> str:
    """`{gen_ai.operation.name} {gen_ai.request.model}`, as the GenAI conventions name spans."""
    model = attrs.get("gen_ai.request.model")
    return f"{attrs['gen_ai.operation.name']} {model}" if model else attrs["gen_ai.operation.name"]


def span_times(started_at: float, total_s: float | None, ttft_s: float | None) -> tuple[int, int]:
    """(start, end) in epoch nanoseconds from the recorded start and duration (else TTFT, else zero)."""
    start = int(started_at * 1e9)
    duration = next((d for d in (total_s, ttft_s) if _number(d) is not None and d >= 0), 0.0)
    return start, start + int(duration * 1e9)


class _CountingExporter:
    """Wraps the OTLP exporter to count what reached the collector and log a failing one once per
    streak (the SDK retries, then drops; a collector that is down must never hold a response)."""

    def __init__(self, inner, url: str):
        self.inner, self.url = inner, url
        self.exported = self.failed = 0
        self._failing = False
        self._shut = False
        self._lock = threading.Lock()

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self.inner.export(spans)
        except Exception:  # an exporter bug must not kill the batch thread
            log.exception("OTLP export to %s failed", display_url(self.url))
            result = SpanExportResult.FAILURE
        with self._lock:
            if result == SpanExportResult.SUCCESS:
                self.exported += len(spans)
                if self._failing:
                    log.warning("OTLP export to %s works again", display_url(self.url))
                self._failing = False
            else:
                self.failed += len(spans)
                if not self._failing:
                    log.warning("OTLP export to %s failed: %d span(s) dropped (more failures are not logged "
                                "until it works again)", display_url(self.url), len(spans))
                self._failing = True
        return result

    @property
    def failing(self) -> bool:
        return self._failing

    def shutdown(self):
        if not self._shut:
            self._shut = True
            self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class TurnSpans:
    """An OTLP/HTTP span exporter for turns. `open(endpoint)` builds it (the SDK is imported then);
    `emit(turn, result, conversation_id)` ends one span per turn; `close()` flushes what is queued."""

    def __init__(self, provider, tracer, exporter: _CountingExporter, url: str):
        self.provider, self.tracer, self.exporter, self.url = provider, tracer, exporter, url
        self.emitted = 0
        # Every string a span carries passes through it (the model name, the fix text, the error): the
        # live path hands over turns unredacted, and a collector is one more place secrets must not go.
        # serve's LiveFeed swaps in the recorder's own (its configured patterns).
        self.redactor = DEFAULT_REDACTOR

    @classmethod
    def open(cls, endpoint: str, *, service_name: str = "prefixtrace", timeout_s: float = 10.0,
             schedule_delay_ms: int = 1000) -> TurnSpans:
        url = traces_url(endpoint)
        require_sdk()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from prefixtrace import __version__

        # Our own provider, not the global one: an application embedding the proxy keeps its tracing.
        # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES still apply (Resource.create reads them);
        # OTEL_EXPORTER_OTLP_HEADERS too (the exporter reads it: a hosted collector's key).
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        exporter = _CountingExporter(OTLPSpanExporter(endpoint=url, timeout=timeout_s), url)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=schedule_delay_ms))
        return cls(provider, provider.get_tracer(SCOPE, __version__), exporter, url)

    def emit(self, turn: Any, result: Any | None, conversation_id: str | None, *, inferred: bool = False) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        redact = self.redactor.text
        attrs = {name: redact(value) if isinstance(value, str) else value
                 for name, value in turn_attributes(turn, result, conversation_id, inferred=inferred).items()}
        if "prefixtrace.note" in attrs:
            attrs["prefixtrace.note"] = attrs["prefixtrace.note"][:NOTE_CHARS]
        start, end = span_times(turn.started_at, turn.total_s, turn.ttft_s)
        kind = SpanKind.INTERNAL if (turn.upstream or "").startswith("embedded:") else SpanKind.CLIENT
        span = self.tracer.start_span(span_name(attrs), kind=kind, attributes=attrs, start_time=start)
        if turn.status >= 400 or turn.error:
            span.set_status(Status(StatusCode.ERROR, redact(turn.error or f"HTTP {turn.status}")[:300]))
        span.end(end_time=end)
        self.emitted += 1

    def flush(self, timeout_s: float = 30.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def close(self, timeout_s: float = 10.0) -> None:
        if self.exporter.failing:  # a collector that is down: no retries at exit, what is queued is dropped
            self.exporter.shutdown()
        else:
            self.flush(timeout_s)
        self.provider.shutdown()


class LiveFeed:
    """`serve --otlp-endpoint`: every recorded turn becomes a span once the live analysis
    (proxy/live.py, the dashboard's) has compared it with its session's previous turn.

    `wake` is a turn observer (cheap: sets an event, on the event loop); a thread of its own
    then runs `live.refresh()` (the same incremental analysis a dashboard poll runs, one at a
    time under its lock). That analysis holds the GIL while it renders and counts, so it waits
    for a pause in the traffic: once no turn has arrived for `quiet_s`, or at the latest
    `max_delay_s` after the first waiting one, it analyses everything waiting in one pass, so
    a burst of requests is not slowed turn by turn (bench/bench_proxy_overhead.py --otlp).
    LiveSessions calls `_on_analysed` for each analysed turn, which ends its span."""

    def __init__(self, spans: TurnSpans, *, quiet_s: float = 0.25, max_delay_s: float = 3.0):
        self.spans = spans
        self.quiet_s, self.max_delay_s = quiet_s, max_delay_s
        self._last_turn = 0.0
        self._live = None
        self._redactor = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self, live) -> None:
        self._live = live
        self._redactor = live.redactor  # turns reach the live analysis unredacted; an error text may quote a body
        self.spans.redactor = live.redactor
        live.listeners.append(self._on_analysed)
        self._thread = threading.Thread(target=self._run, name="prefixtrace-otel-feed", daemon=True)
        self._thread.start()

    def wake(self, turn) -> None:
        self._last_turn = time.monotonic()
        self._wake.set()

    def _on_analysed(self, turn, result, session_id: str, inferred: bool) -> None:
        try:
            if turn.error and self._redactor is not None:
                turn = replace(turn, error=self._redactor.text(turn.error))
            self.spans.emit(turn, result, session_id, inferred=inferred)
        except Exception:  # a span that cannot be built must not cost the dashboard its analysis
            log.exception("no span for turn %s", turn.request_id)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            first = time.monotonic()
            while not self._stop.is_set():  # until a quiet moment, or the longest wait
                quiet_for = time.monotonic() - self._last_turn
                if quiet_for >= self.quiet_s or time.monotonic() - first >= self.max_delay_s:
                    break
                self._stop.wait(min(self.quiet_s - quiet_for, self.max_delay_s - (time.monotonic() - first)))
            self._wake.clear()
            self._refresh()
        self._refresh()

    def _refresh(self) -> None:
        try:
            if self._live is not None and self._live.pending:
                self._live.refresh()
        except Exception:
            log.exception("live analysis for OTLP export failed")

    def close(self, timeout_s: float = 10.0) -> None:
        """Analyse and export what is still queued, then flush (bounded)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.spans.close(timeout_s)


def export_report(report: Any, turns: list, spans: TurnSpans) -> int:
    """`analyze --otlp-endpoint`: one span per recorded turn of the analysed input, each with its
    TurnResult's analysis (session id, break, cost); a request the server refused (listed, not
    chained) gets its span without one. `turns` are the recorded turns (recorder.sources.load_turns;
    empty for bare request bodies, whose spans are then built from the analysis alone). Returns
    how many spans were handed to the exporter."""
    from recorder.turn import Turn

    by_id = {t.request_id: t for t in turns}
    done: set[str] = set()
    count = 0
    for session in report.sessions:
        for result in session.turns:
            turn = by_id.get(result.request_id)
            if turn is None:  # no recorded turn (bare bodies): what the analysis read of it
                turn = Turn(result.request_id, result.ts if result.ts is not None else 0.0, "", "",
                            {"model": result.model} if result.model else {}, status=200,
                            prompt_tokens=result.reported_prompt_tokens, cached_tokens=result.reported_cached_tokens,
                            ttft_s=result.ttft_s)
            if not turn.started_at:
                continue  # no recorded time: a span at 1970 would only mislead
            spans.emit(turn, result, session.id, inferred=session.inferred)
            done.add(result.request_id)
            count += 1
            if count % FLUSH_EVERY == 0:  # the batch queue holds 2,048: a long recording must not overflow it
                spans.flush()
    # Requests the server refused: listed by the report, not chained. Only those: a turn the analysis
    # did not read under the same id (a bare body, given an id of its own on each reading) is not
    # exported twice.
    for failed in report.failed:
        turn = by_id.get(failed.get("request_id"))
        if turn is not None and turn.request_id not in done and turn.started_at:
            spans.emit(turn, None, turn.session_id)
            done.add(turn.request_id)
            count += 1
    return count
