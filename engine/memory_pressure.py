"""Memory pressure: what the running sequences' KV takes, and what gives way when it
is too much. Above the hard watermark the newest sequence is paused (a decoding row:
its KV pinned in the prefix cache or spilled to disk) or parked (a prefill); paused
sequences resume first-in first-out once the memory they need is free; when nothing
can be paused, one request is aborted, never all (docs/CACHE.md, "Pauses").

A part of `Scheduler` (engine/scheduler.py), which owns `paused` and the queues the
pauses take sequences out of (`prefill`, `rows`, `batch`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from engine import dense_prefill
from engine.admission import KV_ROOM_STEP, PrefillJob
from engine.cache_blocks import is_dense
from engine.decode_batch import Row, batch_of_one
from engine.memory import HARD_WATERMARK, SOFT_WATERMARK
from engine.sequence import Failed, Sequence
from common.errors import EngineError

log = logging.getLogger("prefixtrace.scheduler")


@dataclass(eq=False)
class Paused:
    """A sequence whose KV was spilled under memory pressure (or by the test hook)."""

    seq: Sequence
    path: Path | None  # the spilled KV; None for a prefill parked in the prefix cache
    started_at: float
    row: Row | None = None  # decoding when paused; None for a parked prefill
    sampler: object = None
    pending: int = 0  # already emitted; fed first on resume
    cached_ids: list[int] = field(default_factory=list)
    remaining: int = 0
    pos: int = 0  # parked prefill: prompt tokens in the spilled cache
    pinned: list[int] | None = None  # paused row: its KV's tokens, pinned in the prefix cache (no file)


class MemoryPressure:
    """Count the KV in use; pause, park, resume, abort."""

    def _active(self) -> int:
        return len(self.rows) + (self.prefill is not None)

    def _used_bytes(self) -> int:
        # Also read from other threads (`Engine.capacity`): iterate a snapshot, read `prefill` once.
        tokens = sum(len(r.seq.prompt_ids) + len(r.seq.output_ids) for r in list(self.rows.values()))
        used = tokens * self.memory.kv_bytes_per_token
        prefill = self.prefill
        if prefill is not None:
            used += prefill.pos * self.memory.kv_bytes_per_token + self.memory.transient_bytes
        return used

    def _fits(self, need: int, watermark: float = SOFT_WATERMARK) -> bool:
        return self._used_bytes() + need <= watermark * self.memory.capacity_bytes

    def _prompt_need(self, seq: Sequence) -> int:
        return seq.num_prompt_tokens * self.memory.kv_bytes_per_token + self.memory.transient_bytes

    def _final_need(self, seq: Sequence) -> int:
        return self.memory.need_bytes(seq.num_prompt_tokens + self._max_tokens(seq))

    def _max_tokens(self, seq: Sequence) -> int:
        """max_tokens, or when the request gave none, as many as the context and the memory
        ceiling leave (admission checked one token; running past what fits alone would
        outgrow the ceiling with nothing left to pause)."""
        if seq.params.max_tokens:
            return seq.params.max_tokens
        room = self.context_length if self.memory is None else min(self.context_length, self.memory.max_context_tokens)
        return max(1, min(self.default_max_tokens, room - seq.num_prompt_tokens))

    def _relieve_pressure(self) -> None:
        """Above the hard watermark, pause (or park) the newest sequence that has made
        progress since it last resumed; a lone sequence always runs (it fits alone)."""
        while self._active() > 1 and self._used_bytes() > HARD_WATERMARK * self.memory.capacity_bytes:
            candidates = [r.seq for uid, r in self.rows.items() if uid not in self._just_resumed]
            if self.prefill is not None:
                candidates.append(self.prefill.seq)
            if not candidates:
                self._abort_one()
                return
            victim = max(candidates, key=lambda s: (s.arrived_at, s.seq_id))
            if self.prefill is not None and victim is self.prefill.seq:
                self._park_prefill()
            else:
                self._pause_row(victim.seq_id, reason="hard memory pressure")

    def _pause_row(self, uid: int, *, reason: str) -> None:
        """Take a decoding row out of the batch with its exact state; its KV goes to disk."""
        batch, row = self.batch, self.rows[uid]
        index = batch.uids.index(uid)
        # mlx-lm's GenerationBatch samples one token ahead; that token is the
        # row's next output, so it is emitted now and fed first on resume.
        pending = batch._next_tokens[index].item()
        finish = self._take_token(row, pending, batch._next_logprobs[index])
        remaining = batch.max_tokens[index] - batch._num_tokens[index] - 1
        sampler = batch.samplers[index]
        cache, cached_ids = batch.extract_cache(index), list(batch.tokens[index])
        batch.filter([i for i in range(len(batch.uids)) if i != index])
        if finish is not None or remaining <= 0:
            self._finish(row, finish or "length", cache, cached_ids)
            return
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
            except EngineError as exc:  # this request ends; the others are not touched
                self.rows.pop(uid)
                self.prefix_cache.store(cached_ids, cache)  # a re-sent request resumes from it
                self._fail(row.seq, exc)
                return
        self.rows.pop(uid)
        self.paused.append(Paused(row.seq, path, row.started_at, row=row, sampler=sampler, pending=pending,
                                   cached_ids=cached_ids, remaining=remaining, pinned=pinned))
        del cache
        if pinned is None:  # a spill freed the row's KV: hand it back. Pinned, the resume reuses it
            mx.clear_cache()
        self.stats["pauses"] += 1
        log.info("paused request %d after %d output tokens (%s): %d KV tokens %s",
                 uid, len(row.seq.output_ids), reason, len(cached_ids),
                 "pinned in the prefix cache" if pinned is not None else "spilled")

    def _park_prefill(self) -> None:
        """Free a prefill's live KV; it resumes from what it had computed.

        Dense caches go into the prefix cache as pinned blocks (the same blocks
        progress commits write), so resuming is an ordinary prefix lookup; other
        cache types, or a disabled prefix cache, spill to a file. TurboQuant stays on
        the spill path on purpose: a paged TQ hit can be cut back to a group boundary,
        and re-prefilling that stretch in other chunks would change TQ's output, while
        the spill file resumes bit for bit."""
        job, self.prefill = self.prefill, None
        dense_prefill.finish(job)
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
        self.paused.append(Paused(job.seq, path, job.started_at, pos=job.pos))
        job.cache = None
        mx.clear_cache()
        self.stats["parks"] += 1
        log.info("parked prefill of request %d at %d/%d prompt tokens (hard memory pressure; %s)",
                 job.seq.seq_id, job.pos, job.seq.num_prompt_tokens, "pinned in the prefix cache" if path is None
                 else "spilled")

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

    def _unpark(self, paused: Paused) -> PrefillJob:
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

    def _resume(self) -> None:
        """Paused sequences resume first-in first-out, before any new admission, once the
        memory they need at their final length is free; never under hard pressure."""
        while self.paused:
            head = self.paused[0]
            if head.row is None and self.prefill is not None:
                return
            if head.row is not None and len(self.rows) >= self.max_batch:
                return
            if self.memory is not None and self._active() and not self._fits(self._final_need(head.seq)):
                return
            self.paused.popleft()
            if head.row is None:
                self.prefill = self._unpark(head)
            else:
                try:
                    cache = self._restore_row(head)
                except EngineError as exc:  # this request ends; the others are not touched
                    self._fail(head.seq, exc)
                    continue
                self._rejoin(head, cache)
            self.stats["resumes"] += 1
            log.info("resumed request %d (%s)", head.seq.seq_id, "prefill" if head.row is None else "decode")

    def _restore_row(self, paused: Paused) -> list:
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

    def _rejoin(self, paused: Paused, cache: list) -> None:
        seq = paused.seq
        self._join([seq], [paused.pending], [batch_of_one(layer) for layer in cache], [paused.cached_ids],
                   [paused.sampler], [paused.remaining])
        self.rows[seq.seq_id] = paused.row
        self._just_resumed.add(seq.seq_id)

    def _abort_one(self) -> None:
        """Nothing can be paused: fail one request (largest live KV, newest on ties), never all."""
        sizes = {uid: len(r.seq.prompt_ids) + len(r.seq.output_ids) for uid, r in self.rows.items()}
        uid = max(sizes, key=lambda u: (sizes[u], self.rows[u].seq.arrived_at))
        row = self.rows[uid]
        index = self.batch.uids.index(uid)
        self.batch.filter([i for i in range(len(self.batch.uids)) if i != index])
        self.rows.pop(uid)
        self._retire(row.seq, "aborted")
        self.stats["aborts"] += 1
        log.warning("aborted request %d under memory pressure (%d KV tokens)", uid, sizes[uid])
        row.seq.emit(Failed(EngineError("aborted under memory pressure; retry later", retryable=True)))

    def _release(self, paused: Paused) -> None:
        """Drop what a paused sequence holds: its spill file, or its pins in the prefix cache."""
        if paused.path is not None:
            with contextlib.suppress(OSError):
                paused.path.unlink(missing_ok=True)
        elif paused.row is None:
            self.prefix_cache.unpin(paused.seq.prompt_ids[: paused.pos])
        elif paused.pinned is not None:
            self.prefix_cache.unpin(paused.pinned)
