"""Build the dense decode kernel's instances a CUDA engine can launch once, when it loads.

Why: as for TurboQuant (engine/tq_prebuild.py, whose docstring has the mechanism), the dense
start-offset kernel (`decode_attention.dense_attend`: v1, or engine/dense_mma.py under
PREFIXTRACE_DENSE_DECODE=mma) takes the context columns per block (`CHUNK`) as a template
argument, picked by `split_chunk` from the batch's rows and length (64 up to 1,024 at the
default 1,024 target blocks). So the first padded batched decode step past each new chunk
size compiled a kernel (NVRTC) inside that step, every decoding row waiting. Building each
chunk's instance at load, at the variant and launch shape this process runs, moves those
compiles before the first request (MLX keeps them on disk for the next process too).

Nothing is built on the CPU, with PREFIXTRACE_DECODE_ATTENTION=0, for models the kernel does
not take (`decode_attention._gqa`, dtypes), or with PREFIXTRACE_DENSE_PREBUILD=0.
"""

from __future__ import annotations

import logging
import os
import time

import mlx.core as mx

from engine import decode_attention
from engine.tq_prebuild import PLAN_TOKENS, _activation_dtype, chunk_plan, model_shape

log = logging.getLogger("prefixtrace.engine")

ENABLED = os.environ.get("PREFIXTRACE_DENSE_PREBUILD", "1") != "0"


def launches(model, max_batch: int) -> list[tuple[int, tuple]] | None:
    """(chunk, `dense_attend` args) per chunk a batched dense decode step of <= max_batch rows
    can pick, on zero inputs of the model's decode shape (lazy: nothing runs until evaluated);
    None where no step would take the kernel."""
    hq, heads, dim = model_shape(model)
    dtype = _activation_dtype(model)
    q = mx.zeros((1, hq, 1, dim), dtype)
    if (max_batch < 2 or decode_attention.mode() == "off" or not decode_attention.available()
            or dtype not in decode_attention._DENSE_DTYPES or decode_attention._gqa(q, heads) is None):
        return None
    blocks, _ = decode_attention.dense_shape()
    out = []
    for chunk, (rows, tokens) in chunk_plan(heads, hq // heads, PLAN_TOKENS, max_batch, window=0,
                                            target=blocks).items():
        kv = mx.zeros((rows, heads, tokens, dim), dtype)
        out.append((chunk, (mx.zeros((rows, hq, 1, dim), dtype), kv, kv, mx.zeros((rows,), mx.int32), dim ** -0.5)))
    return out


def prebuild(model, max_batch: int) -> dict[int, float]:
    """Run `dense_attend` once per chunk of the plan (`launches`) so each instance is compiled
    now: {chunk: seconds}. Empty where nothing would take the kernel. A build that fails here
    is logged and left to the first step that needs it."""
    plan = launches(model, max_batch) if ENABLED else None
    if plan is None:
        return {}
    out: dict[int, float] = {}
    try:
        for chunk, args in plan:
            t0 = time.perf_counter()
            result = decode_attention.dense_attend(*args)
            if result is not None:
                mx.eval(result)
            out[chunk] = time.perf_counter() - t0
    except Exception as exc:  # the engine still serves: the kernel is built (or fails) on first use
        log.warning("dense decode kernels not built at load (%r); the first step that needs one builds it", exc)
        return out
    log.info("dense decode kernels (%s) built for chunks %s in %.1f s", decode_attention.dense_variant(),
             sorted(out), sum(out.values()))
    return out
