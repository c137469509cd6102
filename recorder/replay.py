"""Replay recorded requests against an OpenAI-compatible server and measure each turn.

v0: one target, each session's requests in order (sessions one after another),
streamed with `stream_options.include_usage` so TTFT and usage are measured the
same way for every server. The replay issue adds several targets, concurrency,
pacing and the A/B report on top of `replay_session`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import httpx

from prefixtrace.errors import UpstreamError
from proxy import sse
from proxy.upstream_backend import map_httpx_errors, normalize_base_url
from recorder.turn import Turn

# Per-request fields that change between a recording and a replay and would
# otherwise make the server see a different request.
_STRIP = ("stream", "stream_options", "n")


@dataclass
class ReplayedTurn:
    session: str | None
    index: int
    request_id: str
    status: int
    prompt_tokens: int | None
    cached_tokens: int | None  # None: the server did not report it
    completion_tokens: int | None
    ttft_ms: float | None
    total_ms: float
    recorded_cached_tokens: int | None
    error: str | None = None


def cached_from_usage(usage: dict | None, chunk: dict | None = None) -> int | None:
    """Cached prompt tokens as each server family reports them (None when not reported)."""
    usage = usage or {}
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    if isinstance(usage.get("cache_read_input_tokens"), int):  # Anthropic
        return usage["cache_read_input_tokens"]
    timings = (chunk or {}).get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):  # llama.cpp
        return timings["cache_n"]
    return None


def replay_turn(client: httpx.Client, turn: Turn, index: int) -> ReplayedTurn:
    body = {k: v for k, v in turn.request_body.items() if k not in _STRIP}
    body.update(stream=True, stream_options={"include_usage": True})
    usage, last_chunk, ttft, status, error = None, None, None, 0, None
    t0 = time.perf_counter()
    try:
        with map_httpx_errors(str(client.base_url)):
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                status = response.status_code
                if status >= 400:
                    error = response.read().decode(errors="replace")[:500]
                else:
                    for line in response.iter_lines():
                        chunk = sse.decode_data(line.encode()) if line.startswith("data:") else None
                        if not chunk:
                            continue
                        last_chunk = chunk
                        if ttft is None and any((c.get("delta") or {}).get("content") or (c.get("delta") or {}).get("reasoning_content")
                                                for c in chunk.get("choices") or []):
                            ttft = time.perf_counter() - t0
                        usage = chunk.get("usage") or usage
    except UpstreamError as exc:
        error = exc.message
    total = time.perf_counter() - t0
    return ReplayedTurn(
        session=turn.session_id,
        index=index,
        request_id=turn.request_id,
        status=status,
        prompt_tokens=(usage or {}).get("prompt_tokens"),
        cached_tokens=cached_from_usage(usage, last_chunk),
        completion_tokens=(usage or {}).get("completion_tokens"),
        ttft_ms=None if ttft is None else round(ttft * 1000, 2),
        total_ms=round(total * 1000, 2),
        recorded_cached_tokens=turn.cached_tokens,
        error=error,
    )


def replay(turns: Iterable[Turn], target: str, *, timeout: float = 600.0) -> dict:
    """Send every replayable turn to `target`, in recorded order per session; return the report."""
    by_session: dict[str | None, list[Turn]] = {}
    for turn in turns:
        if isinstance(turn.request_body, dict) and isinstance(turn.request_body.get("messages"), list):
            by_session.setdefault(turn.session_id, []).append(turn)
    url = normalize_base_url(target)
    results = []
    with httpx.Client(base_url=url, timeout=httpx.Timeout(timeout, connect=10.0)) as client:
        for session_turns in by_session.values():
            for index, turn in enumerate(session_turns):
                results.append(replay_turn(client, turn, index))
    return {"targets": [{"url": url, "turns": [asdict(r) for r in results]}]}


def format_replay(report: dict) -> str:
    lines = []
    for target in report["targets"]:
        lines.append(f"target {target['url']}")
        lines.append(f"{'session':<24} {'#':>3} {'status':>6} {'prompt':>8} {'cached':>8} {'recorded':>8} {'ttft ms':>9} {'total ms':>9}")
        for t in target["turns"]:
            q = lambda v: "?" if v is None else str(v)  # noqa: E731
            lines.append(f"{(t['session'] or '-')[:24]:<24} {t['index']:>3} {t['status']:>6} {q(t['prompt_tokens']):>8} "
                         f"{q(t['cached_tokens']):>8} {q(t['recorded_cached_tokens']):>8} {q(t['ttft_ms']):>9} {t['total_ms']:>9}"
                         + (f"  error: {t['error'][:60]}" if t["error"] else ""))
    return "\n".join(lines)


def write_report(report: dict, path) -> None:
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)
