"""Replay recorded requests against OpenAI-compatible servers and measure each turn.

Each target is replayed in turn (one after another, so two builds never
compete for the same machine); within a target, each session's requests go in
recorded order, sessions in parallel up to `concurrency`. Every request goes
back to the endpoint it was recorded on (`prefixtrace.wire.request.protocol_of`:
chat completions with `stream_options.include_usage`, Anthropic's `/v1/messages`,
OpenAI's `/v1/responses`, legacy `/v1/completions`), streamed, so TTFT and usage are
measured the same way for every server, and cached prompt tokens are
normalised across server families (`cached_from_usage`).

A target that cannot be reached is named in its `error` and every one of its
turns carries that error; the other targets still run. A target that answers
with errors has them recorded per turn. The report's shape is documented in
docs/FORMATS.md; `recorder.replay_report` summarises and renders it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import httpx

from prefixtrace.common.errors import InvalidRequest, UpstreamError
from prefixtrace.common.urls import credentials, display_url, without_credentials
from prefixtrace.wire import sse
from prefixtrace.wire.request import protocol_of
from prefixtrace.wire.http import map_httpx_errors, normalize_base_url
from recorder.replay_report import format_replay, summarise, write_report  # noqa: F401 (re-exported)
from recorder.replay_mark import REPLAY_HEADER
from recorder.turn import Turn

# Per-request fields that change between a recording and a replay and would
# otherwise make the server see a different request.
_STRIP = ("stream", "stream_options", "n")
PACES = ("original", "asap")


@dataclass
class ReplayedTurn:
    session: str | None
    index: int
    request_id: str
    status: int  # HTTP status; 0 = no response (unreachable, connection dropped)
    prompt_tokens: int | None
    cached_tokens: int | None  # None: the server did not report it
    completion_tokens: int | None
    ttft_ms: float | None
    total_ms: float
    recorded_cached_tokens: int | None
    error: str | None = None
    skipped: str | None = None  # why the request was not sent (it cannot be re-sent as recorded)

    @property
    def output_tokens(self) -> int | None:
        return self.completion_tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "output_tokens": self.output_tokens}


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


def _has_output(chunk: dict) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text"):  # legacy completions
            return True
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls"):
            return True
    return False


ENDPOINTS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses",
             "completions": "/v1/completions"}
MESSAGES_ENDPOINT = ENDPOINTS["messages"]


async def replay_turn(client: httpx.AsyncClient, turn: Turn, index: int, model: str | None = None) -> ReplayedTurn:
    """Re-send one recorded turn on the endpoint it was recorded on (each protocol's body and
    stream differ), streamed, and measure it."""
    protocol = protocol_of(turn.endpoint)
    body = {k: v for k, v in turn.request_body.items() if k not in _STRIP}
    body["stream"] = True
    if protocol in ("chat", "completions"):
        body["stream_options"] = {"include_usage": True}
    if model is not None:
        body["model"] = model
    read = {"messages": _read_messages_stream, "responses": _read_responses_stream}.get(protocol, _read_chat_stream)
    content, why = encode_body(body)
    if content is None:
        return ReplayedTurn(turn.session_id, index, turn.request_id, 0, None, None, None, None, 0.0,
                            turn.cached_tokens, None, skipped=why)
    usage, cached, ttft, status, error = None, None, None, 0, None
    t0 = time.perf_counter()
    try:
        with map_httpx_errors(str(client.base_url)):
            async with client.stream("POST", ENDPOINTS[protocol], content=content,
                                     headers={"content-type": "application/json", REPLAY_HEADER: "1"}) as response:
                status = response.status_code
                if status >= 400:
                    error = (await response.aread()).decode(errors="replace")[:500]
                else:
                    usage, cached, ttft, error = await read(response, t0)
    except UpstreamError as exc:
        error = exc.message
    total = time.perf_counter() - t0
    return ReplayedTurn(
        session=turn.session_id,
        index=index,
        request_id=turn.request_id,
        status=status,
        prompt_tokens=(usage or {}).get("prompt_tokens"),
        cached_tokens=cached,
        completion_tokens=(usage or {}).get("completion_tokens"),
        ttft_ms=None if ttft is None else round(ttft * 1000, 2),
        total_ms=round(total * 1000, 2),
        recorded_cached_tokens=turn.cached_tokens,
        error=error,
    )


def encode_body(body: dict) -> tuple[bytes | None, str | None]:
    """`(bytes, None)` for a body as it is sent (UTF-8 JSON, as httpx's `json=` writes it), or
    `(None, why)` for one that cannot be: a lone UTF-16 surrogate (a client's `\\ud800`
    escape, recorded from a request that was answered 400) has no UTF-8 spelling, and
    NaN or Infinity is no JSON. Replay skips such a request and says why, instead of aborting."""
    try:
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError as exc:
        return None, f"the request body holds a number JSON cannot carry (NaN or Infinity): {exc}"
    except (TypeError, RecursionError) as exc:
        return None, f"the request body cannot be serialised as JSON: {type(exc).__name__}: {exc}"
    try:
        return text.encode("utf-8"), None
    except UnicodeEncodeError as exc:
        char = text[exc.start]
        return None, (f"the request body holds a lone UTF-16 surrogate (U+{ord(char):04X}) at character {exc.start},"
                      " which has no UTF-8 spelling (the recorded request was refused for it)")


async def _read_responses_stream(response: httpx.Response, t0: float):
    """The same for a Responses stream: usage is in the terminal event's Response object."""
    usage, ttft, error = {}, None, None
    async for line in response.aiter_lines():
        event = sse.decode_data(line.encode()) if line.startswith("data:") else None
        if not event:
            continue
        kind = event.get("type", "")
        if ttft is None and kind.endswith(".delta"):
            ttft = time.perf_counter() - t0
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            result = event.get("response") or {}
            usage = result.get("usage") or {}
            if result.get("error"):
                error = str((result["error"] or {}).get("message"))[:500]
        elif kind == "error":
            error = str(event.get("message"))[:500]
    details = usage.get("input_tokens_details") if isinstance(usage.get("input_tokens_details"), dict) else {}
    cached = details.get("cached_tokens")
    return ({"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")},
            cached if isinstance(cached, int) else None, ttft, error)


async def _read_chat_stream(response: httpx.Response, t0: float):
    """(usage, cached tokens, ttft, in-band error) of a chat-completions stream."""
    usage, last_chunk, ttft, error = None, None, None, None
    async for line in response.aiter_lines():
        chunk = sse.decode_data(line.encode()) if line.startswith("data:") else None
        if not chunk:
            continue
        if isinstance(chunk.get("error"), dict):  # failed after the headers: reported in-band
            error = str(chunk["error"].get("message"))[:500]
            continue
        last_chunk = chunk
        if ttft is None and _has_output(chunk):
            ttft = time.perf_counter() - t0
        usage = chunk.get("usage") or usage
    return usage, cached_from_usage(usage, last_chunk), ttft, error


async def _read_messages_stream(response: httpx.Response, t0: float):
    """The same for an Anthropic Messages stream: usage arrives in `message_start` (input
    and cache reads) and `message_delta` (output); the prompt is input + cache read + cache
    created, as the proxy records it (proxy/anthropic.py)."""
    start, end, ttft, error = {}, {}, None, None
    async for line in response.aiter_lines():
        event = sse.decode_data(line.encode()) if line.startswith("data:") else None
        if not event:
            continue
        kind = event.get("type")
        if kind == "message_start":
            start = (event.get("message") or {}).get("usage") or {}
        elif kind == "message_delta":
            end = event.get("usage") or {}
        elif kind == "content_block_delta" and ttft is None:
            ttft = time.perf_counter() - t0
        elif kind == "error":
            error = str((event.get("error") or {}).get("message"))[:500]
    merged = {**start, **{k: v for k, v in end.items() if v is not None}}
    parts = [merged.get(k) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")]
    usage = {"prompt_tokens": sum(p for p in parts if isinstance(p, int)) if isinstance(parts[0], int) else None,
             "completion_tokens": merged.get("output_tokens")}
    return usage, cached_from_usage(merged), ttft, error


def group_sessions(turns: Iterable[Turn]) -> list[list[Turn]]:
    """Replayable turns (request bodies of a protocol this replays) per session, sessions in
    order of their first turn, turns in recorded order. Turns without a session form one."""
    by_session: dict[str | None, list[Turn]] = {}
    for turn in sorted(turns, key=lambda t: (t.started_at, t.request_id)):
        if _replayable(turn):
            by_session.setdefault(turn.session_id, []).append(turn)
    return list(by_session.values())


def _replayable(turn: Turn) -> bool:
    body = turn.request_body
    if not isinstance(body, dict):
        return False
    key = {"responses": "input", "completions": "prompt"}.get(protocol_of(turn.endpoint), "messages")
    if turn.endpoint.split("?", 1)[0].rstrip("/").endswith("/count_tokens"):
        return False  # not a model turn
    return body.get(key) is not None if key != "messages" else isinstance(body.get("messages"), list)


def _gaps(session: list[Turn], t_first: float, max_gap_s: float | None) -> list[float]:
    """Seconds to wait before each turn under `--pace original`: the first turn
    waits for its session's original start offset, later turns for the
    original think time between the previous response's end and this request."""
    gaps = []
    for k, turn in enumerate(session):
        if k == 0:
            gap = turn.started_at - t_first
        else:
            prev = session[k - 1]
            gap = turn.started_at - (prev.started_at + (prev.total_s or 0.0))
        gap = max(gap, 0.0)
        gaps.append(gap if max_gap_s is None else min(gap, max_gap_s))
    return gaps


async def _probe(client: httpx.AsyncClient, url: str) -> str | None:
    """None when something answers HTTP at `url`, else why not."""
    try:
        await client.get("/v1/models", timeout=httpx.Timeout(10.0, connect=5.0))
    except httpx.HTTPError as exc:
        return f"target {url} is unreachable: {type(exc).__name__}: {exc}".rstrip(": ")
    return None


async def replay_target(
    url: str,
    sessions: list[list[Turn]],
    *,
    concurrency: int = 1,
    pace: str = "asap",
    model: str | None = None,
    timeout: float = 600.0,
    max_gap_s: float | None = None,
    progress: Callable[[str, ReplayedTurn], None] | None = None,
) -> dict:
    """Replays `sessions` against one target; returns its report entry."""
    real_url = normalize_base_url(url)
    url = display_url(real_url)  # what the report names: never a target's credentials
    results: list[ReplayedTurn] = []
    limits = httpx.Limits(max_connections=max(concurrency, 1) + 1)
    async with httpx.AsyncClient(base_url=without_credentials(real_url), auth=credentials(real_url),
                                 timeout=httpx.Timeout(timeout, connect=10.0), limits=limits) as client:
        unreachable = await _probe(client, url)
        if unreachable is not None:
            for session in sessions:
                for index, turn in enumerate(session):
                    failed = ReplayedTurn(turn.session_id, index, turn.request_id, 0, None, None, None, None, 0.0,
                                          turn.cached_tokens, unreachable)
                    results.append(failed)
                    if progress:
                        progress(url, failed)
            return _target_entry(url, results, sessions, unreachable)

        slots = asyncio.Semaphore(max(concurrency, 1))
        t_first = min((s[0].started_at for s in sessions), default=0.0)
        t_start = time.monotonic()

        async def run_session(session: list[Turn]) -> None:
            gaps = _gaps(session, t_first, max_gap_s) if pace == "original" else [0.0] * len(session)
            first_gap, gaps[0] = gaps[0], 0.0
            # Sessions start at their original offsets; waiting for it holds no slot.
            await asyncio.sleep(max(0.0, first_gap - (time.monotonic() - t_start)))
            async with slots:
                for index, (turn, gap) in enumerate(zip(session, gaps)):
                    if gap:
                        await asyncio.sleep(gap)
                    result = await replay_turn(client, turn, index, model)
                    results.append(result)
                    if progress:
                        progress(url, result)

        await asyncio.gather(*(run_session(s) for s in sessions))
    return _target_entry(url, results, sessions, None)


def _target_entry(url: str, results: list[ReplayedTurn], sessions: list[list[Turn]], error: str | None) -> dict:
    order = {t.request_id: (k, i) for k, s in enumerate(sessions) for i, t in enumerate(s)}
    results.sort(key=lambda r: order[r.request_id])
    turns = [r.to_dict() for r in results]
    skipped = [{"session": r.session, "index": r.index, "request_id": r.request_id, "reason": r.skipped}
               for r in results if r.skipped]
    return {"url": url, "error": error, "turns": turns, "skipped": skipped, "summary": summarise(turns)}


def replay(
    turns: Iterable[Turn],
    targets: str | list[str],
    *,
    concurrency: int = 1,
    pace: str = "asap",
    model: str | None = None,
    timeout: float = 600.0,
    max_gap_s: float | None = None,
    progress: Callable[[str, ReplayedTurn], None] | None = None,
) -> dict:
    """Replays every replayable turn against each target; returns the report
    `{"targets": [{"url", "error", "turns": [...], "summary"}], "comparison"}`."""
    if isinstance(targets, str):
        targets = [targets]
    if not targets:
        raise InvalidRequest("replay needs at least one target")
    if pace not in PACES:
        raise InvalidRequest(f"unknown pace {pace!r}; expected one of {', '.join(PACES)}")
    if concurrency < 1:
        raise InvalidRequest(f"concurrency must be >= 1, got {concurrency}")
    sessions = group_sessions(turns)
    entries = [
        asyncio.run(replay_target(url, sessions, concurrency=concurrency, pace=pace, model=model, timeout=timeout,
                                  max_gap_s=max_gap_s, progress=progress))
        for url in targets
    ]
    from recorder.replay_report import compare

    return {"targets": entries, "comparison": compare(entries)}
