"""Two conversations merged for want of a session id: requests without one are grouped by the prefix
they share, so two runs of one task that opened alike read as one session, and the clock or counter in
their system prompts seems to run backwards between them. A break whose volatile value runs backwards
in an inferred session says so, and that ids would keep them apart."""

from __future__ import annotations

import re

from analyzer.results import Report

_NUMBERS = re.compile(r"\d+")
MERGED = ("the value runs backwards, so these are likely two conversations that opened alike and were grouped "
          "as one for want of a session id: send one per conversation (the X-Session-Id header, or `user` / "
          "`prompt_cache_key` in the body) to keep them apart; ")


def runs_backwards(before: str, after: str) -> bool:
    """'10:00:07' → '10:00:02', '(stale: 5 turns)' → '(stale: 1 turns)': the numbers in it, read in order, went down."""
    a = [int(n) for n in _NUMBERS.findall(before)]
    b = [int(n) for n in _NUMBERS.findall(after)]
    return bool(a) and len(a) == len(b) and b < a


def mark_merged(report: Report) -> None:
    """Prefixes the fix of every such break (inferred sessions only: an id says they are one)."""
    for s in report.sessions:
        if not s.inferred:
            continue
        for t in s.turns:
            vol = t.brk.volatile if t.brk is not None else None
            if isinstance(vol, dict) and vol.get("kind") in ("timestamp", "counter") and \
                    runs_backwards(str(vol.get("before")), str(vol.get("after"))):
                t.brk.suggestion = MERGED + (t.brk.suggestion or "")
