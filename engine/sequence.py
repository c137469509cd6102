"""`Sequence`: one request's state inside the engine, and the events it emits.

The Sequence is the only object that crosses between the HTTP side and the
engine thread. The HTTP side creates it and reads its events; the engine thread
alone mutates its counters. Events are delivered through `emit`, a callable the
engine thread calls: for a server, an `Outbox`'s `put` (below), which hops each event
onto the reader's asyncio loop, so the engine thread runs no proxy code; tests and
benches pass a plain `queue.Queue.put`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.sampling import SamplingParams

_ids = itertools.count()


@dataclass(slots=True)
class TextDelta:
    text: str
    token_ids: list[int]


@dataclass(slots=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefill_s: float
    decode_s: float
    # Blocks the prefix cache had lost for room when the sequence ended (engine/prefix_cache.py
    # `evictions`): a growth before the session's next turn means that turn may find its prefix gone.
    cache_evictions: int | None = None


@dataclass(slots=True)
class Failed:
    error: Exception


Event = TextDelta | Finished | Failed


class Outbox:
    """One sequence's events, from the engine thread to a reader on an asyncio loop: the engine
    thread `put`s (as the sequence's `emit`), the reader awaits `get`. Made on the reader's loop."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, event: Event) -> None:
        """Any thread. Once the reader's loop is closed (a shutdown while a cancelled row still
        ends) nobody is listening: the event is dropped, not raised into the engine thread, where a
        RuntimeError would end every other row's step."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # "Event loop is closed"
            if not self._loop.is_closed():
                raise

    async def get(self) -> Event:
        return await self._events.get()


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    seq_id: int = field(default_factory=lambda: next(_ids))
    arrived_at: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    # When set, each output token's logprob and its top-1/top-2 margin are kept (identity tests, benchmarks).
    record_logprobs: bool = False
    token_logprobs: list[float] = field(default_factory=list)
    top2_margins: list[float] = field(default_factory=list)
    num_pauses: int = 0
    # How far the engine has taken it: "queued" (waiting for a slot), "prefilling", "decoding"
    # (its prompt is in; a paused row stays "decoding"). Set by the engine thread only; read by the
    # HTTP side to record where a request its client abandoned had got to.
    stage: str = "queued"
    # The request's own mlx-lm logits processors (engine/grammar.py: a grammar-constrained reply); the
    # decode batch puts the sampling penalties before them when the row is made (engine/decode_batch.py).
    logits_processors: list = field(default_factory=list)
    # Set by `cancel` from any thread, read by the engine's parts at their next step: one flag written
    # by one thread and read by another, which a plain bool does under the GIL.
    cancelled: bool = field(default=False, init=False)
    num_prompt_tokens: int = field(init=False)  # the prompt never changes: counted once

    def __post_init__(self):
        self.num_prompt_tokens = len(self.prompt_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def cancel(self) -> None:
        """Ask the engine to stop this sequence at its next step (any thread)."""
        self.cancelled = True
