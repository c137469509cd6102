"""TurboQuant decode attention v7: one pass over the codes with an online softmax (CUDA, `mma.sync`).

Why (docs/PERFORMANCE.md, sessions 8 and 9): at one row v4 / v5's code blocks are bound by the
latency of their global loads, not by bytes: each block runs three phases over its chunk (every
token's scores on the tensor cores into a shared array; a block-wide softmax between barriers;
the values), a warp's loop steps have nothing in flight across them, and each pass is ~600 SASS
instructions per 32 tokens. Here each warp streams its own 16-token tiles ONCE: the K and V words
and both norms of tile i+1 are loaded before tile i's math, the scores go through the tensor cores
as v4's (S^T = K Q'^T), a per-warp online softmax (flash-decoding's running max and sum per query
column, the output rescaled when the max grows) turns them into probabilities, which move from the
score C-fragment layout to the P^T B-fragment layout with four shuffles and two byte permutes (no
shared memory, no barrier inside the loop), and the values go through the tensor cores as v4's
(O^T = V^T P^T, the two-token nibble merge). At the end the block combines its warps' (max, sum,
output) and writes v3's partial layout (`o_part`; `ml_part`: the block's max and sum of exp), so
v3's reduce (`decode_attention._tq3_reduce_kernel`) and the dense tail's block (v3's text, one block
of < GROUP tokens) are unchanged. Nothing in MLX or mlx-lm decodes packed codebook codes into MMA
fragments (see engine/tq_mma.py), so the kernel is written here.

What it reuses (imported, not copied): tq_mma's header (pack_half2, mma_f16, ldg_words), v5's
prologue text (runtime chunk from params[1], `end` from the K norms' shape), v5's split
(`tq_mma.split5`, here with v7's own resident blocks per SM) and params (`tq_mma.params5`), v3's
dense-tail text and `_SOFTMAX_STATS` / `_STORE_PARTIALS`.

Lane layout (lane = 4 gq + tq; fragments as engine/tq_mma.py's docstring):
* K (A of S^T = K Q'^T): token gq and gq + 8 of the tile, the D/4 coordinates [(D/4) tq, ...) of
  each (one D/8-byte load), exactly v4's.
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
`ex2.approx`; the partials store the max times ln 2 (v3's layout, natural log).

Shared memory: the pair table, 32 copies (one bank per lane: conflict-free, 32 KB), and nothing
per token. After the loop (one barrier) the table's space holds the warps' partial outputs (v3's
`red` array); in the dense tail's block the same space holds v3's score array of GROUP columns and
`red`. Lookups are byte offsets (code byte << 7 | lane << 2): a shift, a LOP3 and the LDS.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine import decode_attention as da
from engine import tq_mma
from engine.env_choice import EnvChoice

__all__ = ["TQ7_SOURCE", "TQ7_HEADER", "usable7", "attend7", "launches7", "v7_shared_bytes", "split7",
           "build_plan7", "DIMS7", "V7_REGS", "tq7_prefetch", "set_tq7_prefetch"]

DIMS7 = (64, 128)  # D = 256: 64 output and 32 query registers a lane, past the register budget: v5's route
TC7 = 32  # table copies: one per lane (conflict-free)
# ptxas registers a thread, (D, G, PF) -> registers (sm_90; tests/test_tq_fused.py checks them as bounds)
V7_REGS = {(128, 4, True): 128, (128, 8, True): 128, (128, 1, True): 128, (64, 3, True): 96,
           (128, 4, False): 96, (128, 8, False): 128, (128, 1, False): 96, (64, 3, False): 64}
PFS = (1, 0)
_TQ7_PF = EnvChoice("PREFIXTRACE_TQ7_PF", PFS, 1, "v7 tile buffers", on_set=lambda: split7.cache_clear())


def tq7_prefetch() -> bool:
    """Whether a v7 warp keeps the next tile's loads in flight during a tile's math (two tile buffers,
    128 registers, 4 blocks per SM at Qwen3-8B's shape) or loads each tile just before its math (96
    registers, 5 blocks per SM). From PREFIXTRACE_TQ7_PF ("0": one buffer), read once."""
    return bool(_TQ7_PF.get())


set_tq7_prefetch = _TQ7_PF.set

TQ7_HEADER = """
// 2^x, one MUFU.EX2 (ex2.approx.ftz: -inf -> +0).
__device__ inline float ex2_7(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The f16 pair (c[lo nibble], c[hi nibble]) of byte BY of x from the lane's copy of the 32-copy
// table at shared address `tab` (word e * 32 + lane: byte offset (e << 7) | lane4): one shift, one
// LOP3 ((off & 0x7F80) | lane4), and the LDS with the table's base in a uniform register (PTX, so
// that the compiler neither re-masks lane4 nor adds the base per lookup).
template <int BY>
__device__ inline uint32_t pair7(const uint32_t* tab, uint32_t x, uint32_t lane4) {
    const uint32_t off = BY == 0 ? (x << 7) : (x >> (8 * BY - 7));
    uint32_t a;
    asm("lop3.b32 %0, %1, 0x7F80, %2, 0xEA;" : "=r"(a) : "r"(off), "r"(lane4));
    return *reinterpret_cast<const uint32_t*>(reinterpret_cast<const char*>(tab) + a);
}

__device__ inline uint32_t pair7r(const uint32_t* tab, uint32_t x, uint32_t lane4, int by) {  // by: a constant after unrolling
    return by == 0 ? pair7<0>(tab, x, lane4) : by == 1 ? pair7<1>(tab, x, lane4)
         : by == 2 ? pair7<2>(tab, x, lane4) : pair7<3>(tab, x, lane4);
}

// Element t of a per-lane row (64-bit base, 32-bit token index and byte stride): one IMAD.WIDE.U32.
template <typename P>
__device__ inline const P* row7(const void* base, int t, uint32_t stride_bytes) {
    return reinterpret_cast<const P*>(reinterpret_cast<const char*>(base) + (unsigned long long)(uint32_t)t * stride_bytes);
}
"""

_DECLS = """
    constexpr int NT = NW * 32;
    constexpr int DLPT = D / 8;           // dense path: lanes per token, 8 coordinates each
    constexpr int DTPW = 32 / DLPT;
    constexpr int DTG = NW * DTPW;
    constexpr int E = D >= 32 ? D / 32 : 1;
    constexpr int RAW = 256 * 32;         // words: the 32-copy pair table; later red (and the tail's sc)
    static_assert(G * TW + NW * G * D <= RAW, "the tail's scores and red must fit the table's space");
    __shared__ __align__(16) uint32_t raw7[RAW];
    __shared__ float qs[G][D];
    __shared__ float stat[NW][G];
    __shared__ float st7[2][NW][8];       // per warp and query column: running max (log2), sum
    float (*sc)[TW] = reinterpret_cast<float (*)[TW]>(raw7);              // the tail block's scores
    float (*red)[G][D] = reinterpret_cast<float (*)[G][D]>(raw7 + G * TW);  // partial outputs per warp
"""

_FUSED = """ else {
        constexpr int KW = D / 32;        // K code words of a token a lane loads: D / 4 coordinates
        constexpr int KM = D / 16;        // k-steps of the scores per tile
        constexpr int VW = D / 64;        // V code words of a token a lane loads: D / 8 coordinates
        constexpr int VM = D / 16;        // M-tiles of the values per tile
        constexpr float LOG2E = 1.4426950408889634f;
        constexpr float M0 = -1e30f;      // running max before any token (finite: exp2(M0 - M0) = 1, no NaN)
        constexpr float TH7 = 3.f;        // lazy rescale threshold (log2 units, below)
        for (int i = tid; i < 64 * 32; i += NT) {  // the table: word e * 32 + copy, 16 bytes a store
            const int e = i >> 3;
            const uint32_t v = pack_half2(cent[e & 15], cent[e >> 4]);
            reinterpret_cast<uint4*>(raw7)[i] = make_uint4(v, v, v, v);
        }
        const int gq = lane >> 2, tq = lane & 3;
        const int gr = gq < G ? gq : 0;
        uint32_t qb[KM][2];
        #pragma unroll
        for (int j = 0; j < KM; ++j) {
            const int d = (D / 4) * tq + 4 * j;
            qb[j][0] = gq < G ? pack_half2(LOG2E * qs[gr][d], LOG2E * qs[gr][d + 1]) : 0u;
            qb[j][1] = gq < G ? pack_half2(LOG2E * qs[gr][d + 2], LOG2E * qs[gr][d + 3]) : 0u;
        }
        __syncthreads();  // the table is built
        const uint32_t lane4 = lane << 2;
        const uint32_t* tab = raw7;
        // Per-lane bases once (64-bit); per tile only 32-bit token offsets, clamped to the block's
        // last token (branch-free loads; such a token's score is -inf, so its probability is 0).
        const uint32_t* kcb = kc + b * kc_strides[0] + h * kc_strides[1] + (size_t)c0 * kc_strides[2] + tq * KW;
        const uint32_t* vcb = vc + b * vc_strides[0] + h * vc_strides[1] + (size_t)c0 * vc_strides[2] + gq * VW;
        const float* knb = kn + b * kn_strides[0] + h * kn_strides[1] + (size_t)c0 * kn_strides[2];
        const float* vnb = vn + b * vn_strides[0] + h * vn_strides[1] + (size_t)c0 * vn_strides[2];
        const uint32_t ksz = 4 * static_cast<uint32_t>(kc_strides[2]), vsz = 4 * static_cast<uint32_t>(vc_strides[2]);
        const uint32_t knz = 4 * static_cast<uint32_t>(kn_strides[2]), vnz = 4 * static_cast<uint32_t>(vn_strides[2]);
        const int last = n - 1;
        const int tv0 = 2 * tq, tv1 = 2 * tq + 1;  // the lane's V tokens: tv0, tv1, tv0 + 8, tv1 + 8
        const int src0 = 8 * tq + (gq >> 1), src1 = src0 + 4;  // score lanes of tokens 2tq, 2tq + 1 (column gq)
        const uint32_t sel = (gq & 1) ? 0x7632u : 0x5410u;
        struct Tile { uint32_t k[2][KW]; uint32_t v[4][VW]; float kn[2], vn[2]; };
        auto load = [&](Tile& x, int t0) {  // tile starting at token t0 (of the block)
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int t = min(t0 + gq + 8 * r, last);
                ldg_words<KW>(row7<uint32_t>(kcb, t, ksz), x.k[r]);
                x.kn[r] = __ldg(row7<float>(knb, t, knz));
                x.vn[r] = __ldg(row7<float>(vnb, t, vnz));
            }
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int t = min(t0 + (r & 1 ? tv1 : tv0) + 8 * (r >> 1), last);
                ldg_words<VW>(row7<uint32_t>(vcb, t, vsz), x.v[r]);
            }
        };
        float o[VM][4];
        #pragma unroll
        for (int m = 0; m < VM; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.f;
        float mr[2] = {M0, M0}, lr[2] = {0.f, 0.f};  // columns 2tq, 2tq + 1: running max (log2), this lane's sum
        auto math = [&](const Tile& x, int t0) {
            float c[4] = {0.f, 0.f, 0.f, 0.f};
            #pragma unroll
            for (int j = 0; j < KM; ++j) {
                const uint32_t x0 = x.k[0][j >> 1], x1 = x.k[1][j >> 1];
                const int by = 2 * (j & 1);
                mma_f16(c, pair7r(tab, x0, lane4, by), pair7r(tab, x1, lane4, by), pair7r(tab, x0, lane4, by + 1), pair7r(tab, x1, lane4, by + 1),
                        qb[j][0], qb[j][1]);
            }
            const bool ok0 = t0 + gq <= last, ok1 = t0 + gq + 8 <= last;
            float sv[4];
            sv[0] = ok0 ? c[0] * x.kn[0] : NEG_INF;
            sv[1] = ok0 ? c[1] * x.kn[0] : NEG_INF;
            sv[2] = ok1 ? c[2] * x.kn[1] : NEG_INF;
            sv[3] = ok1 ? c[3] * x.kn[1] : NEG_INF;
            float t0m = fmaxf(sv[0], sv[2]), t1m = fmaxf(sv[1], sv[3]);
            #pragma unroll
            for (int off = 4; off < 32; off <<= 1) {  // over the 8 token rows gq (same columns)
                t0m = fmaxf(t0m, __shfl_xor_sync(0xffffffff, t0m, off));
                t1m = fmaxf(t1m, __shfl_xor_sync(0xffffffff, t1m, off));
            }
            const float n0 = fmaxf(mr[0], t0m), n1 = fmaxf(mr[1], t1m);
            // Rescale only where a max grew by more than TH7 (log2): until then the old max stays the
            // reference, so a probability may reach 2^TH7 = 8 (f16 holds p |v| up to |v| ~ 8,000); on random
            // scores a warp's max grows at most tiles, by a little, and each rescale costs ~40 instructions.
            if (__any_sync(0xffffffff, n0 > mr[0] + TH7 || n1 > mr[1] + TH7)) {
                const float a0 = ex2_7(mr[0] - n0), a1 = ex2_7(mr[1] - n1);
                lr[0] *= a0;
                lr[1] *= a1;
                #pragma unroll
                for (int m = 0; m < VM; ++m) {
                    o[m][0] *= a0; o[m][2] *= a0;
                    o[m][1] *= a1; o[m][3] *= a1;
                }
                mr[0] = n0;
                mr[1] = n1;
            }
            const float p0 = ex2_7(sv[0] - mr[0]), p1 = ex2_7(sv[1] - mr[1]);
            const float p2 = ex2_7(sv[2] - mr[0]), p3 = ex2_7(sv[3] - mr[1]);
            lr[0] += p0 + p2;
            lr[1] += p1 + p3;
            const uint32_t w0 = pack_half2(p0 * x.vn[0], p1 * x.vn[0]);  // token gq: columns 2tq, 2tq + 1
            const uint32_t w1 = pack_half2(p2 * x.vn[1], p3 * x.vn[1]);  // token gq + 8
            const uint32_t a0 = __shfl_sync(0xffffffff, w0, src0), a1 = __shfl_sync(0xffffffff, w0, src1);
            const uint32_t e0 = __shfl_sync(0xffffffff, w1, src0), e1 = __shfl_sync(0xffffffff, w1, src1);
            const uint32_t b0 = __byte_perm(a0, a1, sel);  // P(tokens 2tq, 2tq + 1; column gq)
            const uint32_t b1 = __byte_perm(e0, e1, sel);  // P(tokens 2tq + 8, 2tq + 9; column gq)
            #pragma unroll
            for (int j = 0; j < VW; ++j) {
                // Byte k of lo01 = low nibble of token 0's byte k | low nibble of token 1's << 4, ...
                const uint32_t lo01 = (x.v[0][j] & 0x0F0F0F0Fu) | ((x.v[1][j] << 4) & 0xF0F0F0F0u);
                const uint32_t hi01 = ((x.v[0][j] >> 4) & 0x0F0F0F0Fu) | (x.v[1][j] & 0xF0F0F0F0u);
                const uint32_t lo23 = (x.v[2][j] & 0x0F0F0F0Fu) | ((x.v[3][j] << 4) & 0xF0F0F0F0u);
                const uint32_t hi23 = ((x.v[2][j] >> 4) & 0x0F0F0F0Fu) | (x.v[3][j] & 0xF0F0F0F0u);
                #pragma unroll
                for (int k = 0; k < 4; ++k)
                    mma_f16(o[4 * j + k], pair7r(tab, lo01, lane4, k), pair7r(tab, hi01, lane4, k),
                            pair7r(tab, lo23, lane4, k), pair7r(tab, hi23, lane4, k), b0, b1);
            }
        };
        // The warp's tiles: tokens [(i NW + warp) 16, + 16) for i < nt, nt the same for every warp (a tile
        // past n is masked): a block-uniform loop, so the table's base stays in a uniform register and
        // folds into every LDS (a warp-dependent count makes it a per-lookup add). No barrier inside.
        const int nt = (n + 16 * NW - 1) / (16 * NW);
        Tile ta, tb2;
        if constexpr (PF) {  // two tile buffers: tile i + 1's loads in flight during tile i's math
            if (nt > 0) load(ta, 16 * warp);
            for (int i = 0; i < nt; i += 2) {
                if (i + 1 < nt) load(tb2, 16 * ((i + 1) * NW + warp));
                math(ta, 16 * (i * NW + warp));
                if (i + 1 >= nt) break;
                if (i + 2 < nt) load(ta, 16 * ((i + 2) * NW + warp));
                math(tb2, 16 * ((i + 1) * NW + warp));
            }
        } else {  // one buffer (fewer registers, more blocks per SM): a tile's V loads overlap its K math only
            for (int i = 0; i < nt; ++i) {
                load(ta, 16 * (i * NW + warp));
                math(ta, 16 * (i * NW + warp));
            }
        }
        // The block's combine: the lane sums over the 8 token rows, then per column the block's max and
        // each warp's output rescaled to it (v3's red array, in the table's space: after the barrier).
        #pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            lr[0] += __shfl_xor_sync(0xffffffff, lr[0], off);
            lr[1] += __shfl_xor_sync(0xffffffff, lr[1], off);
        }
        if (gq == 0) {
            st7[0][warp][2 * tq] = mr[0]; st7[0][warp][2 * tq + 1] = mr[1];
            st7[1][warp][2 * tq] = lr[0]; st7[1][warp][2 * tq + 1] = lr[1];
        }
        __syncthreads();  // every warp is past its table loads; st7 is complete
        float f[2];
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mb = st7[0][0][2 * tq + i];
            #pragma unroll
            for (int w = 1; w < NW; ++w) mb = fmaxf(mb, st7[0][w][2 * tq + i]);
            f[i] = ex2_7(mr[i] - mb);
        }
        #pragma unroll
        for (int m = 0; m < VM; ++m) {
            const int d = (D / 8) * gq + 2 * m;
            if (2 * tq < G) {
                red[warp][2 * tq][d] = o[m][0] * f[0];
                red[warp][2 * tq][d + 1] = o[m][2] * f[0];
            }
            if (2 * tq + 1 < G) {
                red[warp][2 * tq + 1][d] = o[m][1] * f[1];
                red[warp][2 * tq + 1][d + 1] = o[m][3] * f[1];
            }
        }
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            float mb = st7[0][0][g];
            #pragma unroll
            for (int w = 1; w < NW; ++w) mb = fmaxf(mb, st7[0][w][g]);
            float lb = 0.f;
            #pragma unroll
            for (int w = 0; w < NW; ++w) lb += st7[1][w][g] * ex2_7(st7[0][w][g] - mb);
            mx_[g] = mb * 0.6931471805599453f;  // (v3's partials: natural log)
            l_[g] = lb;
        }
    }
"""

_STATS_DECL = "    float mx_[G], l_[G];\n"


def _tq7_source() -> str:
    """v5's prologue (runtime chunk, `end` from the K norms' shape, the empty block), v3's query
    rotation, then per block either v3's dense tail (scores into `sc`, `_SOFTMAX_STATS`, values) or
    the fused code path (`_FUSED`), and v3's `_STORE_PARTIALS`."""
    v5, v3 = tq_mma.TQ5_SOURCE, da._TQ3_SOURCE
    prologue = v5[v5.index("    const int tid = threadIdx.x"):v5.index(tq_mma._CODEBOOK)]
    a = v5.index("    // Queries, scaled;")
    queries = v5[a:v5.index("    __syncthreads();\n", a) + len("    __syncthreads();\n")]
    k3 = v3.index(tq_mma._K3_END) + len("    } else ")
    tail_scores = v3[k3:v3.index(da._SOFTMAX_STATS, k3)]  # "{ ... }": the dense tail's scores into sc
    v3e = v3.index(tq_mma._V3_END) + len("    } else ")
    tail_values = v3[v3e:v3.rindex(da._STORE_PARTIALS)]  # "{ ... }\n": its values into red
    assert da._SOFTMAX_STATS.count(_STATS_DECL) == 1 and v3.endswith(da._STORE_PARTIALS)
    stats = da._SOFTMAX_STATS.replace(_STATS_DECL, "")
    return (_DECLS + prologue + queries + _STATS_DECL + "    if (tail) {\n" + tail_scores + stats + tail_values.rstrip()
            + "\n    }" + _FUSED + da._STORE_PARTIALS)


TQ7_SOURCE = _tq7_source()
launches7 = [0]  # v7 steps launched in this process (bench/check_decode_kernels.py: that v7 ran)

_INPUTS = ["q", "kn", "kc", "vn", "vc", "tk", "tv", "lp", "signs", "cent", "params"]


@lru_cache(maxsize=1)
def _tq7_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_tq7", input_names=_INPUTS, output_names=["o_part", "ml_part"],
                               source=TQ7_SOURCE, header=da._HEADER + da._TQ3_HEADER + tq_mma.TQ4_HEADER + TQ7_HEADER,
                               ensure_row_contiguous=False)


def v7_shared_bytes(g: int, dim: int) -> int:
    """Static shared memory: the 32-copy table (32 KB), qs[G][D], stat[NW][G], st7[2][NW][8]."""
    return 4 * (256 * TC7 + g * dim + da.NW * g + 2 * da.NW * 8)


def v7_regs(g: int, dim: int, pf: bool | None = None) -> int:
    return V7_REGS.get((dim, g, tq7_prefetch() if pf is None else pf), 128)


def usable7(queries: mx.array, bits: int, g: int, dim: int, group: int) -> bool:
    """Whether v7 maps this step: 4-bit codes, bf16 / f16 queries, D in `DIMS7`, G <= 8 (the N = 8
    query columns of an MMA), and the dense tail's scores and the warps' outputs in the table's space."""
    return (bits == 4 and queries.dtype in (mx.bfloat16, mx.float16) and dim in DIMS7 and 1 <= g <= 8
            and g * group + da.NW * g * dim <= 256 * TC7)


def slots7(g: int, dim: int) -> int:
    """Resident v7 blocks on the device: SMs x blocks per SM (v7's registers and shared memory)."""
    return tq_mma.sm_count() * tq_mma.blocks_per_sm(v7_shared_bytes(g, dim), v7_regs(g, dim))


@lru_cache(maxsize=4096)
def split7(tokens64: int, kv_heads: int, rows: int, g: int, dim: int, at_least64: int) -> int | None:
    """v5's split (`tq_mma.split5`: fewest waves x (columns + a block's fixed work)) at v7's own
    resident blocks, for tokens and window rounded up to multiples of 64 (computed once per 64
    steps); the chunk only, v7 never folds. None where the window does not fit a block."""
    got = tq_mma.split5(64 * tokens64, kv_heads, rows, g, dim, 64 * at_least64, slots=slots7(g, dim))
    return None if got is None else got[0]


@lru_cache(maxsize=None)
def _templates7(dtype, dim: int, g: int, group: int, pf: bool = True) -> list:
    return [("T", dtype), ("D", dim), ("G", g), ("NW", da.NW), ("GROUP", group), ("NQ", 1), ("TW", group),
            ("PF", bool(pf))]


def attend7(queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, scale, codec, group, end):
    """`decode_attention.tq_attend`'s step as v7 (split kernel + v3's reduce), or None where v7
    cannot map it (the caller runs v5's route). Columns [0, end) of the norms and codes (whole
    buffers) are the cache's; the K norms reach the kernel as [0, end) (their shape carries `end`)."""
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
    launches7[0] += 1
    o_part, ml_part = _tq7_kernel()(
        inputs=[queries, kn, k_codes, v_norms, v_codes, win_k, win_v, lp, codec.signs, codec.centroids,
                tq_mma.params5(scale, chunk)],
        template=_templates7(win_k.dtype, dim, g, group, tq7_prefetch()),
        grid=(splits * da.NW * 32, H, B), threadgroup=(da.NW * 32, 1, 1),
        output_shapes=[(B * hq * splits * dim,), (B * hq, splits, 2)], output_dtypes=[mx.float32, mx.float32])
    return da.tq3_reduce(o_part, ml_part, codec.signs, (B, hq, 1, dim), queries.dtype)


def build_plan7(kv_heads: int, g: int, dim: int, max_batch: int) -> dict[int, tuple[int, int]]:
    """engine/tq_prebuild.py's plan under v7: one kernel serves every chunk (a runtime parameter),
    so one launch builds it: {chunk: (rows, tokens)}."""
    chunk = split7(4096 // 64, kv_heads, 1, g, dim, 1)
    return {} if chunk is None else {chunk: (1, 4096)}
