"""TurboQuant decode on CUDA cores: the split kernel (cuda/tq_split.cu), its parallel reduce
(cuda/tq_split_reduce.cu), and the generic split kernel (cuda/tq_generic.cu) for the shapes it
has no lane mapping for. engine/kernels/tq_decode.py reaches them where the tensor-core kernels
cannot map a step: float32 caches, 1 / 2 / 8-bit codes.

TurboQuant layout (engine/turboquant.py): a K or V vector is a float32 norm plus `bits`-bit codes
of the rotated unit vector, packed little-end first into uint32 words. The query is rotated in the
block (the codec's randomised Hadamard transform: signs, then a Walsh-Hadamard butterfly, scaled by
1/sqrt(D)); a key's score is norm * sum_i q'_i c[code_i] with the codebook c in shared memory, and
values accumulate norm * c[code] in the rotated basis; no decoded vector is written anywhere.
Columns a row still holds dense (its tail of < `group` tokens and this call's token, per row from
`BatchTurboQuantKVCache`'s boundary rule, `bounds`) are scored by one extra block per (row, KV
head) with the unrotated query. The reduce rotates the combined code part back and adds the dense
part, all in one softmax.

Why the split kernel is laid out as it is (it was designed from the bandwidth floor down, after a
generic kernel whose lanes loaded one 4-byte code word per token with the dense tail in the same
loop body: 104-237 registers, 2-4 blocks per SM):
* A lane owns CPL consecutive coordinates of a token and loads their codes as one LB-byte load
  (LB = CPL * BITS / 8, at most 8 bytes and with the G x CPL query registers within budget:
  `cpl`), U tokens deep (32 bytes of codes in flight per lane per pass). 16-byte loads cost 168
  registers (3 blocks per SM) and measured slower than 8 (120 registers, 4 blocks) on the H200.
* The G queries of the KV head's group are rotated once per block, one warp per query head, in
  registers (in-lane butterfly stages, then shuffles), then each lane keeps its CPL coordinates
  of all G in registers and scores every G at once.
* Codebook: the 2^BITS centroids in shared memory, looked up once per coordinate and reused for
  the G heads (one LDS and G FMAs per coordinate); at 4 bits the code offsets come from byte
  permutes (`centroid`'s NIB path: ~1.5 integer instructions per code instead of ~2.7).
* The dense tail is the last block of each (row, KV head), on its own small code path, so it adds
  nothing to the code path's registers; both land in the same softmax through the reduce.
* The reduce is parallel over the splits: per (row, query head) one block of RW warps, each warp
  summing every RW-th split, the softmax weights once per split, then one warp turns the rotated
  sum back with shuffles.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from engine.kernels.common import HEADER, NW, launches, reduce, scalar, source

__all__ = ["attend", "attend_generic", "reduce_split", "reduce_warps", "cpl", "unroll", "bounds", "params",
           "templates", "SOURCE", "REDUCE_SOURCE", "GENERIC_SOURCE", "SPLIT_HEADER", "LOADS", "RW", "RW_WIDE",
           "WIDE_SPLITS", "GENERIC_UNROLL"]

SPLIT_HEADER = source("tq_split.cuh")  # load_words, centroid, warp_hadamard
SOURCE = source("tq_split.cu")
REDUCE_SOURCE = source("tq_split_reduce.cu")
GENERIC_SOURCE = source("tq_generic.cu")

LOADS = (8, 4)  # bytes of codes a lane loads per token, widest first (16 measured slower: above)
_REGS = 128  # G x CPL query (and accumulator) registers a lane may hold: ptxas, no spills
GENERIC_UNROLL = 4  # tokens each lane group of the generic kernel loads before it uses them


def bounds(end: int, left_padding: list[int], group: int, queries: int = 1) -> list[int]:
    """Per row, the first column the kernels read dense (the kernels' rule; equal to
    `BatchTurboQuantKVCache.update_and_fetch`'s `bounds`, tested)."""
    prev = end - queries
    return [p + min(prev - p, (end - p) // group * group) for p in left_padding]


def cpl(g: int, dim: int, bits: int, load: int = LOADS[0]) -> int | None:
    """Coordinates per lane of the split kernel's code path: the widest load (of `load`, 4 bytes)
    whose CPL = bytes * 8 / bits coordinates fit the head (D / CPL lanes per token, a power of two
    <= 32) with G x CPL <= `_REGS`. None where none fits (D x bits < 32: the generic kernel)."""
    for lb in LOADS:
        if lb > load:
            continue
        c = lb * 8 // bits
        if c <= dim and dim % c == 0 and g * c <= _REGS:
            return c
    return None


def unroll(c: int, bits: int) -> int:
    """Tokens a lane loads per pass before using them: 32 bytes of codes in flight."""
    return max(1, 32 // (c * bits // 8))


@lru_cache(maxsize=1)
def _tq3_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_tq3",
                               input_names=["q", "kn", "kc", "vn", "vc", "tk", "tv", "lp", "signs", "cent", "params"],
                               output_names=["o_part", "ml_part"], source=SOURCE, header=HEADER + SPLIT_HEADER,
                               ensure_row_contiguous=False)


@lru_cache(maxsize=1)
def _tq3_reduce_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_tq3_reduce", input_names=["o_part", "ml_part", "signs"],
                               output_names=["out"], source=REDUCE_SOURCE, header=HEADER + SPLIT_HEADER)


@lru_cache(maxsize=1)
def _tq_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_tq",
                               input_names=["q", "kn", "kc", "vn", "vc", "tk", "tv", "lp", "signs", "cent", "params"],
                               output_names=["o_part", "ml_part"], source=GENERIC_SOURCE, header=HEADER,
                               ensure_row_contiguous=False)


RW = 4  # warps per reduce block
# From WIDE_SPLITS splits on, RW_WIDE warps. Why: the reduce has one block per (row, query head), so at
# one row there are only 32 blocks of 4 warps on 132 SMs, each warp walking S / 4 splits one dependent
# round of loads after another: 8.7 us at one row of 32k (75 splits) and 13.7 us at 100k (158; ncu) for
# 1.2-2.6 MB of partials. 16 warps walk a quarter of the splits each.
RW_WIDE, WIDE_SPLITS = 16, 48


def reduce_warps(splits: int) -> int:
    return RW_WIDE if splits >= WIDE_SPLITS else RW


def reduce_split(o_part: mx.array, ml_part: mx.array, signs: mx.array, shape: tuple, dtype) -> mx.array:
    """The parallel reduce of a split kernel's partials (`ml_part`: (B x HQ, splits, 2)) into the output
    of `shape` (B, HQ, 1, D), `reduce_warps` warps per (row, query head). The tensor-core kernels
    (engine/kernels/tq_mma.py, tq_fused.py) write the same partials and end with it too."""
    rw = reduce_warps(ml_part.shape[1])
    return _tq3_reduce_kernel()(inputs=[o_part, ml_part, signs], template=[("T", dtype), ("D", shape[-1]), ("RW", rw)],
                                grid=(ml_part.shape[0] * rw * 32, 1, 1), threadgroup=(rw * 32, 1, 1),
                                output_shapes=[tuple(shape)], output_dtypes=[dtype])[0]


@lru_cache(maxsize=None)
def templates(dtype, dim: int, g: int, chunk: int, bits: int, group: int, c: int, nib: bool = True) -> list:
    return [("T", dtype), ("D", dim), ("G", g), ("CHUNK", chunk), ("NW", NW), ("BITS", bits), ("GROUP", group),
            ("NQ", 1), ("CPL", c), ("U", unroll(c, bits)), ("NIB", bool(nib and bits == 4))]


def params(scale: float, end: int) -> mx.array:
    """The split kernel's float parameters: the scale and the cache's column count (exact in float32 below
    2^24). A fresh array every step, so it stays 8 bytes, in MLX's read-mostly small pool: padded to a page
    of its own (`own_page`), every step's host write would move that page to the host and the kernel's
    read back. The tensor-core kernels take `end` from the K norms' shape instead and make their params
    once (engine/kernels/tq_mma.py, `params5`)."""
    assert end < 1 << 24
    return mx.array(np.array([scale, end], np.float32))  # from numpy: no lazy array tied to one thread's stream


def attend(queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, scale, codec, group, chunk, splits,
           end) -> mx.array | None:
    """The split kernel and its reduce, or None where it has no lane mapping (`cpl`: the caller runs
    `attend_generic`). Columns [0, end) of the norms and codes (whole buffers) are the cache's."""
    B, hq, _, dim = queries.shape
    H = k_codes.shape[1]
    c = cpl(hq // H, dim, codec.bits)
    if c is None:
        return None
    launches["tq_split"] += 1
    o_part, ml_part = _tq3_kernel()(
        inputs=[queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, codec.signs, codec.centroids,
                params(scale, end)],
        template=templates(win_k.dtype, dim, hq // H, chunk, codec.bits, group, c),
        grid=(splits * NW * 32, H, B), threadgroup=(NW * 32, 1, 1),
        output_shapes=[(B * hq * splits * dim,), (B * hq, splits, 2)], output_dtypes=[mx.float32, mx.float32])
    return reduce_split(o_part, ml_part, codec.signs, (B, hq, 1, dim), queries.dtype)


@lru_cache(maxsize=None)
def generic_templates(dtype, dim: int, g: int, chunk: int, bits: int, group: int) -> list:
    return [("T", dtype), ("D", dim), ("G", g), ("CHUNK", chunk), ("NW", NW), ("BITS", bits), ("GROUP", group),
            ("NQ", 1), ("U", GENERIC_UNROLL)]


def attend_generic(queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, scale, codec, group, chunk,
                   splits, end) -> mx.array:
    """The generic split kernel (one 4-byte code word per lane and token; it takes the column count
    from the codes' shape, so the buffers are sliced to [0, end)) and the generic reduce."""
    B, hq, _, dim = queries.shape
    H = k_codes.shape[1]
    if k_codes.shape[2] != end:
        cols = (slice(None), slice(None), slice(0, end))
        k_norms, k_codes, v_norms, v_codes = k_norms[cols], k_codes[cols], v_norms[cols], v_codes[cols]
    launches["tq_generic"] += 1
    o_part, ml_part = _tq_kernel()(
        inputs=[queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, codec.signs, codec.centroids,
                scalar(scale)],
        template=generic_templates(win_k.dtype, dim, hq // H, chunk, codec.bits, group),
        grid=(splits * NW * 32, H, B), threadgroup=(NW * 32, 1, 1),
        output_shapes=[(B * hq * splits * dim,), (B * hq, splits, 2)], output_dtypes=[mx.float32, mx.float32])
    return reduce(o_part, ml_part, codec.signs, B, hq, dim, queries.dtype, True)
