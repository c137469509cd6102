"""`Sequence`: one request's state inside the engine, and the events it emits.

The Sequence is the only object that crosses between the HTTP side and the
engine thread. The HTTP side creates it and reads its events; the engine thread
alone mutates its counters. Events are delivered through `emit`, a callable the
HTTP side provides (it hops onto the asyncio loop), so the engine never touches
asyncio.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.sampling import SamplingParams, make_penalties

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


@dataclass(slots=True)
class Failed:
    error: Exception


Event = TextDelta | Finished | Failed


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
    # mlx-lm logits processors for this row (engine/grammar.py: a grammar-constrained reply); none keeps
    # the batch on GenerationBatch's unprocessed path.
    logits_processors: list = field(default_factory=list)
    _cancel: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        # The sampling penalties run first: a grammar's mask, added later, then has the last word.
        self.logits_processors = make_penalties(self.params) + list(self.logits_processors)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def cancel(self) -> None:
        """Ask the engine to stop this sequence at its next step (any thread)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()
