"""The decode batch: mlx-lm's `GenerationBatch` and the `Row` of each sequence in it. Rows join it,
decode one token each per step, stream their text, and leave it when they finish, are cancelled,
are paused or aborted; the scheduler (engine/scheduler.py) asks it to do each and ends what leaves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences
from mlx_lm.models.cache import KVCache

from engine import mlx_batch
from engine.batch_cache import RowBatchKVCache
from engine.sampling import GREEDY, make_penalties, make_sampler
from engine.sequence import Sequence, TextDelta
from engine.stop_strings import StopMatcher


@dataclass(eq=False)
class Row:
    """A sequence's place in the batch, with what samples and streams its tokens. It outlives a pause:
    a resumed row rejoins with the same sampler (a seeded one's key where it was) and processors (the
    penalties' view of the prompt's length)."""

    seq: Sequence
    detok: object
    stops: StopMatcher
    sampler: object
    processors: list  # the sampling penalties first, then the request's own (a grammar's mask has the last word)
    started_at: float
    first_token_at: float | None = None

    @classmethod
    def start(cls, seq: Sequence, detok, started_at: float) -> "Row":
        """The row of a sequence whose prompt is in, made from its request's settings."""
        return cls(seq, detok, StopMatcher(seq.params.stop), make_sampler(seq.params),
                   make_penalties(seq.params) + list(seq.logits_processors), started_at)


@dataclass(eq=False)
class Ended:
    """A row that left the batch for good, with the KV its prefix-cache entry is made of."""

    row: Row
    finish: str
    cache: list
    cached_ids: list[int]


@dataclass(eq=False)
class TakenOut:
    """A row taken out of the batch whole, to be paused: everything its resume needs."""

    row: Row
    pending: int  # sampled ahead by the batch, emitted now; fed first on resume
    remaining: int  # tokens it may still produce after `pending`
    cache: list
    cached_ids: list[int]


def batch_of_one(layer):
    """The batched form of one row's layer cache: dense layers become a
    `RowBatchKVCache`; other cache types batch through their own `merge`.

    Adopting a lone dense row's buffers as they are would save mlx-lm's copy of the KV on a
    warm hit, but measured slower on the H200 (B=1 decode 82 tok/s adopted against 110 merged,
    plain mlx-lm loop 109; docs/history/PERFORMANCE-notebook.md), so every row is merged."""
    if isinstance(layer, KVCache):
        return RowBatchKVCache.merge([layer])
    return layer.merge([layer])


class DecodeBatch:
    """Join rows, decode a step, take each token, let rows go."""

    def __init__(self, model, eos_token_ids):
        self.model = model
        self.eos = set(eos_token_ids)
        self._eos_stops = StopSequences([[t] for t in sorted(self.eos)])
        self._batch: GenerationBatch | None = None
        self.rows: dict[int, Row] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def kv_tokens(self) -> int:
        """Tokens the rows' KV holds (read from other threads too: iterates a snapshot)."""
        return sum(len(r.seq.prompt_ids) + len(r.seq.output_ids) for r in list(self.rows.values()))

    def join(self, rows: list[Row], inputs: list[int], layers: list, cached_ids: list[list[int]],
             max_tokens: list[int]) -> int:
        """Add rows: `inputs` are the tokens each feeds next, `layers` their batched cache holding
        `cached_ids`. The batch's size after."""
        seqs = [row.seq for row in rows]
        joining = GenerationBatch(
            self.model, [seq.seq_id for seq in seqs], mx.array(inputs), layers, cached_ids,
            [row.sampler for row in rows], GREEDY, [list(row.processors) for row in rows],
            [StopSequences() if seq.params.ignore_eos else self._eos_stops for seq in seqs], max_tokens,
        )
        if self._batch is None or len(self._batch) == 0:
            self._batch = joining
        else:
            self._batch.extend(joining)
        for row in rows:
            self.rows[row.seq.seq_id] = row
        return len(self._batch)

    def step(self) -> list[Ended]:
        """One token for every row; the rows that ended (eos, max_tokens, a stop string, a cancel)."""
        ended, leaving = [], {}
        for response in self._batch.next():
            row = self.rows[response.uid]
            if row.first_token_at is None:
                row.first_token_at = time.perf_counter()
            finish = self._take_token(row, response.token, response.logprobs)
            if response.finish_reason is not None:  # eos or max_tokens: the batch already let it go
                ended.append(self._end(row, finish or response.finish_reason, response.prompt_cache,
                                       response.all_tokens))
            elif finish is not None:
                leaving[response.uid] = finish
            elif row.seq.cancelled:
                leaving[response.uid] = "cancelled"
        if leaving:
            ended += self.remove(leaving)
        return ended

    def remove(self, leaving: dict[int, str]) -> list[Ended]:
        """Let these rows go ({uid: finish reason}), each with its KV."""
        ended, keep = [], []
        for index, uid in enumerate(self._batch.uids):
            if uid in leaving:
                ended.append(self._end(self.rows[uid], leaving[uid], self._batch.extract_cache(index),
                                       list(self._batch.tokens[index])))
            else:
                keep.append(index)
        self._batch.filter(keep)
        return ended

    def take_out(self, uid: int) -> TakenOut | Ended:
        """Take a row out with its exact state to pause it; `Ended` when the token the batch had
        sampled ahead (emitted now) ends it anyway."""
        batch = self._batch
        index = batch.uids.index(uid)
        row = self.rows[uid]
        pending, logprobs = mlx_batch.lookahead(batch, index)
        finish = self._take_token(row, pending, logprobs)
        remaining = mlx_batch.tokens_left(batch, index) - 1
        cache, cached_ids = batch.extract_cache(index), list(batch.tokens[index])
        batch.filter([i for i in range(len(batch.uids)) if i != index])
        if finish is not None or remaining <= 0:
            return self._end(row, finish or "length", cache, cached_ids)
        del self.rows[uid]
        return TakenOut(row, pending, remaining, cache, cached_ids)

    def drop(self, uid: int) -> Row:
        """Let a row go without its KV (an abort)."""
        index = self._batch.uids.index(uid)
        self._batch.filter([i for i in range(len(self._batch.uids)) if i != index])
        return self.rows.pop(uid)

    def clear(self) -> None:
        self._batch, self.rows = None, {}

    def _end(self, row: Row, finish: str, cache: list, cached_ids: list[int]) -> Ended:
        self.rows.pop(row.seq.seq_id, None)
        if finish == "length":
            self._flush_text(row)
        return Ended(row, finish, cache, cached_ids)

    def _take_token(self, row: Row, token: int, logprobs=None) -> str | None:
        """Record one sampled token and stream its text; the finish reason it causes, if any."""
        seq = row.seq
        seq.output_ids.append(token)
        if seq.record_logprobs and logprobs is not None:
            top2 = mx.topk(logprobs, 2)
            seq.token_logprobs.append(logprobs[token].item())
            seq.top2_margins.append(abs((top2[1] - top2[0]).item()))
        if token in self.eos and not seq.params.ignore_eos:
            self._flush_text(row)
            return "stop"
        row.detok.add_token(token)
        text, hit_stop = row.stops.feed(row.detok.last_segment)
        if text:
            seq.emit(TextDelta(text, [token]))
        return "stop" if hit_stop else None

    def _flush_text(self, row: Row) -> None:
        row.detok.finalize()
        text, _ = row.stops.feed(row.detok.last_segment)
        text += row.stops.flush()
        if text:
            row.seq.emit(TextDelta(text, []))
