"""Build every decode kernel a CUDA engine can launch once, when it loads.

Why: `mx.fast.cuda_kernel` compiles a kernel (NVRTC) the first time it runs with a new set of template
arguments, in the thread that evaluates it (mlx/backend/cuda/custom_kernel.cpp: the module is named by
the kernel's name and its template arguments, nothing else). The split kernels take the context columns
per block (`CHUNK`, from `common.split_chunk`) as a template argument, and that grows with the context:
at one row of Qwen3-8B's shape 64 up to 8,192 tokens, 128 to 16,384, 256 to 32,768, 512 to 65,536, then
1,024. So the first decode step of a process past each of those lengths compiled a kernel while every
decoding row waited (a 32k prompt after a 4k warm-up paid two compiles). Building them all at load takes
the same compiles once, before the first request. The TurboQuant tensor-core kernels take the chunk as a
runtime parameter, so one launch builds each.

MLX keeps what it compiled on disk (`MLX_PTX_CACHE_DIR`, default <tmp>/mlx/<version>/ptx) under the same
name, so a later process on the same machine loads them in milliseconds. PREFIXTRACE_TQ_PREBUILD=0 /
PREFIXTRACE_DENSE_PREBUILD=0 build lazily instead (docs/CONFIG.md).
"""

from __future__ import annotations

import logging
import os
import time

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.kernels import dense, tq_decode, tq_encode
from engine.kernels.common import DTYPES, MAX_CHUNK, MIN_CHUNK, TARGET_BLOCKS, gqa, no_signs, split_chunk
from engine.kernels.tq_fused import build_plan7, usable7
from engine.kernels.tq_mma import build_plan5, chunk_capacity
from engine.kernels.tq_mma import usable as usable5
from engine.kernels.tq_split import WIDE_SPLITS, reduce_split

__all__ = ["prebuild_tq", "prebuild_dense", "tq_launches", "dense_launches", "reduce_launches", "chunk_plan",
           "model_shape", "activation_dtype", "PLAN_TOKENS"]

log = logging.getLogger("prefixtrace.engine")

# Columns the plan covers: more than any prompt. Nothing holds a prompt to the model's stated
# context below the memory ceiling, and a longer one would pick the largest chunk inside a request.
PLAN_TOKENS = 1 << 20


def chunk_plan(kv_heads: int, g: int, context: int, max_batch: int, window: int = 1,
               target: int = TARGET_BLOCKS) -> dict[int, tuple[int, int]]:
    """Every CHUNK `split_chunk` picks for a decode step of `rows` <= max_batch rows over `tokens` <=
    context columns, each with the smallest (rows x tokens) launch that picks it. `window`: a row's
    dense columns (they must fit one block); `target`: split_chunk's target blocks."""
    plan: dict[int, tuple[int, int]] = {}
    for rows in range(1, max_batch + 1):
        # split_chunk doubles the chunk while ceil(tokens / chunk) x heads x rows passes the
        # target, i.e. while tokens > chunk x per (an integer ceiling against a real bound):
        # it changes only just past those lengths, so they and the ends are all it can pick.
        per = target // (kv_heads * rows)
        candidates = {1, context}
        chunk = MIN_CHUNK
        while chunk <= MAX_CHUNK:
            candidates.add(chunk * per + 1)
            chunk *= 2
        for tokens in sorted(t for t in candidates if 1 <= t <= context):
            chunk = split_chunk(tokens, kv_heads, rows, g, at_least=window, target=target)
            if chunk is not None and (chunk not in plan or rows * tokens < plan[chunk][0] * plan[chunk][1]):
                plan[chunk] = (rows, tokens)
    return dict(sorted(plan.items()))


def activation_dtype(model):
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


def tq_launches(model, tq, max_batch: int):
    """(chunk, args) of one `tq_decode.attend` call per kernel build the model's decode steps can need,
    on zero inputs of its decode shape, and the keys/values/codec of one `tq_encode.encode` call (chunk
    0); None where a decode step would not use the kernels (head sizes or bits they take no step of).
    Lazy arrays: nothing runs until evaluated. `tq`: the engine's TurboQuant settings (`bits`, `group`,
    and `codec(dim)`, the codec its caches encode with: engine/tq_config.py `TQConfig`), so the kernels
    import nothing of the engine core."""
    hq, heads, dim = model_shape(model)
    dtype = activation_dtype(model)
    codec = tq.codec(dim)
    g, q = hq // heads, mx.zeros((1, hq, 1, dim), dtype)
    if not (codec.hadamard and tq_decode.usable(q, heads, tq.bits, dim)):
        return None
    keys = mx.zeros((1, heads, tq.group, dim), dtype)
    out = [(0, (keys, keys, codec))]
    if usable7(q, tq.bits, g, dim, tq.group):
        plan = build_plan7(heads, g, dim)  # one build serves every chunk
    elif usable5(q, tq.bits, g, dim, chunk_capacity(g)):
        plan = build_plan5(heads, g, dim)
    else:  # the CUDA-core split kernels: one build per chunk
        plan = chunk_plan(heads, g, PLAN_TOKENS, max_batch)
    for chunk, (rows, tokens) in plan.items():
        norms = mx.zeros((rows, heads, tokens, 1), mx.float32)
        codes = mx.zeros((rows, heads, tokens, codec.words), mx.uint32)
        window = mx.zeros((rows, heads, 1, dim), dtype)
        out.append((chunk, (mx.zeros((rows, hq, 1, dim), dtype), norms, codes, norms, codes, window, window, None,
                            dim ** -0.5, codec, tq.group)))
    return out


def reduce_launches(model) -> list:
    """One parallel reduce per width it launches at (`tq_split.reduce_warps`: few splits and
    `WIDE_SPLITS`), on zero partials of one row of the model's shape: the widths depend on the split
    count, which the attention plan's shapes do not all reach. Lazy arrays."""
    hq, _, dim = model_shape(model)
    dtype = activation_dtype(model)
    out = []
    for splits in (2, WIDE_SPLITS):
        o_part = mx.zeros((hq * splits * dim,), mx.float32)
        ml_part = mx.zeros((hq, splits, 2), mx.float32)
        out.append(reduce_split(o_part, ml_part, no_signs(dim), (1, hq, 1, dim), dtype))
    return out


def prebuild_tq(model, tq, max_batch: int) -> dict[int, float]:
    """Run the TurboQuant decode attention once per build of `tq_launches` (any context, up to
    `max_batch` rows) and the fused encode once, on zero inputs, so each kernel is compiled now:
    {chunk: seconds} (0: the encode, -1: the reduces). Empty where a decode step would not use the
    kernels or with PREFIXTRACE_TQ_PREBUILD=0. A build that fails here is logged and left to the first
    request that needs it."""
    plan = tq_launches(model, tq, max_batch) if os.environ.get("PREFIXTRACE_TQ_PREBUILD", "1") != "0" else None
    if plan is None:
        return {}
    out: dict[int, float] = {}
    try:
        for chunk, args in plan:
            t0 = time.perf_counter()
            if chunk == 0:
                if tq_encode.usable(*args):
                    mx.eval(tq_encode.encode(*args))
            else:
                result = tq_decode.attend(*args)
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


def dense_launches(model, max_batch: int) -> list[tuple[int, tuple]] | None:
    """(chunk, `dense.attend` args) per chunk a batched dense decode step of <= max_batch rows can pick,
    on zero inputs of the model's decode shape (lazy); None where no step would take the kernels."""
    hq, heads, dim = model_shape(model)
    dtype = activation_dtype(model)
    q = mx.zeros((1, hq, 1, dim), dtype)
    if max_batch < 2 or dtype not in DTYPES or gqa(q, heads) is None:
        return None
    out = []
    for chunk, (rows, tokens) in chunk_plan(heads, hq // heads, PLAN_TOKENS, max_batch, window=0,
                                            target=dense.TARGET_BLOCKS).items():
        kv = mx.zeros((rows, heads, tokens, dim), dtype)
        out.append((chunk, (mx.zeros((rows, hq, 1, dim), dtype), kv, kv, mx.zeros((rows,), mx.int32), dim ** -0.5)))
    return out


def prebuild_dense(model, max_batch: int) -> dict[int, float]:
    """Run `dense.attend` once per chunk of `dense_launches` so each instance is compiled now:
    {chunk: seconds}. Empty where nothing would take the kernels or with PREFIXTRACE_DENSE_PREBUILD=0.
    A build that fails here is logged and left to the first step that needs it."""
    plan = dense_launches(model, max_batch) if os.environ.get("PREFIXTRACE_DENSE_PREBUILD", "1") != "0" else None
    if plan is None:
        return {}
    out: dict[int, float] = {}
    try:
        for chunk, args in plan:
            t0 = time.perf_counter()
            result = dense.attend(*args)
            if result is not None:
                mx.eval(result)
            out[chunk] = time.perf_counter() - t0
    except Exception as exc:  # the engine still serves: the kernel is built (or fails) on first use
        log.warning("dense decode kernels not built at load (%r); the first step that needs one builds it", exc)
        return out
    log.info("dense decode kernels built for chunks %s in %.1f s", sorted(out), sum(out.values()))
    return out
