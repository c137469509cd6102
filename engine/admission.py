"""Admission and prefill: a waiting sequence is admitted onto its prefix-cache hit,
prefilled in chunks (or with same-length companions as one wave) and handed to the
decode batch when its prompt is in.

A part of `Scheduler` (engine/scheduler.py), which owns the queues these methods read
and write: `waiting`, `prefill` (the one sequence prefilling), `rows`, `paused`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import mlx.core as mx

from engine import dense_prefill
from engine.batch_cache import RowBatchKVCache
from engine.cache_blocks import is_dense
from engine.decode_batch import Row, batch_of_one
from engine.sampling import make_sampler
from engine.sequence import Sequence
from engine.stop_strings import StopMatcher

log = logging.getLogger("prefixtrace.scheduler")

# Positions allocated beyond a restored prefix's prompt (mlx-lm's KVCache step): the
# prompt's rest and the first decode steps then write into the restored cache in place.
KV_ROOM_STEP = 256


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


class Admission:
    """Admit, prefill chunk by chunk or as a wave, start decoding."""

    def _admit(self) -> None:
        while self.prefill is None and self.waiting and len(self.rows) < self.max_batch and not self.paused:
            if self.memory is not None and self._active() and not self._fits(self._prompt_need(self.waiting[0])):
                return  # wait for memory; paused requests and running rows go first
            seq = self.waiting.popleft()  # cancelled ones were reaped at the start of this step
            hit = self.prefix_cache.lookup(seq.prompt_ids, room=seq.num_prompt_tokens + KV_ROOM_STEP)
            seq.num_cached_tokens = hit.num_cached
            seq.stage = "prefilling"
            self.prefill = PrefillJob(seq, self.adapt_cache(hit.cache), hit.num_cached)
            dense_prefill.plan(self.prefill, self.prefill_chunk, self._fits if self.memory is not None else None,
                               cold_dense=self.cold_dense_prefill)

    def _prefill_chunk(self) -> None:
        job = self.prefill
        prompt = job.seq.prompt_ids
        # The last prompt token is fed by the first decode step, which samples from it.
        n = min(self.prefill_chunk, len(prompt) - 1 - job.pos)
        if n > 0 and n == len(prompt) - 1 - job.pos:
            wave = self._companions(job, n)
            if wave:
                self._prefill_wave([job, *wave], n)
                return
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
            self._start_decoding([job])
        elif job.seq.park_at is not None and job.pos >= job.seq.park_at and not job.seq.num_pauses:
            self._park_prefill()

    # Sequences a wave may look at beyond the one finishing its prompt: bounds the
    # scan of a long queue, and how far a companion may overtake the ones it skips.
    WAVE_SCAN = 32

    def _companions(self, job: PrefillJob, n: int) -> list[PrefillJob]:
        """Waiting sequences that can prefill their last `n` prompt tokens in the same
        forward pass as `job`, with no padding: same prompt length, same cached prefix
        length, dense caches. Rows that arrive together then also decode unpadded
        (the fused attention kernel, no mask), instead of joining one by one at
        different lengths. At most one prefill chunk of tokens in all."""
        room = min(self.max_batch - len(self.rows) - 1, self.prefill_chunk // n - 1)
        if room <= 0 or not self.waiting or self.paused or not is_dense(job.cache) or job.final_cache is not None:
            return []
        wave, skipped, need = [], [], 0
        while self.waiting and len(wave) < room and len(skipped) < self.WAVE_SCAN:
            seq = self.waiting.popleft()
            if seq.cancelled or seq.num_prompt_tokens != job.seq.num_prompt_tokens or seq.park_at is not None:
                skipped.append(seq)
                continue
            if self.memory is not None and not self._fits(need + self._prompt_need(seq)):
                skipped.append(seq)
                break
            hit = self.prefix_cache.lookup(seq.prompt_ids)
            cache = self.adapt_cache(hit.cache)
            if hit.num_cached != job.pos or not is_dense(cache):
                skipped.append(seq)  # its lookup is repeated when it is admitted on its own
                continue
            seq.num_cached_tokens = hit.num_cached
            seq.stage = "prefilling"
            if self.memory is not None:
                need += self._prompt_need(seq)
            wave.append(PrefillJob(seq, cache, hit.num_cached))
        self.waiting.extendleft(reversed(skipped))
        return wave

    def _prefill_wave(self, jobs: list[PrefillJob], n: int) -> None:
        """Prefill the last `n` prompt tokens of several equal-length sequences as one
        batch and start them decoding together."""
        self.prefill = None
        pos = jobs[0].pos
        layers = [RowBatchKVCache.merge([job.cache[i] for job in jobs]) for i in range(len(jobs[0].cache))]
        self.model(mx.array([job.seq.prompt_ids[pos : pos + n] for job in jobs]), cache=layers)
        mx.eval([c.state for c in layers])
        for index, job in enumerate(jobs):
            job.pos = pos + n
            self.prefix_cache.commit(job.seq.prompt_ids[: job.pos], [c.extract(index) for c in layers])
        self._start_decoding(jobs, layers)
        self.stats["waves"] += 1
        log.debug("prefilled %d sequences of %d tokens as one wave", len(jobs), n)

    def _start_decoding(self, jobs: list[PrefillJob], layers: list | None = None) -> None:
        """Rows join the decode batch: one sequence on its own cache (`layers` None), or a
        wave on the batched cache it was prefilled on."""
        seqs = [j.seq for j in jobs]
        for seq in seqs:
            seq.stage = "decoding"
        self._join(seqs, [seq.prompt_ids[-1] for seq in seqs],
                   layers if layers is not None else [batch_of_one(layer) for layer in jobs[0].cache],
                   [list(seq.prompt_ids[:-1]) for seq in seqs], [make_sampler(seq.params) for seq in seqs],
                   [self._max_tokens(seq) for seq in seqs])
        self.stats["peak_batch"] = max(self.stats["peak_batch"], len(self.batch))
        for j in jobs:
            params = j.seq.params
            self.rows[j.seq.seq_id] = Row(j.seq, self.tokenizer.detokenizer, StopMatcher(params.stop),
                                           started_at=j.started_at)

    def _keep_failed_prefill(self, job: PrefillJob | None) -> None:
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
