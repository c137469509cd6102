"""The decode batch: rows join it, decode one token each per step, stream their
text, and leave it when they finish or are cancelled.

A part of `Scheduler` (engine/scheduler.py), which owns `batch` (mlx-lm's
`GenerationBatch`) and `rows` (the `Row` of each sequence in it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences
from mlx_lm.models.cache import KVCache

from engine.batch_cache import RowBatchKVCache
from engine.sampling import GREEDY
from engine.sequence import Sequence, TextDelta
from engine.stop_strings import StopMatcher


@dataclass(eq=False)
class Row:
    seq: Sequence
    detok: object
    stops: StopMatcher
    started_at: float
    first_token_at: float | None = None


def batch_of_one(layer):
    """The batched form of one row's layer cache: dense layers become a
    `RowBatchKVCache`; other cache types batch through their own `merge`.

    Adopting a lone dense row's buffers as they are would save mlx-lm's copy of the KV on a
    warm hit, but measured slower on the H200 (B=1 decode 82 tok/s adopted against 110 merged,
    plain mlx-lm loop 109; docs/history/PERFORMANCE-notebook.md), so every row is merged."""
    if isinstance(layer, KVCache):
        return RowBatchKVCache.merge([layer])
    return layer.merge([layer])


class Decoding:
    """Join rows, decode a step, take each token, let rows go."""

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

    def _take_token(self, row: Row, token: int, logprobs=None) -> str | None:
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

    def _flush_text(self, row: Row) -> None:
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
