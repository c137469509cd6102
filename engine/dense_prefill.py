"""Prefill on dense stand-in caches: where the scheduler's prefill meets a cache kind.

A TurboQuant cache is slow to prefill on chunk by chunk (every chunk attends over the
decoded codes of all before it), so a prefill of more than one chunk may run on dense
caches instead and be converted once at the end (docs/TURBOQUANT.md). The scheduler
knows this only as `plan` (at admission: the job's caches may be swapped for a dense
stand-in, the real ones kept in `job.final_cache`) and `finish` (the stand-in converted
back, when the prompt is in or the prefill stops early). For a dense engine both do
nothing.
"""

from __future__ import annotations

import logging

from mlx_lm.models.cache import KVCache

from engine.tq_cache import TurboQuantKVCache
from engine.tq_config import append_suffix, dense_copy, dense_copy_bytes

log = logging.getLogger("prefixtrace.scheduler")

def plan(job, chunk: int, fits=None, *, cold_dense: bool = True) -> None:
    """Restored-prefix prefill (docs/TURBOQUANT.md): before a suffix of more than one
    chunk after a restored TurboQuant prefix, prefill on a dense copy of the prefix
    (decoded once) instead of decoding the whole prefix again in every chunk; the
    suffix is quantised and appended at the end (`finish`). Only if the copy fits
    (`fits(bytes)`, None: no memory model, it always does).

    A cold prefill (nothing restored) of more than one chunk runs the same way on fresh
    dense caches and is quantised once when the prompt is done, instead of every chunk
    attending over the decoded codes of all chunks before it (docs/TURBOQUANT.md). Its
    dense KV is what the memory model already charges for the prompt: the memory
    pressure's `prompt_need` and `used_bytes` count dense bytes per token for a TurboQuant engine
    too, and `append_suffix` frees each dense layer as it is encoded. Its blocks reach the
    prefix cache once, quantised, at the end (a dense chunk is not in the TurboQuant block
    format: `PrefixCache.pageable`); a cancel or park quantises what was done first, and so
    does a step that fails between two chunks (`Admission.keep_failed_prefill`); one that
    fails inside a chunk loses the chunks done.

    `cold_dense=False` (the engine's `cold_dense_prefill`) runs a cold prefill's chunks on the
    TurboQuant caches instead, the slower path, kept so bench_turboquant.py can measure the two
    side by side."""
    suffix = job.seq.num_prompt_tokens - 1 - job.pos
    if suffix <= chunk or not any(type(c) is TurboQuantKVCache for c in job.cache):
        return
    if job.pos == 0:
        if not cold_dense:
            return
        job.final_cache = job.cache
        job.cache = [KVCache() if type(c) is TurboQuantKVCache else c for c in job.cache]
        log.info("request %d: cold prefill of %d tokens on dense caches, quantised at the end",
                 job.seq.seq_id, suffix)
        return
    need = dense_copy_bytes(job.cache, job.pos + suffix)
    if fits is not None and not fits(need):
        log.info("request %d: suffix of %d tokens prefills on the quantised prefix of %d (a dense copy of "
                 "%.1f MB does not fit)", job.seq.seq_id, suffix, job.pos, need / 1e6)
        return
    job.final_cache, job.cache = job.cache, dense_copy(job.cache, suffix)
    log.info("request %d: suffix of %d tokens prefills on a dense copy of the restored %d-token prefix "
             "(%.1f MB)", job.seq.seq_id, suffix, job.pos, need / 1e6)


def finish(job) -> None:
    """End a stand-in prefill: the dense suffix is encoded and appended to the TurboQuant
    caches kept aside, whose prefix codes stay as they were, bit for bit. Nothing to do
    for a job without a stand-in."""
    if job.final_cache is not None:
        job.cache, job.final_cache = append_suffix(job.final_cache, job.cache), None
