"""What the HTML and Markdown reports (and the dashboard's per-session report) show, computed once
from the analysis's dict form (`Report.to_dict()`, docs/ANALYZER.md), so every format says the same
thing: the cost of each break, the breaks grouped by cause and fix, the top breaks, and a headline
that keeps breaks apart from appends.

Works on the dict form, not the dataclasses, so the proxy can render a live session it only holds
as dicts. Fields the analysis may not carry yet are derived, and the derivation is named here once:

- turn `number` (1-based): `index + 1` when absent;
- a break's one cost in tokens, `lost_tokens`: else the break's `saves_tokens` (the previous prompt's
  tokens past the common prefix, which a cache would have served had the prompt only grown); the
  turn's `reprefill_tokens` also counts the new tokens appended, which no cache could have served;
- `lost_seconds`: else `lost_tokens / prefill_rate` when a prefill rate is known, else `lost_tokens`
  over the prefill rate the session's own appends show (their new tokens over their TTFT, when at
  least two appends recorded one);
- the differing span of a diff: the break's `diff` spans, else the common prefix and suffix of the
  before/after windows.
"""

from __future__ import annotations

import re
from typing import Any

from analyzer.causes import CAUSES

PALETTE = ("#9aa5b1", "#d64545", "#e8833a", "#8e44ad", "#2d7dd2", "#f2c14e", "#3c9d5d",
           "#c2185b", "#00897b", "#6d4c41", "#546e7a")
COLOURS = dict(zip(CAUSES, PALETTE))
COLOURS.setdefault("server_miss", "#0b7285")
OTHER_COLOUR = "#37474f"
CACHED = "#cfd8dc"
APPEND = "#9ec5e8"  # tokens a turn appended: re-prefilled, but no cache could have served them

# What each cause means, in words a harness author reads without the docs.
LABELS = {
    "append_only": "appended",
    "system_rewrite": "system prompt rewritten",
    "system_fold": "mid-conversation system message moved to the head",
    "thinking_strip": "earlier reasoning dropped",
    "tools_change": "tool list changed",
    "history_edit": "earlier message edited",
    "compaction": "history compacted",
    "dropped_message": "earlier message dropped",
    "request_local_tail": "one-shot trailing message removed",
    "param_change": "request parameter changed",
    "serialization": "same content, other bytes",
    "server_miss": "server did not serve its cached prefix",
}


def colour(cause: str | None) -> str:
    return COLOURS.get(cause or "append_only", OTHER_COLOUR)


def kind(brk: dict) -> str:
    """"system_rewrite/volatile"."""
    return brk["cause"] + (f"/{brk['subtype']}" if brk.get("subtype") else "")


def label(brk: dict) -> str:
    text = LABELS.get(brk["cause"], brk["cause"].replace("_", " "))
    return text + (f" ({brk['subtype']})" if brk.get("subtype") else "")


def where(brk: dict) -> str:
    """Where the prompt broke, in the message the client sent (not the rendering) when known."""
    if brk.get("where"):
        return str(brk["where"])
    if brk.get("tool_index") is not None:
        return f"tools[{brk['tool_index']}] ({brk.get('tool_name')})"
    if brk["cause"] == "tools_change":
        return "the tool list"
    index, role = brk.get("message_index"), brk.get("role")
    if index is None and role == "system":
        text = "the system prompt"
    elif index is None:
        return "the request parameters" if brk["cause"] == "param_change" else \
            f"the rendered head, char {brk.get('char_offset', 0):,} of the rendering"
    else:
        text = f"message {index} ({role})"
    if brk.get("message_char_offset") is not None:
        return f"{text}, char {brk['message_char_offset']:,}"
    return f"{text}, char {brk.get('char_offset', 0):,} of the rendering"


def diff_spans(brk: dict) -> tuple[str, str, int, int, int]:
    """(before, after, start, before_end, after_end): the windows and the differing span in each."""
    d = brk.get("diff")
    if isinstance(d, dict) and isinstance(d.get("before"), str) and isinstance(d.get("after"), str):
        try:
            b, a = d["before"], d["after"]
            return b, a, int(d["start"]), int(d["before_end"]), int(d["after_end"])
        except (KeyError, TypeError, ValueError):
            pass
    b, a = brk.get("before") or "", brk.get("after") or ""
    return (b, a, *resync(b, a))


RESYNC_REACH, RESYNC_MATCH = 64, 6


def resync(b: str, a: str) -> tuple[int, int, int]:
    """(start, before_end, after_end): the first differing span of two windows, where they agree again
    (the nearest point, within 64 chars, from which 6 chars match): "Mon|day." against "Tues|day."
    marks "Mon" and "Tues". The windows are cut at fixed lengths, so a common suffix would mean nothing.
    proxy/static/dashboard.html does the same in its script."""
    start, limit = 0, min(len(b), len(a))
    while start < limit and b[start] == a[start]:
        start += 1
    if start == limit:
        return start, len(b), len(a)
    for total in range(1, 2 * RESYNC_REACH + 1):
        for db in range(max(0, total - RESYNC_REACH), min(total, RESYNC_REACH) + 1):
            da = total - db
            x, y = b[start + db:start + db + RESYNC_MATCH], a[start + da:start + da + RESYNC_MATCH]
            at_ends = start + db + len(x) == len(b) and start + da + len(y) == len(a)
            if x and x == y and (len(x) == RESYNC_MATCH or at_ends):
                return start, start + db, start + da
    return start, len(b), len(a)


def _num(value) -> float | None:
    """A finite number, else None (NaN or inf from a broken usage record must not reach a chart)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if value == value and value not in (float("inf"), float("-inf")) else None


# "('2' → '3')": the values a volatile break's fix names (analyzer/advice.py). Left out of the group's
# fix, so one counter ticking at 35 turns is one card listing them, not 35 cards.
_VALUES = re.compile(r""" \((?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*") → (?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\)""")


def generic_fix(fix: str) -> str:
    return _VALUES.sub("", fix)


def _first_num(d: dict, *keys: str) -> float | None:
    return next((v for v in (_num(d.get(k)) for k in keys) if v is not None), None)


def turn_costs(turn: dict, prefill_rate: float | None) -> tuple[int | None, float | None, str | None]:
    """(lost_tokens, lost_seconds, basis) of a turn's break; (None, None, None) when it has none."""
    brk = turn.get("break")
    if not brk:
        return None, None, None
    tokens = _num(turn.get("lost_tokens"))
    if tokens is None:
        tokens = _num(brk.get("lost_tokens"))
    if tokens is None:
        tokens = _num(brk.get("saves_tokens"))
    if tokens is None:
        tokens = _num(turn.get("reprefill_tokens"))
    seconds = _num(turn.get("lost_seconds"))
    basis = turn.get("lost_seconds_basis")
    if seconds is None and tokens is not None and prefill_rate:
        seconds, basis = round(tokens / prefill_rate, 2), f"--prefill-rate {prefill_rate:g} tok/s"
    return (int(tokens) if tokens is not None else None), seconds, basis


def build(d: dict[str, Any], top_n: int = 10) -> dict[str, Any]:
    """The report's view: sessions (with their turns' rows), breaks, groups by cause + fix, top
    breaks, totals per cause and the headline. `d` is `Report.to_dict()` (or the same shape)."""
    rate = _num(d.get("prefill_rate"))
    sessions, breaks, rows = [], [], []
    prompt_total = cached_total = append_total = 0
    for si, s in enumerate(d.get("sessions") or []):
        turns = s.get("turns") or []
        srows = []
        first_break = len(breaks)
        for i, t in enumerate(turns):
            number = t.get("number") or (t.get("index", i) + 1)
            prompt = _num(t.get("prompt_tokens"))
            cached = _num(t.get("predicted_cached_tokens"))
            if cached is None:
                cached = _num(t.get("common_prefix_tokens"))
            re = _num(t.get("reprefill_tokens"))
            brk = t.get("break")
            lost, seconds, basis = turn_costs(t, rate)
            bid = f"b{si}-{number}" if brk else None
            row = {"s": si, "n": number, "ts": _num(t.get("ts")), "prompt": prompt, "cached": cached, "re": re,
                   "rcached": _first_num(t, "reported_cached_tokens", "reported_cache_read_tokens"),
                   "ttft": _num(t.get("ttft_s")),
                   "cause": kind(brk) if brk else None, "lost": lost, "sec": seconds, "note": t.get("note") or "",
                   "id": bid}
            srows.append(row)
            prompt_total += int(prompt or 0)
            cached_total += int(cached or 0)
            if brk:
                b, a, start, bend, aend = diff_spans(brk)
                breaks.append({
                    "id": bid, "session": s.get("id"), "session_index": si, "number": number, "brk": brk,
                    "cause": brk["cause"], "kind": kind(brk), "label": label(brk), "where": where(brk),
                    "fix": brk.get("suggestion") or "", "lost_tokens": lost, "lost_seconds": seconds,
                    "basis": basis, "reprefill_tokens": re, "token_offset": brk.get("token_offset"),
                    "diff": (b, a, start, bend, aend), "volatile": brk.get("volatile"), "ttft": row["ttft"],
                    "path": brk.get("path"), "served_by": t.get("served_by"), "lost_dollars": _num(t.get("lost_dollars")),
                    "server_miss_reason": t.get("server_miss_reason"),
                    "tokens_basis": t.get("lost_tokens_basis"),
                })
            elif re:
                append_total += int(re)
        _seconds_from_appends(srows, breaks[first_break:])
        rows.extend(srows)
        secs = [r["sec"] for r in srows if r["id"] and r["sec"] is not None]
        sessions.append({"index": si, "id": s.get("id"), "client": s.get("client"), "title": s.get("title"),
                         "kind": s.get("kind"), "parent": s.get("parent"), "side_reason": s.get("side_reason"),
                         "transcript": s.get("transcript"), "rows": srows, "breaks": sum(1 for r in srows if r["id"]),
                         "lost_tokens": sum(r["lost"] or 0 for r in srows if r["id"]),
                         "lost_seconds": round(sum(secs), 2) if secs else None})
    by_cause: dict[str, dict[str, Any]] = {}
    for b in breaks:
        c = by_cause.setdefault(b["cause"], {"cause": b["cause"], "label": LABELS.get(b["cause"], b["cause"]),
                                             "breaks": 0, "lost_tokens": 0, "lost_seconds": None})
        c["breaks"] += 1
        c["lost_tokens"] += b["lost_tokens"] or 0
        if b["lost_dollars"] is not None:
            c["lost_dollars"] = (c.get("lost_dollars") or 0) + b["lost_dollars"]
        if b["lost_seconds"] is not None:
            c["lost_seconds"] = round((c["lost_seconds"] or 0) + b["lost_seconds"], 2)
    groups: dict[tuple, dict[str, Any]] = {}
    for b in breaks:
        fix = generic_fix(b["fix"])
        g = groups.setdefault((b["kind"], fix), {"kind": b["kind"], "cause": b["cause"], "label": b["label"],
                                                 "fix": fix, "breaks": [], "lost_tokens": 0, "lost_seconds": None,
                                                 "values": []})
        g["breaks"].append(b)
        vol = b.get("volatile")
        if isinstance(vol, dict) and "before" in vol and len(g["values"]) < 12:
            g["values"].append(f"{vol.get('before')} → {vol.get('after')}")
        g["lost_tokens"] += b["lost_tokens"] or 0
        if b["lost_seconds"] is not None:
            g["lost_seconds"] = round((g["lost_seconds"] or 0) + b["lost_seconds"], 2)
    ordered = sorted(breaks, key=cost_key)
    group_list = sorted(groups.values(), key=cost_key)
    for g in group_list:
        g["breaks"].sort(key=cost_key)
    lost_tokens = sum(b["lost_tokens"] or 0 for b in breaks)
    secs = [b["lost_seconds"] for b in breaks if b["lost_seconds"] is not None]
    dollars = [b["lost_dollars"] for b in breaks if b["lost_dollars"] is not None]
    return {
        "sessions": sessions, "rows": rows, "breaks": breaks, "top": ordered[:top_n], "groups": group_list,
        "by_cause": sorted(by_cause.values(), key=cost_key),
        "headline": {"breaks": len(breaks), "lost_tokens": lost_tokens,
                     "lost_seconds": round(sum(secs), 2) if secs else None,
                     "seconds_known": len(secs), "lost_dollars": sum(dollars) if dollars else None, "prompt_tokens": prompt_total, "cached_tokens": cached_total,
                     "appended_tokens": append_total, "turns": len(rows), "sessions": len(sessions)},
        "prefill_rate": rate,
    }


def _seconds_from_appends(rows: list[dict], breaks: list[dict]) -> None:
    """Prices the session's breaks that carry no seconds at the prefill rate its appends show."""
    if not any(b["lost_seconds"] is None and b["lost_tokens"] for b in breaks):
        return
    timed = [r for r in rows if not r["id"] and r["ttft"] and r["re"] and r["note"] != "first"]
    if len(timed) < 2:
        return
    rate = sum(r["re"] for r in timed) / sum(r["ttft"] for r in timed)
    basis = f"this session's appends: {rate:,.0f} tok/s from their TTFT"
    by_id = {r["id"]: r for r in rows if r["id"]}
    for b in breaks:
        if b["lost_seconds"] is None and b["lost_tokens"] is not None:
            b["lost_seconds"], b["basis"] = round(b["lost_tokens"] / rate, 2), basis
            by_id[b["id"]]["sec"] = b["lost_seconds"]


def cost_key(item: dict) -> tuple:
    """Seconds first, then tokens, biggest on top; breaks without seconds after those with."""
    seconds = item.get("lost_seconds")
    return (seconds is None, -(seconds or 0), -(item.get("lost_tokens") or 0))


def seconds_text(seconds: float | None) -> str:
    if seconds is None:
        return "? s"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    if seconds < 1:
        return f"{seconds:.2f} s"
    return f"{seconds:.1f} s" if seconds < 100 else f"{seconds:.0f} s"


def dollars_text(value: float | None) -> str:
    if value is None:
        return ""
    return f"${value:,.2f}" if value >= 1 else f"${value:.4f}".rstrip("0").rstrip(".") if value else "$0"


def session_name(s: dict) -> str:
    """"pi · “fix the flaky test” (session 3)": the client and the first user message when known."""
    parts = [p for p in (s.get("client"), f"“{s['title']}”" if s.get("title") else None) if p]
    return " · ".join(parts + [f"session {s.get('id')}"]) if parts else f"session {s.get('id')}"
