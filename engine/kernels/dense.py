"""Dense decode attention on CUDA: one query token per row, each row from its own start offset (left
padding), K and V (B, H, T, D) of any strides along B, H, T; then the generic reduce
(`common.reduce`). Two split kernels with the same grid and partial outputs: the tensor-core one
(cuda/dense_mma.cu) for bf16 / f16 at head sizes 64 / 128 / 256, and the CUDA-core one
(cuda/dense_split.cu) for the rest (float32, head sizes 16 / 32).

Why hand-written: a batched decode step over left-padded rows hands MLX's
`scaled_dot_product_attention` a boolean mask, and on CUDA a masked call leaves the fused vector
kernel (mlx-lm's `GenerationBatch` with padded rows ran at 4.22x its B=1 rate against 6.41x unpadded
on an H200; at 8 x 32k the masked path took 6x fused SDPA). MLX and mlx-lm have no decode kernel that
takes per-row start offsets; vLLM's and FlashInfer's do but work on torch tensors.

CUDA-core kernel: within a block, lanes work in groups of D/8 lanes, one token per group, 8
coordinates per lane (one 16-byte load of bf16), U = 4 tokens per group per loop step; the scores of
the chunk go to shared memory, the block takes their max and exponentials, then the same groups read V
and accumulate. It runs at ~2 TB/s (523 us per layer at 8 x 32k against fused SDPA's 320).

Tensor-core kernel: the CUDA-core kernel's blocks (block (s, h, b) takes columns [max(s CHUNK,
lp[b]), min((s+1) CHUNK, T)) of KV head h of row b, for the G query heads of the group; a block with
no columns writes the empty partial) with the K / V bytes loaded straight into MMA fragments. Each
warp takes 16-token tiles warp, warp + NW, ...; U = 2 tiles' loads are issued before any of their
MMAs (D/16 16-byte loads per tile and lane: 16 loads in flight per lane at D = 128; 104 registers a
thread at D 128, G 4, 4 blocks per SM; U = 4 spills at D 256). At 8 x 32k it takes 301 us per layer
(fused SDPA: 303; ncu 4.1 TB/s, 85 % of DRAM peak).

Fragment layout (PTX ISA, m16n8k16, .bf16 / .f16 inputs, .f32 accumulators; lane = 4 gq + tq;
the same table as engine/kernels/tq_mma.py's docstring):
  A (16 x 16): reg0 = (row gq, cols 2tq, 2tq+1), reg1 = (row gq+8, same), reg2 = (row gq,
               cols 2tq+8, 2tq+9), reg3 = (row gq+8, cols 2tq+8, 2tq+9)
  B (16 x 8):  reg0 = (rows 2tq, 2tq+1; col gq), reg1 = (rows 2tq+8, 2tq+9; col gq)
  C (16 x 8):  c0, c1 = (row gq; cols 2tq, 2tq+1), c2, c3 = (row gq+8; same cols)
The low 16 bits of a register hold the element of the smaller column (A) or row (B).

Scores, S^T = K Q^T (M = 16 tokens, K-dim 16 coordinates, N = 8 query columns, G used): a
dot product does not see a permutation applied to both operands' coordinates, so lane tq's
16-byte load i of a token covers elements 32 i + 8 tq .. + 7 (the four lanes of a token read
64 contiguous bytes per load instruction: whole sectors), and k-step j takes the lane's words
2j, 2j+1: word e of load i holds elements 32 i + 8 tq + 2 e, +1, so reg0 / reg2 = words
2(j&1), 2(j&1)+1 of load j>>1 of token gq, reg1 / reg3 the same of token gq + 8, and the query
B fragment takes the same elements: d = 32 (j>>1) + 8 tq + 4 (j&1), (d, d+1) and (d+2, d+3).
Query columns >= G are zero. The scale multiplies the f32 score (the query stays exact).

Values, O^T = V^T P^T (M = 16 coordinates, K-dim 16 tokens, N = 8 query columns): an A
register holds ONE coordinate of TWO tokens, so it is a byte permute of two tokens' words:
`__byte_perm(x, y, 0x5410)` = (x.lo, y.lo), `0x7632` = (x.hi, y.hi). Lane tq takes tokens 4 tq
.. 4 tq + 3 of the tile (logical k 2tq, 2tq+1 -> tokens 4tq, 4tq+1; 2tq+8, 2tq+9 -> 4tq+2,
4tq+3: P's B fragment is those tokens' probabilities for query gq), lane group gq's load i of a
token covers elements 64 i + 8 gq .. + 7 (the eight groups read 128 contiguous bytes per
instruction), and M-tile m (word e = m & 3 of load m >> 2) maps row gq to coordinate
d = 64 (m>>2) + 8 gq + 2 (m&3) (the words' low halves) and row gq + 8 to d + 1 (high halves).
P is rounded to the cache's dtype (p <= 1; bf16 keeps 8 bits, as FlashAttention's P).

Precision: products of bf16 / f16 operands are exact in the f32 accumulators; only P's rounding
is new against the CUDA-core kernel (whose arithmetic is f32 throughout), which float32 caches keep.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine.kernels.common import HEADER, NW, kernel_starts, launches, no_signs, reduce, scalar, source, split_chunk

__all__ = ["attend", "usable_mma", "SOURCE", "MMA_SOURCE", "MMA_HEADER", "MMA_DIMS", "TARGET_BLOCKS", "UNROLL",
           "MMA_UNROLL", "SCORE_PAD"]

SOURCE = source("dense_split.cu")
MMA_HEADER = source("dense_mma.cuh")
MMA_SOURCE = source("dense_mma.cu")

# Blocks a launch aims at and tokens per lane group per loop step of the CUDA-core kernel: 80 registers a
# thread at D = 128, G = 4 (6 blocks of 128 threads per SM, 792 on an H200), so 1,024 blocks (8 rows x 4k)
# run as 1.3 waves; 2,048 / 4,096 blocks and U = 8 measured no faster.
TARGET_BLOCKS = 1024
UNROLL = 4
MMA_DIMS = (64, 128, 256)  # D / 32 K loads and D / 64 V loads per token and lane: whole loads
MMA_UNROLL = 2  # 16-token tiles a warp loads before it multiplies any
SCORE_PAD = 16  # floats past CHUNK per score row: P's reads (rows gq, gq + 1) fall in other banks


@lru_cache(maxsize=None)
def usable_mma(qdtype, kdtype, dim: int, g: int) -> bool:
    """Whether the tensor-core kernel maps the step: bf16 / f16, D in `MMA_DIMS`, G <= 8 (the N = 8 query
    columns of an MMA; `common.gqa` has checked the rest). Cached: the hook asks per layer per step."""
    return qdtype in (mx.bfloat16, mx.float16) and kdtype == qdtype and dim in MMA_DIMS and 1 <= g <= 8


@lru_cache(maxsize=1)
def _kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_dense", input_names=["q", "k", "v", "lp", "params"],
                               output_names=["o_part", "ml_part"], source=SOURCE, header=HEADER,
                               ensure_row_contiguous=False)


@lru_cache(maxsize=1)
def _mma_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_dense_mma", input_names=["q", "k", "v", "lp", "params"],
                               output_names=["o_part", "ml_part"], source=MMA_SOURCE, header=HEADER + MMA_HEADER,
                               ensure_row_contiguous=False)


@lru_cache(maxsize=None)
def templates(dtype, dim: int, g: int, chunk: int) -> list:
    return [("T", dtype), ("D", dim), ("G", g), ("CHUNK", chunk), ("NW", NW), ("U", UNROLL)]


@lru_cache(maxsize=None)
def mma_templates(dtype, dim: int, g: int, chunk: int) -> list:
    return [("T", dtype), ("D", dim), ("G", g), ("CHUNK", chunk), ("NW", NW), ("U", MMA_UNROLL), ("PAD", SCORE_PAD)]


def attend(queries: mx.array, keys: mx.array, values: mx.array, left_padding: mx.array,
           scale: float) -> mx.array | None:
    """softmax(q K^T * scale) V for one query token per row, row b attending to columns
    [left_padding[b], T) of keys/values (B, H, T, D). CUDA only (engine/kernels/selector.py decides);
    None where no chunk size fits (the caller falls back to MLX)."""
    B, hq, _, dim = queries.shape
    _, H, T, _ = keys.shape
    g = hq // H
    chunk = split_chunk(T, H, B, g, target=TARGET_BLOCKS)
    if chunk is None:
        return None
    splits = -(-T // chunk)
    lp = kernel_starts(left_padding)
    grid, tg = (splits * NW * 32, H, B), (NW * 32, 1, 1)
    shapes, dtypes = [(B * hq * splits * dim,), (B * hq, splits, 2)], [mx.float32, mx.float32]
    if usable_mma(queries.dtype, keys.dtype, dim, g):
        launches["dense_mma"] += 1
        o_part, ml_part = _mma_kernel()(inputs=[queries, keys, values, lp, scalar(scale)],
                                        template=mma_templates(keys.dtype, dim, g, chunk), grid=grid, threadgroup=tg,
                                        output_shapes=shapes, output_dtypes=dtypes)
    else:
        launches["dense_split"] += 1
        o_part, ml_part = _kernel()(inputs=[queries, keys, values, lp, scalar(scale)],
                                    template=templates(keys.dtype, dim, g, chunk), grid=grid, threadgroup=tg,
                                    output_shapes=shapes, output_dtypes=dtypes)
    return reduce(o_part, ml_part, no_signs(dim), B, hq, dim, queries.dtype, False)
