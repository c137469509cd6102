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
from analyzer.canon import Canonicalizer, Payload, first_changed
from analyzer.causes import Cause, classify, payload_cause, server_facts, server_miss
from analyzer.divergence import SegmentCounter, common_prefix_len, compare
from analyzer.load import Request, load, share_prefix
from analyzer.render import GenericRenderer, Rendered, make_renderer
from analyzer.sessions import SessionGrouper
from analyzer.tokens import Tokenizer, as_tokenizer
from prefixtrace.errors import InvalidRequest
from prefixtrace.wire.normalize import ChatNormalizer, UnreadableBody

DISAGREE_FRACTION = 0.10
_MAX_UNRENDERED = 32  # unrendered message changes put back per break before giving up (one render each)
PARALLEL_MIN_REQUESTS = 200  # below this, forking costs more than it saves  # reported vs predicted cached share of the prompt


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
    saves_tokens: int = 0  # tokens a cache would have served had the prompt only grown
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

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "brk"}
        d["break"] = self.brk.to_dict() if self.brk else None
        return d


def _totals(turns: Iterable[TurnResult], rate: float | None) -> dict[str, Any]:
    """Sums per cause. Seconds follow the turns' own figure (block-aligned when
    a block size was given), so they add up to the turns' `reprefill_seconds`."""
    by_cause: dict[str, dict[str, Any]] = {}
    total = reprefill = 0
    seconds = 0.0
    for t in turns:
        total += t.prompt_tokens or 0
        reprefill += t.reprefill_tokens or 0
        seconds += t.reprefill_seconds or 0.0
        if t.brk:
            c = by_cause.setdefault(t.brk.cause, {"breaks": 0, "reprefill_tokens": 0})
            c["breaks"] += 1
            c["reprefill_tokens"] += t.reprefill_tokens or 0
            if rate:
                c["seconds"] = round(c.get("seconds", 0.0) + (t.reprefill_seconds or 0.0), 1)
    return {"prompt_tokens": total, "reprefill_tokens": reprefill,
            "reprefill_seconds": round(seconds, 1) if rate else None,
            "by_cause": dict(sorted(by_cause.items(), key=lambda kv: -kv[1]["reprefill_tokens"]))}


@dataclass
class SessionResult:
    id: str
    inferred: bool
    turns: list[TurnResult] = field(default_factory=list)
    parent: str | None = None  # a side request (fork) of this main chain: not a break of it
    side_reason: str | None = None  # why it shares nothing with the main chain: "replaces the system prompt"

    @property
    def kind(self) -> str:
        return "side_request" if self.parent is not None else "main"

    def to_dict(self, rate: float | None = None) -> dict[str, Any]:
        return {"id": self.id, "inferred": self.inferred, "kind": self.kind, "parent": self.parent,
                "side_reason": self.side_reason, "turns": [t.to_dict() for t in self.turns],
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
    # Which renderer and tokenizer counted the prompts: "recorded" (the server's own, from the database),
    # "given" (--template/--model/--tokenizer) or "fallback" (generic ChatML, o200k), and in words,
    # on fallback with how to give the right one (docs/ANALYZER.md "The server's renderer").
    renderer_source: str = "fallback"
    renderer_note: str = ""

    @property
    def breaks(self) -> list[tuple[SessionResult, TurnResult]]:
        return [(s, t) for s in self.sessions for t in s.turns if t.brk]

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
            first = next((f"line {d.get('line')}: {d['error']}" for d in self.skipped), None) or next(
                (f"session {s.id} turn {t.index} (line {t.line}): {t.note}" for s in self.sessions for t in s.turns
                 if t.note.startswith("unrenderable")), "")
            out.append(f"first: {first}")
        elif c["analysed"] == 0:
            out.append(f"all {c['failed_requests']} request(s) failed (status >= 400): no prompt to analyse")
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
            **({"what_if": self.what_if} if self.what_if else {}),
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
        # and every body is read into the one chat shape (prefixtrace/wire/normalize.py).
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
        for s in sessions:
            if s.parent is not None and s.turns:
                first = s.turns[0]
                first.note = (f"side request of {s.parent}: re-prefilled {first.reprefill_tokens or 0:,} tokens "
                              f"because it {s.side_reason}; {SIDE_REQUEST}") if first.note == "first" else first.note
        skipped.sort(key=lambda d: (d.get("line") is None, d.get("line") or 0))
        return Report(self.tokenizer.name, self.renderer.name, self.block_size, self.prefill_rate, sessions,
                      skipped, failed)

    def walk(self, requests: list[Request], payloads: list[Payload | None]) -> list[TurnResult]:
        """The turns of one session, in order."""
        turns: list[TurnResult] = []
        prev: _State | None = None
        for req, payload in zip(requests, payloads):
            turn = TurnResult(len(turns), req.id, req.ts if req.ts_given else None, req.line, None, None, None,
                              req.reported_prompt_tokens, req.reported_cached_tokens)
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
        path = cause.path
        if index is not None and holder.source_index is not None and index < len(holder.source_index):
            # A translated body (Messages, Responses): name the client's own message index.
            source = holder.source_index[index]
            root = "$.system" if source is None else f"$.messages[{source}]"
            if path and path.startswith(f"$.messages[{index}]"):
                path = root + path[len(f"$.messages[{index}]"):]
            index = source
        turn.brk = Break(cause.cause, cause.subtype, index, role, offset, turn.common_prefix_tokens, before, after,
                         path, cause.tool_index, cause.tool_name, suggestion(cause.cause, cause.subtype),
                         max(0, min(prev.tokens, turn.prompt_tokens or 0) - turn.common_prefix_tokens))

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
        if self.prefill_rate:
            turn.reprefill_seconds = round((turn.block_reprefill_tokens or turn.reprefill_tokens) / self.prefill_rate, 2)
        if turn.reported_cached_tokens is not None:
            # Compare shares, not counts: the server's tokenizer is not ours.
            reported_total = turn.reported_prompt_tokens or turn.prompt_tokens or 1
            share_r = turn.reported_cached_tokens / max(1, reported_total)
            share_p = predicted / max(1, turn.prompt_tokens)
            turn.cached_disagrees = abs(share_r - share_p) > DISAGREE_FRACTION


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
            what_if: list[str] | str | None = None, kv_budget: int | None = None) -> Report:
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
    """
    given = renderer is not None or template is not None or model is not None
    renderer = renderer or make_renderer(template, model)
    if tokenizer is None and model is not None and (Path(model) / "tokenizer.json").is_file():
        tokenizer = str(Path(model) / "tokenizer.json")
    from analyzer.whatif import parse_policies, what_if as price_all

    policies = parse_policies(what_if) if isinstance(what_if, str) or what_if is None else parse_policies(",".join(what_if))
    if kv_budget is not None and kv_budget <= 0:
        raise InvalidRequest("--kv-budget must be positive")
    loaded = load(source)
    from analyzer.server_renderer import choose_renderer

    choice = choose_renderer(loaded, renderer if given else None, tokenizer)
    analyzer = Analyzer(choice.renderer, choice.tokenizer, block_size=block_size, prefill_rate=prefill_rate,
                        workers=workers)
    analyzer.exact_counts = choice.exact
    report = analyzer.run(loaded.requests, loaded.skipped)
    report.renderer_source, report.renderer_note = choice.source, choice.note
    if policies:
        report.what_if = price_all(report, policies, block_size=block_size, kv_budget=kv_budget)
    return report
