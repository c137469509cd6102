"""TurboQuant decode on the tensor cores, split and reduce (cuda/tq_mma.cu, `mma.sync`): the route for the
steps the fused kernel (engine/kernels/tq_fused.py) cannot map, head size 256 at 4 bits.

Why tensor cores: the CUDA-core split kernel (engine/kernels/tq_split.py) is bound by instructions, not
bytes: per coordinate and token it reads the codebook from shared memory and does G FMAs, ~9
instructions per coordinate per pass (SASS), so at 8 rows of 100k its issue floor (~0.47 ms) is twice
the byte floor. Here a warp turns 16 tokens' codes into f16 MMA fragments with one shared-memory load
per fragment register (a 256-entry table of f16 pairs indexed by a code byte: two 4-bit codes) and
multiplies them with m16n8k16 MMAs: per 16 tokens x 128 coordinates, 32 table loads, ~40 integer ops
and 8 MMAs per lane for K, about as much for V. Nothing in MLX or mlx-lm decodes packed codes into MMA
fragments (mlx's quantized matmuls are affine, not codebook, and are Metal-first; vLLM's TurboQuant
backend is Triton over torch), so the kernel is written here, with the inline-PTX `mma.sync` approach
of engine/kernels/skinny_gemm.py.

What it keeps from the split kernel: split-K blocks over the context with per-row start offsets (left
padding), the G queries rotated once per block, the dense tail scored on its own small path, the
block's softmax statistics, the partial-output layout, and the parallel reduce (rotation back, the
dense slot). Unlike it, the columns per block are a runtime parameter (params[1]) against a shared
score array sized for the largest chunk (template CHUNK = `chunk_capacity`), so one build serves every
context, and the split is chosen from the occupancy (`split5`): at one row a 1,024-block target ran
one row of 100k as 784 code blocks on 132 SMs x 5 resident blocks, a second wave with a fifth of the
SMs busy, and latency-bound blocks take as long alone as together. `end` (the cache's column count)
comes from the K norms' shape, so no array the host writes every step reaches the kernel (`params5`).

Fragment layout (PTX ISA, m16n8k16, .f16 inputs, .f32 accumulators; lane = 4 gq + tq):
  A (16 x 16, row major): reg0 = (row gq, cols 2tq, 2tq+1), reg1 = (row gq+8, same cols),
                          reg2 = (row gq, cols 2tq+8, 2tq+9), reg3 = (row gq+8, cols 2tq+8, +9)
  B (16 x 8):             reg0 = (rows 2tq, 2tq+1; col gq), reg1 = (rows 2tq+8, 2tq+9; col gq)
  C (16 x 8):             c0, c1 = (row gq; cols 2tq, 2tq+1), c2, c3 = (row gq+8; same cols)
A register's low 16 bits hold the element of the smaller column (A) or row (B).

Scores, S^T = K Q'^T (M = 16 tokens, K-dim = 16 coordinates per MMA, N = 8 query columns, G
of them used; N = 8 rather than M = 16 queries wastes half the MMA at G = 4, not three
quarters). A dot product does not see a permutation applied to both operands' coordinates, so
k-step j of lane (gq, tq) takes physical coordinates (D/4) tq + 4j + {0, 1} (reg0 / reg1) and
+ {2, 3} (reg2 / reg3): lane tq's coordinates of a token are the D/4 consecutive ones of ONE
contiguous D/8-byte load (16 bytes at D = 128), token gq of the tile for rows gq and token
gq + 8 for rows gq + 8, and code byte 2j / 2j + 1 of that load is exactly one A register
(its two 4-bit codes: low nibble the first coordinate). The B fragments (rotated, scaled
queries, f16) use the same coordinates and are built once per block; query columns >= G are
zero. K norms scale the scores afterwards, in f32.

Values, O^T = V^T P^T (M = 16 coordinates, K-dim = 16 tokens, N = 8 query columns): an A
register holds ONE coordinate of TWO tokens. Lane group gq owns coordinates
[(D/8) gq, (D/8)(gq+1)) (one D/16-byte load per token), M-tile m maps row gq to coordinate
(D/8) gq + 2m and row gq + 8 to the next one (both nibbles of code byte m), and lane tq
takes tokens 4tq .. 4tq+3 of the 16 (logical k 2tq, 2tq+1 -> tokens 4tq, 4tq+1; 2tq+8, 2tq+9 ->
4tq+2, 4tq+3). Two tokens' words merge into bytes of (nibble of token a | nibble of token b
<< 4) with one shift and one masked select each, then the same pair table gives the register.
P's B fragment is the same permuted tokens' probabilities times their V norms (f16: p <= 1, so
only a V norm above 65504 could overflow). The accumulators come back as (coordinate, query)
pairs and go to the split kernel's per-warp partial-output array.

Precision: f16 (11-bit significand) rather than bf16 (8): the queries and centroids are
rounded once to f16 (relative 2^-11), products are exact in the f32 accumulators. A float32
decode keeps the CUDA-core split kernel (its checks hold it to 1e-4 absolute, which f16 operands
would not meet); this kernel takes bf16 / f16 caches, 4-bit codes, D in (64, 128, 256), G <= 8, where the table fits
the shared memory left by the split kernel's arrays (`table_copies`).

Bank conflicts: the table holds TC copies of each pair word side by side (word e * TC + copy,
lane l reads copy l % TC): with TC = 32 every lane has its own bank (conflict-free, 32 KB);
TC = 16 (16 KB, what fits beside a 1024-column split at G = 4) leaves at most two-way
conflicts (lanes l and l + 16 read the same bank when their bytes differ but have the same
parity). A 16-entry table
would be conflict-free (16 words in 16 banks) but costs two loads, two extractions and a
byte permute per register instead of one load and one extraction.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from engine.kernels.common import (HEADER, MAX_CHUNK, NW, SMEM_SCORES, blocks_per_sm, launches, own_page, sm_count,
                                   source)
from engine.kernels.tq_split import SPLIT_HEADER, reduce_split

__all__ = ["attend5", "usable", "table_copies", "chunk_capacity", "split5", "params5", "templates5", "build_plan5",
           "v5_shared_bytes", "v5_regs", "SOURCE", "MMA_HEADER", "DIMS4", "U4", "V5_REGS"]

MMA_HEADER = source("tq_mma.cuh")  # pack_half2, mma_f16, ldg_words (the fused kernel's header too)
SOURCE = source("tq_mma.cu")

U4 = 2  # 16-token tiles a warp loads before it multiplies any: 4 x 16 B (K) / 8 x 8 B (V) in flight per lane
_SMEM_LIMIT = 48 * 1024 - 512  # static shared memory of a block (CUDA's 48 KB without opt-in), some slack
DIMS4 = (64, 128, 256)
# ptxas registers a thread, (D, G, U) -> registers (sm_90; tests/test_tq_mma.py checks them as bounds)
V5_REGS = {(128, 4, 2): 96, (128, 8, 2): 128, (64, 3, 2): 72, (256, 4, 2): 168}
_BLOCK_FIXED = 64  # a block's fixed work (query rotation, table, softmax, stores) in columns' worth


def _split_shared_bytes(g: int, dim: int, chunk: int, bits: int) -> int:
    """The split kernel's static shared arrays: sc[G][CHUNK], qs[G][D], cs[2^BITS], red[NW][G][D], stat[NW][G]."""
    return 4 * (g * chunk + g * dim + (1 << bits) + NW * g * dim + NW * g)


@lru_cache(maxsize=None)
def table_copies(g: int, dim: int, chunk: int, bits: int = 4) -> int | None:
    """Copies of the 256-word pair table that fit the block's static shared memory beside the split
    kernel's arrays: 32 (conflict-free), else 16 / 8 / 4 (at most 2 / 4 / 8-way); None where none fits."""
    free = _SMEM_LIMIT - _split_shared_bytes(g, dim, chunk, bits)
    for tc in (32, 16, 8, 4):
        if 1024 * tc <= free:
            return tc
    return None


def usable(queries: mx.array, bits: int, g: int, dim: int, chunk: int) -> bool:
    """Whether this kernel maps the step: 4-bit codes, bf16 / f16 queries, D in `DIMS4`, G <= 8 (the
    N = 8 query columns of an MMA), and a pair table that fits (`table_copies`)."""
    return (bits == 4 and queries.dtype in (mx.bfloat16, mx.float16) and dim in DIMS4 and 1 <= g <= 8
            and table_copies(g, dim, chunk, bits) is not None)


def chunk_capacity(g: int) -> int:
    """The largest chunk the score array holds: G x CHUNK floats in `common.SMEM_SCORES`."""
    return min(MAX_CHUNK, SMEM_SCORES // g)


def v5_shared_bytes(g: int, dim: int, bits: int = 4) -> int:
    """Static shared memory: the split kernel's arrays at `chunk_capacity`, the pair table, 16 bytes more."""
    cap = chunk_capacity(g)
    return _split_shared_bytes(g, dim, cap, bits) + 1024 * (table_copies(g, dim, cap, bits) or 0) + 16


def v5_regs(g: int, dim: int) -> int:
    """`V5_REGS`, else a bound by head size (more registers: fewer blocks, a safe guess)."""
    return V5_REGS.get((dim, g, U4), 128 if dim <= 128 else 168)


def split5(tokens: int, kv_heads: int, rows: int, g: int, dim: int, at_least: int = 0,
           sms: int | None = None, slots: int | None = None) -> int | None:
    """Columns per code block: the multiple of 64 in [max(64, at_least), capacity] with the fewest (waves
    rounded up) x (columns + `_BLOCK_FIXED`), the larger chunk on a tie (fewer partials to reduce). None
    where the dense window does not fit a block. `slots`: resident blocks on the device (another
    kernel's, engine/kernels/tq_fused.py), else this kernel's."""
    slots = slots or (sms or sm_count()) * blocks_per_sm(v5_shared_bytes(g, dim), v5_regs(g, dim))
    cap = chunk_capacity(g)
    lo = max(64, -(-at_least // 64) * 64)
    if lo > cap:
        return None
    best = None
    for chunk in range(cap, lo - 1, -64):
        blocks = -(-tokens // chunk) * kv_heads * rows
        cost = -(-blocks // slots) * (chunk + _BLOCK_FIXED)
        if best is None or cost < best[0]:
            best = (cost, chunk)
    return best[1]


@lru_cache(maxsize=1)
def _tq5_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_tq5",
                               input_names=["q", "kn", "kc", "vn", "vc", "tk", "tv", "lp", "signs", "cent", "params"],
                               output_names=["o_part", "ml_part"], source=SOURCE,
                               header=HEADER + SPLIT_HEADER + MMA_HEADER, ensure_row_contiguous=False)


@lru_cache(maxsize=None)
def templates5(dtype, dim: int, g: int, bits: int, group: int) -> list:
    """The split kernel's template values at the capacity chunk (CPL: an unused 16, its constants must
    still be well-formed; NIB off), U = `U4` tiles in flight, TC copies of the table."""
    cap = chunk_capacity(g)
    return [("T", dtype), ("D", dim), ("G", g), ("CHUNK", cap), ("NW", NW), ("BITS", bits), ("GROUP", group),
            ("NQ", 1), ("CPL", 16), ("NIB", False), ("U", U4), ("TC", table_copies(g, dim, cap, bits))]


@lru_cache(maxsize=None)
def params5(scale: float, chunk: int) -> mx.array:
    """The float params [scale, chunk], made once per value on a page of their own (`common.OWN_PAGE`),
    not a fresh array every step: MLX's CUDA buffers are managed memory, and on the H200 a fresh
    12-byte params array made this kernel take 205-420 us in isolation (ncu) against 48-54 at one
    row of 32k. The column count comes from the K norms' shape instead."""
    return own_page([scale, chunk], np.float32)


@lru_cache(maxsize=4096)
def _plan5(tokens64: int, kv_heads: int, rows: int, g: int, dim: int, at_least64: int) -> int | None:
    """`split5` for tokens and window rounded up to multiples of 64: a decode step's context grows by
    one, so the plan is computed once per 64 steps (the search is ~10 us of Python)."""
    return split5(64 * tokens64, kv_heads, rows, g, dim, 64 * at_least64)


def attend5(queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, scale, codec, group, end):
    """The step on the tensor cores (split kernel + the parallel reduce), or None where this kernel
    cannot map it (the caller runs engine/kernels/tq_split.py). Columns [0, end) of the norms and codes
    (whole buffers) are the cache's; the K norms reach the kernel as [0, end) (their shape carries `end`)."""
    B, hq, _, dim = queries.shape
    H = k_codes.shape[1]
    g = hq // H
    if not usable(queries, codec.bits, g, dim, chunk_capacity(g)):
        return None
    chunk = _plan5(-(-end // 64), H, B, g, dim, -(-win_k.shape[2] // 64))
    if chunk is None:
        return None
    splits = -(-end // chunk) + 1  # + the dense block
    kn = k_norms if k_norms.shape[2] == end else k_norms[:, :, :end]
    launches["tq_mma"] += 1
    o_part, ml_part = _tq5_kernel()(
        inputs=[queries, kn, k_codes, v_norms, v_codes, win_k, win_v, lp, codec.signs, codec.centroids,
                params5(scale, chunk)],
        template=templates5(win_k.dtype, dim, g, codec.bits, group),
        grid=(splits * NW * 32, H, B), threadgroup=(NW * 32, 1, 1),
        output_shapes=[(B * hq * splits * dim,), (B * hq, splits, 2)], output_dtypes=[mx.float32, mx.float32])
    return reduce_split(o_part, ml_part, codec.signs, (B, hq, 1, dim), queries.dtype)


def build_plan5(kv_heads: int, g: int, dim: int) -> dict[int, tuple[int, int]]:
    """engine/kernels/prebuild.py's plan: one kernel serves every chunk (a runtime parameter), so one
    launch builds it: {chunk: (rows, tokens)}."""
    chunk = split5(4096, kv_heads, 1, g, dim, at_least=1)
    return {} if chunk is None else {chunk: (1, 4096)}
