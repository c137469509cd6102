"""What the proxy records turns through: the `TurnSink` protocol (every member the proxy, the
dashboard and `run` call, declared here and nowhere else) and `TappedSink`, the one sink that shows
each turn to a fixed list of taps once it has handed it to the recorder.

`recorder.store.Recorder` implements `TurnSink`. Callers use its members directly, never probing
with getattr/hasattr; a wrapper declares and forwards every member (no `__getattr__`), so a member
added here and missing in a wrapper is a type error and fails tests/test_turn_sink.py, not a silent
fallback."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

from recorder.redact import Redactor
from recorder.turn import Turn

log = logging.getLogger(__name__)


@runtime_checkable
class TurnSink(Protocol):
    """A recorder of turns. `record` hands a turn over (blocking only while the queue is full) and
    returns a Future resolved once it is committed; `enqueue` is the same without blocking the event
    loop; `record_async` also waits for the commit (a failed write is logged, not raised)."""

    redactor: Redactor  # what the recorder masks stored text with; the live dashboard masks with it too

    def record(self, turn: Turn) -> Future: ...

    async def enqueue(self, turn: Turn) -> Future: ...

    async def record_async(self, turn: Turn) -> None: ...

    def flush(self, timeout: float | None = None) -> bool: ...

    def close(self, timeout: float | None = None) -> None: ...

    def health(self) -> tuple[bool, str | None]: ...

    @property
    def pending(self) -> int: ...

    def spool_state(self) -> dict: ...


# Every member of the protocol, for the check that each sink declares them itself.
SINK_MEMBERS = ("redactor", "record", "enqueue", "record_async", "flush", "close", "health", "pending",
                "spool_state")

Tap = Callable[[Turn], None]


class TappedSink:
    """`sink` with taps behind it: every turn handed to any recording member is recorded, then shown
    to each tap, in the order given. A tap reads the turn and never writes it (only the relay and the
    builder do: tests/test_turn_fields_owned.py). A tap that raises is logged and skipped: a tap is
    observability or learning, and must never cost a response or a recorded turn.

    On the event loop the taps run at its next turn, not in the caller's: `record_async`'s caller
    is a response waiting for its turn's commit, which goes out first (its body, or a stream's end
    marker) instead of waiting for the dashboard's analysis too. The loop runs them before it takes
    in anything new, so a client that reads that response and sends its next request finds them done
    with this turn (the fixes learnt from it, /metrics counting it)."""

    def __init__(self, sink: TurnSink, taps: Sequence[Tap]):
        self.sink = sink
        self.taps = tuple(taps)

    def _tap(self, turn: Turn) -> None:
        for tap in self.taps:
            try:
                tap(turn)
            except Exception:
                log.exception("tap %r failed on turn %s; the turn is recorded anyway", tap, turn.request_id)

    def _tap_next(self, turn: Turn) -> None:
        """The taps, at the event loop's next turn (at once where no loop runs: a thread's caller)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._tap(turn)
        else:
            loop.call_soon(self._tap, turn)

    @property
    def redactor(self) -> Redactor:
        return self.sink.redactor

    def record(self, turn: Turn) -> Future:
        try:
            return self.sink.record(turn)
        finally:
            self._tap_next(turn)

    async def enqueue(self, turn: Turn) -> Future:
        try:
            return await self.sink.enqueue(turn)
        finally:
            self._tap_next(turn)

    async def record_async(self, turn: Turn) -> None:
        try:
            await self.sink.record_async(turn)
        finally:  # also when the response waiting for the commit is cancelled: the turn was handed over
            self._tap_next(turn)

    def flush(self, timeout: float | None = None) -> bool:
        return self.sink.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        self.sink.close(timeout)

    def health(self) -> tuple[bool, str | None]:
        return self.sink.health()

    @property
    def pending(self) -> int:
        return self.sink.pending

    def spool_state(self) -> dict:
        return self.sink.spool_state()
