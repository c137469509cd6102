"""Pauses and parks forced at chosen points, for the memory-pressure tests and bench/bench_pause.py.

A seam around one engine's scheduler steps, so the product loop carries no test hook: after each
decode step a registered row is paused when its output reaches one of its lengths (the same
`_pause_row` hard memory pressure calls), and after each prefill chunk a registered prefill is parked
once that many prompt tokens are in (`_park_prefill`), once. Register a sequence before submitting it.

    forced_pauses(engine).add(seq, pause_at={5, 9})    # or park_at=48
"""

from __future__ import annotations

import weakref

_installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ForcedPauses:
    def __init__(self, scheduler):
        self.pause_at: dict[int, frozenset[int]] = {}
        self.park_at: dict[int, int] = {}
        decode, prefill_chunk = scheduler._decode, scheduler._prefill_chunk

        def decode_then_pause():
            decode()
            for uid, row in list(scheduler.decode.rows.items()):
                at = self.pause_at.get(uid)
                if at and len(row.seq.output_ids) in at and row.seq.num_pauses < len(at):
                    scheduler._pause_row(uid, reason="forced")

        def prefill_then_park():
            job = scheduler.admission.prefill
            prefill_chunk()
            at = self.park_at.get(job.seq.seq_id)
            if at is not None and scheduler.admission.prefill is job and job.pos >= at and not job.seq.num_pauses:
                scheduler._park_prefill()

        scheduler._decode = decode_then_pause
        scheduler._prefill_chunk = prefill_then_park

    def add(self, seq, *, pause_at=(), park_at: int | None = None) -> None:
        if pause_at:
            self.pause_at[seq.seq_id] = frozenset(pause_at)
        if park_at is not None:
            self.park_at[seq.seq_id] = park_at


def forced_pauses(engine) -> ForcedPauses:
    """The seam on this engine's scheduler (installed once; the engine must be ready)."""
    scheduler = engine.scheduler
    if scheduler not in _installed:
        _installed[scheduler] = ForcedPauses(scheduler)
    return _installed[scheduler]
