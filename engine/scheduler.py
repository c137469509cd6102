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

The scheduler composes three parts, each owning its state behind a small interface it asks and
then tells (the way nano-vllm's scheduler asks its block manager `can_allocate` before `allocate`):
`Admission` (engine/admission.py: the waiting queue and the one prefill job, chunked and wave
prefill), `DecodeBatch` (engine/decode_batch.py: mlx-lm's batch and its rows) and `MemoryPressure`
(engine/memory_pressure.py: the KV budget, the paused sequences, the spill store).
engine/dense_prefill.py holds the dense stand-in a TurboQuant prefill runs on (the only place the
prefill path looks at a cache's kind). This module owns one step's order, the moves of a sequence
between the parts, and how a sequence ends.
"""

from __future__ import annotations

import logging
import time

from engine.admission import Admission, Prefilled, as_restored
from engine.decode_batch import DecodeBatch, Ended, Row, batch_of_one
from engine.memory import SOFT_WATERMARK, MemoryModel
from engine.memory_pressure import MemoryPressure, Paused
from engine.prefix_cache import PrefixCache
from engine.sequence import Failed, Finished, Sequence
from engine.spill import SpillStore
from prefixtrace.common.errors import EngineError

log = logging.getLogger("prefixtrace.scheduler")


# Seconds of decoding owed per second of prefill while both kinds of work wait.
# 1.0 would split time evenly; decode steps also pay for the scheduling around
# them and run slower right after a chunk, so a margin is needed to keep running
# rows above half their solo rate. Measured (bench/bench_scheduler.py): 1.5 gave
# 0.58 of solo on the CPU but 0.41-0.53 on an H200; 2.0 is the setting recorded
# in docs/PERFORMANCE.md. The price is a proportionally slower prefill.
DECODE_PER_PREFILL_S = 2.0


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
        cold_dense_prefill: bool = True,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.context_length = context_length
        self.max_batch = max_batch
        # Turns a prefix-cache hit into the caches prefill runs on (e.g. engine.tq_cache.to_turboquant).
        self.adapt_cache = adapt_cache or as_restored
        self.admission = Admission(model, prefix_cache, prefill_chunk=prefill_chunk, adapt_cache=self.adapt_cache,
                                   cold_dense_prefill=cold_dense_prefill)
        self.decode = DecodeBatch(model, tokenizer.eos_token_ids)
        self.pressure = MemoryPressure(memory, spill or SpillStore(), prefix_cache, self.adapt_cache,
                                       context_length=context_length, default_max_tokens=default_max_tokens)
        self._inflight: dict[int, Sequence] = {}  # added and not yet ended, wherever it is
        self._decode_s_since_prefill = 0.0
        self._last_prefill_s = 0.0
        self.stats = {"requests": 0, "cancelled": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                      "peak_batch": 0, "pauses": 0, "parks": 0, "resumes": 0, "aborts": 0, "waves": 0}

    # The parts' settings and state, by the names the engine, the tests and the benches use.

    @property
    def memory(self) -> MemoryModel | None:
        return self.pressure.memory

    @property
    def spill(self) -> SpillStore:
        return self.pressure.spill

    @property
    def prefill_chunk(self) -> int:
        return self.admission.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, tokens: int) -> None:  # bench/bench_engine_speed.py, while the engine is idle
        self.admission.prefill_chunk = tokens

    @property
    def prefill(self):
        return self.admission.prefill

    @property
    def paused(self):
        return self.pressure.paused

    # --- asking ------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.admission.waiting or self.admission.prefill or self.decode.rows or self.pressure.paused)

    def status(self) -> dict:
        """Read from other threads too (`Engine.capacity`)."""
        return {
            "running": len(self.decode),
            "prefilling": int(self.admission.prefill is not None),
            "waiting": len(self.admission.waiting),
            "paused": len(self.pressure.paused),
            "kv_bytes_in_use": self._used_bytes() if self.memory else None,
        }

    @property
    def num_running(self) -> int:
        return len(self.decode)

    def add(self, seq: Sequence) -> None:
        self._inflight[seq.seq_id] = seq
        self.admission.add(seq)

    # --- one step ----------------------------------------------------------------

    def step(self) -> None:
        self._reap_cancelled()
        if self.memory is not None:
            self._relieve_pressure()
        self._resume()
        self._admit()
        if self.decode.rows:
            t0 = time.perf_counter()
            self._decode()
            self._decode_s_since_prefill += time.perf_counter() - t0
        if self.admission.prefill is not None and (
            not self.decode.rows or self._decode_s_since_prefill >= self._last_prefill_s * DECODE_PER_PREFILL_S
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
        self.pressure.release_all()  # their spill files and pins go with them
        job = self.admission.clear()
        self.decode.clear()
        self.admission.keep_failed_prefill(job)  # before the errors: a request re-sent on its error finds it
        for seq in seqs:
            seq.emit(error_event)

    # --- memory: the parts' numbers together ---------------------------------------

    def _active(self) -> int:
        return len(self.decode) + (self.admission.prefill is not None)

    def _used_bytes(self) -> int:
        # read `prefill` once: other threads call this too
        return self.pressure.used_bytes(self.decode.kv_tokens(), self.admission.prefill)

    def _fits(self, need: int, watermark: float = SOFT_WATERMARK) -> bool:
        return self.pressure.fits(self._used_bytes(), need, watermark)

    def _wave_fits(self, seqs: list[Sequence]) -> bool:
        return self._fits(sum(self.pressure.prompt_need(seq) for seq in seqs))

    # --- admission and prefill -------------------------------------------------------

    def _admit(self) -> None:
        admission, pressure = self.admission, self.pressure
        while (admission.prefill is None and admission.waiting and len(self.decode) < self.max_batch
               and not pressure.paused):
            if self.memory is not None and self._active() and not self._fits(pressure.prompt_need(admission.waiting[0])):
                return  # wait for memory; paused requests and running rows go first
            admission.admit(self._fits if self.memory is not None else None)

    def _prefill_chunk(self) -> None:
        room = 0 if self.pressure.paused else self.max_batch - len(self.decode) - 1
        ready = self.admission.run_chunk(room, self._wave_fits if self.memory is not None else None)
        if ready is not None:
            self._start_decoding(ready)

    def _start_decoding(self, ready: Prefilled) -> None:
        """Rows join the decode batch: one sequence on its own cache, or a wave on the batched
        cache it was prefilled on."""
        jobs = ready.jobs
        seqs = [j.seq for j in jobs]
        for seq in seqs:
            seq.stage = "decoding"
        rows = [Row.start(j.seq, self.tokenizer.detokenizer, j.started_at) for j in jobs]
        layers = ready.layers if ready.layers is not None else [batch_of_one(layer) for layer in jobs[0].cache]
        size = self._join(rows, [seq.prompt_ids[-1] for seq in seqs], layers,
                          [list(seq.prompt_ids[:-1]) for seq in seqs], [self.pressure.max_tokens(seq) for seq in seqs])
        self.stats["peak_batch"] = max(self.stats["peak_batch"], size)
        if ready.layers is not None:
            self.stats["waves"] += 1

    def _join(self, rows: list[Row], *args) -> int:
        return self.decode.join(rows, *args)

    # --- decoding ----------------------------------------------------------------------

    def _decode(self) -> None:
        for ended in self.decode.step():
            self._finish(ended)
        # Every row in the batch decoded a token: each resumed one has made progress.
        self.pressure.just_resumed.clear()

    # --- memory pressure ----------------------------------------------------------------

    def _relieve_pressure(self) -> None:
        """Above the hard watermark, pause (or park) the newest sequence that has made
        progress since it last resumed; a lone sequence always runs (it fits alone)."""
        while self._active() > 1 and self.pressure.over_hard_watermark(self._used_bytes()):
            victim = self.pressure.victim(self.decode.rows, self.admission.prefill)
            if victim is None:
                self._abort_one()
                return
            if self.admission.prefill is not None and victim is self.admission.prefill.seq:
                self._park_prefill()
            else:
                self._pause_row(victim.seq_id, reason="hard memory pressure")

    def _pause_row(self, uid: int, *, reason: str) -> None:
        """Take a decoding row out of the batch with its exact state; its KV is pinned or spilled."""
        taken = self.decode.take_out(uid)
        if isinstance(taken, Ended):  # the token sampled ahead ended it
            self._finish(taken)
            return
        row, n_cached = taken.row, len(taken.cached_ids)
        try:
            paused = self.pressure.hold_row(taken)
        except EngineError as exc:  # this request ends; the others are not touched
            self._fail(row.seq, exc)
            return
        self.stats["pauses"] += 1
        log.info("paused request %d after %d output tokens (%s): %d KV tokens %s",
                 uid, len(row.seq.output_ids), reason, n_cached,
                 "pinned in the prefix cache" if paused.pinned is not None else "spilled")

    def _park_prefill(self) -> None:
        """Free the prefill's live KV; it resumes from what it had computed."""
        job = self.admission.take_prefill()
        paused = self.pressure.park(job)
        self.stats["parks"] += 1
        log.info("parked prefill of request %d at %d/%d prompt tokens (hard memory pressure; %s)",
                 job.seq.seq_id, job.pos, job.seq.num_prompt_tokens,
                 "pinned in the prefix cache" if paused.path is None else "spilled")

    def _resume(self) -> None:
        """Paused sequences resume first-in first-out, before any new admission, once the
        memory they need at their final length is free; never under hard pressure."""
        pressure = self.pressure
        while pressure.paused:
            head = pressure.paused[0]
            if head.row is None and self.admission.prefill is not None:
                return
            if head.row is not None and len(self.decode) >= self.max_batch:
                return
            if self.memory is not None and self._active() and not self._fits(pressure.final_need(head.seq)):
                return
            pressure.paused.popleft()
            if head.row is None:
                self.admission.prefill = pressure.unpark(head)
            else:
                try:
                    cache = pressure.restore_row(head)
                except EngineError as exc:  # this request ends; the others are not touched
                    self._fail(head.seq, exc)
                    continue
                self._rejoin(head, cache)
            self.stats["resumes"] += 1
            log.info("resumed request %d (%s)", head.seq.seq_id, "prefill" if head.row is None else "decode")

    def _rejoin(self, paused: Paused, cache: list) -> None:
        self._join([paused.row], [paused.pending], [batch_of_one(layer) for layer in cache], [paused.cached_ids],
                   [paused.remaining])
        self.pressure.just_resumed.add(paused.seq.seq_id)

    def _abort_one(self) -> None:
        """Nothing can be paused: fail one request (largest live KV, newest on ties), never all."""
        rows = self.decode.rows
        sizes = {uid: len(r.seq.prompt_ids) + len(r.seq.output_ids) for uid, r in rows.items()}
        uid = max(sizes, key=lambda u: (sizes[u], rows[u].seq.arrived_at))
        row = self.decode.drop(uid)
        self._retire(row.seq, "aborted")
        self.stats["aborts"] += 1
        log.warning("aborted request %d under memory pressure (%d KV tokens)", uid, sizes[uid])
        row.seq.emit(Failed(EngineError("aborted under memory pressure; retry later", retryable=True)))

    # --- endings ------------------------------------------------------------------

    def _fail(self, seq: Sequence, error: EngineError) -> None:
        """End one request with an error (its KV could not be spilled or read back)."""
        log.error("request %d failed: %s", seq.seq_id, error)
        self._retire(seq, "failed")
        self.stats["aborts"] += 1
        seq.emit(Failed(error))

    def _reap_cancelled(self) -> None:
        prefill = self.admission.prefill
        if prefill is not None and prefill.seq.cancelled:
            job = self.admission.take_prefill()
            self.prefix_cache.store(job.seq.prompt_ids, job.cache)  # keep what was prefilled
            self._retire(job.seq, "cancelled")
            job.seq.emit(Finished("cancelled", job.seq.num_prompt_tokens, 0, job.seq.num_cached_tokens, 0.0, 0.0))
        for paused in self.pressure.take_cancelled():
            self._retire(paused.seq, "cancelled")
            paused.seq.emit(Finished("cancelled", paused.seq.num_prompt_tokens, paused.seq.num_completion_tokens,
                                     paused.seq.num_cached_tokens, 0.0, 0.0))
        cancelled = {uid: "cancelled" for uid, row in self.decode.rows.items() if row.seq.cancelled}
        if cancelled:
            for ended in self.decode.remove(cancelled):
                self._finish(ended)
        for seq in self.admission.take_cancelled():
            self._retire(seq, "cancelled")
            seq.emit(Finished("cancelled", seq.num_prompt_tokens, 0, 0, 0.0, 0.0))

    def _finish(self, ended: Ended) -> None:
        self.prefix_cache.store(ended.cached_ids, ended.cache)
        end = time.perf_counter()
        row = ended.row
        first = row.first_token_at or end
        seq = row.seq
        self._retire(seq, ended.finish)
        seq.emit(Finished(ended.finish, seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_cached_tokens,
                          prefill_s=first - row.started_at, decode_s=end - first,
                          cache_evictions=self.prefix_cache.evictions))

    def _retire(self, seq: Sequence, finish: str) -> None:
        """Bookkeeping for a sequence that ends here (its final event follows): counted, and
        no longer in flight, so `fail_all` will not send it a second ending."""
        self._inflight.pop(seq.seq_id, None)
        self.stats["requests"] += 1
        self.stats["cancelled"] += finish == "cancelled"
        self.stats["prompt_tokens"] += seq.num_prompt_tokens
        self.stats["cached_tokens"] += seq.num_cached_tokens
        self.stats["generated_tokens"] += seq.num_completion_tokens
