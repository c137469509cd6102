"""Stop-sequence matching on streamed text.

Stop strings are matched on decoded text, not token ids, because a stop string
may span tokens or start mid-token. Text that could still become the start of a
stop string is held back, so the client never receives a partial stop string.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add newly decoded text; return (text safe to emit, whether a stop was hit)."""
        self._pending += text
        if not self.stops:
            out, self._pending = self._pending, ""
            return out, False
        hits = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = self._pending[: min(hits)]
            self._pending = ""
            return out, True
        hold = self._longest_partial_stop_suffix()
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _longest_partial_stop_suffix(self) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:n]):
                    best = n
                    break
        return best
