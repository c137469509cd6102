"""Memory pressure: the KV budget, the paused sequences and the spill store. It counts what the
live KV takes, says what must give way above the hard watermark (the newest sequence: a decoding
row paused, its KV pinned in the prefix cache or spilled to disk, or a prefill parked), holds paused
sequences until the memory they need is free, and gives their KV back on resume (docs/CACHE.md,
"Pauses"). The scheduler (engine/scheduler.py) asks it and takes the rows and prefills out of the
other parts; an abort, when nothing can be paused, is the scheduler's.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from engine.admission import KV_ROOM_STEP, PrefillJob
from engine.cache_blocks import is_dense
from engine.decode_batch import Row, TakenOut
from engine.memory import HARD_WATERMARK, SOFT_WATERMARK, MemoryModel
from engine.sequence import Sequence
from engine.spill import SpillStore
from prefixtrace.common.errors import EngineError

log = logging.getLogger("prefixtrace.scheduler")


@dataclass(eq=False)
class Paused:
    """A sequence taken out under memory pressure, and where its KV waits."""

    seq: Sequence
    path: Path | None  # the spilled KV; None for a prefill parked in the prefix cache
    started_at: float
    row: Row | None = None  # decoding when paused (its sampler and processors with it); None for a parked prefill
    pending: int = 0  # already emitted; fed first on resume
    cached_ids: list[int] = field(default_factory=list)
    remaining: int = 0
    pos: int = 0  # parked prefill: prompt tokens in the spilled cache
    pinned: list[int] | None = None  # paused row: its KV's tokens, pinned in the prefix cache (no file)


class MemoryPressure:
    """Count the KV in use; hold paused rows and parked prefills; give their KV back."""

    def __init__(self, memory: MemoryModel | None, spill: SpillStore, prefix_cache, adapt_cache, *,
                 context_length: int, default_max_tokens: int):
        self.memory = memory
        self.spill = spill
        self.prefix_cache = prefix_cache
        self.adapt_cache = adapt_cache
        self.context_length = context_length
        self.default_max_tokens = default_max_tokens
        self.paused: deque[Paused] = deque()
        # Rows resumed and not yet decoded since: never chosen to pause again before they progress.
        self.just_resumed: set[int] = set()

    # --- asking ------------------------------------------------------------------

    def used_bytes(self, kv_tokens: int, prefill: PrefillJob | None) -> int:
        """The KV of `kv_tokens` decoding tokens and a prefill at its position."""
        used = kv_tokens * self.memory.kv_bytes_per_token
        if prefill is not None:
            used += prefill.pos * self.memory.kv_bytes_per_token + self.memory.transient_bytes
        return used

    def fits(self, used: int, need: int, watermark: float = SOFT_WATERMARK) -> bool:
        return used + need <= watermark * self.memory.capacity_bytes

    def over_hard_watermark(self, used: int) -> bool:
        return used > HARD_WATERMARK * self.memory.capacity_bytes

    def prompt_need(self, seq: Sequence) -> int:
        return seq.num_prompt_tokens * self.memory.kv_bytes_per_token + self.memory.transient_bytes

    def final_need(self, seq: Sequence) -> int:
        return self.memory.need_bytes(seq.num_prompt_tokens + self.max_tokens(seq))

    def max_tokens(self, seq: Sequence) -> int:
        """max_tokens, or when the request gave none, as many as the context and the memory
        ceiling leave (admission checked one token; running past what fits alone would
        outgrow the ceiling with nothing left to pause)."""
        if seq.params.max_tokens:
            return seq.params.max_tokens
        room = self.context_length if self.memory is None else min(self.context_length, self.memory.max_context_tokens)
        return max(1, min(self.default_max_tokens, room - seq.num_prompt_tokens))

    def victim(self, rows: dict[int, Row], prefill: PrefillJob | None) -> Sequence | None:
        """The newest sequence that has made progress since it last resumed; None when none has."""
        candidates = [r.seq for uid, r in rows.items() if uid not in self.just_resumed]
        if prefill is not None:
            candidates.append(prefill.seq)
        return max(candidates, key=lambda s: (s.arrived_at, s.seq_id)) if candidates else None

    # --- holding -----------------------------------------------------------------

    def hold_row(self, taken: TakenOut) -> Paused:
        """Keep a row taken out of the decode batch: its KV pinned in the prefix cache, or spilled.
        Raises EngineError when it can be neither (its KV then goes to the prefix cache, so a
        re-sent request resumes from it)."""
        row, cache, cached_ids = taken.row, taken.cache, taken.cached_ids
        uid = row.seq.seq_id
        row.seq.num_pauses += 1
        path, pinned = None, None
        if self.prefix_cache.pageable(cache) and is_dense(cache):
            # The prefix cache already holds the prompt's blocks (committed during prefill) and
            # whatever earlier turns left: only the blocks it lacks are copied, and the pins
            # keep them until the resume restores them by an ordinary lookup. Bit for bit the
            # same KV as a spill file, without writing the whole row (docs/CACHE.md, "Pauses").
            self.prefix_cache.pin(cached_ids)
            self.prefix_cache.store(cached_ids, cache)
            if self.prefix_cache.holds(cached_ids):
                pinned = cached_ids
            else:  # no room in either tier: the spill file below
                self.prefix_cache.unpin(cached_ids)
        if pinned is None:
            try:
                path = self.spill.spill(f"row-{uid}-{row.seq.num_pauses}", cache)
            except EngineError:
                self.prefix_cache.store(cached_ids, cache)
                raise
        paused = Paused(row.seq, path, row.started_at, row=row, pending=taken.pending,
                        cached_ids=cached_ids, remaining=taken.remaining, pinned=pinned)
        self.paused.append(paused)
        taken.cache = cache = None
        if pinned is None:  # a spill freed the row's KV: hand it back. Pinned, the resume reuses it
            mx.clear_cache()
        return paused

    def park(self, job: PrefillJob) -> Paused:
        """Keep a prefill taken out of admission; it resumes from what it had computed.

        Dense caches go into the prefix cache as pinned blocks (the same blocks
        progress commits write), so resuming is an ordinary prefix lookup; other
        cache types, or a disabled prefix cache, spill to a file. TurboQuant stays on
        the spill path on purpose: a paged TQ hit can be cut back to a group boundary,
        and re-prefilling that stretch in other chunks would change TQ's output, while
        the spill file resumes bit for bit."""
        job.seq.num_pauses += 1
        done = job.seq.prompt_ids[: job.pos]
        path = None
        if self.prefix_cache.enabled and is_dense(job.cache) and job.pos > 0:
            self.prefix_cache.pin(done)
            self.prefix_cache.store(done, job.cache)
            if not self.prefix_cache.holds(done):  # no room in either tier
                self.prefix_cache.unpin(done)
                path = self._spill_parked(job, done)
        else:
            path = self._spill_parked(job, done)
        paused = Paused(job.seq, path, job.started_at, pos=job.pos)
        self.paused.append(paused)
        job.cache = None
        mx.clear_cache()
        return paused

    def _spill_parked(self, job: PrefillJob, done: list[int]) -> Path | None:
        """A parked prefill's spill file; None when it cannot be written: the prefill then
        resumes like a pinned one, from what the prefix cache holds, recomputing the rest."""
        try:
            return self.spill.spill(f"prefill-{job.seq.seq_id}-{job.seq.num_pauses}", job.cache)
        except EngineError as exc:
            log.warning("request %d: %s; its prefill will recompute what the prefix cache does not hold",
                        job.seq.seq_id, exc)
            self.prefix_cache.pin(done)  # released on resume or cancel, like a pinned park
            return None

    # --- giving back ---------------------------------------------------------------

    def unpark(self, paused: Paused) -> PrefillJob:
        """A parked prefill's job again, on its spilled caches or its prefix-cache hit."""
        seq = paused.seq
        if paused.path is not None:
            try:
                return PrefillJob(seq, self.spill.restore(paused.path), paused.pos, started_at=paused.started_at)
            except EngineError as exc:  # recompute: progress commits left some of it in the prefix cache
                log.warning("request %d: %s; its prefill recomputes what the prefix cache does not hold",
                            seq.seq_id, exc)
        hit = self.prefix_cache.lookup(seq.prompt_ids, room=seq.num_prompt_tokens + KV_ROOM_STEP)
        if paused.path is None:  # parked in the prefix cache: its pins go
            self.prefix_cache.unpin(seq.prompt_ids[: paused.pos])
            if hit.num_cached < paused.pos:
                log.warning("request %d resumed from %d of its %d prefilled tokens (cache evicted the rest)",
                            seq.seq_id, hit.num_cached, paused.pos)
        return PrefillJob(seq, self.adapt_cache(hit.cache), hit.num_cached, started_at=paused.started_at)

    def restore_row(self, paused: Paused) -> list:
        """A paused row's exact KV: from its spill file, or from the prefix cache's pinned blocks."""
        if paused.pinned is None:
            return self.spill.restore(paused.path, tokens=len(paused.cached_ids))
        n = len(paused.cached_ids)
        hit = self.prefix_cache.lookup([*paused.cached_ids, paused.pending], room=n + KV_ROOM_STEP)
        self.prefix_cache.unpin(paused.pinned)
        paused.pinned = None
        if hit.num_cached != n:  # pinned blocks are never evicted; a damaged disk block can still miss
            raise EngineError(f"the paused request's KV came back with {hit.num_cached} of its {n} tokens",
                              retryable=True)
        return hit.cache

    def take_cancelled(self) -> list[Paused]:
        """Paused sequences whose request was cancelled, out of the queue with what they held released."""
        cancelled = [p for p in self.paused if p.seq.cancelled]
        for paused in cancelled:
            self.paused.remove(paused)
            self.release(paused)
        return cancelled

    def release_all(self) -> None:
        """Every paused sequence's spill file and pins go (a failed step)."""
        while self.paused:
            self.release(self.paused.popleft())

    def release(self, paused: Paused) -> None:
        """Drop what a paused sequence holds: its spill file, or its pins in the prefix cache."""
        if paused.path is not None:
            with contextlib.suppress(OSError):
                paused.path.unlink(missing_ok=True)
        elif paused.row is None:
            self.prefix_cache.unpin(paused.seq.prompt_ids[: paused.pos])
        elif paused.pinned is not None:
            self.prefix_cache.unpin(paused.pinned)
