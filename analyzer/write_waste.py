"""Cache writes nobody read (`cache_write_waste`, docs/ANALYZER.md "Cache-write waste").

A provider that charges for cache writes (Anthropic: 1.25x the input rate for a 5 minute entry, 2x
for 1 hour) bills `cache_creation_input_tokens` whether or not a later request reads them. A turn's
write covers the tokens after what it read: [read, read + written). A later turn of the same session
reads it up to its own `cache_read_input_tokens`; an entry lives its lifetime from its last read. What
no later turn read before the entry expired is waste, charged to what stopped the reading: the break
of the first later turn that read short of it (`param_change`, `system_rewrite`, …), `ttl` when the
session paused past the lifetime, `session_end` when no turn followed. Only the provider's own counts
are used: a turn without a reported write writes nothing here, one without a reported read ends the
search (unknown is never a miss).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from analyzer.causes import PROVIDER_TTLS

# Breaks after which the prompt is still the same text, so a later turn may still read the entry.
SAME_PREFIX = frozenset({"server_miss", "concurrent", "lookback"})
LOOKAHEAD = 64  # later turns searched for a read of one write (a session re-reads its prefix every turn)


def _ttl(req: Any) -> int:
    return PROVIDER_TTLS["anthropic-1h" if getattr(req, "cache_ttl_1h", False) else "anthropic"][0]


def _end(t) -> float:
    return (t.ts or 0.0) + (t.ttft_s or 0.0)


def session_waste(turns: list, requests: Mapping[str, Any]) -> list[tuple[int, int, str]]:
    """(turn index, wasted tokens, cause) for each turn of one session whose reported write was not all read."""
    out = []
    for i, t in enumerate(turns):
        written = t.reported_cache_write_tokens or 0
        if written <= 0:
            continue
        start = t.reported_cache_read_tokens or 0
        end = start + written
        used, touched, cause = 0, _end(t), "session_end"
        ttl = _ttl(requests.get(t.request_id))
        for later in turns[i + 1 : i + 1 + LOOKAHEAD]:
            if later.ts is not None and t.ts is not None and later.ts - touched > ttl:
                cause = "ttl"
                break
            read = later.reported_cache_read_tokens
            if read is None:
                cause = "unknown"
                break
            if read < end and later.brk is not None and later.brk.cause not in SAME_PREFIX:
                cause = later.brk.cause  # the prompt changed before the entry's end: no later turn can read it
                break
            if read < end and cause == "session_end":
                cause = later.brk.cause if later.brk is not None else "read_short"
            if read > start:
                used = max(used, min(read, end) - start)
                touched = _end(later)
            if used >= written:
                break
        if used < written and cause != "unknown":
            out.append((i, written - used, cause))
    return out


def write_waste(report, requests: Mapping[str, Any], sheet=None) -> dict | None:
    """Wasted writes per session and per cause, in tokens and (with a price sheet) dollars: `dollars` what
    the writes cost, `premium_dollars` what marking them cost over sending them uncached. None when no turn
    reported a cache write."""
    if not any(t.reported_cache_write_tokens for s in report.sessions for t in s.turns):
        return None
    by_cause: dict[str, dict[str, Any]] = {}
    sessions: dict[str, dict[str, Any]] = {}
    written_total = wasted_total = 0
    for s in report.sessions:
        written_total += sum(t.reported_cache_write_tokens or 0 for t in s.turns)
        for index, tokens, cause in session_waste(s.turns, requests):
            t = s.turns[index]
            dollars = premium = None
            if sheet is not None and sheet.charges_cache_writes:
                n = t.reported_prompt_tokens or t.prompt_tokens or tokens
                dollars = tokens * sheet.cache_write.at(n)
                premium = tokens * (sheet.cache_write.at(n) - sheet.input.at(n))
            wasted_total += tokens
            for row in (by_cause.setdefault(cause, {}), sessions.setdefault(s.id, {"by_cause": {}}),
                        sessions[s.id]["by_cause"].setdefault(cause, {})):
                row["tokens"] = row.get("tokens", 0) + tokens
                if dollars is not None:
                    row["dollars"] = round(row.get("dollars", 0.0) + dollars, 6)
                    row["premium_dollars"] = round(row.get("premium_dollars", 0.0) + premium, 6)
    out: dict[str, Any] = {"written_tokens": written_total, "wasted_tokens": wasted_total,
                           "by_cause": dict(sorted(by_cause.items(), key=lambda kv: -kv[1]["tokens"])),
                           "sessions": sessions}
    if sheet is not None and sheet.charges_cache_writes:
        out["dollars"] = round(sum(c.get("dollars", 0.0) for c in by_cause.values()), 6)
        out["premium_dollars"] = round(sum(c.get("premium_dollars", 0.0) for c in by_cause.values()), 6)
    return out


def text_lines(waste: dict | None) -> list[str]:
    """The report's lines: the total, then per cause (costliest first)."""
    if not waste:
        return []
    usd = lambda v: f", ${v:,.4f}" if v is not None else ""  # noqa: E731
    lines = [f"cache writes never read: {waste['wasted_tokens']:,} of {waste['written_tokens']:,} written tokens"
             + usd(waste.get("dollars"))
             + (f" (${waste['premium_dollars']:,.4f} over sending them uncached)" if "premium_dollars" in waste else "")]
    lines += [f"  {cause}: {c['tokens']:,} tokens{usd(c.get('dollars'))}" for cause, c in waste["by_cause"].items()]
    return lines
