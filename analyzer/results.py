"""The analysis's result model: each break (`Break`), each turn (`TurnResult`), each
session (`SessionResult`) and the whole run (`Report`), with the totals and the
coverage every output format prints from.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from analyzer.turn_kinds import miss_rates
from prefixtrace.common.errors import InvalidRequest
from prefixtrace.common.words import plural


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
        if self.cause == "lookback":
            return "the cache breakpoints"
        if self.cause == "concurrent":
            return "the send time"
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
        d = dict(self.__dict__)
        if self.cause in ("lookback", "concurrent"):  # not a place in the prompt: said for the pages' own `where`
            d["where"] = self.where()
        return d


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
    # Whose count `lost_tokens` is: "server" (the provider's usage: its own tokens), "exact" (the server's
    # tokenizer and renderer) or "estimate" (the rebuilt prompt counted by the analysis's tokenizer).
    lost_tokens_basis: str | None = None
    ttft_s: float | None = None  # the turn's recorded time to first token
    blocks: int | None = None  # a Messages request's content blocks as sent (Anthropic's lookback counts them)
    opened_by: str | None = None  # what opened the turn: user, tool_result, subagent, … (analyzer/turn_kinds.py)
    harness: str | None = None  # who sent it and at which version (analyzer/versions.py)
    harness_version: str | None = None

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
    server_prompt = server_cached = server_turns = 0
    seconds = lost_s = 0.0
    for t in turns:
        total += t.prompt_tokens or 0
        if t.reported_prompt_tokens is not None:  # the server's own counts, summed apart (another unit)
            server_turns += 1
            server_prompt += t.reported_prompt_tokens
            server_cached += t.reported_cached_tokens or 0
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
            "reprefill_seconds": round(seconds, 1) if rate else None, "by_cause": dict(order),
            "server_counted_turns": server_turns, "server_prompt_tokens": server_prompt,
            "server_cached_tokens": server_cached}


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
    write_waste: dict | None = None  # analyzer/write_waste.py: provider cache writes never read
    hashed_note: str = ""  # analyzer/hashed.py: what a hash-only recording cannot tell
    # analyzer/fix_report.py: the fixes `serve --fix` applied ({"name", "note", "turns"}), and what each
    # fix would have saved on this recording (`analyze --propose-fixes`)
    proxy_fixes: list[dict] = field(default_factory=list)
    fix_proposals: list[dict] = field(default_factory=list)
    replayed: int = 0  # requests `prefixtrace replay` sent through the proxy: left out of the analysis
    remote_compactions: int = 0  # POST /v1/responses/compact requests: left out of the analysis, counted

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
            out.append(f"{c['not_analysed']} of {plural(c['input'], 'request')} not analysed: "
                       f"{plural(c['skipped_lines'], 'line')} could not be read, "
                       f"{plural(c['unrenderable_turns'], 'turn')} could not be rendered")
            # Skipped lines are listed one by one by every format; an unrenderable turn only in its table row.
            if not self.skipped:
                first = next((f"session {s.id} turn {t.number} (line {t.line}): {t.note}" for s in self.sessions
                              for t in s.turns if t.note.startswith("unrenderable")), "")
                out.append(f"first: {first}")
        elif c["analysed"] == 0:
            out.append(f"{'the' if c['failed_requests'] == 1 else 'all'} {plural(c['failed_requests'], 'request')} "
                       "failed (status >= 400): no prompt to analyse")
        if self.hashed_note:
            out.append(self.hashed_note)
        if self.replayed:
            out.append(f"{plural(self.replayed, 'replayed request')} left out: `prefixtrace replay` sent "
                       f"{'it' if self.replayed == 1 else 'them'} (marked X-Prefixtrace-Replay), not the client")
        if self.remote_compactions:
            out.append(f"{plural(self.remote_compactions, 'remote compaction request')} (/v1/responses/compact) "
                       "left out: the server rewrote the history there; the call after each is compared")
        rebuilt = [s for s in self.sessions if s.transcript]
        if rebuilt:
            out.append(f"{plural(len(rebuilt), 'session')} rebuilt from harness transcripts, not recorded traffic: "
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
            "replayed_requests": self.replayed,
            "remote_compaction_requests": self.remote_compactions,
            "sessions": [s.to_dict(self.prefill_rate) for s in self.sessions],
            "totals": _totals((t for s in self.sessions for t in s.turns), self.prefill_rate),
            "top_breaks": [{"session": s.id, "turn": t.number, "cause": t.brk.cause, "subtype": t.brk.subtype,
                            "where": t.brk.location(), "lost_seconds": t.lost_seconds, "lost_tokens": t.lost_tokens,
                            "lost_seconds_basis": t.lost_seconds_basis} for s, t in self.top_breaks()],
            **({"what_if": self.what_if} if self.what_if else {}),
            **({"pricing": self.pricing} if self.pricing else {}),
            **({"cache_write_waste": self.write_waste} if self.write_waste else {}),
            "opened_by": miss_rates(t for s in self.sessions for t in s.turns),
            **({"proxy_fixes": self.proxy_fixes} if self.proxy_fixes else {}),
            **({"fix_proposals": self.fix_proposals} if self.fix_proposals else {}),
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

