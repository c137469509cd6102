"""Continuous batching: admit, prefill in chunks, decode rows together.

Built on mlx-lm's `GenerationBatch`: batched decode over a left-padded
`BatchKVCache` (here `RowBatchKVCache`, which skips the mask when no row is
padded), per-row samplers, stop tokens, max_tokens, and
`extract_cache`/`filter`/`extend` for rows that leave or join.
Where we depart from mlx-lm's `BatchGenerator`, and why:

* Prefill runs one sequence at a time on its own single-row `KVCache`, exactly
  as a request alone would, and the row joins the decode batch only when its
  prompt is in. Batched right-padded prefill would shave little on these
  machines and would make "a reply is the same alone or batched" depend on
  padding arithmetic. The one exception is a *wave*: sequences of the same
  prompt length and the same cached prefix whose remaining prompt fits in one
  chunk together prefill as one unpadded batch and join the decode batch
  together, so rows that arrive together decode without a padding mask.
* `BatchGenerator` interleaves one prefill chunk per decode step whatever the
  chunk costs; a 2k-token chunk freezes decoding rows for its whole duration.
  Here decode and prefill share time: a prefill chunk runs only once the
  decode steps since the previous chunk took 2x as long as that chunk, so
  running rows keep more than half their solo rate.
* Stop strings are matched on text (`StopMatcher`), eos/max_tokens by
  `GenerationBatch`; cancellation removes a row at the next step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences
from mlx_lm.models.cache import KVCache

from engine.batch_cache import RowBatchKVCache
from engine.cache_blocks import is_dense
from engine.memory import HARD_WATERMARK, SOFT_WATERMARK, MemoryModel
from engine.prefix_cache import PrefixCache
from engine.sampling import GREEDY, make_sampler
from engine.sequence import Failed, Finished, Sequence, TextDelta
from engine.spill import SpillStore
from engine.stop_strings import StopMatcher
from engine.tq_cache import TurboQuantKVCache
from engine.tq_config import append_suffix, dense_copy, dense_copy_bytes
from common.errors import EngineError

log = logging.getLogger("prefixtrace.scheduler")


# Seconds of decoding owed per second of prefill while both kinds of work wait.
# 1.0 would split time evenly; decode steps also pay for the scheduling around
# them and run slower right after a chunk, so a margin is needed to keep running
# rows above half their solo rate. Measured (bench/bench_scheduler.py): 1.5 gave
# 0.58 of solo on the CPU but 0.41-0.53 on an H200; 2.0 is the setting recorded
# in docs/PERFORMANCE.md. The price is a proportionally slower prefill.
DECODE_PER_PREFILL_S = 2.0


@dataclass(eq=False)
class _Prefill:
    seq: Sequence
    cache: list
    pos: int  # prompt tokens already in `cache`
    started_at: float = field(default_factory=time.perf_counter)
    # Restored-prefix prefill: the restored TurboQuant caches while `cache` is their dense copy.
    quantised: list | None = None
    # A chunk is being run: `cache` may hold part of it (what `pos` does not count).
    in_chunk: bool = False


@dataclass(eq=False)
class _Row:
    seq: Sequence
    detok: object
    stops: StopMatcher
    started_at: float
    first_token_at: float | None = None


@dataclass(eq=False)
class _Paused:
    """A sequence whose KV was spilled under memory pressure (or by the test hook)."""

    seq: Sequence
    path: Path | None  # the spilled KV; None for a prefill parked in the prefix cache
    started_at: float
    row: _Row | None = None  # decoding when paused; None for a parked prefill
    sampler: object = None
    pending: int = 0  # already emitted; fed first on resume
    cached_ids: list[int] = field(default_factory=list)
    remaining: int = 0
    pos: int = 0  # parked prefill: prompt tokens in the spilled cache
    pinned: list[int] | None = None  # paused row: its KV's tokens, pinned in the prefix cache (no file)


# A TurboQuant engine's cold prefill of more than one chunk runs on dense caches and is
# quantised once at the end (`Scheduler._dense_suffix`). False: every chunk on the
# TurboQuant caches, as before session 6; kept for bench_turboquant's before/after figures.
COLD_DENSE_PREFILL = True

# Positions allocated beyond a restored prefix's prompt (mlx-lm's KVCache step): the
# prompt's rest and the first decode steps then write into the restored cache in place.
KV_ROOM_STEP = 256
# Adopt a lone row's cache into the batch instead of mlx-lm's merge (saves one copy of the KV
# on a warm hit). Off: measured on the H200 (bench_engine_speed.py), B=1 decode ran at 82 tok/s
# adopted against 110 merged (plain mlx-lm loop 109); the cause was not found.
ADOPT_ONE_ROW = False


def _batch_of_one(layer):
    """The batched form of one row's layer cache: dense layers become a
    `RowBatchKVCache`; other cache types batch through their own `merge`.

    With ADOPT_ONE_ROW a dense layer is adopted as it is (its buffers, spare room
    included): one row needs no padding, and mlx-lm's `merge` copies the whole KV into a
    buffer of exactly its length, which the first decode step then grows with a second
    copy. Off by default (see ADOPT_ONE_ROW)."""
    if ADOPT_ONE_ROW and type(layer) is KVCache and layer.keys is not None:
        batched = RowBatchKVCache([0])
        batched.keys, batched.values, batched._idx = layer.keys, layer.values, layer.offset
        batched.offset = mx.array([layer.offset])
        return batched
    if isinstance(layer, KVCache):
        return RowBatchKVCache.merge([layer])
    return layer.merge([layer])


class Scheduler:
    def __init__(
        self,
        model,
        tokenizer,
        prefix_cache: PrefixCache,
        *,
        context_length: int,
        max_batch: int = 8,
        prefill_chunk: int = 512,
        default_max_tokens: int = 4096,
        memory: MemoryModel | None = None,
        spill: SpillStore | None = None,
        adapt_cache=None,
    ):
        self.model = model
        # Turns a prefix-cache hit into the caches prefill runs on (e.g. engine.tq_cache.to_turboquant).
        self.adapt_cache = adapt_cache or (lambda cache: cache)
        self.memory = memory
        self.spill = spill or SpillStore()
        self.paused: deque[_Paused] = deque()
        self._just_resumed: set[int] = set()
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.context_length = context_length
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.default_max_tokens = default_max_tokens
        self._eos = set(tokenizer.eos_token_ids)
        self._eos_stops = StopSequences([[t] for t in sorted(self._eos)])
        self.waiting: deque[Sequence] = deque()
        self._inflight: dict[int, Sequence] = {}  # added and not yet ended, wherever it is
        self.prefill: _Prefill | None = None
        self.batch: GenerationBatch | None = None
        self.rows: dict[int, _Row] = {}
        self._decode_s_since_prefill = 0.0
        self._last_prefill_s = 0.0
        self.stats = {"requests": 0, "cancelled": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                      "peak_batch": 0, "pauses": 0, "parks": 0, "resumes": 0, "aborts": 0, "waves": 0}

    # --- asking ------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefill or self.rows or self.paused)

    def status(self) -> dict:
        return {
            "running": len(self.rows),
            "prefilling": int(self.prefill is not None),
            "waiting": len(self.waiting),
            "paused": len(self.paused),
            "kv_bytes_in_use": self._used_bytes() if self.memory else None,
        }

    @property
    def num_running(self) -> int:
        return len(self.rows)

    def add(self, seq: Sequence) -> None:
        self._inflight[seq.seq_id] = seq
        self.waiting.append(seq)

    # --- one step ----------------------------------------------------------------

    def step(self) -> None:
        self._reap_cancelled()
        if self.memory is not None:
            self._relieve_pressure()
        self._resume()
        self._admit()
        if self.rows:
            t0 = time.perf_counter()
            self._decode()
            self._decode_s_since_prefill += time.perf_counter() - t0
        if self.prefill is not None and (
            not self.rows or self._decode_s_since_prefill >= self._last_prefill_s * DECODE_PER_PREFILL_S
        ):
            t0 = time.perf_counter()
            self._prefill_chunk()
            self._last_prefill_s = time.perf_counter() - t0
            self._decode_s_since_prefill = 0.0

    def fail_all(self, error_event) -> None:
        """After an exception inside a step: every in-flight sequence gets the error, including
        one the step had taken out of every queue (between prefill and the decode batch, or
        popped into a wave) when it failed: such a sequence would otherwise wait forever."""
        seqs, self._inflight = list(self._inflight.values()), {}
        self.waiting.clear()
        while self.paused:  # their spill files and pins go with them
            self._release(self.paused.popleft())
        job = self.prefill
        self.prefill, self.batch, self.rows = None, None, {}
        self._keep_failed_prefill(job)  # before the errors: a request re-sent on its error finds it
        for seq in seqs:
            seq.emit(error_event)

    def _keep_failed_prefill(self, job: _Prefill | None) -> None:
        """What a prefill on dense caches had done when a step failed goes to the prefix cache,
        quantised, as a cancel's does (a re-sent request then resumes from it): nothing of it
        was committed yet (dense chunks are not in the TurboQuant block format), while a dense
        engine's or the chunked path's per-chunk commits already hold theirs.

        Only between chunks: a failure inside a chunk (the forward pass or its evaluation)
        may have left part of that chunk in some layers and not others, lazily, and
        evaluating it could raise again (out of memory); nothing is kept then. A failure
        here is logged, never raised: the requests have their error already."""
        if job is None or job.quantised is None or job.in_chunk:
            return
        try:
            self._requantise(job)
            self.prefix_cache.store(job.seq.prompt_ids[: job.pos], job.cache)
            log.info("request %d failed mid-prefill: its %d prefilled tokens are kept in the prefix cache",
                     job.seq.seq_id, job.pos)
        except Exception:
            log.exception("request %d: could not keep its prefilled tokens after the failed step", job.seq.seq_id)

    # --- admission and prefill ---------------------------------------------------

    def _admit(self) -> None:
        while self.prefill is None and self.waiting and len(self.rows) < self.max_batch and not self.paused:
            if self.memory is not None and self._active() and not self._fits(self._prompt_need(self.waiting[0])):
                return  # wait for memory; paused requests and running rows go first
            seq = self.waiting.popleft()  # cancelled ones were reaped at the start of this step
            hit = self.prefix_cache.lookup(seq.prompt_ids, room=seq.num_prompt_tokens + KV_ROOM_STEP)
            seq.num_cached_tokens = hit.num_cached
            seq.stage = "prefilling"
            self.prefill = _Prefill(seq, self.adapt_cache(hit.cache), hit.num_cached)
            self._dense_suffix(self.prefill)

    def _dense_suffix(self, job: _Prefill) -> None:
        """Restored-prefix prefill (docs/TURBOQUANT.md): before a suffix of more than one
        chunk after a restored TurboQuant prefix, prefill on a dense copy of the prefix
        (decoded once) instead of decoding the whole prefix again in every chunk; the
        suffix is quantised and appended at the end (`_requantise`). Only if the copy fits.

        A cold prefill (nothing restored) of more than one chunk runs the same way on fresh
        dense caches and is quantised once when the prompt is done, instead of every chunk
        attending over the decoded codes of all chunks before it (docs/TURBOQUANT.md). Its
        dense KV is what the memory model already charges for the prompt: `_prompt_need`
        and `_used_bytes` count dense bytes per token for a TurboQuant engine too, and
        `append_suffix` frees each dense layer as it is encoded. Its blocks reach the prefix
        cache once, quantised, at the end (a dense chunk is not in the TurboQuant block
        format: `PrefixCache.pageable`); a cancel or park quantises what was done first, and so
        does a step that fails between two chunks (`_keep_failed_prefill`); one that fails
        inside a chunk loses the chunks done."""
        suffix = job.seq.num_prompt_tokens - 1 - job.pos
        if suffix <= self.prefill_chunk or not any(type(c) is TurboQuantKVCache for c in job.cache):
            return
        if job.pos == 0:
            if not COLD_DENSE_PREFILL:
                return
            job.quantised = job.cache
            job.cache = [KVCache() if type(c) is TurboQuantKVCache else c for c in job.cache]
            log.info("request %d: cold prefill of %d tokens on dense caches, quantised at the end",
                     job.seq.seq_id, suffix)
            return
        need = dense_copy_bytes(job.cache, job.pos + suffix)
        if self.memory is not None and not self._fits(need):
            log.info("request %d: suffix of %d tokens prefills on the quantised prefix of %d (a dense copy of "
                     "%.1f MB does not fit)", job.seq.seq_id, suffix, job.pos, need / 1e6)
            return
        job.quantised, job.cache = job.cache, dense_copy(job.cache, suffix)
        log.info("request %d: suffix of %d tokens prefills on a dense copy of the restored %d-token prefix "
                 "(%.1f MB)", job.seq.seq_id, suffix, job.pos, need / 1e6)

    def _requantise(self, job: _Prefill) -> None:
        """End a dense-suffix prefill: the suffix is encoded and appended to the restored
        TurboQuant caches, whose prefix codes stay as they were, bit for bit."""
        if job.quantised is not None:
            job.cache, job.quantised = append_suffix(job.quantised, job.cache), None

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
            if job.quantised is not None:
                self._requantise(job)
                self.prefix_cache.commit(prompt[: job.pos], job.cache)
            self._start_decoding([job])
        elif job.seq.park_at is not None and job.pos >= job.seq.park_at and not job.seq.num_pauses:
            self._park_prefill()

    # Sequences a wave may look at beyond the one finishing its prompt: bounds the
    # scan of a long queue, and how far a companion may overtake the ones it skips.
    WAVE_SCAN = 32

    def _companions(self, job: _Prefill, n: int) -> list[_Prefill]:
        """Waiting sequences that can prefill their last `n` prompt tokens in the same
        forward pass as `job`, with no padding: same prompt length, same cached prefix
        length, dense caches. Rows that arrive together then also decode unpadded
        (the fused attention kernel, no mask), instead of joining one by one at
        different lengths. At most one prefill chunk of tokens in all."""
        room = min(self.max_batch - len(self.rows) - 1, self.prefill_chunk // n - 1)
        if room <= 0 or not self.waiting or self.paused or not is_dense(job.cache) or job.quantised is not None:
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
            wave.append(_Prefill(seq, cache, hit.num_cached))
        self.waiting.extendleft(reversed(skipped))
        return wave

    def _prefill_wave(self, jobs: list[_Prefill], n: int) -> None:
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

    def _start_decoding(self, jobs: list[_Prefill], layers: list | None = None) -> None:
        """Rows join the decode batch: one sequence on its own cache (`layers` None), or a
        wave on the batched cache it was prefilled on."""
        seqs = [j.seq for j in jobs]
        for seq in seqs:
            seq.stage = "decoding"
        self._join(seqs, [seq.prompt_ids[-1] for seq in seqs],
                   layers if layers is not None else [_batch_of_one(layer) for layer in jobs[0].cache],
                   [list(seq.prompt_ids[:-1]) for seq in seqs], [make_sampler(seq.params) for seq in seqs],
                   [self._max_tokens(seq) for seq in seqs])
        self.stats["peak_batch"] = max(self.stats["peak_batch"], len(self.batch))
        for j in jobs:
            params = j.seq.params
            self.rows[j.seq.seq_id] = _Row(j.seq, self.tokenizer.detokenizer, StopMatcher(params.stop),
                                           started_at=j.started_at)

    def _join(self, seqs: list[Sequence], inputs: list[int], layers: list, cached_ids: list[list[int]],
              samplers: list, max_tokens: list[int]) -> None:
        """Add rows to the decode batch: `inputs` are the tokens each row feeds next, `layers`
        their batched cache holding `cached_ids`."""
        joining = GenerationBatch(
            self.model, [seq.seq_id for seq in seqs], mx.array(inputs), layers, cached_ids, samplers, GREEDY,
            [list(seq.logits_processors) for seq in seqs], [StopSequences() if seq.params.ignore_eos else self._eos_stops for seq in seqs],
            max_tokens,
        )
        if self.batch is None or len(self.batch) == 0:
            self.batch = joining
        else:
            self.batch.extend(joining)

    # --- decode ------------------------------------------------------------------

    def _decode(self) -> None:
        leaving: dict[int, str] = {}
        for response in self.batch.next():
            self._just_resumed.discard(response.uid)
            row = self.rows[response.uid]
            if row.first_token_at is None:
                row.first_token_at = time.perf_counter()
            finish = self._take_token(row, response.token, response.logprobs)
            if response.finish_reason is not None:  # eos or max_tokens: the batch already let it go
                self._finish(row, finish or response.finish_reason, response.prompt_cache, response.all_tokens)
            elif finish is not None:
                leaving[response.uid] = finish
            elif row.seq.cancelled:
                leaving[response.uid] = "cancelled"
        if leaving:
            self._remove(leaving)
        for uid, row in list(self.rows.items()):
            if len(row.seq.output_ids) in row.seq.pause_at and row.seq.num_pauses < len(row.seq.pause_at):
                self._pause_row(uid, reason="test hook")

    def _take_token(self, row: _Row, token: int, logprobs=None) -> str | None:
        """Record one sampled token and stream its text; the finish reason it causes, if any."""
        seq = row.seq
        seq.output_ids.append(token)
        if seq.record_logprobs and logprobs is not None:
            top2 = mx.topk(logprobs, 2)
            seq.token_logprobs.append(logprobs[token].item())
            seq.top2_margins.append(abs((top2[1] - top2[0]).item()))
        if token in self._eos and not seq.params.ignore_eos:
            self._flush_text(row)
            return "stop"
        row.detok.add_token(token)
        text, hit_stop = row.stops.feed(row.detok.last_segment)
        if text:
            seq.emit(TextDelta(text, [token]))
        return "stop" if hit_stop else None

    def _flush_text(self, row: _Row) -> None:
        row.detok.finalize()
        text, _ = row.stops.feed(row.detok.last_segment)
        text += row.stops.flush()
        if text:
            row.seq.emit(TextDelta(text, []))

    def _remove(self, leaving: dict[int, str]) -> None:
        keep = []
        for index, uid in enumerate(self.batch.uids):
            if uid in leaving:
                self._finish(self.rows[uid], leaving[uid], self.batch.extract_cache(index), list(self.batch.tokens[index]))
            else:
                keep.append(index)
        self.batch.filter(keep)

    # --- memory pressure: pause, park, resume --------------------------------------

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
        self.paused.append(_Paused(row.seq, path, row.started_at, row=row, sampler=sampler, pending=pending,
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
        self._requantise(job)
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
        self.paused.append(_Paused(job.seq, path, job.started_at, pos=job.pos))
        job.cache = None
        mx.clear_cache()
        self.stats["parks"] += 1
        log.info("parked prefill of request %d at %d/%d prompt tokens (hard memory pressure; %s)",
                 job.seq.seq_id, job.pos, job.seq.num_prompt_tokens, "pinned in the prefix cache" if path is None
                 else "spilled")

    def _spill_parked(self, job: _Prefill, done: list[int]) -> Path | None:
        """A parked prefill's spill file; None when it cannot be written: the prefill then
        resumes like a pinned one, from what the prefix cache holds, recomputing the rest."""
        try:
            return self.spill.spill(f"prefill-{job.seq.seq_id}-{job.seq.num_pauses}", job.cache)
        except EngineError as exc:
            log.warning("request %d: %s; its prefill will recompute what the prefix cache does not hold",
                        job.seq.seq_id, exc)
            self.prefix_cache.pin(done)  # released on resume or cancel, like a pinned park
            return None

    def _unpark(self, paused: _Paused) -> _Prefill:
        seq = paused.seq
        if paused.path is not None:
            try:
                return _Prefill(seq, self.spill.restore(paused.path), paused.pos, started_at=paused.started_at)
            except EngineError as exc:  # recompute: progress commits left some of it in the prefix cache
                log.warning("request %d: %s; its prefill recomputes what the prefix cache does not hold",
                            seq.seq_id, exc)
        hit = self.prefix_cache.lookup(seq.prompt_ids, room=seq.num_prompt_tokens + KV_ROOM_STEP)
        if paused.path is None:  # parked in the prefix cache: its pins go
            self.prefix_cache.unpin(seq.prompt_ids[: paused.pos])
            if hit.num_cached < paused.pos:
                log.warning("request %d resumed from %d of its %d prefilled tokens (cache evicted the rest)",
                            seq.seq_id, hit.num_cached, paused.pos)
        return _Prefill(seq, self.adapt_cache(hit.cache), hit.num_cached, started_at=paused.started_at)

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

    def _restore_row(self, paused: _Paused) -> list:
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

    def _rejoin(self, paused: _Paused, cache: list) -> None:
        seq = paused.seq
        self._join([seq], [paused.pending], [_batch_of_one(layer) for layer in cache], [paused.cached_ids],
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

    def _release(self, paused: _Paused) -> None:
        """Drop what a paused sequence holds: its spill file, or its pins in the prefix cache."""
        if paused.path is not None:
            with contextlib.suppress(OSError):
                paused.path.unlink(missing_ok=True)
        elif paused.row is None:
            self.prefix_cache.unpin(paused.seq.prompt_ids[: paused.pos])
        elif paused.pinned is not None:
            self.prefix_cache.unpin(paused.pinned)

    def _fail(self, seq: Sequence, error: EngineError) -> None:
        """End one request with an error (its KV could not be spilled or read back)."""
        log.error("request %d failed: %s", seq.seq_id, error)
        self._retire(seq, "failed")
        self.stats["aborts"] += 1
        seq.emit(Failed(error))

    def _reap_cancelled(self) -> None:
        if self.prefill is not None and self.prefill.seq.cancelled:
            job, self.prefill = self.prefill, None
            self._requantise(job)
            self.prefix_cache.store(job.seq.prompt_ids, job.cache)  # keep what was prefilled
            self._retire(job.seq, "cancelled")
            job.seq.emit(Finished("cancelled", job.seq.num_prompt_tokens, 0, job.seq.num_cached_tokens, 0.0, 0.0))
        for paused in [p for p in self.paused if p.seq.cancelled]:
            self.paused.remove(paused)
            self._release(paused)
            self._retire(paused.seq, "cancelled")
            paused.seq.emit(Finished("cancelled", paused.seq.num_prompt_tokens, paused.seq.num_completion_tokens,
                                     paused.seq.num_cached_tokens, 0.0, 0.0))
        cancelled = {uid: "cancelled" for uid, row in self.rows.items() if row.seq.cancelled}
        if cancelled:
            self._remove(cancelled)
        # Waiting requests too, wherever they are in the queue (one may sit behind paused ones
        # or a memory check for long).
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            self._retire(seq, "cancelled")
            seq.emit(Finished("cancelled", seq.num_prompt_tokens, 0, 0, 0.0, 0.0))

    def _finish(self, row: _Row, finish: str, cache: list, cached_ids: list[int]) -> None:
        self.rows.pop(row.seq.seq_id, None)
        if finish == "length":
            self._flush_text(row)
        self.prefix_cache.store(cached_ids, cache)
        end = time.perf_counter()
        first = row.first_token_at or end
        seq = row.seq
        self._retire(seq, finish)
        seq.emit(Finished(finish, seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_cached_tokens,
                          prefill_s=first - row.started_at, decode_s=end - first))

    def _retire(self, seq: Sequence, finish: str) -> None:
        """Bookkeeping for a sequence that ends here (its final event follows): counted, and
        no longer in flight, so `fail_all` will not send it a second ending."""
        self._inflight.pop(seq.seq_id, None)
        self.stats["requests"] += 1
        self.stats["cancelled"] += finish == "cancelled"
        self.stats["prompt_tokens"] += seq.num_prompt_tokens
        self.stats["cached_tokens"] += seq.num_cached_tokens
        self.stats["generated_tokens"] += seq.num_completion_tokens
