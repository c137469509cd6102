"""Opt-in repairs of a request's prompt, each tied to one analyzer cause (docs/FIXES.md).

Each fix is a function (request body, protocol, the session's record) -> `Outcome`: a fixed copy of
the body or None, and one line saying what changed or why it stood aside. None is on unless named
(`serve --fix NAME[,NAME...]`, `analyze --fix`, `replay --fix`). `apply_fixes` runs the named ones
in the order of `FIXES`; a fix that raises leaves the body as it was and says so in its entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from prefixtrace.common.errors import InvalidRequest
from analyzer.fixes import breakpoints, session_key, thinking, tool_args, tool_order, volatile
from analyzer.fixes.base import Fix, Outcome, SessionRecord, reply_key

# name -> (fix, the analyzer cause it addresses)
FIXES: dict[str, tuple[Fix, str]] = {
    volatile.NAME: (volatile.fix, "system_rewrite"),
    tool_order.NAME: (tool_order.fix, "tools_change"),
    tool_args.NAME: (tool_args.fix, "serialization"),
    thinking.NAME: (thinking.fix, "thinking_strip"),
    breakpoints.NAME: (breakpoints.fix, "server_miss"),
    session_key.NAME: (session_key.fix, "server_miss"),
}

__all__ = ["FIXES", "Applied", "Outcome", "SessionRecord", "apply_fixes", "parse_fix_names", "reply_key"]


def parse_fix_names(spec: str | list[str] | None) -> list[str]:
    """`--fix volatile,tool-order` (or the option given several times) as a list of known names;
    an unknown name is an `InvalidRequest` listing the names."""
    if not spec:
        return []
    parts = [spec] if isinstance(spec, str) else list(spec)
    names = [n.strip() for part in parts for n in part.split(",") if n.strip()]
    unknown = [n for n in names if n not in FIXES]
    if unknown:
        raise InvalidRequest(f"unknown fix {', '.join(map(repr, unknown))}: the fixes are {', '.join(FIXES)}")
    return [n for n in FIXES if n in names]  # the library's order, each once


def _size(body: Any) -> int:
    return len(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode())


@dataclass
class Applied:
    """The body after the named fixes (the very object passed in when none fired), one entry per fix
    ({"name", "fired", "note", "bytes_before", "bytes_after"}, "error" when it raised), and the
    headers the fired ones add upstream."""
    body: dict
    entries: list[dict] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def fired(self) -> list[dict]:
        return [e for e in self.entries if e["fired"]]


def apply_fixes(names: list[str], body: dict, protocol: str, record: SessionRecord) -> Applied:
    """Runs the named fixes over `body` in turn, each on the previous one's result; the record's memos
    are updated for the next request of the session."""
    out = Applied(body)
    for name in names:
        fix, _cause = FIXES[name]
        before = _size(out.body)
        try:
            outcome = fix(out.body, protocol, record)
        except Exception as exc:  # a fix's bug never costs the request: it goes on as it was
            out.entries.append({"name": name, "fired": False, "note": f"the fix failed and stood aside: "
                                f"{type(exc).__name__}: {exc}", "error": True,
                                "bytes_before": before, "bytes_after": before})
            continue
        if outcome.fired and protocol == "messages" and breakpoints.count_breakpoints(outcome.body) > \
                breakpoints.MAX_BREAKPOINTS:
            outcome = Outcome(None, f"stood aside: the result would carry more than {breakpoints.MAX_BREAKPOINTS} "
                              "cache_control breakpoints (an invalid request)", outcome.memo)
        if outcome.memo is not None:
            record.memos[name] = outcome.memo
        out.headers.update(outcome.headers)
        if outcome.fired:
            out.body = outcome.body
        out.entries.append({"name": name, "fired": outcome.fired, "note": outcome.note,
                            "bytes_before": before, "bytes_after": _size(out.body)})
    return out
