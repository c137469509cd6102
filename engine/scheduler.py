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

The scheduler's parts, each a module of one job mixed into `Scheduler`:
`engine/admission.py` (admission, chunked and wave prefill), `engine/decode_batch.py`
(the decode batch), `engine/memory_pressure.py` (KV accounting, pause/park/resume,
abort) and `engine/dense_prefill.py` (the dense stand-in a TurboQuant prefill runs on,
the only place the prefill path looks at a cache's kind). This module owns the state
they share, one step's order, and how a sequence ends.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from mlx_lm.generate import GenerationBatch, StopSequences

from engine import dense_prefill
from engine.admission import Admission, PrefillJob
from engine.decode_batch import Decoding, Row
from engine.memory import MemoryModel
from engine.memory_pressure import MemoryPressure, Paused
from engine.prefix_cache import PrefixCache
from engine.sequence import Failed, Finished, Sequence
from engine.spill import SpillStore
from common.errors import EngineError

log = logging.getLogger("prefixtrace.scheduler")


# Seconds of decoding owed per second of prefill while both kinds of work wait.
# 1.0 would split time evenly; decode steps also pay for the scheduling around
# them and run slower right after a chunk, so a margin is needed to keep running
# rows above half their solo rate. Measured (bench/bench_scheduler.py): 1.5 gave
# 0.58 of solo on the CPU but 0.41-0.53 on an H200; 2.0 is the setting recorded
# in docs/PERFORMANCE.md. The price is a proportionally slower prefill.
DECODE_PER_PREFILL_S = 2.0


class Scheduler(Admission, Decoding, MemoryPressure):
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
        cold_dense_prefill: bool = True,
    ):
        self.model = model
        self.cold_dense_prefill = cold_dense_prefill  # engine/dense_prefill.py `plan`
        # Turns a prefix-cache hit into the caches prefill runs on (e.g. engine.tq_cache.to_turboquant).
        self.adapt_cache = adapt_cache or (lambda cache: cache)
        self.memory = memory
        self.spill = spill or SpillStore()
        self.paused: deque[Paused] = deque()
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
        self.prefill: PrefillJob | None = None
        self.batch: GenerationBatch | None = None
        self.rows: dict[int, Row] = {}
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

    # --- endings ------------------------------------------------------------------

    def _fail(self, seq: Sequence, error: EngineError) -> None:
        """End one request with an error (its KV could not be spilled or read back)."""
        log.error("request %d failed: %s", seq.seq_id, error)
        self._retire(seq, "failed")
        self.stats["aborts"] += 1
        seq.emit(Failed(error))

    def _reap_cancelled(self) -> None:
        if self.prefill is not None and self.prefill.seq.cancelled:
            job, self.prefill = self.prefill, None
            dense_prefill.finish(job)
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

    def _finish(self, row: Row, finish: str, cache: list, cached_ids: list[int]) -> None:
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
