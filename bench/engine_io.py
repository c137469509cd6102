"""Talking to an in-process `Engine` from a benchmark: submit, wait, time the first token."""

from __future__ import annotations

import queue
import time

from engine.sampling import SamplingParams
from engine.sequence import Failed, Finished, Sequence


def ttft(engine, token_ids) -> tuple[float, int]:
    """(seconds to the first token, cached prompt tokens) of one greedy 1-token request."""
    events: queue.Queue = queue.Queue()
    t0 = time.perf_counter()
    engine.submit(Sequence(list(token_ids), SamplingParams(temperature=0.0, max_tokens=1), events.put))
    first = None
    while True:
        event = events.get(timeout=600)
        first = first or time.perf_counter()
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, Finished):
            return first - t0, event.cached_tokens
