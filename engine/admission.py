"""Admission and prefill: the waiting queue and the one prefill job. A waiting sequence is admitted
onto its prefix-cache hit and prefilled in chunks (or with same-length companions as one wave); when
its prompt is in, the scheduler (engine/scheduler.py) hands it to the decode batch.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from engine import dense_prefill
from engine.batch_cache import RowBatchKVCache
from engine.cache_blocks import is_dense
from engine.sequence import Sequence

log = logging.getLogger("prefixtrace.scheduler")

# Positions allocated beyond a restored prefix's prompt (mlx-lm's KVCache step): the
# prompt's rest and the first decode steps then write into the restored cache in place.
KV_ROOM_STEP = 256


def as_restored(cache: list) -> list:
    """The default `adapt_cache`: prefill runs on a prefix-cache hit's caches as they are."""
    return cache


@dataclass(eq=False)
class PrefillJob:
    seq: Sequence
    cache: list
    pos: int  # prompt tokens already in `cache`
    started_at: float = field(default_factory=time.perf_counter)
    # The caches the prompt ends in while `cache` is a dense stand-in for them (engine/dense_prefill.py).
    final_cache: list | None = None
    # A chunk is being run: `cache` may hold part of it (what `pos` does not count).
    in_chunk: bool = False


@dataclass(eq=False)
class Prefilled:
    """Jobs whose prompt is in, ready to decode: one on its own cache (`layers` None), or a wave
    on the batched cache it was prefilled on."""

    jobs: list[PrefillJob]
    layers: list | None = None


class Admission:
    """Admit, prefill chunk by chunk or as a wave."""

    # Sequences a wave may look at beyond the one finishing its prompt: bounds the
    # scan of a long queue, and how far a companion may overtake the ones it skips.
    WAVE_SCAN = 32

    def __init__(self, model, prefix_cache, *, prefill_chunk: int, adapt_cache, cold_dense_prefill: bool):
        self.model = model
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk
        # Turns a prefix-cache hit into the caches prefill runs on (e.g. engine.tq_cache.to_turboquant).
        self.adapt_cache = adapt_cache
        self.cold_dense_prefill = cold_dense_prefill  # engine/dense_prefill.py `plan`
        self.waiting: deque[Sequence] = deque()
        self.prefill: PrefillJob | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self, fits: Callable[[int], bool] | None) -> None:
        """The head of the queue starts prefilling on its prefix-cache hit (`fits`: the memory
        check its plan may consult; None without a memory model)."""
        seq = self.waiting.popleft()  # cancelled ones were reaped at the start of this step
        hit = self.prefix_cache.lookup(seq.prompt_ids, room=seq.num_prompt_tokens + KV_ROOM_STEP)
        seq.num_cached_tokens = hit.num_cached
        seq.stage = "prefilling"
        self.prefill = PrefillJob(seq, self.adapt_cache(hit.cache), hit.num_cached)
        dense_prefill.plan(self.prefill, self.prefill_chunk, fits, cold_dense=self.cold_dense_prefill)

    def run_chunk(self, room: int, wave_fits: Callable[[list[Sequence]], bool] | None) -> Prefilled | None:
        """Prefill one chunk; what is ready to decode once the prompt is in. `room`: rows the decode
        batch can take beside this one (0: no wave); `wave_fits`: whether the companions' prompts
        fit in memory together (None without a memory model)."""
        job = self.prefill
        prompt = job.seq.prompt_ids
        # The last prompt token is fed by the first decode step, which samples from it.
        n = min(self.prefill_chunk, len(prompt) - 1 - job.pos)
        if n > 0 and n == len(prompt) - 1 - job.pos:
            wave = self._companions(job, n, room, wave_fits)
            if wave:
                return self._prefill_wave([job, *wave], n)
        if n > 0:
            job.in_chunk = True
            self.model(mx.array(prompt[job.pos : job.pos + n])[None], cache=job.cache)
            job.pos += n
            # Progress survives a cancel or abort: the chunk's finished blocks are copied out
            # in the same evaluation as the chunk itself (one sync per chunk, as a plain
            # mlx-lm prefill has), and their disk copies go to the writer thread after it.
            blocks = self.prefix_cache.commit(prompt[: job.pos], job.cache, lazy=True)
            mx.eval([c.state for c in job.cache], blocks)
            self.prefix_cache.settle()
            job.in_chunk = False
        if job.pos == len(prompt) - 1:
            self.prefill = None
            if job.final_cache is not None:
                dense_prefill.finish(job)
                self.prefix_cache.commit(prompt[: job.pos], job.cache)
            return Prefilled([job])
        return None

    def take_prefill(self) -> PrefillJob:
        """The prefill job leaves admission (parked, or cancelled); its stand-in caches converted."""
        job, self.prefill = self.prefill, None
        dense_prefill.finish(job)
        return job

    def take_cancelled(self) -> list[Sequence]:
        """Waiting sequences cancelled wherever they are in the queue (one may sit behind paused
        ones or a memory check for long)."""
        cancelled = [s for s in self.waiting if s.cancelled]
        for seq in cancelled:
            self.waiting.remove(seq)
        return cancelled

    def clear(self) -> PrefillJob | None:
        """Forget the queue and the prefill (a failed step); the prefill job that was running."""
        job, self.prefill = self.prefill, None
        self.waiting.clear()
        return job

    def _companions(self, job: PrefillJob, n: int, room: int, wave_fits) -> list[PrefillJob]:
        """Waiting sequences that can prefill their last `n` prompt tokens in the same
        forward pass as `job`, with no padding: same prompt length, same cached prefix
        length, dense caches. Rows that arrive together then also decode unpadded
        (the fused attention kernel, no mask), instead of joining one by one at
        different lengths. At most one prefill chunk of tokens in all."""
        room = min(room, self.prefill_chunk // n - 1)
        if room <= 0 or not self.waiting or not is_dense(job.cache) or job.final_cache is not None:
            return []
        wave, skipped = [], []
        while self.waiting and len(wave) < room and len(skipped) < self.WAVE_SCAN:
            seq = self.waiting.popleft()
            if seq.cancelled or seq.num_prompt_tokens != job.seq.num_prompt_tokens:
                skipped.append(seq)
                continue
            if wave_fits is not None and not wave_fits([*(j.seq for j in wave), seq]):
                skipped.append(seq)
                break
            hit = self.prefix_cache.lookup(seq.prompt_ids)
            cache = self.adapt_cache(hit.cache)
            if hit.num_cached != job.pos or not is_dense(cache):
                skipped.append(seq)  # its lookup is repeated when it is admitted on its own
                continue
            seq.num_cached_tokens = hit.num_cached
            seq.stage = "prefilling"
            wave.append(PrefillJob(seq, cache, hit.num_cached))
        self.waiting.extendleft(reversed(skipped))
        return wave

    def _prefill_wave(self, jobs: list[PrefillJob], n: int) -> Prefilled:
        """Prefill the last `n` prompt tokens of several equal-length sequences as one batch."""
        self.prefill = None
        pos = jobs[0].pos
        layers = [RowBatchKVCache.merge([job.cache[i] for job in jobs]) for i in range(len(jobs[0].cache))]
        self.model(mx.array([job.seq.prompt_ids[pos : pos + n] for job in jobs]), cache=layers)
        mx.eval([c.state for c in layers])
        for index, job in enumerate(jobs):
            job.pos = pos + n
            self.prefix_cache.commit(job.seq.prompt_ids[: job.pos], [c.extract(index) for c in layers])
        log.debug("prefilled %d sequences of %d tokens as one wave", len(jobs), n)
        return Prefilled(jobs, layers)

    def keep_failed_prefill(self, job: PrefillJob | None) -> None:
        """What a prefill on dense caches had done when a step failed goes to the prefix cache,
        converted, as a cancel's is (a re-sent request then resumes from it): nothing of it
        was committed yet (a stand-in's chunks are not in the final caches' block format),
        while a dense engine's or the chunked path's per-chunk commits already hold theirs.

        Only between chunks: a failure inside a chunk (the forward pass or its evaluation)
        may have left part of that chunk in some layers and not others, lazily, and
        evaluating it could raise again (out of memory); nothing is kept then. A failure
        here is logged, never raised: the requests have their error already."""
        if job is None or job.final_cache is None or job.in_chunk:
            return
        try:
            dense_prefill.finish(job)
            self.prefix_cache.store(job.seq.prompt_ids[: job.pos], job.cache)
            log.info("request %d failed mid-prefill: its %d prefilled tokens are kept in the prefix cache",
                     job.seq.seq_id, job.pos)
        except Exception:
            log.exception("request %d: could not keep its prefilled tokens after the failed step", job.seq.seq_id)
