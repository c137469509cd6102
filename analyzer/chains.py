"""The chains: per session and turn, did the prompt extend the previous one, where
did it break, why, and how many tokens it lost (`Analyzer`).

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
from dataclasses import dataclass
from typing import Any

from analyzer.advice import SIDE_REQUEST, suggestion
from analyzer.canon import Canonicalizer, Payload, first_changed, flatten_content
from analyzer.causes import Cause, classify, marked_compaction, payload_cause, server_facts, server_miss
from analyzer.costing import price_breaks
from analyzer.divergence import SegmentCounter, common_prefix_len, compare, diff_window
from analyzer.load import Request, share_prefix
from analyzer.render import GenericRenderer, Rendered
from analyzer.results import Break, Report, SessionResult, TurnResult
from analyzer.rule_breaks import RuleBreaks, request_facts
from analyzer.server_counts import (PARTIAL_LOSS_MIN, asked_long_lifetime, input_fell, reasoning_drop_text,
                                    server_lost, too_short_to_cache)
from analyzer.sessions import SessionGrouper
from analyzer.tokens import Tokenizer, as_tokenizer
from prefixtrace.common.errors import InvalidRequest
from prefixtrace.wire.normalize import ChatNormalizer, UnreadableBody

DISAGREE_FRACTION = 0.10  # reported vs predicted cached share of the prompt
_MAX_UNRENDERED = 32  # unrendered message changes put back per break before giving up (one render each)
PARALLEL_MIN_REQUESTS = 200  # below this, forking costs more than it saves


@dataclass
class _State:
    payload: Payload
    rendered: Rendered
    tokens: int
    req: Request | None = None


class Analyzer:
    """Holds the per-run caches; `run(requests)` returns a Report."""

    def __init__(self, renderer=None, tokenizer: Tokenizer | str | None = None, *, block_size: int | None = None,
                 prefill_rate: float | None = None, workers: int | None = None,
                 min_partial_loss: int = PARTIAL_LOSS_MIN):
        if block_size is not None and block_size <= 0:
            raise InvalidRequest("--block-size must be positive")
        if min_partial_loss < 0:
            raise InvalidRequest("--min-partial-loss must not be negative")
        self.min_partial_loss = min_partial_loss
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
            request_facts(req)  # what only the body as sent and its headers say (analyzer/rule_breaks.py)
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
                s.transcript = {k: found.get(k) for k in ("harness", "file", "version", "not_rebuilt")}
        for s in sessions:
            if s.parent is not None and s.turns:
                first = s.turns[0]
                first.note = (f"side request of {s.parent}: re-prefilled {first.reprefill_tokens or 0:,} tokens "
                              f"because it {s.side_reason}; {SIDE_REQUEST}") if first.note == "first" else first.note
        skipped.sort(key=lambda d: (d.get("line") is None, d.get("line") or 0))
        price_breaks(sessions, self.prefill_rate)
        return Report(self.tokenizer.name, self.renderer.name, self.block_size, self.prefill_rate, sessions,
                      skipped, failed)

    def walk(self, requests: list[Request], payloads: list[Payload | None],
             rules: RuleBreaks | None = None) -> list[TurnResult]:
        """The turns of one session, in order. `rules`: the session's walk of the providers' rules when it
        goes on from an earlier call (the live dashboard walks a session a pair of turns at a time)."""
        turns: list[TurnResult] = []
        prev: _State | None = None
        rules = rules or RuleBreaks(self.tokenizer)  # the providers' rules past the rendered prompt, per session
        counted: Request | None = None  # the latest request the server counted (usage with a prompt)
        for req, payload in zip(requests, payloads):
            if req.reported_prompt_tokens == 0:
                # A failed or aborted call's usage (all zeros), not a prompt the server counted.
                req.reported_prompt_tokens = req.reported_cached_tokens = None
            turn = TurnResult(len(turns), req.id, req.ts if req.ts_given else None, req.line, None, None, None,
                              req.reported_prompt_tokens, req.reported_cached_tokens)
            turn.ttft_s = req.ttft_s
            turn.harness, turn.harness_version = req.harness, req.harness_version
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
            rebuilt = req.transcript is not None or (req.upstream or "").startswith("transcript:")
            if prev is None:
                turn.note, turn.common_prefix_tokens = "first", 0
            else:
                self._compare(turn, prev, payload, rendered, req.body)
                if turn.brk is not None and marked_compaction(req, prev.req) and turn.brk.cause != "compaction":
                    turn.brk.cause, turn.brk.subtype, turn.brk.volatile = "compaction", None, None
                    turn.brk.suggestion = suggestion("compaction", None, None, turn.brk.location())
                if turn.brk is None:  # the shared prefix reaches into what the previous turn left cached
                    turn.common_prefix_tokens += self._reach(prev, rendered)
                rules.name(turn, prev, turns[-2], payload, rendered, req)
            rules.after(turn, prev, payload, req)
            turn.reprefill_tokens = tokens - turn.common_prefix_tokens
            self._cost(turn)
            if rebuilt:  # a rebuilt prompt lacks the system prompt and tools: its share is not the server's
                turn.cached_disagrees = None
            if prev is not None and turn.brk is None:
                self._server_miss(turn, prev, req, payload, counted)
            elif prev is not None and not self.exact_counts and (lost := server_lost(counted, req)) is not None:
                # The server's own counts win over the rebuilt prompt's (docs/ANALYZER.md "Cost").
                turn.lost_tokens, turn.lost_tokens_basis = lost, "server"
            prev = _State(payload, rendered, tokens, req)
            # A break the server did not count (a failed compaction call) leaves nothing to compare with.
            counted = req if req.reported_prompt_tokens is not None else None if turn.brk is not None else counted
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

    def _server_miss(self, turn: TurnResult, prev: _State, req: Request, payload: Payload,
                     counted: Request | None = None) -> None:
        """An append-only turn whose reported cached tokens fall short of the prediction lost its prefix on
        the server: a `server_miss` break (analyzer/causes.py names the subtype). Counts compare as numbers
        when the tokenizer is the server's and this turn's prompt counts agree; otherwise as shares of the
        prompt, by more than DISAGREE_FRACTION (another tokenizer's counts differ by a few percent). Where
        both requests carry the server's own counts, a loss of `min_partial_loss` tokens or more by those
        counts is a miss whatever its share, and what it cost is that count."""
        reported, predicted, prev_req = turn.reported_cached_tokens, turn.predicted_cached_tokens, prev.req
        if reported is None or not predicted or prev_req is None:
            return
        exact = self.exact_counts and turn.prompt_tokens == turn.reported_prompt_tokens
        # The server's tokenizer and renderer count the same tokens and also see the reply's (`_reach`).
        # `counted`: the latest earlier request with the server's counts (a failed call between reports none).
        by_server = None if exact else server_lost(counted, req)
        if by_server is not None and too_short_to_cache(counted, req):
            return
        if exact:
            short = predicted - reported
        elif by_server is not None:
            # The server's own counts decide: a loss of over DISAGREE_FRACTION of its prompt, or of
            # `min_partial_loss` tokens or more, whatever its share.
            share = by_server / max(1, turn.reported_prompt_tokens or 1)
            short = by_server if by_server >= max(1, self.min_partial_loss) or share > DISAGREE_FRACTION else 0
        else:
            total = turn.reported_prompt_tokens or turn.prompt_tokens or 1
            beyond_share = reported / max(1, total) < predicted / max(1, turn.prompt_tokens or 1) - DISAGREE_FRACTION
            short = max(0, predicted - round(reported * (turn.prompt_tokens or 0) / max(1, total))) \
                if beyond_share else 0
        if short <= 1:  # an engine always computes the last prompt token again (it needs its logits): an
            return      # identical prompt is served n-1 tokens from cache, which is no miss
        appended = payload.messages[len(prev.payload.messages):]
        fell = input_fell(counted, req)
        if fell is not None and by_server:
            new_user = any(isinstance(m, dict) and m.get("role") == "user" for m in appended)
            subtype, why = "reasoning_drop", reasoning_drop_text(fell, new_user)
        else:
            subtype, why = server_miss(prev_req, req, ttl_1h=asked_long_lifetime(req) or asked_long_lifetime(prev_req))
        if by_server is not None:
            turn.lost_tokens_basis = "server"
            short = by_server
            # The re-prefill in the analysis's own tokens: the server's lost share of this prompt.
            kept = round((reported / max(1, turn.reported_prompt_tokens or 1)) * (turn.prompt_tokens or 0))
            turn.reprefill_tokens = max(0, (turn.prompt_tokens or 0) - kept)
        else:
            turn.lost_tokens_basis = "exact" if exact else "estimate"
            # What it cost is what the server re-prefilled past what it kept, not the prediction's tail.
            turn.reprefill_tokens = (turn.prompt_tokens or 0) - (predicted - short)
        # The two sides in one unit: the server's own counts where it gave them.
        before, after = (f"previous prompt, by the server's count: {counted.reported_prompt_tokens:,} tokens",
                         f"read from cache, by the server's count: {reported:,} tokens") if by_server is not None \
            else (f"predicted cached (the analysis' tokens): {predicted:,} tokens",
                  f"reported cached (the server's tokens): {reported:,} tokens")
        turn.brk = Break("server_miss", subtype, None, None, 0, reported, before, after,
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
            turn.lost_tokens_basis = "exact" if self.exact_counts else "estimate"
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

