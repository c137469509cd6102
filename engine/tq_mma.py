"""TurboQuant decode attention v4: scores and values on the tensor cores (CUDA, `mma.sync`).

Why: v3 (`decode_attention._TQ3_SOURCE`) is bound by CUDA-core instructions, not bytes: per
coordinate and token it reads the codebook from shared memory and does G FMAs, ~9 instructions
per coordinate per pass (SASS, docs/PERFORMANCE.md session 6), so at 8 rows of 100k its issue
floor (~0.47 ms) is twice the byte floor. Here a warp turns 16 tokens' codes into f16 MMA
fragments with one shared-memory load per fragment register (a 256-entry table of f16 pairs
indexed by a code byte: two 4-bit codes) and multiplies them with m16n8k16 MMAs: per 16 tokens
x 128 coordinates, 32 table loads, ~40 integer ops and 8 MMAs per lane for K, about as much for
V, against v3's 64 x 9 warp instructions. Nothing in MLX or mlx-lm decodes packed codes into
MMA fragments (mlx's quantized matmuls are affine, not codebook, and are Metal-first; vLLM's
TurboQuant backend is Triton over torch), so the kernel is written here, with the inline-PTX
`mma.sync` approach of engine/skinny_gemm.py.

What it keeps from v3 (the body is v3's with its two code paths replaced, `_tq4_source`):
split-K blocks over the context with per-row start offsets (left padding), the G queries
rotated once per block, the dense tail scored on its own small path in the same block
structure and softmax, the block's softmax statistics, the partial-output layout, and v3's
reduce kernel (rotation back, the dense slot).

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
pairs and go to v3's per-warp partial-output array.

Precision: f16 (11-bit significand) rather than bf16 (8): the queries and centroids are
rounded once to f16 (relative 2^-11), products are exact in the f32 accumulators. A float32
decode keeps v3 (its checks hold v3 to 1e-4 absolute, which f16 operands would not meet);
v4 takes bf16 / f16 caches, 4-bit codes, D in (64, 128, 256), G <= 8, where the table fits
the shared memory left by v3's arrays (`table_copies`); everything else runs v3.

Bank conflicts: the table holds TC copies of each pair word side by side (word e * TC + copy,
lane l reads copy l % TC): with TC = 32 every lane has its own bank (conflict-free, 32 KB);
TC = 16 (16 KB, what fits beside v3's 1024-token split at G = 4) leaves at most two-way
conflicts (lanes l and l + 16 read the same bank when their bytes differ but have the same
parity). A 16-entry table
would be conflict-free (16 words in 16 banks) but costs two loads, two extractions and a
byte permute per register instead of one load and one extraction.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx
import numpy as np

from engine import decode_attention as da
from engine.env_choice import EnvChoice

__all__ = ["table_copies", "usable", "attend", "TQ4_SOURCE", "TQ4_HEADER", "U4", "launches"]

U4 = 2  # 16-token tiles a warp loads before it multiplies any: 4 x 16 B (K) / 8 x 8 B (V) in flight per lane
_SMEM_LIMIT = 48 * 1024 - 512  # static shared memory of a block (CUDA's 48 KB without opt-in), some slack
DIMS4 = (64, 128, 256)

TQ4_HEADER = """
__device__ inline uint32_t pack_half2(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);  // .x (low 16 bits) = lo
    return *reinterpret_cast<const uint32_t*>(&v);
}

// D = A B + D, m16n8k16, f16 operands, f32 accumulators (layout: engine/tq_mma.py).
__device__ inline void mma_f16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                               uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The f16 pair (c[lo nibble], c[hi nibble]) of byte `by` of x, from the lane's copy of the table.
template <int TC>
__device__ inline uint32_t pair(const uint32_t* tabl, uint32_t x, int by) {
    return tabl[((x >> (8 * by)) & 0xFFu) * TC];
}

// N consecutive code words (16-byte loads where N allows).
template <int N>
__device__ inline void ldg_words(const uint32_t* p, uint32_t* o) {
    if constexpr (N % 4 == 0) {
        #pragma unroll
        for (int i = 0; i < N; i += 4) {
            const uint4 r = __ldg(reinterpret_cast<const uint4*>(p + i));
            o[i] = r.x; o[i + 1] = r.y; o[i + 2] = r.z; o[i + 3] = r.w;
        }
    } else if constexpr (N == 2) {
        const uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
        o[0] = r.x; o[1] = r.y;
    } else {
        o[0] = __ldg(p);
    }
}
"""

# The pair table, after v3 has loaded the codebook: built from `cent` (global, cached), 16 bytes a store.
_TABLE = """
    __shared__ __align__(16) uint32_t tab[256 * TC];
    for (int i = tid; i < 64 * TC; i += NT) {
        const int e = (4 * i) / TC;
        const uint32_t v = pack_half2(cent[e & 15], cent[e >> 4]);
        reinterpret_cast<uint4*>(tab)[i] = make_uint4(v, v, v, v);
    }
"""

_K4 = """    if (!tail) {
        // Scores on the tensor cores (layout: engine/tq_mma.py). Lane (gq, tq).
        constexpr int KW = D / 32;        // code words of a token a lane loads: D / 4 coordinates
        constexpr int KM = D / 16;        // k-steps (MMAs) per 16-token tile
        const int gq = lane >> 2, tq = lane & 3;
        const int gr = gq < G ? gq : 0;
        uint32_t qb[KM][2];
        #pragma unroll
        for (int j = 0; j < KM; ++j) {
            const int d = (D / 4) * tq + 4 * j;
            qb[j][0] = gq < G ? pack_half2(qs[gr][d], qs[gr][d + 1]) : 0u;
            qb[j][1] = gq < G ? pack_half2(qs[gr][d + 2], qs[gr][d + 3]) : 0u;
        }
        const uint32_t* tabl = tab + (lane % TC);
        const uint32_t* kcb = kc + b * kc_strides[0] + h * kc_strides[1] + tq * KW;
        const float* knb = kn + b * kn_strides[0] + h * kn_strides[1];
        for (int base = warp * 16; base < n; base += NW * 16 * U) {  // (warp-uniform: every lane reaches the MMAs)
            uint32_t w[U][2][KW];
            float nr[U][2];
            #pragma unroll
            for (int u = 0; u < U; ++u)
                #pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int t = base + u * NW * 16 + gq + 8 * r;
                    if (t < n) {
                        ldg_words<KW>(kcb + (size_t)(c0 + t) * kc_strides[2], w[u][r]);
                        nr[u][r] = knb[(size_t)(c0 + t) * kn_strides[2]];
                    } else {
                        #pragma unroll
                        for (int i = 0; i < KW; ++i) w[u][r][i] = 0u;
                        nr[u][r] = 0.f;
                    }
                }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                float c[4] = {0.f, 0.f, 0.f, 0.f};
                #pragma unroll
                for (int j = 0; j < KM; ++j) {
                    const uint32_t x0 = w[u][0][j >> 1], x1 = w[u][1][j >> 1];
                    const int by = 2 * (j & 1);
                    mma_f16(c, pair<TC>(tabl, x0, by), pair<TC>(tabl, x1, by), pair<TC>(tabl, x0, by + 1),
                            pair<TC>(tabl, x1, by + 1), qb[j][0], qb[j][1]);
                }
                const int t0 = base + u * NW * 16 + gq, t1 = t0 + 8;
                if (t0 < n) {
                    if (2 * tq < G) sc[2 * tq][t0] = c[0] * nr[u][0];
                    if (2 * tq + 1 < G) sc[2 * tq + 1][t0] = c[1] * nr[u][0];
                }
                if (t1 < n) {
                    if (2 * tq < G) sc[2 * tq][t1] = c[2] * nr[u][1];
                    if (2 * tq + 1 < G) sc[2 * tq + 1][t1] = c[3] * nr[u][1];
                }
            }
        }
"""

_V4 = """    if (!tail) {
        // Values on the tensor cores: O^T = V^T P^T (layout: engine/tq_mma.py). Lane (gq, tq).
        constexpr int VW = D / 64;        // code words of a token a lane loads: D / 8 coordinates
        constexpr int VM = D / 16;        // M-tiles of 16 coordinates (two per lane group each)
        const int gq = lane >> 2, tq = lane & 3;
        const int gr = gq < G ? gq : 0;
        float o[VM][4];
        #pragma unroll
        for (int m = 0; m < VM; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.f;
        const uint32_t* tabl = tab + (lane % TC);
        const uint32_t* vcb = vc + b * vc_strides[0] + h * vc_strides[1] + gq * VW;
        const float* vnb = vn + b * vn_strides[0] + h * vn_strides[1];
        for (int base = warp * 16; base < n; base += NW * 16 * U) {
            uint32_t w[U][4][VW];
            float p[U][4];
            #pragma unroll
            for (int u = 0; u < U; ++u)
                #pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int t = base + u * NW * 16 + 4 * tq + r;
                    if (t < n) {
                        ldg_words<VW>(vcb + (size_t)(c0 + t) * vc_strides[2], w[u][r]);
                        p[u][r] = gq < G ? sc[gr][t] * vnb[(size_t)(c0 + t) * vn_strides[2]] : 0.f;
                    } else {
                        #pragma unroll
                        for (int i = 0; i < VW; ++i) w[u][r][i] = 0u;
                        p[u][r] = 0.f;
                    }
                }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint32_t b0 = pack_half2(p[u][0], p[u][1]), b1 = pack_half2(p[u][2], p[u][3]);
                #pragma unroll
                for (int j = 0; j < VW; ++j) {
                    // Byte k of lo01 = low nibble of token 0's byte k | low nibble of token 1's << 4, ...
                    const uint32_t lo01 = (w[u][0][j] & 0x0F0F0F0Fu) | ((w[u][1][j] << 4) & 0xF0F0F0F0u);
                    const uint32_t hi01 = ((w[u][0][j] >> 4) & 0x0F0F0F0Fu) | (w[u][1][j] & 0xF0F0F0F0u);
                    const uint32_t lo23 = (w[u][2][j] & 0x0F0F0F0Fu) | ((w[u][3][j] << 4) & 0xF0F0F0F0u);
                    const uint32_t hi23 = ((w[u][2][j] >> 4) & 0x0F0F0F0Fu) | (w[u][3][j] & 0xF0F0F0F0u);
                    #pragma unroll
                    for (int k = 0; k < 4; ++k)
                        mma_f16(o[4 * j + k], pair<TC>(tabl, lo01, k), pair<TC>(tabl, hi01, k),
                                pair<TC>(tabl, lo23, k), pair<TC>(tabl, hi23, k), b0, b1);
                }
            }
        }
        #pragma unroll
        for (int m = 0; m < VM; ++m) {
            const int d = (D / 8) * gq + 2 * m;
            if (2 * tq < G) {
                red[warp][2 * tq][d] = o[m][0];
                red[warp][2 * tq][d + 1] = o[m][2];
            }
            if (2 * tq + 1 < G) {
                red[warp][2 * tq + 1][d] = o[m][1];
                red[warp][2 * tq + 1][d + 1] = o[m][3];
            }
        }
"""

_K3_START = "    if (!tail) {\n        const int sub = lane % LPT, tg = warp * TPW + lane / LPT;\n        float qr[G][CPL];"
_K3_END = "    } else {\n        const int sub = lane % DLPT, tg = warp * DTPW + lane / DLPT;\n        float qr[G][8];"
_V3_START = "    if (!tail) {\n        const int sub = lane % LPT, tg = warp * TPW + lane / LPT;\n        float acc[G][CPL];"
_V3_END = "    } else {\n        const int sub = lane % DLPT, tg = warp * DTPW + lane / DLPT;\n        float acc[G][8];"
_CODEBOOK = "    for (int i = tid; i < (1 << BITS); i += NT) cs[i] = cent[i];\n"


def _swap(source: str, start: str, end: str, new: str) -> str:
    a = source.index(start)
    z = source.index(end, a)
    assert source.count(start) == 1
    return source[:a] + new + source[z:]


def _tq4_source() -> str:
    """v3's body with its code paths (scores, values) replaced by the MMA ones and the pair
    table built beside the codebook; the dense tail, softmax and stores stay v3's."""
    s = _swap(da._TQ3_SOURCE, _K3_START, _K3_END, _K4)
    s = _swap(s, _V3_START, _V3_END, _V4)
    assert s.count(_CODEBOOK) == 1
    return s.replace(_CODEBOOK, _CODEBOOK + _TABLE)


TQ4_SOURCE = _tq4_source()


def _v3_shared_bytes(g: int, dim: int, chunk: int, bits: int) -> int:
    """v3's static shared arrays: sc[G][CHUNK], qs[G][D], cs[2^BITS], red[NW][G][D], stat[NW][G]."""
    return 4 * (g * chunk + g * dim + (1 << bits) + da.NW * g * dim + da.NW * g)


@lru_cache(maxsize=None)
def table_copies(g: int, dim: int, chunk: int, bits: int = 4) -> int | None:
    """Copies of the 256-word pair table that fit the block's static shared memory beside v3's
    arrays: 32 (conflict-free), else 16 / 8 / 4 (at most 2 / 4 / 8-way); None where none fits."""
    free = _SMEM_LIMIT - _v3_shared_bytes(g, dim, chunk, bits)
    for tc in (32, 16, 8, 4):
        if 1024 * tc <= free:
            return tc
    return None


def usable(queries: mx.array, bits: int, g: int, dim: int, chunk: int) -> bool:
    """Whether v4 maps this step: 4-bit codes, bf16 / f16 queries, D in `DIMS4`, G <= 8 (the
    N = 8 query columns of an MMA), and a pair table that fits (`table_copies`)."""
    return (bits == 4 and queries.dtype in (mx.bfloat16, mx.float16) and dim in DIMS4 and 1 <= g <= 8
            and table_copies(g, dim, chunk, bits) is not None)


launches = [0]  # v4 steps launched in this process (bench/check_decode_kernels.py: that v4, not v3, ran)


@lru_cache(maxsize=1)
def _tq4_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_tq4",
                               input_names=["q", "kn", "kc", "vn", "vc", "tk", "tv", "lp", "signs", "cent", "params"],
                               output_names=["o_part", "ml_part"], source=TQ4_SOURCE,
                               header=da._HEADER + da._TQ3_HEADER + TQ4_HEADER, ensure_row_contiguous=False)


@lru_cache(maxsize=None)
def templates(dtype, dim: int, g: int, chunk: int, bits: int, group: int) -> list:
    """v3's template values (CPL: an unused 16, its constants must still be well-formed) with
    U = `U4` tiles in flight and TC copies of the table."""
    t = [(k, v) for k, v in da._templates3(dtype, dim, g, chunk, bits, group, 16, False) if k != "U"]
    return t + [("U", U4), ("TC", table_copies(g, dim, chunk, bits))]


def attend(queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, scale, codec, group, chunk, splits, end):
    """`decode_attention.tq_attend`'s step on the tensor cores, or None where v4 cannot map it
    (the caller runs v3). Same launch grid, partial outputs and reduce as v3; columns [0, end) of
    the norms and codes (whole buffers) are the cache's."""
    B, hq, _, dim = queries.shape
    H = k_codes.shape[1]
    g = hq // H
    if not usable(queries, codec.bits, g, dim, chunk):
        return None
    launches[0] += 1
    o_part, ml_part = _tq4_kernel()(
        inputs=[queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, codec.signs, codec.centroids,
                da._params(scale, end)],
        template=templates(win_k.dtype, dim, g, chunk, codec.bits, group),
        grid=(splits * da.NW * 32, H, B), threadgroup=(da.NW * 32, 1, 1),
        output_shapes=[(B * hq * splits * dim,), (B * hq, splits, 2)], output_dtypes=[mx.float32, mx.float32])
    return da.tq3_reduce(o_part, ml_part, codec.signs, (B, hq, 1, dim), queries.dtype)


# --- v5: v4's kernel with the split chosen from the occupancy, and the reduce folded in ---------
#
# Why (docs/PERFORMANCE.md, session 8): at one row v4's split aims at 1,024 blocks, so one row of
# 100k runs 784 code blocks of 1,024 columns on 132 SMs x 5 resident blocks (660): a second wave
# with a fifth of the SMs busy, and latency-bound blocks take as long alone as together. v5 picks
# the columns per block (any multiple of 64) that minimise (waves, rounded up) x (columns + a
# block's fixed work), from the SM count and the blocks per SM that the kernel's registers and
# shared memory allow. The chunk is a runtime parameter (params[1]) against a shared score array
# sized for the largest chunk (template CHUNK = `chunk_capacity`), so one build serves every
# context (v4 builds one kernel per CHUNK, engine/tq_prebuild.py). Where the grid is small (at
# most `FOLD_WAVES` waves: one row, short batches) the last block of each (row, KV head) to
# finish combines the splits (v2's `_LAST_BLOCK_REDUCE` counter) and writes the output: one
# launch, and one custom-kernel call less on the host, per layer.

# ptxas registers a thread, (D, G, U) -> registers (sm_90; tests/test_tq_mma.py checks them as bounds)
V5_REGS = {(128, 4, 2): 96, (128, 4, 1): 80, (128, 4, 4): 127, (128, 8, 2): 128, (64, 3, 2): 72, (256, 4, 2): 168}
U5S = (1, 2, 4)  # tiles in flight per warp (`tq5_unroll`)
FOLD_WAVES = 2  # fold the reduce into the split kernel up to this many waves of code blocks
_SM_SMEM = 228 * 1024  # shared memory per SM on Hopper (a block also reserves 1 KB)
_SM_REGS, _SM_THREADS, _SM_BLOCKS = 65536, 2048, 32
_BLOCK_FIXED = 64  # a block's fixed work (query rotation, table, softmax, stores) in columns' worth


def chunk_capacity(g: int) -> int:
    """The largest chunk v5's score array holds: G x CHUNK floats in `decode_attention._SMEM_SCORES`."""
    return min(da.MAX_CHUNK, da._SMEM_SCORES // g)


@lru_cache(maxsize=1)
def sm_count() -> int:
    """Multiprocessors of device 0 (the CUDA driver's attribute 16), else an H200's 132."""
    import ctypes

    try:
        cu = ctypes.CDLL("libcuda.so.1")
        dev, n = ctypes.c_int(), ctypes.c_int()
        if cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0 \
                and cu.cuDeviceGetAttribute(ctypes.byref(n), 16, dev) == 0 and n.value > 0:
            return n.value
    except (OSError, AttributeError):
        pass
    return 132


def v5_shared_bytes(g: int, dim: int, bits: int = 4) -> int:
    """v5's static shared memory: v3's arrays at `chunk_capacity`, the pair table, the fold's flag."""
    cap = chunk_capacity(g)
    return _v3_shared_bytes(g, dim, cap, bits) + 1024 * (table_copies(g, dim, cap, bits) or 0) + 16


def v5_regs(g: int, dim: int, u: int | None = None) -> int:
    """`V5_REGS`, else a bound by head size and tiles in flight (more registers: fewer blocks, a safe guess)."""
    u = u or tq5_unroll()
    return V5_REGS.get((dim, g, u), 128 if dim <= 128 and u <= 2 else 168)


_TQ5_UNROLL = EnvChoice("PREFIXTRACE_TQ5_U", U5S, U4, "v5 tiles in flight", on_set=lambda: _plan5.cache_clear())


def tq5_unroll() -> int:
    """16-token tiles a v5 warp loads before it multiplies any (v4: `U4` = 2). 4: twice the bytes
    in flight per warp at 127 registers (4 blocks per SM instead of 5): for large grids, where
    the loads' latency, not the waves, may bind (docs/PERFORMANCE.md, session 8). From
    PREFIXTRACE_TQ5_U, read once."""
    return _TQ5_UNROLL.get()


set_tq5_unroll = _TQ5_UNROLL.set  # (drops the cached split plans: they depend on the registers)


def blocks_per_sm(shared: int, regs: int = 96, threads: int = da.NW * 32) -> int:
    """Resident blocks per SM by registers (allocated per warp in 256s), shared memory and threads."""
    warp_regs = -(-regs * 32 // 256) * 256
    by_regs = (_SM_REGS // warp_regs) // (threads // 32)
    by_smem = _SM_SMEM // (shared + 1024)
    return max(1, min(by_regs, by_smem, _SM_THREADS // threads, _SM_BLOCKS))


def split5(tokens: int, kv_heads: int, rows: int, g: int, dim: int, at_least: int = 0,
           sms: int | None = None, u: int | None = None, slots: int | None = None) -> tuple[int, bool] | None:
    """(columns per code block, fold) for v5: the multiple of 64 in [max(64, at_least), capacity]
    with the fewest (waves rounded up) x (columns + `_BLOCK_FIXED`), the larger chunk on a tie
    (fewer partials to reduce); fold where the code blocks fill at most `FOLD_WAVES` waves. None
    where the dense window does not fit a block. `slots`: resident blocks on the device (another
    kernel's, engine/tq_fused.py), else v5's."""
    slots = slots or (sms or sm_count()) * blocks_per_sm(v5_shared_bytes(g, dim), v5_regs(g, dim, u))
    cap = chunk_capacity(g)
    lo = max(64, -(-at_least // 64) * 64)
    if lo > cap:
        return None
    best = None
    for chunk in range(cap, lo - 1, -64):
        blocks = -(-tokens // chunk) * kv_heads * rows
        cost = -(-blocks // slots) * (chunk + _BLOCK_FIXED)
        if best is None or cost < best[0]:
            best = (cost, chunk, blocks)
    _, chunk, blocks = best
    return chunk, blocks <= FOLD_WAVES * slots


_FOLD_START = "        return;\n    }\n    const int n = c1 - c0;\n"
# The last block of each (row, KV head) to finish reduces its G query heads: warp w takes heads
# w, w + NW, ...; per head the max and the sum over the S splits (lanes over splits), then the
# weighted sum of the rotated partials (a lane holds E = D / 32 coordinates, one 16-byte load per
# split at D = 128), the butterfly back, the dense slot (S - 1) added. Partials written by other
# blocks are read through L2 (__ldcg) after the fence that the counter orders.
_FOLD_REDUCE = """
    __shared__ bool last5_;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int* cnt5 = const_cast<int*>(cnt) + b * gridDim.y + h;
        last5_ = atomicAdd(cnt5, 1) == S - 1;
        if (last5_) atomicExch(cnt5, 0);
    }
    __syncthreads();
    if (!last5_) return;
    __threadfence();
    for (int g = warp; g < G; g += NW) {
        const size_t r = (size_t)(b * HQ + h * G + g);
        const float* ml = ml_part + r * S * 2;
        const float* op = o_part + r * S * D + lane * E;
        float m = NEG_INF;
        for (int s2 = lane; s2 < S; s2 += 32) m = fmaxf(m, __ldcg(ml + 2 * s2));
        m = warp_max(m);
        float l = 0.f;
        for (int s2 = lane; s2 < S; s2 += 32) {
            const float ms = __ldcg(ml + 2 * s2);
            if (ms != NEG_INF) l += __expf(ms - m) * __ldcg(ml + 2 * s2 + 1);
        }
        l = warp_sum(l);
        float x[E];
        #pragma unroll
        for (int e = 0; e < E; ++e) x[e] = 0.f;
        #pragma unroll 8
        for (int s2 = 0; s2 < S - 1; ++s2) {
            const float ms = __ldcg(ml + 2 * s2);
            const float w = ms == NEG_INF ? 0.f : __expf(ms - m);
            #pragma unroll
            for (int e = 0; e < E; e += 2) {
                const float2 v = __ldcg(reinterpret_cast<const float2*>(op + (size_t)s2 * D + e));
                x[e] = fmaf(w, v.x, x[e]);
                x[e + 1] = fmaf(w, v.y, x[e + 1]);
            }
        }
        warp_hadamard<D, E>(x, lane);
        const float md = __ldcg(ml + 2 * (S - 1));
        const float wd = md == NEG_INF ? 0.f : __expf(md - m);
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            const int d = lane * E + e;
            const float v = x[e] * rsqrtf((float)D) * signs[d] + wd * __ldcg(op + (size_t)(S - 1) * D + e);
            out[r * D + d] = static_cast<T>(l > 0.f ? v / l : 0.f);
        }
    }
"""


def _tq5_source(fold: bool) -> str:
    """v4's body with the chunk read from params[1] (CHUNK: the score array's capacity) and the
    cache's column count from the K norms' shape (`attend5` passes them as columns [0, end): no
    array the host writes every step, see `params5`); with `fold`, the empty block's early return
    turned into a branch (every block must reach the counter) and `_FOLD_REDUCE` after the stores."""
    s = TQ4_SOURCE
    for old, new in (("max(s * CHUNK, start)", "max(s * CH5, start)"), ("min((s + 1) * CHUNK, bound)", "min((s + 1) * CH5, bound)"),
                     ("    const int end = static_cast<int>(params[1]);  // the cache's columns: kc may be its whole buffer\n",
                      "    const int end = kn_shape[2];  // the cache's columns: kn is [0, end), kc may be its whole buffer\n"),
                     ("    const bool tail = s == S - 1;\n",
                      "    const bool tail = s == S - 1;\n    const int CH5 = static_cast<int>(params[1]);  // columns per code block (<= CHUNK)\n")):
        assert s.count(old) == 1, old
        s = s.replace(old, new)
    if fold:
        assert s.count(_FOLD_START) == 1
        s = s.replace(_FOLD_START, "    } else {\n    const int n = c1 - c0;\n") + "    }\n" + _FOLD_REDUCE
    return s


TQ5_SOURCE = _tq5_source(False)
TQ5_FOLD_SOURCE = _tq5_source(True)
launches5 = [0, 0]  # v5 steps launched in this process: [split + reduce, folded]

_INPUTS = ["q", "kn", "kc", "vn", "vc", "tk", "tv", "lp", "signs", "cent", "params"]


@lru_cache(maxsize=2)
def _tq5_kernel(fold: bool):
    return mx.fast.cuda_kernel(name="prefixtrace_decode_tq5" + ("f" if fold else ""),
                               input_names=_INPUTS + (["cnt"] if fold else []),
                               output_names=["o_part", "ml_part"] + (["out"] if fold else []),
                               source=TQ5_FOLD_SOURCE if fold else TQ5_SOURCE,
                               header=da._HEADER + da._TQ3_HEADER + TQ4_HEADER, ensure_row_contiguous=False)


@lru_cache(maxsize=None)
def templates5(dtype, dim: int, g: int, bits: int, group: int, u: int = U4) -> list:
    """v4's template values at the capacity chunk (the table copies follow from it), U = `u`."""
    return [(k, u if k == "U" else v) for k, v in templates(dtype, dim, g, chunk_capacity(g), bits, group)]


@lru_cache(maxsize=None)
def params5(scale: float, chunk: int) -> mx.array:
    """v5's float params [scale, chunk], made once per value, not a fresh array every step as v3 /
    v4 make for the column count. Why (suspected, not yet verified on the device): MLX's CUDA
    buffers are managed memory (cudaMallocManaged), so an array the host writes every step is a
    page the next kernel may read across a GPU page fault. In session 8's H200 run, v5 with a fresh
    12-byte params array took 205-420 us a kernel in isolation (ncu) against v4's 48-54 at one row
    of 32k, and +0.13-0.18 ms a synced step at every shape but within 5% queued (where a token's
    36 arrays may share one page); v4's 8-byte array goes to MLX's small pool, advised read-mostly.
    The column count comes from the K norms' shape instead (`_tq5_source`)."""
    return da.own_page([scale, chunk], np.float32)  # a page of its own: `decode_attention.OWN_PAGE`


_tq5_fold: bool | None = None


def fold5() -> bool:
    """Whether v5 folds the reduce into its last blocks on small grids (`split5`'s fold). Off by
    default: on the H200 (session 8, run 2) the folded kernel took 133 us at one row of 100k
    against 98 + 14 for the split and v3's reduce apart (its last block walks 158 splits per head),
    and 64 against 52 + 9 at 32k; its host saving (one custom-kernel call) did not show queued
    (0.120 / 0.200 ms a layer against 0.124 / 0.179). From PREFIXTRACE_TQ5_FOLD ("1": fold),
    read once; bench/bench_tq_attention.py --tq5-nofold times both."""
    global _tq5_fold
    if _tq5_fold is None:
        _tq5_fold = os.environ.get("PREFIXTRACE_TQ5_FOLD", "0") == "1"
    return _tq5_fold


def set_fold5(on: bool) -> None:
    global _tq5_fold
    _tq5_fold = bool(on)


@lru_cache(maxsize=4096)
def _plan5(tokens64: int, kv_heads: int, rows: int, g: int, dim: int, at_least64: int):
    """`split5` for tokens and window rounded up to multiples of 64: a decode step's context grows
    by one, so the plan is computed once per 64 steps (the search is ~10 us of Python)."""
    return split5(64 * tokens64, kv_heads, rows, g, dim, 64 * at_least64)


def attend5(queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, scale, codec, group, counters, end):
    """`decode_attention.tq_attend`'s step as v5, or None where v4's rules say it cannot map it
    (the caller runs v4's route, and so v3). `counters`: the cache's int32 zeros (B x H), needed
    to fold; None: never fold. Columns [0, end) of the norms and codes (whole buffers) are the cache's."""
    B, hq, _, dim = queries.shape
    H = k_codes.shape[1]
    g = hq // H
    cap = chunk_capacity(g)
    if not usable(queries, codec.bits, g, dim, cap):
        return None
    plan = _plan5(-(-end // 64), H, B, g, dim, -(-win_k.shape[2] // 64))
    if plan is None:
        return None
    chunk, fold = plan
    fold = fold and counters is not None and fold5()
    splits = -(-end // chunk) + 1  # + the dense block
    kn = k_norms if k_norms.shape[2] == end else k_norms[:, :, :end]  # its shape carries `end` (one slice)
    inputs = [queries, kn, k_codes, v_norms, v_codes, win_k, win_v, lp, codec.signs, codec.centroids,
              params5(scale, chunk)]
    grid, tg = (splits * da.NW * 32, H, B), (da.NW * 32, 1, 1)
    template = templates5(win_k.dtype, dim, g, codec.bits, group, tq5_unroll())
    parts = [(B * hq * splits * dim,), (B * hq, splits, 2)]
    if fold:
        assert counters.dtype == mx.int32 and counters.size >= B * H
        launches5[1] += 1
        return _tq5_kernel(True)(inputs=inputs + [counters], template=template, grid=grid, threadgroup=tg,
                                 output_shapes=parts + [(B, hq, 1, dim)],
                                 output_dtypes=[mx.float32, mx.float32, queries.dtype])[2]
    launches5[0] += 1
    o_part, ml_part = _tq5_kernel(False)(inputs=inputs, template=template, grid=grid, threadgroup=tg,
                                         output_shapes=parts, output_dtypes=[mx.float32, mx.float32])
    return da.tq3_reduce(o_part, ml_part, codec.signs, (B, hq, 1, dim), queries.dtype)


def build_plan5(kv_heads: int, g: int, dim: int, max_batch: int) -> dict[int, tuple[int, int]]:
    """engine/tq_prebuild.py's plan under v5: v5 builds one kernel per fold choice, not per chunk
    (the chunk is a runtime parameter): with the fold on (`fold5`), one launch that folds (one row,
    4,096 columns) and one that does not (`max_batch` rows, past `FOLD_WAVES` waves of
    1,024-column blocks); with it off, one launch. Keyed by the chunk each picks: {chunk: (rows, tokens)}."""
    slots = sm_count() * blocks_per_sm(v5_shared_bytes(g, dim), v5_regs(g, dim))
    tokens = chunk_capacity(g) * (FOLD_WAVES * slots // (kv_heads * max_batch) + 1)
    plan = {}
    for rows, cols in ((1, 4096), (max_batch, tokens)) if fold5() else ((1, 4096),):
        got = split5(cols, kv_heads, rows, g, dim, at_least=1)
        if got is not None:
            plan.setdefault(got[0], (rows, cols))
    return plan
