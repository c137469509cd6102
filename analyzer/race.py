"""Requests of one session that race (`concurrent`, docs/ANALYZER.md "Races").

A prefix is cached once its request has been prefilled, which is when its first token comes back. A
request of the same session sent before that (a parallel tool loop, a sub-agent started at once, an
eager retry) finds only what was cached before the previous request, whatever it shares with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone


@dataclass
class Race:
    prev_sent: float
    prev_first_token: float
    sent: float

    @property
    def early_s(self) -> float:
        return self.prev_first_token - self.sent


def race(prev_ts: float | None, prev_ttft_s: float | None, ts: float | None) -> Race | None:
    """The race when this request (sent at `ts`) left before the previous one's first token; None when
    it did not, or a time is unknown."""
    if prev_ts is None or prev_ttft_s is None or ts is None:
        return None
    first = prev_ts + prev_ttft_s
    return Race(prev_ts, first, ts) if ts < first else None


def clock(ts: float) -> str:
    """A time as a person compares two of them: UTC, to the millisecond."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def fix_text(r: Race) -> str:
    return (f"this request left {r.early_s:.2f} s before the previous one's first token, so the previous "
            f"prompt was not cached yet: wait for the first token (or the reply) before sending the next "
            f"request of a conversation, and start parallel sub-agents after one request has warmed the "
            f"shared prefix")
