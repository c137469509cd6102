"""Dense decode attention on the tensor cores (CUDA, `mma.sync`): one query token per row,
each row from its own start offset (left padding), bf16 / f16 K and V.

Why hand-written: MLX's fused vector SDPA takes no per-row start offset, and a left-padded
batch hands it a boolean mask, whose path is the unfused one (6x fused SDPA at 8 x 32k on the
H200, docs/PERFORMANCE.md session 7); mlx-lm has no decode kernel of its own. The session-4
start-offset kernel (`decode_attention._DENSE_SOURCE`, variant "v1") computes on the CUDA
cores, one 16-byte load per lane per token group with the score pass waiting on each load,
and runs at ~2 TB/s (523 us per layer at 8 x 32k against fused SDPA's 320). This is
engine/tq_mma.py's v4 structure with the K / V bytes loaded straight into MMA fragments (no
codebook table): bf16 pairs are the fragment registers as they come from memory.

Block structure (v1's, so v1's launch grid, partial outputs and reduce kernel are reused):
block (s, h, b) takes columns [max(s CHUNK, lp[b]), min((s+1) CHUNK, T)) of KV head h of row
b, for the G query heads of the group; a block with no columns writes the empty partial.
Each warp takes 16-token tiles warp, warp + NW, ...; U tiles' loads are issued before any of
their MMAs (D/16 16-byte loads per tile and lane, 8 at D = 128: 2 x 8 = 16 loads in flight
per lane at U = 2). Scores go to shared memory, the block's softmax statistics are v1's
(`decode_attention._SOFTMAX_STATS`), then the same tiles of V.

Fragment layout (PTX ISA, m16n8k16, .bf16 / .f16 inputs, .f32 accumulators; lane = 4 gq + tq;
the same table as engine/tq_mma.py's docstring):
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
is new against v1 (whose arithmetic is f32 throughout). float32 caches keep v1.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine import decode_attention as da
from engine.env_choice import EnvChoice

__all__ = ["DIMS", "U", "UNROLLS", "SOURCE", "HEADER", "usable", "attend", "templates", "launches", "unroll",
           "set_unroll"]

DIMS = (64, 128, 256)  # D / 32 K loads and D / 64 V loads per token and lane: whole loads
U = 2  # 16-token tiles a warp loads before it multiplies any
SCORE_PAD = 16  # floats past CHUNK per score row: P's reads (rows gq, gq + 1) fall in other banks

HEADER = """
template <typename T> __device__ inline uint32_t pack2(float lo, float hi);
template <> __device__ inline uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low 16 bits) = lo
    return *reinterpret_cast<const uint32_t*>(&v);
}
template <> __device__ inline uint32_t pack2<__half>(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// D = A B + D, m16n8k16, bf16 / f16 operands (T), f32 accumulators (layout: engine/dense_mma.py).
template <typename T> __device__ inline void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                      uint32_t b0, uint32_t b1);
template <> __device__ inline void mma16816<__nv_bfloat16>(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                                           uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <> __device__ inline void mma16816<__half>(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                    uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ inline uint32_t word_of(const uint4& r, int e) {
    return e == 0 ? r.x : e == 1 ? r.y : e == 2 ? r.z : r.w;  // (e: a constant after unrolling)
}
"""

# Template: T (bf16 / f16), D, G, CHUNK, NW, U, PAD (`SCORE_PAD`). Inputs q (B, HQ, 1, D), k / v (B, H, T, D) of any
# strides along B, H, T (last axis contiguous, rows 16-byte aligned), lp (B,) int32, params [scale].
SOURCE = """
    constexpr int NT = NW * 32;
    constexpr int KL = D / 32;            // 16-byte K loads per token and lane (D / 4 coordinates)
    constexpr int KM = D / 16;            // k-steps per tile
    constexpr int VL = D / 64;            // 16-byte V loads per token and lane (D / 8 coordinates)
    constexpr int VM = D / 16;            // M-tiles of V (16 coordinates each)
    constexpr int SP = CHUNK + PAD;       // score row pitch
    __shared__ __align__(16) float sc[G][SP];
    __shared__ __align__(16) uint16_t qs[G][D];  // the queries' raw bits (exact, no conversion)
    __shared__ float red[NW][G][D];
    __shared__ float stat[NW][G];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int s = blockIdx.x, S = gridDim.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int HQ = gridDim.y * G;
    const int start = lp[b];
    const float scale = params[0];
    const int end = k_shape[2];
    const int c0 = max(s * CHUNK, start), c1 = min((s + 1) * CHUNK, end);
""" + da._EMPTY_BLOCK + """
    const int n = c1 - c0;
    for (int i = tid; i < G * D; i += NT)
        qs[i / D][i % D] = *reinterpret_cast<const uint16_t*>(
            q + b * q_strides[0] + (h * G + i / D) * q_strides[1] + (i % D) * q_strides[3]);
    __syncthreads();
    const int gq = lane >> 2, tq = lane & 3;
    const int gr = gq < G ? gq : 0;
    {
        // Scores on the tensor cores. Lane (gq, tq): tokens gq and gq + 8 of each tile.
        uint32_t qb[KM][2];
        #pragma unroll
        for (int j = 0; j < KM; ++j) {
            const int d = 32 * (j >> 1) + 8 * tq + 4 * (j & 1);
            qb[j][0] = gq < G ? *reinterpret_cast<const uint32_t*>(&qs[gr][d]) : 0u;
            qb[j][1] = gq < G ? *reinterpret_cast<const uint32_t*>(&qs[gr][d + 2]) : 0u;
        }
        const T* kb = k + b * k_strides[0] + h * k_strides[1] + 8 * tq;
        for (int base = warp * 16; base < n; base += NW * 16 * U) {  // (warp-uniform: every lane reaches the MMAs)
            uint4 w[U][2][KL];
            #pragma unroll
            for (int u = 0; u < U; ++u)
                #pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int t = base + u * NW * 16 + gq + 8 * r;
                    #pragma unroll
                    for (int i = 0; i < KL; ++i)
                        w[u][r][i] = t < n ? __ldg(reinterpret_cast<const uint4*>(kb + (size_t)(c0 + t) * k_strides[2]
                                                                                  + 32 * i))
                                           : make_uint4(0u, 0u, 0u, 0u);
                }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                float c[4] = {0.f, 0.f, 0.f, 0.f};
                #pragma unroll
                for (int j = 0; j < KM; ++j) {
                    const int i = j >> 1, e = 2 * (j & 1);
                    mma16816<T>(c, word_of(w[u][0][i], e), word_of(w[u][1][i], e), word_of(w[u][0][i], e + 1),
                                word_of(w[u][1][i], e + 1), qb[j][0], qb[j][1]);
                }
                const int t0 = base + u * NW * 16 + gq, t1 = t0 + 8;
                if (t0 < n) {
                    if (2 * tq < G) sc[2 * tq][t0] = c[0] * scale;
                    if (2 * tq + 1 < G) sc[2 * tq + 1][t0] = c[1] * scale;
                }
                if (t1 < n) {
                    if (2 * tq < G) sc[2 * tq][t1] = c[2] * scale;
                    if (2 * tq + 1 < G) sc[2 * tq + 1][t1] = c[3] * scale;
                }
            }
        }
    }
""" + da._SOFTMAX_STATS + """
    {
        // Values on the tensor cores: O^T = V^T P^T. Lane (gq, tq): tokens 4 tq .. 4 tq + 3 of each tile.
        float o[VM][4];
        #pragma unroll
        for (int m = 0; m < VM; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.f;
        const T* vb = v + b * v_strides[0] + h * v_strides[1] + 8 * gq;
        for (int base = warp * 16; base < n; base += NW * 16 * U) {
            uint4 w[U][4][VL];
            #pragma unroll
            for (int u = 0; u < U; ++u)
                #pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int t = base + u * NW * 16 + 4 * tq + r;
                    #pragma unroll
                    for (int i = 0; i < VL; ++i)  // (zeros past n: 0 x a stale value could be NaN)
                        w[u][r][i] = t < n ? __ldg(reinterpret_cast<const uint4*>(vb + (size_t)(c0 + t) * v_strides[2]
                                                                                  + 64 * i))
                                           : make_uint4(0u, 0u, 0u, 0u);
                }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = base + u * NW * 16 + 4 * tq;
                float p[4];
                #pragma unroll
                for (int r = 0; r < 4; ++r) p[r] = gq < G && t + r < n ? sc[gr][t + r] : 0.f;
                const uint32_t b0 = pack2<T>(p[0], p[1]), b1 = pack2<T>(p[2], p[3]);
                #pragma unroll
                for (int m = 0; m < VM; ++m) {
                    const int i = m >> 2, e = m & 3;
                    const uint32_t x0 = word_of(w[u][0][i], e), x1 = word_of(w[u][1][i], e);
                    const uint32_t x2 = word_of(w[u][2][i], e), x3 = word_of(w[u][3][i], e);
                    mma16816<T>(o[m], __byte_perm(x0, x1, 0x5410), __byte_perm(x0, x1, 0x7632),
                                __byte_perm(x2, x3, 0x5410), __byte_perm(x2, x3, 0x7632), b0, b1);
                }
            }
        }
        #pragma unroll
        for (int m = 0; m < VM; ++m) {
            const int d = 64 * (m >> 2) + 8 * gq + 2 * (m & 3);
            if (2 * tq < G) {
                red[warp][2 * tq][d] = o[m][0];
                red[warp][2 * tq][d + 1] = o[m][2];
            }
            if (2 * tq + 1 < G) {
                red[warp][2 * tq + 1][d] = o[m][1];
                red[warp][2 * tq + 1][d + 1] = o[m][3];
            }
        }
    }
""" + da._STORE_PARTIALS

UNROLLS = (1, 2, 4)
_UNROLL = EnvChoice("PREFIXTRACE_DENSE_MMA_UNROLL", UNROLLS, U, "dense MMA unroll")


def unroll() -> int:
    """16-token tiles a warp loads before it multiplies any (`U`). Default 2: 104 registers a
    thread at D 128, G 4 (ptxas, sm_90: 4 blocks of 128 threads per SM, 16 loads of 16 bytes in
    flight per lane); 1: 90 registers (5 blocks); 4: 200 (2 blocks), and at D 256 it spills, so
    D 256 takes at most 2. From PREFIXTRACE_DENSE_MMA_UNROLL, read once; `set_unroll` for benches."""
    return _UNROLL.get()


set_unroll = _UNROLL.set


def usable(queries: mx.array, keys: mx.array, g: int) -> bool:
    """Whether this kernel maps the step: bf16 / f16, D in `DIMS`, G <= 8 (the N = 8 query
    columns of an MMA; `decode_attention._gqa` has checked the rest)."""
    return _maps(queries.dtype, keys.dtype, queries.shape[-1], g)


@lru_cache(maxsize=None)
def _maps(qdtype, kdtype, dim: int, g: int) -> bool:  # (cached: the hook asks per layer per step)
    return qdtype in (mx.bfloat16, mx.float16) and kdtype == qdtype and dim in DIMS and 1 <= g <= 8


launches = [0]  # steps this kernel took in this process (bench/check_decode_kernels.py: that it, not v1, ran)


@lru_cache(maxsize=1)
def _kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_dense_mma", input_names=["q", "k", "v", "lp", "params"],
                               output_names=["o_part", "ml_part"], source=SOURCE, header=da._HEADER + HEADER,
                               ensure_row_contiguous=False)


@lru_cache(maxsize=None)
def templates(dtype, dim: int, g: int, chunk: int, unroll: int = U) -> list:
    return [("T", dtype), ("D", dim), ("G", g), ("CHUNK", chunk), ("NW", da.NW),
            ("U", min(unroll, 2) if dim == 256 else unroll), ("PAD", SCORE_PAD)]


def attend(queries, keys, values, lp, scale: float, chunk: int, splits: int):
    """Pass 1 of `decode_attention.dense_attend` on the tensor cores (same grid and partial
    outputs as v1's kernel: its reduce follows), or None where this kernel cannot map the step."""
    B, hq, _, dim = queries.shape
    H = keys.shape[1]
    g = hq // H
    dtype = keys.dtype
    if not _maps(queries.dtype, dtype, dim, g):
        return None
    launches[0] += 1
    return _kernel()(
        inputs=[queries, keys, values, lp, da._scalar(scale)],
        template=templates(dtype, dim, g, chunk, _UNROLL.get()),
        grid=(splits * da.NW * 32, H, B), threadgroup=(da.NW * 32, 1, 1),
        output_shapes=[(B * hq * splits * dim,), (B * hq, splits, 2)], output_dtypes=[mx.float32, mx.float32])
