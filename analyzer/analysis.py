"""The analysis: per session and turn, did the prompt extend the previous one,
where did it break, why, and what did it cost.

One pass over the requests in time order. Per session only the previous
turn's payload and rendering are kept, so memory stays flat however long the
recording. Order of work per request, cheapest first: payload keys (cached
per message object), session, render (sentinel skeleton), compare segments
(identity first), tokenize only new segments and the break window.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analyzer.advice import SIDE_REQUEST, suggestion
from analyzer.canon import Canonicalizer, Payload, first_changed, flatten_content
from analyzer.causes import Cause, classify, payload_cause, server_facts, server_miss
from analyzer.divergence import SegmentCounter, common_prefix_len, compare, diff_window
from analyzer.load import Request, load, share_prefix
from analyzer.render import GenericRenderer, Rendered, make_renderer
from analyzer.sessions import SessionGrouper
from analyzer.tokens import Tokenizer, as_tokenizer
from common.errors import InvalidRequest
from wire.normalize import ChatNormalizer, UnreadableBody

DISAGREE_FRACTION = 0.10  # reported vs predicted cached share of the prompt
_MAX_UNRENDERED = 32  # unrendered message changes put back per break before giving up (one render each)
PARALLEL_MIN_REQUESTS = 200  # below this, forking costs more than it saves
HIT_SHARE = 0.5  # a turn served at least this share of its prompt from cache is a cache hit (seconds, "Cost")
MIN_PREFILL = 64  # uncached tokens a turn must prefill to measure a prefill rate from its TTFT


@dataclass
class Break:
    cause: str
    subtype: str | None
    message_index: int | None
    role: str | None
    char_offset: int
    token_offset: int
    before: str
    after: str
    path: str | None = None  # payload-level JSON path (deepdiff), when the client changed something
    tool_index: int | None = None  # tools: the first tool that differs, and its name
    tool_name: str | None = None
    suggestion: str = ""  # what the harness author can do (analyzer/advice.py)
    saves_tokens: int = 0  # detail: the turn's `lost_tokens` before any block rounding
    message_char_offset: int | None = None  # char offset inside the message's own content (not the rendering)
    diff: dict | None = None  # {"before", "after", "start", "before_end", "after_end", "offset"}: divergence.diff_window
    volatile: dict | None = None  # {"kind", "before", "after"} when only a volatile value changed (causes.volatile_change)
    detail: str | None = None  # server_miss: why the server lost the prefix, in words (analyzer/causes.py)

    def where(self) -> str:
        """"message 2 (user)", "tools[0] (read)", "the request parameters"."""
        if self.cause == "server_miss":
            return "the server's cache"
        if self.tool_index is not None or self.cause == "tools_change":
            return f"tools[{self.tool_index}] ({self.tool_name})"
        if self.message_index is None and self.role == "system":
            return "the system prompt"
        if self.message_index is None:
            return "the request parameters" if self.cause == "param_change" else "the rendered head"
        return f"message {self.message_index} ({self.role})"

    def location(self) -> str:
        """`where()` with the char offset inside that message: "message 0 (system), char 53"."""
        if self.message_char_offset is not None and (self.message_index is not None or self.role == "system"):
            return f"{self.where()}, char {self.message_char_offset:,}"
        return self.where()

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class TurnResult:
    index: int
    request_id: str
    ts: float | None  # None: the record had no time
    line: int | None
    prompt_tokens: int | None  # analysis tokenizer, whole rendering
    common_prefix_tokens: int | None
    reprefill_tokens: int | None
    reported_prompt_tokens: int | None
    reported_cached_tokens: int | None  # None = the server did not say (unknown, not a miss)
    predicted_cached_tokens: int | None = None  # block-aligned when --block-size
    block_reprefill_tokens: int | None = None
    reprefill_seconds: float | None = None
    cached_disagrees: bool | None = None  # None when nothing was reported
    brk: Break | None = None
    payload_change: str | None = None  # what the payload diff saw, even when the render did not break
    note: str = ""  # "first", "unrenderable: …"
    model: str | None = None  # the request's `model` (what-if pricing reads per-model rules)
    # The provider's own cache figures beside the analysis (docs/ANALYZER.md "Server-side misses"):
    reported_cache_read_tokens: int | None = None  # Anthropic cache_read_input_tokens / OpenAI cached_tokens
    reported_cache_write_tokens: int | None = None  # Anthropic cache_creation_input_tokens
    server_miss_reason: str | None = None  # Anthropic cache diagnostics' cache_miss_reason type
    served_by: str | None = None  # the upstream member or engine that answered, when recorded
    lost_dollars: float | None = None  # with --price-model: the break's lost tokens at input minus cache-read rates
    lost_seconds: float | None = None  # THE cost of this turn's break in seconds, from the recorded timings by default
    lost_seconds_basis: str | None = None  # how `lost_seconds` was found (or why it could not be)
    lost_tokens: int | None = None  # the same cost in tokens (docs/ANALYZER.md "Cost")
    ttft_s: float | None = None  # the turn's recorded time to first token

    @property
    def number(self) -> int:
        """1-based: "turn 3" is the session's third request, everywhere a person reads it (`index` is 0-based)."""
        return self.index + 1

    def to_dict(self) -> dict[str, Any]:
        d = {"index": self.index, "number": self.number}
        d.update((k, v) for k, v in self.__dict__.items() if k != "brk")
        d["break"] = self.brk.to_dict() if self.brk else None
        return d


def _totals(turns: Iterable[TurnResult], rate: float | None) -> dict[str, Any]:
    """Sums per cause. The cost of the breaks is `lost_tokens` / `lost_seconds` (the one cost, summed;
    seconds over the breaks that could be priced, `priced` of them). `reprefill_tokens` (appends
    included) and, with --prefill-rate, `seconds` / `reprefill_seconds` are details."""
    by_cause: dict[str, dict[str, Any]] = {}
    total = reprefill = lost = breaks = priced = 0
    seconds = lost_s = 0.0
    for t in turns:
        total += t.prompt_tokens or 0
        reprefill += t.reprefill_tokens or 0
        seconds += t.reprefill_seconds or 0.0
        if t.brk:
            c = by_cause.setdefault(t.brk.cause, {"breaks": 0, "lost_seconds": None, "lost_tokens": 0,
                                                  "priced": 0, "reprefill_tokens": 0})
            c["breaks"] += 1
            breaks += 1
            c["lost_tokens"] += t.lost_tokens or 0
            lost += t.lost_tokens or 0
            if t.lost_seconds is not None:
                c["lost_seconds"] = round((c["lost_seconds"] or 0.0) + t.lost_seconds, 2)
                c["priced"] += 1
                lost_s += t.lost_seconds
                priced += 1
            c["reprefill_tokens"] += t.reprefill_tokens or 0
            if rate:
                c["seconds"] = round(c.get("seconds", 0.0) + (t.reprefill_seconds or 0.0), 1)
    order = sorted(by_cause.items(), key=lambda kv: (-(kv[1]["lost_seconds"] or 0.0), -kv[1]["lost_tokens"]))
    return {"breaks": breaks, "lost_seconds": round(lost_s, 2) if priced else None, "lost_tokens": lost,
            "priced": priced, "prompt_tokens": total, "reprefill_tokens": reprefill,
            "reprefill_seconds": round(seconds, 1) if rate else None, "by_cause": dict(order)}


def break_order(t: TurnResult) -> tuple[float, int]:
    """Biggest first: by seconds lost, then tokens lost."""
    return (-(t.lost_seconds or 0.0), -(t.lost_tokens or 0))


@dataclass
class SessionResult:
    id: str
    inferred: bool
    turns: list[TurnResult] = field(default_factory=list)
    parent: str | None = None  # a side request (fork) of this main chain: not a break of it
    side_reason: str | None = None  # why it shares nothing with the main chain: "replaces the system prompt"
    # Rebuilt from a harness transcript, not recorded: {"harness", "file", "not_rebuilt": [...]}
    transcript: dict | None = None

    @property
    def kind(self) -> str:
        return "side_request" if self.parent is not None else "main"

    def to_dict(self, rate: float | None = None) -> dict[str, Any]:
        return {"id": self.id, "inferred": self.inferred, "kind": self.kind, "parent": self.parent,
                "side_reason": self.side_reason, "transcript": self.transcript,
                "turns": [t.to_dict() for t in self.turns],
                "totals": _totals(self.turns, rate)}


@dataclass
class Report:
    tokenizer: str
    renderer: str
    block_size: int | None
    prefill_rate: float | None
    sessions: list[SessionResult]
    skipped: list[dict]
    failed: list[dict] = field(default_factory=list)  # requests the server refused (status >= 400): not chained
    what_if: list[dict] = field(default_factory=list)  # analyzer/whatif.py: the traffic priced under other caches
    pricing: dict | None = None  # analyzer/pricing.py: the rates dollars were computed with (--price-model)
    # Which renderer and tokenizer counted the prompts: "recorded" (the server's own, from the database),
    # "given" (--template/--model/--tokenizer) or "fallback" (generic ChatML, o200k), and in words,
    # on fallback with how to give the right one (docs/ANALYZER.md "The server's renderer").
    renderer_source: str = "fallback"
    renderer_note: str = ""

    @property
    def breaks(self) -> list[tuple[SessionResult, TurnResult]]:
        return [(s, t) for s in self.sessions for t in s.turns if t.brk]

    def top_breaks(self, n: int = 10) -> list[tuple[SessionResult, TurnResult]]:
        """The `n` costliest breaks: by seconds lost, then tokens lost."""
        return sorted(self.breaks, key=lambda st: break_order(st[1]))[:n]

    def coverage(self) -> dict[str, Any]:
        """How much of the input was analysed: never a silent zero (docs/ANALYZER.md)."""
        turns = [t for s in self.sessions for t in s.turns]
        unrenderable = [t for t in turns if t.note.startswith("unrenderable")]
        total = len(turns) + len(self.skipped) + len(self.failed)
        return {"input": total, "analysed": len(turns) - len(unrenderable), "skipped_lines": len(self.skipped),
                "unrenderable_turns": len(unrenderable), "failed_requests": len(self.failed),
                "not_analysed": len(self.skipped) + len(unrenderable)}

    def warnings(self) -> list[str]:
        """The lines every format prints first when part of the input was not analysed."""
        c = self.coverage()
        out = []
        if c["input"] == 0:
            out.append("no request found in the input: nothing was analysed")
        elif c["not_analysed"]:
            out.append(f"{c['not_analysed']} of {c['input']} request(s) not analysed: {c['skipped_lines']} line(s) "
                       f"could not be read, {c['unrenderable_turns']} turn(s) could not be rendered")
            # Skipped lines are listed one by one by every format; an unrenderable turn only in its table row.
            if not self.skipped:
                first = next((f"session {s.id} turn {t.number} (line {t.line}): {t.note}" for s in self.sessions
                              for t in s.turns if t.note.startswith("unrenderable")), "")
                out.append(f"first: {first}")
        elif c["analysed"] == 0:
            out.append(f"all {c['failed_requests']} request(s) failed (status >= 400): no prompt to analyse")
        rebuilt = [s for s in self.sessions if s.transcript]
        if rebuilt:
            out.append(f"{len(rebuilt)} session(s) rebuilt from harness transcripts, not recorded traffic: "
                       "each lists what its transcript does not hold")
        return out

    def too_much_unread(self, max_unreadable: str | int | float | None = 0) -> bool:
        """True when more than `max_unreadable` of the input could not be analysed: a count, or a
        share like "5%". Empty input (or only failed requests) always counts as too much."""
        c = self.coverage()
        if c["analysed"] == 0:
            return True
        limit = parse_threshold(max_unreadable, c["input"])
        return c["not_analysed"] > limit

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "warnings": self.warnings(),
            "coverage": self.coverage(),
            "tokenizer": self.tokenizer,
            "renderer": self.renderer,
            "renderer_source": self.renderer_source,
            "renderer_note": self.renderer_note,
            "block_size": self.block_size,
            "prefill_rate": self.prefill_rate,
            "skipped_lines": self.skipped,
            "failed_requests": self.failed,
            "sessions": [s.to_dict(self.prefill_rate) for s in self.sessions],
            "totals": _totals((t for s in self.sessions for t in s.turns), self.prefill_rate),
            "top_breaks": [{"session": s.id, "turn": t.number, "cause": t.brk.cause, "subtype": t.brk.subtype,
                            "where": t.brk.location(), "lost_seconds": t.lost_seconds, "lost_tokens": t.lost_tokens,
                            "lost_seconds_basis": t.lost_seconds_basis} for s, t in self.top_breaks()],
            **({"what_if": self.what_if} if self.what_if else {}),
            **({"pricing": self.pricing} if self.pricing else {}),
        }


def parse_threshold(value: str | int | float | None, total: int) -> float:
    """`--max-unreadable`: a count ("3") or a share of the input ("5%")."""
    if value is None:
        return 0.0
    if isinstance(value, str):
        text = value.strip()
        try:
            if text.endswith("%"):
                share = float(text[:-1])
                if not 0 <= share <= 100:
                    raise ValueError
                return total * share / 100
            value = float(text)
        except ValueError:
            raise InvalidRequest(f"--max-unreadable must be a count or a percentage like 5%, got {value!r}") from None
    if value < 0 or value != value:
        raise InvalidRequest(f"--max-unreadable must not be negative, got {value!r}")
    return float(value)


@dataclass
class _State:
    payload: Payload
    rendered: Rendered
    tokens: int
    req: Request | None = None


class Analyzer:
    """Holds the per-run caches; `run(requests)` returns a Report."""

    def __init__(self, renderer=None, tokenizer: Tokenizer | str | None = None, *, block_size: int | None = None,
                 prefill_rate: float | None = None, workers: int | None = None):
        if block_size is not None and block_size <= 0:
            raise InvalidRequest("--block-size must be positive")
        if prefill_rate is not None and prefill_rate <= 0:
            raise InvalidRequest("--prefill-rate must be positive")
        self.renderer = renderer or GenericRenderer()
        self.tokenizer = as_tokenizer(tokenizer)
        self.counter = SegmentCounter(self.tokenizer)
        self.canon = Canonicalizer()
        self.wire = ChatNormalizer()
        self.block_size, self.prefill_rate = block_size, prefill_rate
        self.workers = workers if workers is not None else min(2, os.cpu_count() or 1)
        self._short_ids: dict[str, list[int]] = {}
        self.exact_counts = False  # the tokenizer is the server's: reported and predicted counts compare as numbers

    def run(self, requests: list[Request], skipped: list[dict] | None = None) -> Report:
        # Phase 0: requests the server refused are listed, not chained (no prompt was cached for them),
        # and every body is read into the one chat shape (wire/normalize.py).
        failed = [{"request_id": r.id, "line": r.line, "ts": r.ts if r.ts_given else None, "status": r.status,
                   "session": r.session, "endpoint": r.endpoint, "error": (r.error or "")[:300]}
                  for r in requests if r.status is not None and r.status >= 400]
        if failed:
            requests = [r for r in requests if r.status is None or r.status < 400]
        skipped = list(skipped or [])
        readable = []
        for i, req in enumerate(requests):
            try:
                req.body = self.wire.to_chat(req.body, req.endpoint)
            except UnreadableBody as exc:  # reported per line with the reason, like a malformed line
                req.unreadable = str(exc)
                skipped.append({"line": req.line, "request_id": req.id, "error": req.unreadable})
                continue
            readable.append(req)
        requests = readable
        # Phase 1, in order: payload keys and sessions (cheap, and inference is sequential).
        grouper = SessionGrouper(split_forks=True)
        payloads: list[Payload | None] = []
        last: dict[str, Payload] = {}
        for i, req in enumerate(requests):
            payload = self.canon.payload(req.body)  # every body here was read (phase 0)
            # Roles: session inference and side-request chains read where the system head ends.
            roles = [str(m.get("role")) if isinstance(m, dict) else "" for m in payload.messages]
            sess = grouper.add(i, req.session, payload.keys, roles, payload.tools_key, payload.chars)
            prev = last.get(id(sess))
            if prev is not None:
                payload.messages = share_prefix(prev.messages, payload.messages)
                if "system" not in req.body and isinstance(req.body.get("messages"), list):
                    req.body = {**req.body, "messages": payload.messages}
            last[id(sess)] = payload  # by object: finish() may still rename chains
            payloads.append(payload)
        # Phase 2, per session (independent, so spread over processes): render, count, compare.
        grouped = grouper.finish()
        jobs = [(s.id, s.inferred, s.indices) for s in grouped]
        walked = _map_sessions(self, requests, payloads, jobs)
        sessions = [SessionResult(g.id, g.inferred, turns, g.parent, g.side_reason) for g, turns in zip(grouped, walked)]
        self._shared_starts(requests, payloads, [job[2] for job in jobs], sessions)
        origins = {r.id: r.transcript for r in requests if r.transcript is not None}
        for s in sessions:
            found = next((origins[t.request_id] for t in s.turns if t.request_id in origins), None)
            if found is not None:
                s.transcript = {k: found.get(k) for k in ("harness", "file", "not_rebuilt")}
        for s in sessions:
            if s.parent is not None and s.turns:
                first = s.turns[0]
                first.note = (f"side request of {s.parent}: re-prefilled {first.reprefill_tokens or 0:,} tokens "
                              f"because it {s.side_reason}; {SIDE_REQUEST}") if first.note == "first" else first.note
        skipped.sort(key=lambda d: (d.get("line") is None, d.get("line") or 0))
        price_breaks(sessions, self.prefill_rate)
        return Report(self.tokenizer.name, self.renderer.name, self.block_size, self.prefill_rate, sessions,
                      skipped, failed)

    def walk(self, requests: list[Request], payloads: list[Payload | None]) -> list[TurnResult]:
        """The turns of one session, in order."""
        turns: list[TurnResult] = []
        prev: _State | None = None
        for req, payload in zip(requests, payloads):
            turn = TurnResult(len(turns), req.id, req.ts if req.ts_given else None, req.line, None, None, None,
                              req.reported_prompt_tokens, req.reported_cached_tokens)
            turn.ttft_s = req.ttft_s
            turns.append(turn)
            try:
                if payload is None:
                    raise InvalidRequest(req.unreadable or "request body is not a JSON object")
                rendered = self.renderer.render(req.body)
            except InvalidRequest as exc:
                turn.note = f"unrenderable: {exc.message}"
                continue
            # The prompt as the server counts it: the rendering and the generation prompt after it.
            tokens = self.counter.total(rendered) + len(self._ids(rendered.generation))
            turn.prompt_tokens = tokens
            model = payload.params.get("model")
            turn.model = model if isinstance(model, str) else None
            server_facts(turn, req)
            if prev is None:
                turn.note, turn.common_prefix_tokens = "first", 0
            else:
                self._compare(turn, prev, payload, rendered, req.body)
                if turn.brk is None:  # the shared prefix reaches into what the previous turn left cached
                    turn.common_prefix_tokens += self._reach(prev, rendered)
            turn.reprefill_tokens = tokens - turn.common_prefix_tokens
            self._cost(turn)
            if prev is not None and turn.brk is None:
                self._server_miss(turn, prev.req, req)
            prev = _State(payload, rendered, tokens, req)
        return turns

    SHARED_START_CANDIDATES = 8  # earlier sessions a new session's first prompt is compared with

    def _shared_starts(self, requests: list[Request], payloads: list, indices: list[list[int]],
                       sessions: list[SessionResult]) -> None:
        """A session's first prompt may find its start cached by other sessions (one harness's system
        prompt and tools; a side request's shared conversation): the server's cache is shared. Its
        `predicted_cached_tokens` is the longest prefix it shares with what an earlier session left
        cached (that session's latest prompt before it, and its reply), among the latest few sessions
        that begin with the same first message (else the latest one: the template's opening tokens)."""
        first_of = {own[0]: n for n, own in enumerate(indices) if own}
        session_of = {i: n for n, own in enumerate(indices) for i in own}
        by_key: dict[Any, OrderedDict[int, int]] = {}  # first message key -> session -> its latest index so far
        latest: OrderedDict[int, int] = OrderedDict()  # any session -> its latest index so far
        renders: OrderedDict[int, Rendered] = OrderedDict()  # recent candidates' renderings, by index

        def render(i: int) -> Rendered | None:
            hit = renders.get(i)
            if hit is None:
                try:
                    hit = self.renderer.render(requests[i].body)
                except InvalidRequest:
                    return None
                renders[i] = hit
                if len(renders) > 4 * self.SHARED_START_CANDIDATES:
                    renders.popitem(last=False)
            return hit

        for i in sorted(session_of):
            n = session_of[i]
            key = tuple(payloads[i].keys[:1]) if payloads[i] is not None else None
            if i in first_of and sessions[n].turns and sessions[n].turns[0].prompt_tokens is not None and latest:
                same = by_key.get(key)
                candidates = list(reversed(same.values()))[: self.SHARED_START_CANDIDATES] if same else \
                    [next(reversed(latest.values()))]
                self._shared_start(sessions[n].turns[0], i, candidates, requests, payloads, render)
            if payloads[i] is not None:
                for table in (latest, by_key.setdefault(key, OrderedDict())):
                    table[n] = i
                    table.move_to_end(n)

    def _shared_start(self, first: TurnResult, index: int, candidates: list[int], requests, payloads, render) -> None:
        rendered = render(index)
        if rendered is None:
            return
        shared = 0
        for i in candidates:
            other = render(i)
            if other is None:
                continue
            cmp = compare(other, rendered, self.counter)
            n = cmp.common_tokens
            if cmp.append_only:
                n += self._reach(_State(payloads[i], other, 0, requests[i]), rendered)
            elif cmp.common_chars >= len(rendered.text) and rendered.generation:
                # This prompt is a start of the other one's: its generation prompt may be cached too.
                start = len(rendered.text)
                n += common_prefix_len(self._ids(rendered.generation),
                                       self.tokenizer(other.text[start : start + len(rendered.generation) + 64]))
            shared = max(shared, n)
        # A server recomputes at least a prompt's last token (it needs its logits).
        shared = min(shared, max(0, first.prompt_tokens - 1))
        if self.block_size:
            shared = shared // self.block_size * self.block_size
        first.predicted_cached_tokens = shared
        if first.reported_cached_tokens is not None:
            reported_total = first.reported_prompt_tokens or first.prompt_tokens or 1
            first.cached_disagrees = abs(first.reported_cached_tokens / max(1, reported_total)
                                         - shared / max(1, first.prompt_tokens)) > DISAGREE_FRACTION

    def _ids(self, text: str) -> list[int]:
        """Token ids of a short text (generation prompts: a handful per run), cached."""
        if not text:
            return []
        ids = self._short_ids.get(text)
        if ids is None:
            ids = self._short_ids[text] = list(self.tokenizer(text))
        return ids

    def _reach(self, prev: _State, rendered: Rendered) -> int:
        """Tokens past the previous rendering that the server's cache also holds for this prompt: the
        previous generation prompt and as much of the previous reply's own tokens (recorded by the
        engine) as this prompt repeats token for token. A template that renders the reply otherwise
        than the model wrote it (stripped reasoning, re-serialised tool calls) stops the reach there."""
        tail = self._ids(prev.rendered.generation) + list((prev.req.reply_token_ids if prev.req else None) or [])
        if not tail:
            return 0
        start = len(prev.rendered.text)
        text = rendered.text + rendered.generation
        if not text.startswith(prev.rendered.text):
            return 0
        window = text[start : start + 16 * len(tail) + 64]
        return common_prefix_len(self.tokenizer(window), tail)

    def _compare(self, turn: TurnResult, prev: _State, payload: Payload, rendered: Rendered, body: Any = None) -> None:
        model_changed = prev.payload.params.get("model") != payload.params.get("model")
        pc = None
        if first_changed(prev.payload.keys, payload.keys) != len(prev.payload.keys) or \
                prev.payload.tools_key != payload.tools_key or prev.payload.params != payload.params:
            pc = payload_cause(prev.payload, payload)
            turn.payload_change = f"{pc.cause}{'/' + pc.subtype if pc.subtype else ''} at {pc.path}" if pc else None
        cmp = compare(prev.rendered, rendered, self.counter)
        if cmp.append_only and not model_changed:
            turn.common_prefix_tokens = cmp.common_tokens
            return
        if cmp.append_only:  # another model: its server cache shares nothing with this one
            cause = Cause("param_change", "model", None, "$.model")
            turn.common_prefix_tokens = 0
            offset = 0
            before, after = f"model: {prev.payload.params.get('model')}", f"model: {payload.params.get('model')}"
            cmp.diff = diff_window(before, after, len("model: "))
        else:
            effective = payload
            if isinstance(body, dict) and cmp.message_index is not None and pc is not None and \
                    pc.cause not in ("param_change", "tools_change") and pc.tool_index is None:
                effective = self._rendered_changes(prev.payload, payload, body, rendered.text, cmp.message_index)
            cause = classify(prev.payload, effective, prev.rendered, rendered, cmp.message_index)
            turn.common_prefix_tokens = 0 if model_changed else cmp.common_tokens
            offset, before, after = cmp.common_chars, cmp.before, cmp.after
        index = cause.message_index if cause.message_index is not None else cmp.message_index
        if cause.cause in ("tools_change", "param_change") or cause.tool_index is not None or \
                (index is not None and index < 0):
            index = None  # not a message: the tools block or the request parameters
        holder = payload if index is not None and 0 <= index < len(payload.messages) and \
            cause.cause != "dropped_message" else prev.payload  # a dropped message is in prev only
        msgs = holder.messages
        role = msgs[index].get("role") if index is not None and 0 <= index < len(msgs) and isinstance(msgs[index], dict) else None
        char_in_message = None if index is None else _message_offset(
            prev.payload, payload, index, cause.cause, rendered, prev.rendered, offset)
        path = cause.path
        if index is not None and holder.source_index is not None and index < len(holder.source_index):
            # A translated body (Messages, Responses): name the client's own message index.
            source = holder.source_index[index]
            root = "$.system" if source is None else f"$.messages[{source}]"
            if path and path.startswith(f"$.messages[{index}]"):
                path = root + path[len(f"$.messages[{index}]"):]
            index = source
        turn.brk = Break(cause.cause, cause.subtype, index, role, offset, turn.common_prefix_tokens, before, after,
                         path, cause.tool_index, cause.tool_name, "",
                         max(0, min(prev.tokens, turn.prompt_tokens or 0) - turn.common_prefix_tokens),
                         char_in_message, cmp.diff, cause.volatile)
        turn.brk.suggestion = suggestion(cause.cause, cause.subtype, cause.volatile, turn.brk.location())

    def _rendered_changes(self, prev: Payload, payload: Payload, body: dict, text: str, break_index: int) -> Payload:
        """`payload` with the changed messages before the rendered break that the renderer does not render
        (rendering them as `prev` had them gives the same prompt) put back to `prev`'s: such a change is not
        a break (docs/ANALYZER.md), so it must not name the break that a later message caused."""
        messages, keys = list(payload.messages), list(payload.keys)
        base = {k: v for k, v in body.items() if k != "system"}  # `messages` already holds a top-level system
        for _ in range(_MAX_UNRENDERED):
            k = first_changed(prev.keys, keys)
            if k >= min(len(prev.keys), len(keys), break_index):
                break
            trial = [*messages[:k], prev.messages[k], *messages[k + 1:]]
            try:
                if self.renderer.render({**base, "messages": trial}).text != text:
                    break
            except InvalidRequest:
                break
            messages, keys = trial, [*keys[:k], prev.keys[k], *keys[k + 1:]]
        if len(messages) == len(payload.messages) and all(a is b for a, b in zip(messages, payload.messages)):
            return payload
        return Payload(messages, keys, payload.tools, payload.tools_key, payload.params, payload.chars)

    def _server_miss(self, turn: TurnResult, prev_req: Request | None, req: Request) -> None:
        """An append-only turn whose reported cached tokens fall short of the prediction lost its prefix on
        the server: a `server_miss` break (analyzer/causes.py names the subtype). Counts compare as numbers
        when the tokenizer is the server's and this turn's prompt counts agree; otherwise as shares of the prompt, by more than
        DISAGREE_FRACTION (another tokenizer's counts differ by a few percent)."""
        reported, predicted = turn.reported_cached_tokens, turn.predicted_cached_tokens
        if reported is None or not predicted or prev_req is None:
            return
        if self.exact_counts and turn.prompt_tokens == turn.reported_prompt_tokens:
            short = predicted - reported
            if short <= 0:
                return
        else:
            total = turn.reported_prompt_tokens or turn.prompt_tokens or 1
            if reported / max(1, total) >= predicted / max(1, turn.prompt_tokens or 1) - DISAGREE_FRACTION:
                return
            short = max(0, predicted - round(reported * (turn.prompt_tokens or 0) / max(1, total)))
        subtype, why = server_miss(prev_req, req, ttl_1h=req.cache_ttl_1h)
        # What it cost is what the server re-prefilled past what it kept, not the prediction's tail.
        turn.reprefill_tokens = (turn.prompt_tokens or 0) - (predicted - short)
        turn.brk = Break("server_miss", subtype, None, None, 0, reported, f"predicted cached: {predicted:,} tokens",
                         f"reported cached: {reported:,} tokens",
                         suggestion=suggestion("server_miss", subtype), saves_tokens=short, detail=why)

    def _cost(self, turn: TurnResult) -> None:
        predicted = turn.common_prefix_tokens
        if self.block_size:
            predicted = predicted // self.block_size * self.block_size
            turn.block_reprefill_tokens = turn.prompt_tokens - predicted
        turn.predicted_cached_tokens = predicted
        if turn.brk is not None:
            # The one cost (docs/ANALYZER.md "Cost"): what a cache would have served had this request only
            # extended the previous one (the previous prompt, at most this one's length), less what it served.
            ideal = turn.brk.saves_tokens + turn.common_prefix_tokens
            if self.block_size:
                ideal = ideal // self.block_size * self.block_size
            turn.lost_tokens = max(0, ideal - predicted)
        if self.prefill_rate:
            turn.reprefill_seconds = round((turn.block_reprefill_tokens or turn.reprefill_tokens) / self.prefill_rate, 2)
        if turn.reported_cached_tokens is not None:
            # Compare shares, not counts: the server's tokenizer is not ours.
            reported_total = turn.reported_prompt_tokens or turn.prompt_tokens or 1
            share_r = turn.reported_cached_tokens / max(1, reported_total)
            share_p = predicted / max(1, turn.prompt_tokens)
            turn.cached_disagrees = abs(share_r - share_p) > DISAGREE_FRACTION


def _text(msg: Any) -> str | None:
    if not isinstance(msg, dict):
        return None
    content = flatten_content(msg.get("content"))
    return content if isinstance(content, str) else None


def _message_offset(prev: Payload, payload: Payload, index: int, cause: str, rendered: Rendered,
                    prev_rendered: Rendered, offset: int) -> int | None:
    """The char offset of the first difference inside message `index`'s own content (not the rendering):
    from the two payloads when the content itself changed, else from the rendering when the difference
    falls inside that message's content there; None when it is outside any content (role markers,
    tool calls, the template's own text)."""
    if cause == "dropped_message":
        return 0  # the whole message is gone
    a = _text(prev.messages[index]) if index < len(prev.messages) else None
    b = _text(payload.messages[index]) if index < len(payload.messages) else None
    if a is not None and b is not None and a != b:
        return common_prefix_len(a, b)
    for r in (rendered, prev_rendered):
        pos = 0
        for seg, owner, kind in zip(r.segments, r.owners, r.kinds):
            if pos <= offset < pos + len(seg):
                if owner == index and kind == "content":
                    content = b if r is rendered else a
                    lead = content.find(seg) if content else -1
                    return offset - pos + max(0, lead)
                break
            pos += len(seg)
    return None


def price_breaks(sessions: list[SessionResult], prefill_rate: float | None) -> None:
    """Sets every break's `lost_seconds` and `lost_seconds_basis`, in this order of preference:

    1. `--prefill-rate`: lost_tokens / that rate;
    2. the turn's recorded TTFT against the median TTFT of (up to 3 of) this session's cache hits
       nearest in prompt size (append-only turns served mostly from cache): the extra wait;
    3. a prefill rate measured from this session's own turns (median of uncached tokens / TTFT over
       turns that prefilled at least MIN_PREFILL tokens): lost_tokens / that rate;
    4. the same rate measured from every session of the same model in the input;
    else None, with a basis that says how to give a rate."""
    def uncached(t: TurnResult) -> int | None:
        if t.prompt_tokens is None:
            return None
        if t.reported_cached_tokens is not None and t.reported_prompt_tokens:
            share = max(0, t.reported_prompt_tokens - t.reported_cached_tokens) / t.reported_prompt_tokens
            return round(share * t.prompt_tokens)
        return t.block_reprefill_tokens if t.block_reprefill_tokens is not None else t.reprefill_tokens

    def rate_of(turns: list[TurnResult]) -> float | None:
        rates = sorted(u / t.ttft_s for t in turns if t.ttft_s and t.ttft_s > 0
                       and (u := uncached(t)) is not None and u >= MIN_PREFILL)
        if not rates:
            return None
        mid = len(rates) // 2
        return rates[mid] if len(rates) % 2 else (rates[mid - 1] + rates[mid]) / 2

    def is_hit(t: TurnResult) -> bool:
        if t.brk is not None or t.ttft_s is None or not t.prompt_tokens or t.note:
            return False
        if t.reported_cached_tokens is not None and t.reported_prompt_tokens:
            return t.reported_cached_tokens >= HIT_SHARE * t.reported_prompt_tokens
        return (t.predicted_cached_tokens or 0) >= HIT_SHARE * t.prompt_tokens

    by_model: dict[str | None, float | None] = {}
    for s in sessions:
        for t in s.turns:
            if t.brk is not None and t.lost_tokens is None:
                # A break named after the cost pass (a server-side miss): its tokens are what the server
                # lost, `saves_tokens`, the same definition.
                t.lost_tokens = t.brk.saves_tokens
        breaks = [t for t in s.turns if t.brk is not None and t.lost_tokens is not None]
        if not breaks:
            continue
        hits = [t for t in s.turns if is_hit(t)]
        session_rate = rate_of(s.turns)
        for t in breaks:
            if prefill_rate:
                t.lost_seconds = round(t.lost_tokens / prefill_rate, 2)
                t.lost_seconds_basis = f"--prefill-rate {prefill_rate:,.0f} tok/s"
                continue
            if t.ttft_s is not None and hits:
                near = sorted(hits, key=lambda h: abs(h.prompt_tokens - (t.prompt_tokens or 0)))[:3]
                base = sorted(h.ttft_s for h in near)[len(near) // 2] if len(near) % 2 else \
                    sum(sorted(h.ttft_s for h in near)[len(near) // 2 - 1 : len(near) // 2 + 1]) / 2
                t.lost_seconds = round(max(0.0, t.ttft_s - base), 2)
                hits_text = "cache hit" if len(near) == 1 else f"{len(near)} cache hits"
                t.lost_seconds_basis = (f"TTFT {t.ttft_s:.2f} s against {base:.2f} s, the median TTFT of this "
                                        f"session's {hits_text} nearest in size")
                continue
            if session_rate:
                t.lost_seconds = round(t.lost_tokens / session_rate, 2)
                t.lost_seconds_basis = f"prefill rate {session_rate:,.0f} tok/s measured from this session's turns"
                continue
            if t.model not in by_model:
                by_model[t.model] = rate_of([u for x in sessions for u in x.turns if u.model == t.model])
            rate = by_model[t.model]
            if rate:
                t.lost_seconds = round(t.lost_tokens / rate, 2)
                t.lost_seconds_basis = f"prefill rate {rate:,.0f} tok/s measured from all recorded turns of this model"
            else:
                t.lost_seconds_basis = "no timings recorded: give --prefill-rate TOK_PER_S to price it in seconds"


_FORKED: tuple | None = None  # (analyzer, requests, payloads, jobs), inherited by forked workers


def _walk_job(j: int) -> list[TurnResult]:
    analyzer, requests, payloads, jobs = _FORKED
    indices = jobs[j][2]
    return analyzer.walk([requests[i] for i in indices], [payloads[i] for i in indices])


def _map_sessions(analyzer: Analyzer, requests, payloads, jobs) -> list[list[TurnResult]]:
    """Walks every session, in `analyzer.workers` forked processes when it
    pays (Linux, enough requests): workers inherit the parsed requests by
    fork, so nothing big is pickled, and only the small results come back."""
    global _FORKED
    workers = min(analyzer.workers, len(jobs))
    if workers <= 1 or len(requests) < PARALLEL_MIN_REQUESTS or sys.platform != "linux":
        return [_walk_job_local(analyzer, requests, payloads, job) for job in jobs]
    # Biggest sessions first, so the pool's queue balances the load.
    order = sorted(range(len(jobs)), key=lambda j: -len(jobs[j][2]))
    _FORKED = (analyzer, requests, payloads, jobs)
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = dict(zip(order, pool.map(_walk_job, order, chunksize=1)))
    finally:
        _FORKED = None
    return [results[j] for j in range(len(jobs))]


def _walk_job_local(analyzer: Analyzer, requests, payloads, job) -> list[TurnResult]:
    return analyzer.walk([requests[i] for i in job[2]], [payloads[i] for i in job[2]])


def analyze(source: str | Path | Iterable[Any], *, template: str | Path | None = None, model: str | Path | None = None,
            tokenizer: Tokenizer | str | None = None, block_size: int | None = None,
            prefill_rate: float | None = None, renderer=None, workers: int | None = None,
            what_if: list[str] | str | None = None, kv_budget: int | None = None,
            price_model: str | None = None, price_provider: str | None = None) -> Report:
    """Analyses a recorder database, a JSONL file, or an iterable of request
    bodies / Requests / recorder Turns.

    Args:
        template: a chat template file (.jinja).
        model: a model directory: its tokenizer_config.json chat template and,
            unless `tokenizer` is given, its tokenizer.json.
        tokenizer: a Tokenizer or spec ("regex", "tiktoken:NAME", a
            tokenizer.json path); default tiktoken o200k_base (offline copy).
        block_size: also report the block-aligned figures of a paged cache.
        prefill_rate: tokens per second, to price re-prefill in seconds.
        workers: processes for the per-session work (default: up to 2).
        what_if: also price the traffic under these caches ("vllm", "sglang", "anthropic", "openai";
            analyzer/whatif.py), with `block_size` as their block/page size and `kv_budget` tokens of KV.
        price_model: price in dollars as this model ("claude-sonnet-4-5", "gpt-5"; genai-prices'
            data, analyzer/pricing.py): each break's lost tokens and each what-if policy.
        price_provider: the provider whose price of `price_model` to use (default: genai-prices' match).
    """
    given = renderer is not None or template is not None or model is not None
    renderer = renderer or make_renderer(template, model)
    if tokenizer is None and model is not None and (Path(model) / "tokenizer.json").is_file():
        tokenizer = str(Path(model) / "tokenizer.json")
    from analyzer.whatif import parse_policies, what_if as price_all

    policies = parse_policies(what_if) if isinstance(what_if, str) or what_if is None else parse_policies(",".join(what_if))
    if kv_budget is not None and kv_budget <= 0:
        raise InvalidRequest("--kv-budget must be positive")
    sheet = None
    if price_model:
        from analyzer.pricing import price_sheet

        sheet = price_sheet(price_model, price_provider)
    loaded = load(source)
    from analyzer.server_renderer import choose_renderer

    choice = choose_renderer(loaded, renderer if given else None, tokenizer)
    analyzer = Analyzer(choice.renderer, choice.tokenizer, block_size=block_size, prefill_rate=prefill_rate,
                        workers=workers)
    analyzer.exact_counts = choice.exact
    report = analyzer.run(loaded.requests, loaded.skipped)
    report.renderer_source, report.renderer_note = choice.source, choice.note
    if policies:
        report.what_if = price_all(report, policies, block_size=block_size, kv_budget=kv_budget, sheet=sheet)
    if sheet is not None:
        report.pricing = sheet.to_dict()
        dollars_of_breaks(report, sheet)
    return report


def dollars_of_breaks(report: Report, sheet) -> None:
    """Each break's lost tokens in dollars (analyzer/pricing.py `lost_dollars`)."""
    for s in report.sessions:
        for t in s.turns:
            lost = getattr(t, "lost_tokens", None)
            if lost is None and t.brk is not None:
                lost = t.reprefill_tokens
            if t.brk is not None and lost:
                t.lost_dollars = round(sheet.lost_dollars(lost, t.prompt_tokens), 6)
