"""Breaks that the rendered prompt does not show: the providers' own rules (docs/ANALYZER.md
"Parameter breakers", "Lookback", "Races"), applied per session after the rendered comparison.

`request_facts` reads, once per request and before its body is read into the chat shape, what only the
body as sent and its headers say (cache parameters, Messages content blocks, the harness and version;
a hash-only body's stand-ins). `RuleBreaks` keeps one session's cache writes and names, on a turn the
rendering calls append-only (or a `param_change` it saw): `param_change/<parameter>`, `lookback`,
`concurrent`; and what opened each turn.
"""

from __future__ import annotations

from typing import Any

from analyzer.causes import summary_marks
from analyzer.divergence import diff_window
from analyzer.hashed import expand as expand_hashed
from analyzer.lookback import LOOKBACK_BLOCKS, cache_blocks, lookback_miss
from analyzer.lookback import fix_text as lookback_fix
from analyzer.param_breakers import cache_params, first_change, fix_text, kept_prefix
from analyzer.race import clock, race
from analyzer.race import fix_text as race_fix
from analyzer.results import Break, TurnResult
from analyzer.turn_kinds import opened_by
from analyzer.versions import harness_version
from prefixtrace.wire.responses import compaction_marks

MAX_WRITES = 64  # cache writes kept per session (the lookback needs only the newest)


def request_facts(req) -> None:
    """Fills `req` from its body as sent (call before the body is translated)."""
    req.body, req.hashed = expand_hashed(req.body)  # `serve --store hashes`: stand-ins for the texts
    req.cache_params = cache_params(req.body, req.endpoint, req.headers, req.upstream)
    req.cache_blocks = cache_blocks(req.body, req.endpoint)
    req.harness, req.harness_version = harness_version(req.headers, req.body, req.transcript)
    req.compactions = compaction_marks(req.body) | summary_marks(req.body)


def _carries_a_reply(prev, payload) -> bool:
    """Whether this request appends an assistant message to the previous one's: it then holds the previous
    reply and was sent after it, whatever the recorded times say (re-timed or skewed records)."""
    new = payload.messages[len(prev.keys):]
    return any(isinstance(m, dict) and m.get("role") == "assistant" for m in new)


class RuleBreaks:
    """One session's walk: `name` after the rendered comparison of a turn with a previous one, `after`
    for every turn. `prev` is the chain's state (payload, rendered, tokens, req)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.writes: list[int] = []  # block boundaries where the session's earlier requests wrote a cache

    def name(self, turn: TurnResult, prev, prev_turn: TurnResult, payload, rendered, req) -> None:
        self._param(turn, prev, req)
        if turn.brk is None and prev.req is not None and (prev.req.cache_params or {}).get("provider") == "anthropic":
            self._lookback(turn, payload, rendered, req)
        if turn.brk is None and not _carries_a_reply(prev.payload, payload):
            self._race(turn, prev_turn, prev.req, req)
        if turn.brk is not None and turn.brk.cause != "lookback":
            self.writes = []  # the prefix changed: earlier writes no longer match it

    def after(self, turn: TurnResult, prev, payload, req) -> None:
        blocks = req.cache_blocks
        if blocks is not None:
            turn.blocks = blocks.total
            # Each boundary once, newest last: the live dashboard walks a session a pair of turns at a time,
            # so it sees each turn twice.
            fresh = blocks.breakpoints
            self.writes = ([w for w in self.writes if w not in fresh] + fresh)[-MAX_WRITES:]
        prev_req = prev.req if prev is not None else None
        gap = req.ts - (prev_req.ts + (prev_req.total_s or 0.0)) if prev_req is not None and req.ts_given \
            and prev_req.ts_given else None
        turn.opened_by = opened_by(prev.payload if prev is not None else None, payload, turn.brk, gap)

    def _count(self, text: str) -> int:
        return len(self.tokenizer(text))

    def _param(self, turn: TurnResult, prev, req) -> None:
        """A provider-documented parameter that changed (analyzer/param_breakers.py): it names a
        `param_change` the rendering saw, and makes one of a turn the rendering calls append-only."""
        change = first_change(prev.req.cache_params if prev.req else None, req.cache_params)
        if change is None:
            return
        # Adding or removing the web search server tool is the toggle Anthropic documents.
        toggled = turn.brk is not None and turn.brk.cause == "tools_change" and change.name == "web_search"
        if turn.brk is not None and turn.brk.cause != "param_change" and not toggled:
            return
        if turn.brk is not None:
            turn.brk.cause, turn.brk.tool_index, turn.brk.tool_name = "param_change", None, None
            if turn.brk.subtype == "model" or change.provider != "local" and change.level == "rendered":
                return
            turn.brk.subtype, turn.brk.path = change.name, f"$.{change.name}"
            turn.brk.before, turn.brk.after = change.text(change.before), change.text(change.after)
            turn.brk.suggestion = fix_text(change)
            return
        if change.level == "rendered":
            return  # the template rendered the same prompt: a local server keeps its cache
        kept, chars = kept_prefix(change.level, prev.rendered, self._count)
        kept = min(turn.common_prefix_tokens, kept)
        before, after = change.text(change.before), change.text(change.after)
        turn.brk = Break("param_change", change.name, None, None, chars, kept, before, after, f"$.{change.name}",
                         diff=diff_window(before, after, len(change.name) + 2), suggestion=fix_text(change),
                         saves_tokens=max(0, min(prev.tokens, turn.prompt_tokens or 0) - kept),
                         detail=f"{change.provider}: invalidates from the {change.level} on")
        turn.common_prefix_tokens = kept

    def _race(self, turn: TurnResult, prev_turn: TurnResult, prev_req, req) -> None:
        """An append-only turn sent before the previous one's first token (analyzer/race.py): it can reuse
        only what was cached before the previous request."""
        if prev_req is None or not (prev_req.ts_given and req.ts_given):
            return
        r = race(prev_req.ts, prev_req.ttft_s, req.ts)
        if r is None:
            return
        kept = min(turn.common_prefix_tokens, prev_turn.predicted_cached_tokens or 0)
        before = f"previous turn sent {clock(r.prev_sent)}, first token {clock(r.prev_first_token)}"
        after = f"this turn sent {clock(r.sent)}, {r.early_s:.2f} s before that first token"
        turn.brk = Break("concurrent", None, None, None, 0, kept, before, after,
                         diff={"before": before, "after": after, "start": 0, "before_end": 0, "after_end": 0,
                               "offset": 0},  # two times, not two prompts: nothing to mark
                         suggestion=race_fix(r), saves_tokens=max(0, turn.common_prefix_tokens - kept),
                         detail=f"sent {r.early_s:.2f} s before the previous turn's first token")
        turn.common_prefix_tokens = kept

    def _lookback(self, turn: TurnResult, payload, rendered, req) -> None:
        """An append-only Messages turn whose breakpoints all lie more than 20 blocks past the session's
        newest cache write (analyzer/lookback.py): what they still find stays cached, the rest is lost."""
        miss = lookback_miss(req.cache_blocks, self.writes)
        if miss is None:
            return
        kept = chars = 0
        if miss.hit:
            kept, chars = self._prefix_through(rendered, payload, req.cache_blocks.message_of[miss.hit - 1])
        kept = min(turn.common_prefix_tokens, kept)
        before = f"newest cache write after block {miss.newest_write}"
        after = f"{before}; breakpoint after block {miss.breakpoint}: {miss.behind} blocks later"
        turn.brk = Break("lookback", None, None, None, chars, kept, before, after,
                         diff=diff_window(before, after, len(before)), suggestion=lookback_fix(miss),
                         saves_tokens=max(0, turn.common_prefix_tokens - kept),
                         detail=f"{miss.behind} blocks behind the breakpoint; Anthropic looks back {LOOKBACK_BLOCKS}")
        turn.common_prefix_tokens = kept

    def _prefix_through(self, rendered, payload, message: int | None) -> tuple[int, int]:
        """(tokens, chars) of the rendering up to the end of the client's message `message` (None: the head)."""
        source: list[Any] = payload.source_index or []
        text = []
        for segment, owner in zip(rendered.segments, rendered.owners):
            client = source[owner] if 0 <= owner < len(source) else (owner if owner >= 0 else None)
            if client is not None and (message is None or client > message):
                break
            text.append(segment)
        joined = "".join(text)
        return (self._count(joined), len(joined)) if joined else (0, 0)
