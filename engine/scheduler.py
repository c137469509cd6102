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
  padding arithmetic.
* `BatchGenerator` interleaves one prefill chunk per decode step whatever the
  chunk costs; a 2k-token chunk freezes decoding rows for its whole duration.
  Here decode and prefill share time: a prefill chunk runs only once the
  decode steps since the previous chunk took 1.5x as long as that chunk, so
  running rows keep more than half their solo rate.
* Stop strings are matched on text (`StopMatcher`), eos/max_tokens by
  `GenerationBatch`; cancellation removes a row at the next step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences
from mlx_lm.models.cache import KVCache

from engine.batch_cache import RowBatchKVCache
from engine.prefix_cache import PrefixCache
from engine.sampling import GREEDY
from engine.sequence import Finished, Sequence, TextDelta
from engine.stop_strings import StopMatcher


# Seconds of decoding owed per second of prefill while both kinds of work wait.
# 1.0 would split time evenly; decode steps also pay for the scheduling around
# them, so a margin keeps running rows above half their solo rate (measured in
# bench/bench_scheduler.py), at the price of a proportionally slower prefill.
DECODE_PER_PREFILL_S = 1.5


@dataclass(eq=False)
class _Prefill:
    seq: Sequence
    cache: list
    pos: int  # prompt tokens already in `cache`
    started_at: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class _Row:
    seq: Sequence
    detok: object
    stops: StopMatcher
    started_at: float
    first_token_at: float | None = None


def _batch_of_one(layer):
    """The batched form of one row's layer cache: dense layers become a
    `RowBatchKVCache`; other cache types batch through their own `merge`."""
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
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.context_length = context_length
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.default_max_tokens = default_max_tokens
        self._eos = set(tokenizer.eos_token_ids)
        self._eos_stops = StopSequences([[t] for t in sorted(self._eos)])
        self.waiting: deque[Sequence] = deque()
        self.prefill: _Prefill | None = None
        self.batch: GenerationBatch | None = None
        self.rows: dict[int, _Row] = {}
        self._decode_s_since_prefill = 0.0
        self._last_prefill_s = 0.0
        self.stats = {"requests": 0, "cancelled": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                      "peak_batch": 0}

    # --- asking ------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefill or self.rows)

    @property
    def num_running(self) -> int:
        return len(self.rows)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # --- one step ----------------------------------------------------------------

    def step(self) -> None:
        self._reap_cancelled()
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
        """After an exception inside a step: every in-flight sequence gets the error."""
        seqs = list(self.waiting) + ([self.prefill.seq] if self.prefill else []) + [r.seq for r in self.rows.values()]
        self.waiting.clear()
        self.prefill, self.batch, self.rows = None, None, {}
        for seq in seqs:
            seq.emit(error_event)

    # --- admission and prefill ---------------------------------------------------

    def _admit(self) -> None:
        while self.prefill is None and self.waiting and len(self.rows) < self.max_batch:
            seq = self.waiting.popleft()
            if seq.cancelled:
                self._count(seq, "cancelled")
                seq.emit(Finished("cancelled", seq.num_prompt_tokens, 0, 0, 0.0, 0.0))
                continue
            hit = self.prefix_cache.lookup(seq.prompt_ids)
            seq.num_cached_tokens = hit.num_cached
            self.prefill = _Prefill(seq, hit.cache, hit.num_cached)

    def _prefill_chunk(self) -> None:
        job = self.prefill
        prompt = job.seq.prompt_ids
        # The last prompt token is fed by the first decode step, which samples from it.
        n = min(self.prefill_chunk, len(prompt) - 1 - job.pos)
        if n > 0:
            self.model(mx.array(prompt[job.pos : job.pos + n])[None], cache=job.cache)
            mx.eval([c.state for c in job.cache])
            job.pos += n
        if job.pos == len(prompt) - 1:
            self.prefill = None
            self._start_decoding(job)

    def _start_decoding(self, job: _Prefill) -> None:
        seq, params = job.seq, job.seq.params
        max_tokens = params.max_tokens or min(self.default_max_tokens, self.context_length - seq.num_prompt_tokens)
        joining = GenerationBatch(
            self.model,
            [seq.seq_id],
            mx.array(seq.prompt_ids[-1:]),
            [_batch_of_one(layer) for layer in job.cache],
            [list(seq.prompt_ids[:-1])],
            [params.make_sampler()],
            GREEDY,
            [[]],
            [StopSequences() if params.ignore_eos else self._eos_stops],
            [max_tokens],
        )
        if self.batch is None or len(self.batch) == 0:
            self.batch = joining
        else:
            self.batch.extend(joining)
        self.stats["peak_batch"] = max(self.stats["peak_batch"], len(self.batch))
        self.rows[seq.seq_id] = _Row(seq, self.tokenizer.detokenizer, StopMatcher(params.stop), started_at=job.started_at)

    # --- decode ------------------------------------------------------------------

    def _decode(self) -> None:
        leaving: dict[int, str] = {}
        for response in self.batch.next():
            row = self.rows[response.uid]
            if row.first_token_at is None:
                row.first_token_at = time.perf_counter()
            finish = self._take_token(row, response.token)
            if response.finish_reason is not None:  # eos or max_tokens: the batch already let it go
                self._finish(row, finish or response.finish_reason, response.prompt_cache, response.all_tokens)
            elif finish is not None:
                leaving[response.uid] = finish
            elif row.seq.cancelled:
                leaving[response.uid] = "cancelled"
        if leaving:
            self._remove(leaving)

    def _take_token(self, row: _Row, token: int) -> str | None:
        """Record one sampled token and stream its text; the finish reason it causes, if any."""
        seq = row.seq
        seq.output_ids.append(token)
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

    def _reap_cancelled(self) -> None:
        if self.prefill is not None and self.prefill.seq.cancelled:
            job, self.prefill = self.prefill, None
            self.prefix_cache.store(job.seq.prompt_ids, job.cache)  # keep what was prefilled
            self._count(job.seq, "cancelled")
            job.seq.emit(Finished("cancelled", job.seq.num_prompt_tokens, 0, job.seq.num_cached_tokens, 0.0, 0.0))
        cancelled = {uid: "cancelled" for uid, row in self.rows.items() if row.seq.cancelled}
        if cancelled:
            self._remove(cancelled)

    def _finish(self, row: _Row, finish: str, cache: list, cached_ids: list[int]) -> None:
        self.rows.pop(row.seq.seq_id, None)
        if finish == "length":
            self._flush_text(row)
        self.prefix_cache.store(cached_ids, cache)
        end = time.perf_counter()
        first = row.first_token_at or end
        seq = row.seq
        self._count(seq, finish)
        seq.emit(Finished(finish, seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_cached_tokens,
                          prefill_s=first - row.started_at, decode_s=end - first))

    def _count(self, seq: Sequence, finish: str) -> None:
        self.stats["requests"] += 1
        self.stats["cancelled"] += finish == "cancelled"
        self.stats["prompt_tokens"] += seq.num_prompt_tokens
        self.stats["cached_tokens"] += seq.num_cached_tokens
        self.stats["generated_tokens"] += seq.num_completion_tokens
