"""Prometheus metrics in the text exposition format (version 0.0.4), no client library.

The proxy's own counters are fed one `Turn` at a time (`Metrics.observe`, on
the event loop, no I/O). Engine and upstream gauges are read at scrape time
from `Engine.stats`, `Engine.capacity()`, the prefix cache's `stats` and the
upstream pool's `stats()`. Names follow Prometheus conventions: `prefixtrace_`
prefix, base units (`_seconds`, `_bytes`), `_total` on counters.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from typing import Any, Iterable

from recorder.numbers import count, seconds
from recorder.turn import Turn

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def samples(self, name: str, labels: dict[str, str]) -> Iterable[str]:
        running = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts):
            running += n
            yield _sample(f"{name}_bucket", {**labels, "le": _float(bound)}, running)
        yield _sample(f"{name}_sum", labels, self.sum)
        yield _sample(f"{name}_count", labels, self.count)


class Metrics:
    """The proxy's counters and histograms, rendered with the engine's and upstreams' gauges."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = defaultdict(int)  # (endpoint, upstream, status)
        self.tokens: dict[tuple[str, str], int] = defaultdict(int)  # (kind, upstream)
        self.reported_prompt_tokens = 0  # prompt tokens of turns that reported a cached count
        self.reprefill: dict[str, int] = defaultdict(int)
        self.breaks: dict[str, int] = defaultdict(int)
        self.ttft: dict[str, Histogram] = {}
        self.latency: dict[str, Histogram] = {}
        self.usage_unusable = 0  # turns whose backend reported a usage count that is none (NaN, 1e29)
        self.usage_impossible = 0  # turns whose backend reported more cached than prompt tokens (clamped)
        self.fixes: dict[tuple[str, str], int] = defaultdict(int)  # (fix, "applied" | "failed"): serve --fix

    def observe(self, turn: Turn) -> None:
        """Count one finished turn (called with every recorded turn). A reported count that is
        no count (NaN, Infinity, 1e29: recorder/numbers.py) is left out, never summed."""
        self.requests[(turn.endpoint, turn.upstream, str(turn.status))] += 1
        for entry in turn.fixes or []:
            if entry.get("fired") or entry.get("error"):
                self.fixes[(entry.get("name", "?"), "applied" if entry.get("fired") else "failed")] += 1
        prompt, generated, cached = count(turn.prompt_tokens), count(turn.completion_tokens), count(turn.cached_tokens)
        if prompt:
            self.tokens[("prompt", turn.upstream)] += prompt
        if generated:
            self.tokens[("generated", turn.upstream)] += generated
        if cached is not None and prompt:
            if cached > prompt:  # more served from cache than was sent: impossible; counted as all cached, flagged
                self.usage_impossible += 1
                cached = prompt
            self.tokens[("cached", turn.upstream)] += cached
            self.reported_prompt_tokens += prompt
        if turn.status < 400:
            ttft, total = seconds(turn.ttft_s), seconds(turn.total_s)
            if ttft is not None:
                self.ttft.setdefault(turn.endpoint, Histogram(TTFT_BUCKETS)).observe(ttft)
            if total is not None:
                self.latency.setdefault(turn.endpoint, Histogram(LATENCY_BUCKETS)).observe(total)

    def on_unusable_usage(self, turn: Turn, fields: list[str]) -> None:
        """One turn whose backend reported `fields` as numbers no token count can be."""
        self.usage_unusable += 1

    def on_break(self, cause: str, reprefill_tokens: int) -> None:
        """One prefix break found by the live analysis (`LiveSessions(on_break=...)`)."""
        self.breaks[cause] += 1
        self.reprefill[cause] += reprefill_tokens

    @property
    def cache_hit_ratio(self) -> float:
        cached = sum(v for (kind, _), v in self.tokens.items() if kind == "cached")
        return min(1.0, cached / self.reported_prompt_tokens) if self.reported_prompt_tokens else 0.0

    def render(self, *, engine=None, upstreams: list[dict] | None = None, recorder: dict | None = None) -> str:
        """`recorder`: the recorder's `spool_state()` (whether the database takes writes, spooled and dropped turns)."""
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples: Iterable[str]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(samples)

        family("prefixtrace_requests_total", "counter", "Requests served, by endpoint, upstream and HTTP status.",
               (_sample("prefixtrace_requests_total", {"endpoint": e, "upstream": u, "status": s}, n)
                for (e, u, s), n in sorted(self.requests.items())))
        for kind, help_ in (("prompt", "Prompt tokens reported by the backend."),
                            ("cached", "Prompt tokens the backend reported as served from its prefix cache."),
                            ("generated", "Completion tokens generated.")):
            name = f"prefixtrace_{kind}_tokens_total"
            family(name, "counter", help_, (_sample(name, {"upstream": u}, n)
                                            for (k, u), n in sorted(self.tokens.items()) if k == kind))
        family("prefixtrace_cache_hit_ratio", "gauge",
               "Cached over prompt tokens, over the turns whose backend reported a cached count.",
               [_sample("prefixtrace_cache_hit_ratio", {}, round(self.cache_hit_ratio, 6))])
        family("prefixtrace_usage_unusable_total", "counter",
               "Turns whose backend reported a usage count that is no count (NaN, Infinity, negative, past 2**63);"
               " recorded as unknown, the usage kept as sent.",
               [_sample("prefixtrace_usage_unusable_total", {}, self.usage_unusable)])
        family("prefixtrace_usage_impossible_total", "counter",
               "Turns whose backend reported more cached tokens than prompt tokens; counted as wholly cached"
               " (the ratio above stays within 0..1), the usage kept as sent.",
               [_sample("prefixtrace_usage_impossible_total", {}, self.usage_impossible)])
        family("prefixtrace_reprefill_tokens_total", "counter",
               "Tokens re-prefilled after a prefix break, by the analyzer's cause (analysis tokenizer).",
               (_sample("prefixtrace_reprefill_tokens_total", {"cause": c}, n) for c, n in sorted(self.reprefill.items())))
        family("prefixtrace_fixes_total", "counter",
               "Requests a `serve --fix` fix changed (outcome=applied) or failed on and left as sent (outcome=failed).",
               (_sample("prefixtrace_fixes_total", {"fix": f, "outcome": o}, n) for (f, o), n in sorted(self.fixes.items())))
        family("prefixtrace_prefix_breaks_total", "counter", "Prefix breaks found by the live analysis, by cause.",
               (_sample("prefixtrace_prefix_breaks_total", {"cause": c}, n) for c, n in sorted(self.breaks.items())))
        family("prefixtrace_ttft_seconds", "histogram", "Time to the first content token.",
               (s for e, h in sorted(self.ttft.items()) for s in h.samples("prefixtrace_ttft_seconds", {"endpoint": e})))
        family("prefixtrace_request_duration_seconds", "histogram", "Whole request latency.",
               (s for e, h in sorted(self.latency.items())
                for s in h.samples("prefixtrace_request_duration_seconds", {"endpoint": e})))
        if recorder is not None:
            family("prefixtrace_recorder_writable", "gauge", "1 when the recorder's database takes writes.",
                   [_sample("prefixtrace_recorder_writable", {}, int(bool(recorder["writable"])))])
            family("prefixtrace_recorder_spooled_turns", "gauge",
                   "Finished turns waiting in the recorder's spool for the database to take writes.",
                   [_sample("prefixtrace_recorder_spooled_turns", {}, recorder["spooled"])])
            family("prefixtrace_recorder_dropped_turns_total", "counter",
                   "Finished turns lost because the database could not be written and the spool was full.",
                   [_sample("prefixtrace_recorder_dropped_turns_total", {}, recorder["dropped"])])
        if engine is not None and engine.ready:
            out.extend(_engine_families(engine))
        if upstreams:
            out.extend(_upstream_families(upstreams))
        return "\n".join(out) + "\n"


def engine_state(engine) -> dict[str, Any]:
    """The engine's numbers in one dict (dashboard and metrics): capacity, stats, prefix cache."""
    capacity = engine.capacity()
    stats = dict(engine.stats)
    cache = getattr(engine.prefix_cache, "stats", None)
    cache = cache() if callable(cache) else cache
    prompt = stats.get("prompt_tokens", 0)
    return {
        "capacity": capacity,
        "stats": stats,
        "prefix_cache": cache if isinstance(cache, dict) else {},
        "cache_hit_ratio": min(1.0, stats.get("cached_tokens", 0) / prompt) if prompt else 0.0,
        "memory_bytes": capacity["weights_bytes"] + (capacity.get("kv_bytes_in_use") or 0),
        "memory_ceiling_bytes": capacity["ceiling_bytes"],
    }


def _engine_families(engine) -> list[str]:
    state = engine_state(engine)
    cap, stats, cache = state["capacity"], state["stats"], state["prefix_cache"]
    out: list[str] = []

    def one(name: str, kind: str, help_: str, value, labels: dict | None = None) -> None:
        out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", _sample(name, labels or {}, value)])

    for key in ("running", "waiting", "paused", "prefilling"):
        one(f"prefixtrace_engine_requests_{key}", "gauge", f"Engine requests {key} now.", cap.get(key, 0))
    one("prefixtrace_engine_memory_bytes", "gauge", "Weights plus KV in use (the memory model's estimate).",
        state["memory_bytes"])
    one("prefixtrace_engine_memory_ceiling_bytes", "gauge", "Memory the engine may use (weights + KV + prefill peak).",
        state["memory_ceiling_bytes"])
    one("prefixtrace_engine_kv_bytes", "gauge", "KV cache bytes held by running and paused requests.",
        cap.get("kv_bytes_in_use") or 0)
    one("prefixtrace_engine_max_context_tokens", "gauge", "Longest request that fits the memory ceiling.",
        cap["max_context_tokens"])
    measured = cap.get("measured") or {}
    one("prefixtrace_engine_mlx_active_bytes", "gauge", "MLX active memory.", measured.get("active_bytes", 0))
    for key, help_ in (("requests", "Requests the engine finished."),
                       ("prompt_tokens", "Prompt tokens the engine admitted."),
                       ("cached_tokens", "Prompt tokens the engine served from its prefix cache."),
                       ("generated_tokens", "Tokens the engine generated."),
                       ("pauses", "Requests paused under memory pressure."),
                       ("parks", "Prefills parked under memory pressure."),
                       ("resumes", "Paused or parked requests resumed."),
                       ("aborts", "Requests aborted under memory pressure."),
                       ("cancelled", "Requests cancelled by their client.")):
        one(f"prefixtrace_engine_{key}_total", "counter", help_, stats.get(key, 0))
    one("prefixtrace_engine_cache_hit_ratio", "gauge", "Engine cached over prompt tokens since start.",
        round(state["cache_hit_ratio"], 6))
    one("prefixtrace_engine_prefix_cache_memory_bytes", "gauge", "Prefix cache bytes in memory.",
        cache.get("memory_bytes", engine.prefix_cache.nbytes if engine.prefix_cache else 0))
    one("prefixtrace_engine_prefix_cache_disk_bytes", "gauge", "Prefix cache bytes on disk (0 without a disk tier).",
        cache.get("disk_bytes", 0))
    return out


def _upstream_families(upstreams: list[dict]) -> list[str]:
    out: list[str] = []
    for key, kind, help_ in (("up", "gauge", "1 when the upstream's last health check passed."),
                             ("sessions", "gauge", "Sessions pinned to the upstream now."),
                             ("requests_total", "counter", "Requests sent to the upstream."),
                             ("errors_total", "counter", "Requests to the upstream that failed to connect."),
                             ("failovers_total", "counter", "Sessions moved away from the upstream (cache affinity lost).")):
        name = f"prefixtrace_upstream_{key}"
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        field_ = key.removesuffix("_total")
        out += [_sample(name, {"upstream": u["url"]}, int(u[field_])) for u in upstreams]
    return out


def _sample(name: str, labels: dict[str, str], value) -> str:
    if labels:
        inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
        return f"{name}{{{inner}}} {_float(value)}"
    return f"{name} {_float(value)}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _float(value) -> str:
    if isinstance(value, float):
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    return str(int(value))
