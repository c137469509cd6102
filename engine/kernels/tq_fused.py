"""TurboQuant decode on the tensor cores in one pass over the codes with an online softmax
(cuda/tq_fused.cu, `mma.sync`): the production decode kernel for 4-bit codes at head sizes 64 and 128
in bf16 / f16.

Why: at one row the MMA split kernel's code blocks (engine/kernels/tq_mma.py) are bound by the latency
of their global loads, not by bytes: each block runs three phases over its chunk (every token's scores
on the tensor cores into a shared array; a block-wide softmax between barriers; the values), a warp's
loop steps have nothing in flight across them, and each pass is ~600 SASS instructions per 32 tokens.
Here each warp streams its own 16-token tiles ONCE: the K and V words and both norms of tile i+1 are
loaded before tile i's math, the scores go through the tensor cores (S^T = K Q'^T), a per-warp online
softmax (flash-decoding's running max and sum per query column, the output rescaled when the max grows)
turns them into probabilities, which move from the score C-fragment layout to the P^T B-fragment layout
with four shuffles and two byte permutes (no shared memory, no barrier inside the loop), and the values
go through the tensor cores (O^T = V^T P^T, the two-token nibble merge). At the end the block combines
its warps' (max, sum, output) and writes the split kernels' partial layout, so the parallel reduce
(engine/kernels/tq_split.py) and the dense tail's block (the split kernel's text, one block of < GROUP
tokens) are unchanged. Its split is tq_mma's (`split5`: fewest waves x (columns + a block's fixed
work)) at its own resident blocks per SM, and its params are tq_mma's (`params5`).

Lane layout (lane = 4 gq + tq; fragments as engine/kernels/tq_mma.py's docstring):
* K (A of S^T = K Q'^T): token gq and gq + 8 of the tile, the D/4 coordinates [(D/4) tq, ...) of
  each (one D/8-byte load), exactly tq_mma's.
* Scores (C): c0, c1 = (token gq; query columns 2tq, 2tq + 1), c2, c3 = (token gq + 8; same
  columns). The lane loads both norms of its two tokens, so it forms p * |v| in f32 before packing.
* V (A of O^T = V^T P^T) and P (B): k index = token of the tile, no permutation: lane tq takes
  tokens 2tq, 2tq + 1 (register 0 / 1 rows) and 2tq + 8, 2tq + 9 (registers 2 / 3), coordinates
  [(D/8) gq, ...) of each (one D/16-byte load). B reg0 = P(tokens 2tq, 2tq + 1; column gq): the
  score lane (gq' = 2tq, tq' = gq / 2) holds token 2tq's pair of columns (2tq', 2tq' + 1) packed as
  one f16x2 word, half gq & 1 of it; so four shuffles (two tokens x two words) and one `prmt` per
  register pick them up.
* Output (C of O^T): c0, c1 = (coordinate (D/8) gq + 2m; columns 2tq, 2tq + 1), c2, c3 = the next
  coordinate: the same query columns as the lane's scores, so the lane's running max and sum are
  the ones its output needs (no shuffle to rescale).
The scores are kept in the log2 domain (queries times log2 e when packed to f16): exp2 is one
`ex2.approx`; the partials store the max times ln 2 (the split kernels' layout, natural log).

Shared memory: the pair table, 32 copies (one bank per lane: conflict-free, 32 KB), and nothing
per token. After the loop (one barrier) the table's space holds the warps' partial outputs (the split
kernel's `red` array); in the dense tail's block the same space holds the split kernel's score array of GROUP columns and
`red`. Lookups are byte offsets (code byte << 7 | lane << 2): a shift, a LOP3 and the LDS.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine.kernels.common import HEADER, NW, blocks_per_sm, launches, sm_count, source
from engine.kernels.tq_mma import MMA_HEADER, params5, split5
from engine.kernels.tq_split import SPLIT_HEADER, reduce_split

__all__ = ["attend7", "usable7", "split7", "build_plan7", "v7_shared_bytes", "v7_regs", "slots7", "templates7",
           "SOURCE", "FUSED_HEADER", "DIMS7", "V7_REGS"]

FUSED_HEADER = source("tq_fused.cuh")  # ex2_7, pair7, row7
SOURCE = source("tq_fused.cu")

DIMS7 = (64, 128)  # D = 256: 64 output and 32 query registers a lane, past the register budget: tq_mma's route
TC7 = 32  # table copies: one per lane (conflict-free)
# ptxas registers a thread, (D, G) -> registers (sm_90; tests/test_tq_fused.py checks them as bounds). Each
# warp keeps the next tile's loads in flight during a tile's math (two tile buffers, template PF): 128
# registers and 4 blocks per SM at Qwen3-8B's shape.
V7_REGS = {(128, 4): 128, (128, 8): 128, (128, 1): 128, (64, 3): 96}


def v7_shared_bytes(g: int, dim: int) -> int:
    """Static shared memory: the 32-copy table (32 KB), qs[G][D], stat[NW][G], st7[2][NW][8]."""
    return 4 * (256 * TC7 + g * dim + NW * g + 2 * NW * 8)


def v7_regs(g: int, dim: int) -> int:
    return V7_REGS.get((dim, g), 128)


def usable7(queries: mx.array, bits: int, g: int, dim: int, group: int) -> bool:
    """Whether this kernel maps the step: 4-bit codes, bf16 / f16 queries, D in `DIMS7`, G <= 8 (the N = 8
    query columns of an MMA), and the dense tail's scores and the warps' outputs in the table's space."""
    return (bits == 4 and queries.dtype in (mx.bfloat16, mx.float16) and dim in DIMS7 and 1 <= g <= 8
            and g * group + NW * g * dim <= 256 * TC7)


def slots7(g: int, dim: int) -> int:
    """Resident blocks on the device: SMs x blocks per SM (this kernel's registers and shared memory)."""
    return sm_count() * blocks_per_sm(v7_shared_bytes(g, dim), v7_regs(g, dim))


@lru_cache(maxsize=4096)
def split7(tokens64: int, kv_heads: int, rows: int, g: int, dim: int, at_least64: int) -> int | None:
    """tq_mma's split at this kernel's own resident blocks, for tokens and window rounded up to multiples
    of 64 (computed once per 64 steps). None where the window does not fit a block."""
    return split5(64 * tokens64, kv_heads, rows, g, dim, 64 * at_least64, slots=slots7(g, dim))


@lru_cache(maxsize=1)
def _tq7_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_tq7",
                               input_names=["q", "kn", "kc", "vn", "vc", "tk", "tv", "lp", "signs", "cent", "params"],
                               output_names=["o_part", "ml_part"], source=SOURCE,
                               header=HEADER + SPLIT_HEADER + MMA_HEADER + FUSED_HEADER, ensure_row_contiguous=False)


@lru_cache(maxsize=None)
def templates7(dtype, dim: int, g: int, group: int) -> list:
    return [("T", dtype), ("D", dim), ("G", g), ("NW", NW), ("GROUP", group), ("NQ", 1), ("TW", group),
            ("PF", True)]


def attend7(queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, scale, codec, group, end):
    """The step (split kernel + the parallel reduce), or None where this kernel cannot map it (the caller
    runs engine/kernels/tq_mma.py's). Columns [0, end) of the norms and codes (whole buffers) are the
    cache's; the K norms reach the kernel as [0, end) (their shape carries `end`)."""
    B, hq, _, dim = queries.shape
    H = k_codes.shape[1]
    g = hq // H
    if not usable7(queries, codec.bits, g, dim, group):
        return None
    chunk = split7(-(-end // 64), H, B, g, dim, -(-win_k.shape[2] // 64))
    if chunk is None:
        return None
    splits = -(-end // chunk) + 1  # + the dense block
    kn = k_norms if k_norms.shape[2] == end else k_norms[:, :, :end]
    launches["tq_fused"] += 1
    o_part, ml_part = _tq7_kernel()(
        inputs=[queries, kn, k_codes, v_norms, v_codes, win_k, win_v, lp, codec.signs, codec.centroids,
                params5(scale, chunk)],
        template=templates7(win_k.dtype, dim, g, group),
        grid=(splits * NW * 32, H, B), threadgroup=(NW * 32, 1, 1),
        output_shapes=[(B * hq * splits * dim,), (B * hq, splits, 2)], output_dtypes=[mx.float32, mx.float32])
    return reduce_split(o_part, ml_part, codec.signs, (B, hq, 1, dim), queries.dtype)


def build_plan7(kv_heads: int, g: int, dim: int) -> dict[int, tuple[int, int]]:
    """engine/kernels/prebuild.py's plan: one kernel serves every chunk (a runtime parameter), so one
    launch builds it: {chunk: (rows, tokens)}."""
    chunk = split7(4096 // 64, kv_heads, 1, g, dim, 1)
    return {} if chunk is None else {chunk: (1, 4096)}
