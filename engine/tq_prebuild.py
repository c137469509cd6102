"""Build every TurboQuant decode kernel a CUDA engine can launch once, when it loads.

Why: `mx.fast.cuda_kernel` compiles a kernel (NVRTC) the first time it runs with a new set
of template arguments, in the thread that evaluates it (mlx/backend/cuda/custom_kernel.cpp:
the module is named by the kernel's name and its template arguments, nothing else). The
TurboQuant decode kernel takes the context columns per block (`CHUNK`, from
`decode_attention.split_chunk`) as a template argument, and that grows with the context: at
one row of Qwen3-8B's shape 64 up to 8,192 tokens, 128 to 16,384, 256 to 32,768, 512 to
65,536, then 1,024. So the first decode step of a process past each of those lengths compiled
a kernel while every decoding row waited, and a 32k prompt after a 4k warm-up paid two
compiles (256 for its first step, 512 for the one mlx-lm queues ahead before returning the
first token): the "first TurboQuant engine of a process" one-off measured in session 6
(docs/PERFORMANCE.md). Building them all at load takes the same compiles once, before the
first request, instead of inside one.

MLX keeps what it compiled on disk (`MLX_PTX_CACHE_DIR`, default <tmp>/mlx/<version>/ptx)
under the same name, so a later process on the same machine loads them in milliseconds.

The alternative, a kernel with the chunk as a runtime argument (one build), changes the
kernel's unrolled loops and its shared-memory sizing; not done here.
"""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import mlx.core as mx
from mlx.utils import tree_flatten

from engine import decode_attention
from engine.turboquant import get_codec

log = logging.getLogger("prefixtrace.engine")

# PREFIXTRACE_TQ_PREBUILD=0: build lazily, as before (bench_turboquant's before/after).
ENABLED = os.environ.get("PREFIXTRACE_TQ_PREBUILD", "1") != "0"


def chunk_plan(kv_heads: int, g: int, context: int, max_batch: int, window: int = 1,
               target: int = decode_attention._TARGET_BLOCKS) -> dict[int, tuple[int, int]]:
    """Every CHUNK `split_chunk` picks for a decode step of `rows` <= max_batch rows over
    `tokens` <= context columns, each with the smallest (rows x tokens) launch that picks it.
    `window`: a row's dense columns (they must fit one block); `target`: split_chunk's target
    blocks (the dense kernel's is `decode_attention.dense_shape`'s)."""
    plan: dict[int, tuple[int, int]] = {}
    for rows in range(1, max_batch + 1):
        # split_chunk doubles the chunk while ceil(tokens / chunk) x heads x rows passes the
        # target, i.e. while tokens > chunk x per (an integer ceiling against a real bound):
        # it changes only just past those lengths, so they and the ends are all it can pick.
        per = target // (kv_heads * rows)
        candidates = {1, context}
        chunk = decode_attention.MIN_CHUNK
        while chunk <= decode_attention.MAX_CHUNK:
            candidates.add(chunk * per + 1)
            chunk *= 2
        for tokens in sorted(t for t in candidates if 1 <= t <= context):
            chunk = decode_attention.split_chunk(tokens, kv_heads, rows, g, at_least=window, target=target)
            if chunk is not None and (chunk not in plan or rows * tokens < plan[chunk][0] * plan[chunk][1]):
                plan[chunk] = (rows, tokens)
    return dict(sorted(plan.items()))


def _activation_dtype(model):
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype
    return mx.float32


def model_shape(model) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of an mlx-lm model (as engine.memory reads them)."""
    args = model.args
    hq = args.num_attention_heads
    heads = getattr(args, "num_key_value_heads", None) or hq
    dim = getattr(args, "head_dim", None) or args.hidden_size // hq
    return hq, heads, dim


# Columns the plan covers: more than any prompt. Nothing holds a prompt to the model's stated
# context below the memory ceiling, and a longer one would pick the largest chunk inside a request.
PLAN_TOKENS = 1 << 20


def launches(model, tq, max_batch: int):
    """(chunk, args, kwargs) of one `decode_attention.tq_attend` call per chunk of `chunk_plan`,
    on zero inputs of the model's decode shape, and the keys/values/codec of one
    `encode_kv` call (chunk 0); None where a decode step would not use the kernels (head
    sizes or bits they have no variant for, the CPU). Lazy arrays: nothing runs until
    evaluated."""
    hq, heads, dim = model_shape(model)
    dtype = _activation_dtype(model)
    codec = get_codec(dim, tq.bits, tq.seed)
    if not (codec.hadamard and decode_attention.use_tq(mx.zeros((1, hq, 1, dim), dtype), heads, tq.bits, dim)):
        return None
    keys = mx.zeros((1, heads, tq.group, dim), dtype)
    out = [(0, (keys, keys, codec), {})]
    plan = chunk_plan(heads, hq // heads, PLAN_TOKENS, max_batch)
    if decode_attention.tq_variant() == "v5":
        from engine import tq_mma

        plan = tq_mma.build_plan5(heads, hq // heads, dim, max_batch)
    if decode_attention.tq_variant() == "v7":
        from engine import tq_fused

        plan = tq_fused.build_plan7(heads, hq // heads, dim, max_batch)
    for chunk, (rows, tokens) in plan.items():
        norms = mx.zeros((rows, heads, tokens, 1), mx.float32)
        codes = mx.zeros((rows, heads, tokens, codec.words), mx.uint32)
        window = mx.zeros((rows, heads, 1, dim), dtype)
        cnt = decode_attention.counters(SimpleNamespace(), rows * heads) if decode_attention.one_launch() else None
        out.append((chunk, (mx.zeros((rows, hq, 1, dim), dtype), norms, codes, norms, codes, window, window, None,
                            dim ** -0.5, codec, tq.group), {"counters": cnt}))
    return out


def reduce_launches(model) -> list:
    """One v3 reduce per width it launches at (`decode_attention.tq3_reduce_warps`: few splits and
    `TQ3_WIDE_SPLITS`), on zero partials of one row of the model's shape: the widths depend on the
    split count, which the attention plan's shapes do not all reach (v5's plan is one row of 4,096
    columns). Lazy arrays."""
    hq, _, dim = model_shape(model)
    dtype = _activation_dtype(model)
    out = []
    for splits in (2, decode_attention.TQ3_WIDE_SPLITS):
        o_part = mx.zeros((hq * splits * dim,), mx.float32)
        ml_part = mx.zeros((hq, splits, 2), mx.float32)
        out.append(decode_attention.tq3_reduce(o_part, ml_part, decode_attention._no_signs(dim), (1, hq, 1, dim), dtype))
    return out


def prebuild(model, tq, max_batch: int) -> dict[int, float]:
    """Run the TurboQuant decode attention once per CHUNK of `chunk_plan` (any context, up to
    `max_batch` rows) and the fused encode once, on zero inputs, so each kernel is compiled
    now: {chunk: seconds} (0: the encode, -1: the reduces). Nothing (an empty dict) where a decode step would
    not use the kernels (`launches`) or with PREFIXTRACE_TQ_PREBUILD=0. A build that fails
    here is logged and left to the first request that needs it, as without this."""
    plan = launches(model, tq, max_batch) if ENABLED else None
    if plan is None:
        return {}
    out: dict[int, float] = {}
    try:
        for chunk, args, kwargs in plan:
            t0 = time.perf_counter()
            if chunk == 0:
                if decode_attention.use_encode(*args[:2], args[2]):
                    mx.eval(decode_attention.encode_kv(*args))
            else:
                result = decode_attention.tq_attend(*args, **kwargs)
                if result is not None:
                    mx.eval(result)
            out[chunk] = time.perf_counter() - t0
        t0 = time.perf_counter()
        mx.eval(*reduce_launches(model))
        out[-1] = time.perf_counter() - t0
    except Exception as exc:  # the engine still serves: the kernel is built (or fails) on first use
        log.warning("TurboQuant decode kernels not built at load (%r); the first step that needs one builds it",
                    exc)
        return out
    log.info("TurboQuant decode kernels built for chunks %s in %.1f s (%s)", sorted(c for c in out if c > 0),
             sum(out.values()), ", ".join(f"{'reduces' if c < 0 else c or 'encode'}: {s:.2f} s" for c, s in out.items()))
    return out
