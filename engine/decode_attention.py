"""Split-K decode attention on CUDA: one query token per row, left-padded rows, dense or TurboQuant KV.

Why this is hand-written: a batched decode step over left-padded rows hands MLX's
`scaled_dot_product_attention` a boolean mask, and on CUDA a masked call leaves the
fused vector kernel (mlx-lm's `GenerationBatch` with padded rows ran at 4.22x its B=1
rate against 6.41x unpadded on an H200, issue 17). And attention over a TurboQuant
cache with stock MLX ops writes the T x d codebook values of every layer to memory
before SDPA reads them back (5.6-13x a dense step on the H200, issue 18). Neither
MLX nor mlx-lm has a decode kernel that takes per-row start offsets or reads
packed codes; vLLM's and FlashInfer's kernels do both but work on torch tensors.

Both kernels are flash-decoding style (split-K): block (s, h, b) takes context
columns [s*CHUNK, (s+1)*CHUNK) of KV head h of row b, intersected with the row's own
columns [left_padding[b], end), and scores every query head of its GQA group against
them (the K/V bytes are read once for the G = q_heads / kv_heads queries). Within a
block, lanes work in groups of D/8 lanes, one token per group, 8 coordinates per
lane (one 16-byte load of bf16); the scores of the chunk go to shared memory, the
block takes their max and exponentials, then the same groups read V and accumulate.
Each block writes its unnormalised output with its max and sum; a second kernel
combines the splits of each (row, head) with max/sum rescaling (variant v2 does that in the
same launch, by the last block of each row and KV head: `_LAST_BLOCK_REDUCE`; slower on the
H200, so v2s, two launches, replaced it; variant v3, the default, is two launches of its own
kernels, `_TQ3_SOURCE` and `_TQ3_REDUCE_SOURCE`: `tq_variant`; v4, engine/tq_mma.py, is v3's kernel
with the scores and values on the tensor cores).

TurboQuant (`tq_attend`, layout in engine/turboquant.py): a K or V vector is a
float32 norm plus `bits`-bit codes of the rotated unit vector, packed little-end
first into uint32 words. The query is rotated in the block (the codec's
randomised Hadamard transform: signs, then an in-place Walsh-Hadamard butterfly in
shared memory, scaled by 1/sqrt(D)), a key's score is norm * sum_i q'_i c[code_i]
with the codebook c in shared memory, and values accumulate norm * c[code] in the
rotated basis; no decoded vector is written anywhere. Columns a row still holds
dense (its tail of < `group` tokens and this call's token, per row from the same
boundary rule as `BatchTurboQuantKVCache`) are scored by one extra block per
(row, KV head) with the unrotated query. The reduce kernel rotates the combined
code part back (butterfly, signs) and adds the dense part, all in one softmax.

Which calls take it (`use_dense`, `use_tq`): only on a CUDA device, one query token,
head_dim 64/128/256, bits dividing 8 (TurboQuant), G <= 8. Everything else — the CPU,
prefill chunks, other shapes — stays on MLX's own attention (CPU tests emulate the
kernels' index arithmetic: tests/test_decode_attention.py; the GPU check is
bench/check_decode_kernels.py). PREFIXTRACE_DECODE_ATTENTION: "0" off, "all" also for
unpadded dense batches (default: dense batches only when padded, where MLX would
take its masked path; TurboQuant decode always).
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx
import numpy as np

from engine.env_choice import EnvChoice

__all__ = ["available", "mode", "set_mode", "use_dense", "use_tq", "dense_attend", "tq_attend", "split_chunk",
           "tq_bounds", "MODES", "tq_variant", "set_tq_variant", "tq_unroll", "set_tq_unroll", "defer_encode", "one_launch", "counters", "kernel_sources",
           "TQ_VARIANTS", "tq3_load", "set_tq3_load", "tq3_cpl", "tq3_nibble", "set_tq3_nibble",
           "dense_shape", "set_dense_shape", "DENSE_BLOCKS", "DENSE_UNROLLS", "DENSE_VARIANTS", "dense_variant",
           "set_dense_variant"]

NW = 4  # warps per pass-1 block
_TARGET_BLOCKS = 1024  # ~8 blocks per SM on an H200's 132: enough to keep its memory system busy
MIN_CHUNK, MAX_CHUNK = 64, 1024
_SMEM_SCORES = 4096  # G x CHUNK floats of scores per block (16 KB)
DIMS = (16, 32, 64, 128, 256)  # D / 8 lanes per token must divide a warp

_HEADER = """
#define NEG_INF (-__int_as_float(0x7f800000))
template <typename T>
__device__ inline void load8(const T* p, float* o) {
    if constexpr (sizeof(T) == 4) {
        const float4 a = *reinterpret_cast<const float4*>(p);
        const float4 b = *reinterpret_cast<const float4*>(p + 4);
        o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
        o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
    } else {
        const uint4 r = *reinterpret_cast<const uint4*>(p);
        const T* e = reinterpret_cast<const T*>(&r);
        #pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = static_cast<float>(e[i]);
    }
}

__device__ inline float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

__device__ inline float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
"""

# Shared by both pass-1 kernels once a block knows its columns [c0, c1) (n = c1 - c0 > 0) and
# has filled sc[g][t] with the scaled scores: softmax statistics of the chunk (_SOFTMAX_STATS,
# v3's kernel uses it too), then the values pass (VALUE(t, w) accumulates w * v_t into acc),
# then the block's partial output.
_SOFTMAX_STATS = """
    __syncthreads();
    float mx_[G], l_[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        float m = NEG_INF;
        for (int t = tid; t < n; t += NT) m = fmaxf(m, sc[g][t]);
        m = warp_max(m);
        if (lane == 0) stat[warp][g] = m;
    }
    __syncthreads();
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        float m = stat[0][g];
        #pragma unroll
        for (int w = 1; w < NW; ++w) m = fmaxf(m, stat[w][g]);
        mx_[g] = m;
    }
    __syncthreads();
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        float l = 0.f;
        for (int t = tid; t < n; t += NT) {
            const float p = __expf(sc[g][t] - mx_[g]);
            sc[g][t] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) stat[warp][g] = l;
    }
    __syncthreads();
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        float l = 0.f;
        #pragma unroll
        for (int w = 0; w < NW; ++w) l += stat[w][g];
        l_[g] = l;
    }
"""

# The warps' partial outputs summed into the block's (every split kernel's end; `_STORE_PARTIALS` below).
_SUM_PARTIALS = """\
    __syncthreads();
    for (int i = tid; i < G * D; i += NT) {
        const int g = i / D, d = i % D;
        float v = 0.f;
        #pragma unroll
        for (int w = 0; w < NW; ++w) v += red[w][g][d];
        o_part[((size_t)(b * HQ + h * G + g) * S + s) * D + d] = v;
    }
"""

_SOFTMAX_AND_STORE = _SOFTMAX_STATS + """    float acc[G][8];
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
    // U tokens per group per step, loads first: more bytes in flight per lane.
    for (int base = 0; base < n; base += TG * U) {
        VLOAD
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            if (t < n) {
                VACC
            }
        }
    }
    // Token groups of a warp hold the same coordinates: add them, then the warps.
    #pragma unroll
    for (int o = LPT; o < 32; o <<= 1)
        #pragma unroll
        for (int g = 0; g < G; ++g)
            #pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] += __shfl_xor_sync(0xffffffff, acc[g][i], o);
    if (lane < LPT) {
        #pragma unroll
        for (int g = 0; g < G; ++g)
            #pragma unroll
            for (int i = 0; i < 8; ++i) red[warp][g][sub * 8 + i] = acc[g][i];
    }
""" + _SUM_PARTIALS + """\
    if (tid < G) {
        ml_part[((size_t)(b * HQ + h * G + tid) * S + s) * 2] = mx_[tid];
        ml_part[((size_t)(b * HQ + h * G + tid) * S + s) * 2 + 1] = l_[tid];
    }
"""

# A block with no columns (a split inside a row's left padding) still writes its slot.
_EMPTY_WRITES = """
        for (int i = tid; i < G * D; i += NT)
            o_part[((size_t)(b * HQ + h * G + i / D) * S + s) * D + i % D] = 0.f;
        if (tid < G) {
            ml_part[((size_t)(b * HQ + h * G + tid) * S + s) * 2] = NEG_INF;
            ml_part[((size_t)(b * HQ + h * G + tid) * S + s) * 2 + 1] = 0.f;
        }
"""
_EMPTY_BLOCK = """
    if (c0 >= c1) {""" + _EMPTY_WRITES + """
        return;
    }
"""

# The end of a split block (v3, v4, the dense MMA kernel): the partial outputs summed, then the block's
# softmax statistics; one text, so the kernels' partial layouts cannot drift apart.
_STORE_PARTIALS = _SUM_PARTIALS + """\
    #pragma unroll
    for (int g = 0; g < G; ++g)  // (not mx_[tid]: a register array indexed at run time goes to the stack)
        if (tid == g) {
            ml_part[((size_t)(b * HQ + h * G + g) * S + s) * 2] = mx_[g];
            ml_part[((size_t)(b * HQ + h * G + g) * S + s) * 2 + 1] = l_[g];
        }
"""

_PROLOGUE = """
    constexpr int LPT = D / 8;            // lanes per token: 8 coordinates each
    constexpr int TPW = 32 / LPT;         // tokens per warp step
    constexpr int TG = NW * TPW;          // token groups per block
    constexpr int NT = NW * 32;
    constexpr int U = 4;                  // tokens per group per loop step
    __shared__ float sc[G][CHUNK];
    __shared__ float qs[G][D];
    __shared__ float red[NW][G][D];
    __shared__ float stat[NW][G];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int s = blockIdx.x, S = gridDim.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int HQ = gridDim.y * G;
    const int tg = warp * TPW + lane / LPT, sub = lane % LPT;
    const int start = lp[b];
    const float scale = params[0];
"""

# Dense K/V (B, H, T, D) of any strides along B, H, T (the cache's capacity buffer,
# sliced), last axis contiguous. Columns [left_padding[b], T) are row b's. U (tokens per
# lane group per loop step) is a template argument here: `dense_unroll`.
_U4 = "    constexpr int U = 4;                  // tokens per group per loop step\n"
assert _U4 in _PROLOGUE
_DENSE_SOURCE = _PROLOGUE.replace(_U4, "") + """
    const int end = k_shape[2];
    const int c0 = max(s * CHUNK, start), c1 = min((s + 1) * CHUNK, end);
""" + _EMPTY_BLOCK + """
    const int n = c1 - c0;
    for (int i = tid; i < G * D; i += NT)
        qs[i / D][i % D] = scale * static_cast<float>(
            q[b * q_strides[0] + (h * G + i / D) * q_strides[1] + (i % D) * q_strides[3]]);
    __syncthreads();
    float qr[G][8];
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int i = 0; i < 8; ++i) qr[g][i] = qs[g][sub * 8 + i];
    const T* kb = k + b * k_strides[0] + h * k_strides[1] + sub * 8;
    const T* vb = v + b * v_strides[0] + h * v_strides[1] + sub * 8;
    // Every lane runs every step (the shuffles need the whole warp); past n it loads nothing.
    for (int base = 0; base < n; base += TG * U) {
        float x[U][8];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            if (t < n) load8(kb + (size_t)(c0 + t) * k_strides[2], x[u]);
            else {
                #pragma unroll
                for (int i = 0; i < 8; ++i) x[u][i] = 0.f;
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            float a[G];
            #pragma unroll
            for (int g = 0; g < G; ++g) {
                a[g] = 0.f;
                #pragma unroll
                for (int i = 0; i < 8; ++i) a[g] += qr[g][i] * x[u][i];
            }
            #pragma unroll
            for (int o = LPT / 2; o > 0; o >>= 1)
                #pragma unroll
                for (int g = 0; g < G; ++g) a[g] += __shfl_xor_sync(0xffffffff, a[g], o);
            if (t < n && sub == 0) {
                #pragma unroll
                for (int g = 0; g < G; ++g) sc[g][t] = a[g];
            }
        }
    }
""" + _SOFTMAX_AND_STORE.replace("VLOAD", """
        float x[U][8];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            if (t < n) load8(vb + (size_t)(c0 + t) * v_strides[2], x[u]);
        }
""").replace("VACC", """
                #pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float p = sc[g][t];
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) acc[g][i] += p * x[u][i];
                }
""")

# TurboQuant: norms (B, H, T, 1) float32 and codes (B, H, T, W) uint32 for columns [0, T);
# the dense window (B, H, Tw, D) holds columns [T - Tw, T). Row b's boundary (columns below
# it are read as codes, the rest dense) is BatchTurboQuantKVCache's rule for a call of NQ
# tokens: start + min(prev - start, floor((T - start) / GROUP) * GROUP), prev = T - NQ.
# Blocks s < S - 1 take codes; block S - 1 takes the dense columns [max(bound, start), T).
# (U, tokens per lane group per loop step, is a template argument here: `tq_unroll`.)
_TQ_SOURCE = _PROLOGUE.replace("    constexpr int U = 4;                  // tokens per group per loop step\n", "") + """
    constexpr int MASK = (1 << BITS) - 1;
    __shared__ float cs[1 << BITS];
    const int end = kc_shape[2];
    const int ws = end - tk_shape[2];
    const int prev = end - NQ;
    const int bound = start + min(prev - start, ((end - start) / GROUP) * GROUP);
    const bool tail = s == S - 1;
    const int c0 = tail ? max(bound, start) : max(s * CHUNK, start);
    const int c1 = tail ? end : min((s + 1) * CHUNK, bound);
""" + _EMPTY_BLOCK + """
    const int n = c1 - c0;
    for (int i = tid; i < G * D; i += NT)
        qs[i / D][i % D] = scale * static_cast<float>(
            q[b * q_strides[0] + (h * G + i / D) * q_strides[1] + (i % D) * q_strides[3]]);
    for (int i = tid; i < (1 << BITS); i += NT) cs[i] = cent[i];
    if (!tail) {
        // q' = H (q * signs) / sqrt(D): the codec's rotation, as mx.hadamard_transform computes it.
        __syncthreads();
        for (int i = tid; i < G * D; i += NT) qs[i / D][i % D] *= signs[i % D];
        #pragma unroll
        for (int hh = 1; hh < D; hh <<= 1) {
            __syncthreads();
            for (int i = tid; i < G * D / 2; i += NT) {
                const int g = i / (D / 2), j = i % (D / 2);
                const int lo = (j / hh) * 2 * hh + (j % hh), hi = lo + hh;
                const float a = qs[g][lo], c = qs[g][hi];
                qs[g][lo] = a + c;
                qs[g][hi] = a - c;
            }
        }
    }
    __syncthreads();
    const float qscale = tail ? 1.f : rsqrtf((float)D);
    float qr[G][8];
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int i = 0; i < 8; ++i) qr[g][i] = qscale * qs[g][sub * 8 + i];
    const size_t kcb = b * kc_strides[0] + h * kc_strides[1];
    const size_t knb = b * kn_strides[0] + h * kn_strides[1];
    const size_t vcb = b * vc_strides[0] + h * vc_strides[1];
    const size_t vnb = b * vn_strides[0] + h * vn_strides[1];
    const T* tkb = tk + b * tk_strides[0] + h * tk_strides[1] + sub * 8;
    const T* tvb = tv + b * tv_strides[0] + h * tv_strides[1] + sub * 8;
    constexpr int BIT0 = 8 * BITS;       // a lane's 8 codes start at bit sub * BIT0 of the row
    for (int base = 0; base < n; base += TG * U) {
        float x[U][8];
        uint32_t w0[U], w1[U];
        float norm[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            w0[u] = 0u; w1[u] = 0u; norm[u] = 0.f;
            #pragma unroll
            for (int i = 0; i < 8; ++i) x[u][i] = 0.f;
            if (t < n) {
                const int c = c0 + t;
                if (tail) {
                    load8(tkb + (size_t)(c - ws) * tk_strides[2], x[u]);
                    norm[u] = 1.f;
                } else {
                    const uint32_t* row = kc + kcb + (size_t)c * kc_strides[2] + (sub * BIT0) / 32;
                    w0[u] = row[0];
                    if (BIT0 > 32) w1[u] = row[1];
                    norm[u] = kn[knb + (size_t)c * kn_strides[2]];
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            if (!tail) {
                #pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const int bit = (sub * BIT0) % 32 + i * BITS;
                    x[u][i] = cs[(bit < 32 ? (w0[u] >> bit) : (w1[u] >> (bit - 32))) & MASK];
                }
            }
            float a[G];
            #pragma unroll
            for (int g = 0; g < G; ++g) {
                a[g] = 0.f;
                #pragma unroll
                for (int i = 0; i < 8; ++i) a[g] += qr[g][i] * x[u][i];
            }
            #pragma unroll
            for (int o = LPT / 2; o > 0; o >>= 1)
                #pragma unroll
                for (int g = 0; g < G; ++g) a[g] += __shfl_xor_sync(0xffffffff, a[g], o);
            if (t < n && sub == 0) {
                #pragma unroll
                for (int g = 0; g < G; ++g) sc[g][t] = a[g] * norm[u];
            }
        }
    }
""" + _SOFTMAX_AND_STORE.replace("VLOAD", """
        float x[U][8];
        uint32_t w0[U], w1[U];
        float norm[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            w0[u] = 0u; w1[u] = 0u; norm[u] = 1.f;
            if (t < n) {
                const int c = c0 + t;
                if (tail) {
                    load8(tvb + (size_t)(c - ws) * tv_strides[2], x[u]);
                } else {
                    const uint32_t* row = vc + vcb + (size_t)c * vc_strides[2] + (sub * BIT0) / 32;
                    w0[u] = row[0];
                    if (BIT0 > 32) w1[u] = row[1];
                    norm[u] = vn[vnb + (size_t)c * vn_strides[2]];
                }
            }
        }
""").replace("VACC", """
                if (!tail) {
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const int bit = (sub * BIT0) % 32 + i * BITS;
                        x[u][i] = cs[(bit < 32 ? (w0[u] >> bit) : (w1[u] >> (bit - 32))) & MASK];
                    }
                }
                #pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float p = sc[g][t] * norm[u];
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) acc[g][i] += p * x[u][i];
                }
""")

# v2: the same blocks, and the reduce in the same launch. Each block, once its partials are
# written, bumps its (row, KV head)'s counter; the block that brings it to S (the last one
# done) combines the S partials of its G query heads as `_REDUCE_SOURCE` does (max/sum
# rescaling, the rotated part turned back once, the dense part added) and resets the
# counter to 0 for the next launch. The counters are an input the kernel writes through
# (MLX custom kernels have no in-place outputs; an output with an init value would cost
# a fill launch per step): zero before and after every launch, so to MLX it never changes.
# Counters belong to one cache, whose decode steps depend on each other, so no two
# launches share them at once.
_LAST_BLOCK_REDUCE = """
    __shared__ bool last_;
    __shared__ float ls_[G];
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int* cnt_ = const_cast<int*>(cnt) + b * gridDim.y + h;
        last_ = atomicAdd(cnt_, 1) == S - 1;
        if (last_) atomicExch(cnt_, 0);
    }
    __syncthreads();
    if (!last_) return;
    __threadfence();
    for (int i = tid; i < G * D; i += NT) {
        const int g = i / D, d = i % D;
        const size_t r = (size_t)(b * HQ + h * G + g);
        const float* ml = ml_part + r * S * 2;
        const float* op = o_part + r * S * D + d;
        float M = NEG_INF;
        for (int s2 = 0; s2 < S; ++s2) M = fmaxf(M, __ldcg(ml + 2 * s2));
        float L = 0.f, rot = 0.f, plain = 0.f;
        for (int s2 = 0; s2 < S; ++s2) {
            const float m = __ldcg(ml + 2 * s2);
            if (m == NEG_INF) continue;
            const float w = __expf(m - M);
            L += w * __ldcg(ml + 2 * s2 + 1);
            if (s2 < S - 1) rot += w * __ldcg(op + (size_t)s2 * D);
            else plain += w * __ldcg(op + (size_t)s2 * D);
        }
        red[0][g][d] = rot;
        red[1][g][d] = plain;
        if (d == 0) ls_[g] = L;
    }
    #pragma unroll
    for (int hh = 1; hh < D; hh <<= 1) {
        __syncthreads();
        for (int i = tid; i < G * D / 2; i += NT) {
            const int g = i / (D / 2), j = i % (D / 2);
            const int lo = (j / hh) * 2 * hh + (j % hh), hi = lo + hh;
            const float a = red[0][g][lo], c = red[0][g][hi];
            red[0][g][lo] = a + c;
            red[0][g][hi] = a - c;
        }
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += NT) {
        const int g = i / D, d = i % D;
        const float L = ls_[g];
        const float v = red[1][g][d] + red[0][g][d] * rsqrtf((float)D) * signs[d];
        out[(size_t)(b * HQ + h * G + g) * D + d] = static_cast<T>(L > 0.f ? v / L : 0.f);
    }
"""


def _one_launch(source: str) -> str:
    """`source` (a pass-1 body with `_EMPTY_BLOCK`) with the empty case as a branch instead of a
    return (every block must reach the counter), then `_LAST_BLOCK_REDUCE`."""
    head, body = source.split(_EMPTY_BLOCK)
    return head + "\n    if (c0 >= c1) {" + _EMPTY_WRITES + "    } else {\n" + body + "\n    }\n" + _LAST_BLOCK_REDUCE


_TQ1_SOURCE = _one_launch(_TQ_SOURCE)


# One block of D threads per (row, query head): combine the S partials with max/sum
# rescaling. ROT: slots [0, S-1) are in the codec's rotated basis and slot S-1 is dense;
# the rotated sum is turned back (butterfly, 1/sqrt(D), signs) before the dense part is added.
_REDUCE_SOURCE = """
    __shared__ float xs[D];
    const int r = blockIdx.x, d = threadIdx.x;
    const int S = ml_part_shape[1];
    const float* ml = ml_part + (size_t)r * S * 2;
    const float* op = o_part + (size_t)r * S * D + d;
    float M = NEG_INF;
    for (int s = 0; s < S; ++s) M = fmaxf(M, ml[2 * s]);
    float L = 0.f, rot = 0.f, plain = 0.f;
    for (int s = 0; s < S; ++s) {
        const float m = ml[2 * s];
        if (m == NEG_INF) continue;
        const float w = __expf(m - M);
        L += w * ml[2 * s + 1];
        if (ROT && s < S - 1) rot += w * op[(size_t)s * D];
        else plain += w * op[(size_t)s * D];
    }
    if (ROT) {
        xs[d] = rot;
        #pragma unroll
        for (int hh = 1; hh < D; hh <<= 1) {
            __syncthreads();
            if (d < D / 2) {
                const int lo = (d / hh) * 2 * hh + (d % hh), hi = lo + hh;
                const float a = xs[lo], c = xs[hi];
                xs[lo] = a + c;
                xs[hi] = a - c;
            }
        }
        __syncthreads();
        plain += xs[d] * rsqrtf((float)D) * signs[d];
    }
    out[(size_t)r * D + d] = static_cast<T>(L > 0.f ? plain / L : 0.f);
"""

# TurboQuant encode of new K and V vectors in one launch (engine/turboquant.py's
# `encode`: norm, unit vector, signs, Walsh-Hadamard / sqrt(D), codes = how many
# thresholds a coordinate exceeds, packed BITS to a code from bit 0 of word 0). One warp
# per vector, E = D / 32 consecutive coordinates per lane: the butterfly's first log2(E)
# stages are within a lane, the rest between lanes. Warps [0, NV) take K, [NV, 2 NV) V.
_ENCODE_SOURCE = """
    constexpr int E = D / 32;
    constexpr int W = D * BITS / 32;
    constexpr int LEVELS = 1 << BITS;
    const int gw = blockIdx.x;            // one warp per block, one vector per warp
    const int lane = threadIdx.x;
    const int NV = gridDim.x / 2;
    const bool is_v = gw >= NV;
    const int vec = is_v ? gw - NV : gw;
    const auto* src = is_v ? v + (size_t)vec * D : k + (size_t)vec * D;
    float x[E];
    float ss = 0.f;
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        x[e] = static_cast<float>(src[lane * E + e]);
        ss += x[e] * x[e];
    }
    ss = warp_sum(ss);
    const float norm = sqrtf(ss);
    const float den = fmaxf(norm, 1e-30f);
    #pragma unroll
    for (int e = 0; e < E; ++e) x[e] = x[e] / den * signs[lane * E + e];
    #pragma unroll
    for (int hh = 1; hh < E; hh <<= 1)
        #pragma unroll
        for (int e = 0; e < E; ++e)
            if ((e & hh) == 0) {
                const float a = x[e], c = x[e + hh];
                x[e] = a + c;
                x[e + hh] = a - c;
            }
    #pragma unroll
    for (int hh = E; hh < D; hh <<= 1) {
        const int o = hh / E;
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            const float other = __shfl_xor_sync(0xffffffff, x[e], o);
            x[e] = (lane & o) ? other - x[e] : x[e] + other;
        }
    }
    const float rs = rsqrtf((float)D);
    uint32_t cd[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        const float y = x[e] * rs;
        uint32_t code = 0u;
        #pragma unroll
        for (int j = 0; j < LEVELS - 1; ++j) code += y > thr[j] ? 1u : 0u;
        cd[e] = code;
    }
    uint32_t* codes = is_v ? vc : kc;
    if constexpr (E * BITS <= 32) {
        // A word holds the codes of LPW consecutive lanes: OR their pieces together.
        constexpr int LPW = 32 / (E * BITS);
        uint32_t piece = 0u;
        #pragma unroll
        for (int e = 0; e < E; ++e) piece |= cd[e] << (((lane * E + e) * BITS) % 32);
        #pragma unroll
        for (int o = 1; o < LPW; o <<= 1) piece |= __shfl_xor_sync(0xffffffff, piece, o);
        if (lane % LPW == 0) codes[(size_t)vec * W + (lane * E * BITS) / 32] = piece;
    } else {
        // A lane's codes fill whole words (E * BITS / 32 of them).
        constexpr int PER = 32 / BITS;
        #pragma unroll
        for (int j = 0; j < E / PER; ++j) {
            uint32_t word = 0u;
            #pragma unroll
            for (int e = 0; e < PER; ++e) word |= cd[j * PER + e] << (e * BITS);
            codes[(size_t)vec * W + (lane * E * BITS) / 32 + j] = word;
        }
    }
    if (lane == 0) (is_v ? vn : kn)[vec] = norm;
"""


# --- variant v3: the TurboQuant decode kernel designed from the bandwidth floor down ------------
#
# What bounds a v2 block at long context is not bytes but how few of them are in flight: a lane
# loads one 4-byte code word per token, and the dense-tail path, living in the same loop body,
# keeps U x 8 floats of dense values in every block's registers (104-237 registers, 2-4 blocks per
# SM). v3 changes the lane mapping and splits the paths:
#
# * A lane owns CPL consecutive coordinates of a token and loads their codes as one LB-byte load
#   (LB = CPL * BITS / 8, at most `tq3_load()` and with the G x CPL query registers within budget:
#   `tq3_cpl`), U tokens deep (32 bytes of codes in flight per lane per pass). 16 bytes (32 codes at
#   4 bits, a warp moving 8 tokens' 64-byte code rows per load instruction at D = 128) costs 168
#   registers (3 blocks per SM); 8 bytes, 120 (4 blocks) and measured faster: the default.
# * The G queries of the KV head's group are rotated once per block, one warp per query head, in
#   registers (in-lane butterfly stages, then shuffles: no barrier per stage), then each lane keeps
#   its CPL coordinates of all G in registers and scores every G at once.
# * Codebook: the 2^BITS centroids in shared memory, looked up once per coordinate and reused for
#   the G heads (one LDS and G FMAs per coordinate). The alternative, a per-dimension q x centroid
#   table (D x 2^BITS x G floats: 32 KB at D = 128, G = 4), turns each FMA into an LDS + FADD: G
#   shared-memory reads per coordinate instead of one, and shared-memory bandwidth (one 32-lane
#   LDS per SM per clock) is already the co-bottleneck with the FMAs at G = 4. The 16-entry table
#   sits in 16 distinct banks, so any pattern of codes reads it without conflicts.
# * The dense tail (< GROUP tokens and this call's own) is the last block of each (row, KV head),
#   on its own small code path (8 coordinates per lane, one token in flight), so it adds nothing to
#   the code path's registers; both land in the same softmax through the reduce.
# * The reduce (`_TQ3_REDUCE_SOURCE`) is parallel over the splits: per (row, query head) one block of
#   RW warps, each warp summing every RW-th split (D / 32 coordinates per lane), the softmax
#   weights once per split, then one warp turns the rotated sum back with shuffles.
_TQ3_HEADER = """
template <int LW>
__device__ inline void load_words(const uint32_t* p, uint32_t* o) {
    if constexpr (LW == 4) {
        const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
        o[0] = r.x; o[1] = r.y; o[2] = r.z; o[3] = r.w;
    } else if constexpr (LW == 2) {
        const uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
        o[0] = r.x; o[1] = r.y;
    } else {
        o[0] = __ldg(p);
    }
}

// Centroid of code k (of PER) in word w: c[(w >> k * BITS) & mask]. NIB (4 bits): the byte
// offsets of all eight codes come from two shifts and two masks per word (even codes' offsets
// x 4 in the bytes of lo, odd codes' in hi; the table is 16 floats, so an offset fits 6 bits) and
// one byte permute per code, instead of a shift, a mask and an address add per code: the
// compiler hoists lo / hi out of the k loop (k is a constant after unrolling).
template <int BITS, bool NIB, int PER>
__device__ inline float centroid(const float* cs, uint32_t w, int k) {
    if constexpr (NIB && BITS == 4) {
        const uint32_t lo = (w << 2) & 0x3C3C3C3Cu, hi = (w >> 2) & 0x3C3C3C3Cu;
        const uint32_t off = __byte_perm((k & 1) ? hi : lo, 0u, 0x4440u + (k >> 1));
        return *reinterpret_cast<const float*>(reinterpret_cast<const char*>(cs) + off);
    } else {
        return cs[(w >> (k * BITS)) & ((1u << BITS) - 1u)];
    }
}

// The Walsh-Hadamard butterfly of one D-vector held by a warp, E = max(1, D / 32) coordinates
// per lane (coordinate lane * E + e): stages below E within a lane, the rest between lanes.
// Unscaled, in the stage order of mx.hadamard_transform's (and the encode kernel's).
template <int D, int E>
__device__ inline void warp_hadamard(float* x, int lane) {
    #pragma unroll
    for (int hh = 1; hh < E; hh <<= 1)
        #pragma unroll
        for (int e = 0; e < E; ++e)
            if ((e & hh) == 0) {
                const float a = x[e], c = x[e + hh];
                x[e] = a + c;
                x[e + hh] = a - c;
            }
    #pragma unroll
    for (int hh = E; hh < D; hh <<= 1) {
        const int o = hh / E;
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            const float other = __shfl_xor_sync(0xffffffff, x[e], o);
            x[e] = (lane & o) ? other - x[e] : x[e] + other;
        }
    }
}
"""

# Template: T, D, G, CHUNK, NW, BITS, GROUP, NQ as `_TQ_SOURCE`, plus CPL (coordinates per lane on
# the code path) and U (tokens in flight per lane). Columns and boundaries: `_TQ_SOURCE`'s rule.
_TQ3_SOURCE = """
    constexpr int NT = NW * 32;
    constexpr int LW = CPL * BITS / 32;   // code words a lane loads per token: 4 = one 16-byte load
    constexpr int PER = 32 / BITS;        // codes per word
    constexpr int LPT = D / CPL;          // code path: lanes per token
    constexpr int TPW = 32 / LPT;
    constexpr int TG = NW * TPW;          // tokens per block per load
    constexpr int DLPT = D / 8;           // dense path: lanes per token, 8 coordinates each
    constexpr int DTPW = 32 / DLPT;
    constexpr int DTG = NW * DTPW;
    constexpr int E = D >= 32 ? D / 32 : 1;
    __shared__ float sc[G][CHUNK];
    __shared__ float qs[G][D];
    __shared__ float cs[1 << BITS];
    __shared__ float red[NW][G][D];
    __shared__ float stat[NW][G];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int s = blockIdx.x, S = gridDim.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int HQ = gridDim.y * G;
    const int start = lp[b];
    const float scale = params[0];
    const int end = static_cast<int>(params[1]);  // the cache's columns: kc may be its whole buffer
    const int ws = end - tk_shape[2];
    const int prev = end - NQ;
    const int bound = start + min(prev - start, ((end - start) / GROUP) * GROUP);
    const bool tail = s == S - 1;
    const int c0 = tail ? max(bound, start) : max(s * CHUNK, start);
    const int c1 = tail ? end : min((s + 1) * CHUNK, bound);
    if (c0 >= c1) {
        for (int i = tid; i < G * D; i += NT)
            o_part[((size_t)(b * HQ + h * G + i / D) * S + s) * D + i % D] = 0.f;
        if (tid < G) {
            ml_part[((size_t)(b * HQ + h * G + tid) * S + s) * 2] = NEG_INF;
            ml_part[((size_t)(b * HQ + h * G + tid) * S + s) * 2 + 1] = 0.f;
        }
        return;
    }
    const int n = c1 - c0;
    for (int i = tid; i < (1 << BITS); i += NT) cs[i] = cent[i];
    // Queries, scaled; for the code blocks rotated as the codec rotates keys: q' = H (q * signs) / sqrt(D).
    for (int g = warp; g < G; g += NW) {
        float x[E];
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            const int d = lane * E + e;
            x[e] = d < D ? scale * static_cast<float>(q[b * q_strides[0] + (h * G + g) * q_strides[1]
                                                        + d * q_strides[3]]) : 0.f;
            if (!tail && d < D) x[e] *= signs[d];
        }
        if (!tail) {
            warp_hadamard<D, E>(x, lane);
            #pragma unroll
            for (int e = 0; e < E; ++e) x[e] *= rsqrtf((float)D);
        }
        #pragma unroll
        for (int e = 0; e < E; ++e)
            if (lane * E + e < D) qs[g][lane * E + e] = x[e];
    }
    __syncthreads();
    if (!tail) {
        const int sub = lane % LPT, tg = warp * TPW + lane / LPT;
        float qr[G][CPL];
        #pragma unroll
        for (int g = 0; g < G; ++g)
            #pragma unroll
            for (int i = 0; i < CPL; ++i) qr[g][i] = qs[g][sub * CPL + i];
        const uint32_t* kcb = kc + b * kc_strides[0] + h * kc_strides[1] + sub * LW;
        const float* knb = kn + b * kn_strides[0] + h * kn_strides[1];
        for (int base = 0; base < n; base += TG * U) {
            uint32_t w[U][LW];
            float nr[U];
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = base + u * TG + tg;
                if (t < n) {
                    load_words<LW>(kcb + (size_t)(c0 + t) * kc_strides[2], w[u]);
                    nr[u] = knb[(size_t)(c0 + t) * kn_strides[2]];
                } else {
                    #pragma unroll
                    for (int j = 0; j < LW; ++j) w[u][j] = 0u;
                    nr[u] = 0.f;
                }
            }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = base + u * TG + tg;
                float a[G];
                #pragma unroll
                for (int g = 0; g < G; ++g) a[g] = 0.f;
                #pragma unroll
                for (int j = 0; j < LW; ++j)
                    #pragma unroll
                    for (int k = 0; k < PER; ++k) {
                        const float c = centroid<BITS, NIB, PER>(cs, w[u][j], k);
                        #pragma unroll
                        for (int g = 0; g < G; ++g) a[g] = fmaf(qr[g][j * PER + k], c, a[g]);
                    }
                #pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1)
                    #pragma unroll
                    for (int g = 0; g < G; ++g) a[g] += __shfl_xor_sync(0xffffffff, a[g], o);
                if (t < n && sub == 0) {
                    #pragma unroll
                    for (int g = 0; g < G; ++g) sc[g][t] = a[g] * nr[u];
                }
            }
        }
    } else {
        const int sub = lane % DLPT, tg = warp * DTPW + lane / DLPT;
        float qr[G][8];
        #pragma unroll
        for (int g = 0; g < G; ++g)
            #pragma unroll
            for (int i = 0; i < 8; ++i) qr[g][i] = qs[g][sub * 8 + i];
        const T* tkb = tk + b * tk_strides[0] + h * tk_strides[1] + sub * 8;
        for (int base = 0; base < n; base += DTG) {
            const int t = base + tg;
            float x[8];
            if (t < n) load8(tkb + (size_t)(c0 + t - ws) * tk_strides[2], x);
            else {
                #pragma unroll
                for (int i = 0; i < 8; ++i) x[i] = 0.f;
            }
            float a[G];
            #pragma unroll
            for (int g = 0; g < G; ++g) {
                a[g] = 0.f;
                #pragma unroll
                for (int i = 0; i < 8; ++i) a[g] = fmaf(qr[g][i], x[i], a[g]);
            }
            #pragma unroll
            for (int o = DLPT / 2; o > 0; o >>= 1)
                #pragma unroll
                for (int g = 0; g < G; ++g) a[g] += __shfl_xor_sync(0xffffffff, a[g], o);
            if (t < n && sub == 0) {
                #pragma unroll
                for (int g = 0; g < G; ++g) sc[g][t] = a[g];
            }
        }
    }""" + _SOFTMAX_STATS + """    if (!tail) {
        const int sub = lane % LPT, tg = warp * TPW + lane / LPT;
        float acc[G][CPL];
        #pragma unroll
        for (int g = 0; g < G; ++g)
            #pragma unroll
            for (int i = 0; i < CPL; ++i) acc[g][i] = 0.f;
        const uint32_t* vcb = vc + b * vc_strides[0] + h * vc_strides[1] + sub * LW;
        const float* vnb = vn + b * vn_strides[0] + h * vn_strides[1];
        for (int base = 0; base < n; base += TG * U) {
            uint32_t w[U][LW];
            float nr[U];
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = base + u * TG + tg;
                if (t < n) {
                    load_words<LW>(vcb + (size_t)(c0 + t) * vc_strides[2], w[u]);
                    nr[u] = vnb[(size_t)(c0 + t) * vn_strides[2]];
                }
            }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = base + u * TG + tg;
                if (t < n) {
                    float p[G];
                    #pragma unroll
                    for (int g = 0; g < G; ++g) p[g] = sc[g][t] * nr[u];
                    #pragma unroll
                    for (int j = 0; j < LW; ++j)
                        #pragma unroll
                        for (int k = 0; k < PER; ++k) {
                            const float c = centroid<BITS, NIB, PER>(cs, w[u][j], k);
                            #pragma unroll
                            for (int g = 0; g < G; ++g) acc[g][j * PER + k] = fmaf(p[g], c, acc[g][j * PER + k]);
                        }
                }
            }
        }
        // Token groups of a warp hold the same coordinates: add them, then the warps (below).
        #pragma unroll
        for (int o = LPT; o < 32; o <<= 1)
            #pragma unroll
            for (int g = 0; g < G; ++g)
                #pragma unroll
                for (int i = 0; i < CPL; ++i) acc[g][i] += __shfl_xor_sync(0xffffffff, acc[g][i], o);
        if (lane < LPT) {
            #pragma unroll
            for (int g = 0; g < G; ++g)
                #pragma unroll
                for (int i = 0; i < CPL; ++i) red[warp][g][sub * CPL + i] = acc[g][i];
        }
    } else {
        const int sub = lane % DLPT, tg = warp * DTPW + lane / DLPT;
        float acc[G][8];
        #pragma unroll
        for (int g = 0; g < G; ++g)
            #pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
        const T* tvb = tv + b * tv_strides[0] + h * tv_strides[1] + sub * 8;
        for (int base = 0; base < n; base += DTG) {
            const int t = base + tg;
            if (t < n) {
                float x[8];
                load8(tvb + (size_t)(c0 + t - ws) * tv_strides[2], x);
                #pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float p = sc[g][t];
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(p, x[i], acc[g][i]);
                }
            }
        }
        #pragma unroll
        for (int o = DLPT; o < 32; o <<= 1)
            #pragma unroll
            for (int g = 0; g < G; ++g)
                #pragma unroll
                for (int i = 0; i < 8; ++i) acc[g][i] += __shfl_xor_sync(0xffffffff, acc[g][i], o);
        if (lane < DLPT) {
            #pragma unroll
            for (int g = 0; g < G; ++g)
                #pragma unroll
                for (int i = 0; i < 8; ++i) red[warp][g][sub * 8 + i] = acc[g][i];
        }
    }
""" + _STORE_PARTIALS

# One block of RW warps per (row, query head). Slots [0, S-1) are in the rotated basis, slot S-1
# (the dense block) in the original one. The max and the sum over the splits are block
# reductions; warp w adds the weighted outputs of splits w, w + RW, ... (E coordinates per lane,
# a coalesced row of D floats per split per warp), so a thread walks S / RW splits, not S.
_TQ3_REDUCE_SOURCE = """
    constexpr int E = D >= 32 ? D / 32 : 1;
    constexpr int NT = RW * 32;
    __shared__ float part[RW][D];
    __shared__ float st[2][RW];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int r = blockIdx.x;
    const int S = ml_part_shape[1];
    const float* ml = ml_part + (size_t)r * S * 2;
    const float* op = o_part + (size_t)r * S * D;
    float m = NEG_INF;
    for (int s = tid; s < S; s += NT) m = fmaxf(m, ml[2 * s]);
    m = warp_max(m);
    if (lane == 0) st[0][warp] = m;
    __syncthreads();
    float M = st[0][0];
    #pragma unroll
    for (int w = 1; w < RW; ++w) M = fmaxf(M, st[0][w]);
    float l = 0.f;
    for (int s = tid; s < S; s += NT) {
        const float ms = ml[2 * s];
        if (ms != NEG_INF) l += __expf(ms - M) * ml[2 * s + 1];
    }
    l = warp_sum(l);
    if (lane == 0) st[1][warp] = l;
    float x[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) x[e] = 0.f;
    #pragma unroll 4
    for (int s = warp; s < S - 1; s += RW) {
        const float ms = ml[2 * s];
        const float w = ms == NEG_INF ? 0.f : __expf(ms - M);
        #pragma unroll
        for (int e = 0; e < E; ++e)
            if (lane * E + e < D) x[e] = fmaf(w, op[(size_t)s * D + lane * E + e], x[e]);
    }
    #pragma unroll
    for (int e = 0; e < E; ++e)
        if (lane * E + e < D) part[warp][lane * E + e] = x[e];
    __syncthreads();
    if (warp == 0) {
        float L = 0.f;
        #pragma unroll
        for (int w = 0; w < RW; ++w) L += st[1][w];
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            const int d = lane * E + e;
            float v = 0.f;
            if (d < D) {
                #pragma unroll
                for (int w = 0; w < RW; ++w) v += part[w][d];
            }
            x[e] = v;
        }
        warp_hadamard<D, E>(x, lane);
        const float md = ml[2 * (S - 1)];
        const float wd = md == NEG_INF ? 0.f : __expf(md - M);
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            const int d = lane * E + e;
            if (d < D) {
                const float v = x[e] * rsqrtf((float)D) * signs[d] + wd * op[(size_t)(S - 1) * D + d];
                out[(size_t)r * D + d] = static_cast<T>(L > 0.f ? v / L : 0.f);
            }
        }
    }
"""

ENCODE_DIMS = (32, 64, 128, 256)


@lru_cache(maxsize=1)
def _encode_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_tq_encode", input_names=["k", "v", "signs", "thr"],
                               output_names=["kn", "kc", "vn", "vc"], source=_ENCODE_SOURCE, header=_HEADER)


def use_encode(keys: mx.array, values: mx.array, codec) -> bool:
    """Whether new K/V go through `encode_kv` (CUDA, Hadamard codec, bits dividing 8, the
    same head size for K and V)."""
    return (mode() != "off" and available() and codec.hadamard and 8 % codec.bits == 0
            and keys.shape == values.shape and keys.shape[-1] == codec.dim and codec.dim in ENCODE_DIMS
            and keys.dtype in (mx.bfloat16, mx.float16, mx.float32) and keys.size > 0)


def encode_kv(keys: mx.array, values: mx.array, codec):
    """(k_norms, k_codes, v_norms, v_codes) of keys/values (..., D), as `codec.encode` gives
    them, in one launch. CUDA only (`use_encode`)."""
    lead = keys.shape[:-1]
    nv = keys.size // keys.shape[-1]
    words = codec.words
    kn, kc, vn, vc = _encode_kernel()(
        inputs=[keys, values.astype(keys.dtype), codec.signs, codec.thresholds],
        # T: MLX names a kernel by its template arguments only and writes the inputs' dtypes into
        # its source, so without it a second dtype in one process ran the first one's build.
        template=[("T", keys.dtype), ("D", codec.dim), ("BITS", codec.bits)],
        grid=(2 * nv * 32, 1, 1), threadgroup=(32, 1, 1),
        output_shapes=[(nv,), (nv, words), (nv,), (nv, words)],
        output_dtypes=[mx.float32, mx.uint32, mx.float32, mx.uint32])
    return (kn.reshape(*lead, 1), kc.reshape(*lead, words), vn.reshape(*lead, 1), vc.reshape(*lead, words))


MODES = ("off", "on", "all")
_mode: str | None = None


def mode() -> str:
    """"on" (default): TurboQuant decode, and dense batches with padded rows; "all": every
    dense batched decode step too; "off": MLX's attention everywhere. From
    PREFIXTRACE_DECODE_ATTENTION (0 / all), read once; `set_mode` for benchmarks."""
    global _mode
    if _mode is None:
        env = os.environ.get("PREFIXTRACE_DECODE_ATTENTION", "on")
        _mode = "off" if env == "0" else "all" if env == "all" else "on"
    return _mode


def set_mode(new: str) -> None:
    if new not in MODES:
        raise ValueError(f"decode attention mode must be one of {MODES}, not {new!r}")
    global _mode
    _mode = new


TQ_VARIANTS = ("v1", "v2", "v2s", "v3", "v4", "v5", "v7")
# v7 (session 9): kernel time per layer step 0.59x / 0.54x / 0.33x / 0.42x dense at 1x32k / 1x100k / 8x32k /
# 8x100k on the H200 (v5: 0.83x / 0.79x at one row; v4 1.06x / 1.02x), through the engine 1.54-1.58x dense's
# tok/s at 32k and 2.73-3.37x at 100k (v4 1.54x / 2.36x in the same session); its checks passed
# (docs/PERFORMANCE.md, "TurboQuant decode v7"). Steps v7 cannot map (D = 256, float32, 2 / 8 bits) run
# v5's route, and so v4's and v3's. Before: v4 (session 7), faster than v3 at every per-layer shape.
DEFAULT_TQ_VARIANT = "v7"
_TQ_VARIANT = EnvChoice("PREFIXTRACE_TQ_DECODE", TQ_VARIANTS, DEFAULT_TQ_VARIANT, "TurboQuant decode variant")


def tq_variant() -> str:
    """How a TurboQuant decode step runs on CUDA. "v7" (default): one pass over the codes per block
    with an online softmax (below). "v4": v3's step with the scores and
    values on the tensor cores (below). "v3": v2s's step (below) with the
    attention kernel rebuilt from the bandwidth floor down (`_TQ3_SOURCE`: wide code loads, the
    dense tail on its own path, a reduce parallel over the splits; 0.66-0.90x v2s's step on the
    H200, session 6). "v2s": the new token is appended
    to the dense tail in place and encoded later, in one launch for a whole group's worth
    of tokens, when a row is about to see it decoded (or it leaves the tail); the decoded
    K/V `update_and_fetch` returns is not built for hooked caches; attention is the split
    kernel and the reduce kernel. "v2": the same with attention in one launch (the last block
    of each row and head reduces): checked on the H200 but slower there (its reduce runs in
    one block per row and KV head; docs/PERFORMANCE.md, session 5). "v1": session 4's step
    (encode every token, concatenate the tail), kept to compare side by side and to fall
    back to. "v4": v3's step with the scores and values on the tensor cores (engine/tq_mma.py;
    bf16 / f16 caches with 4-bit codes, else v3; docs/PERFORMANCE.md, session 7). "v5": v4's kernel
    with the split chosen from the occupancy (waves) and, on small grids, the reduce folded into
    its last blocks (engine/tq_mma.py, `attend5`; what it cannot map runs v4's route). "v7": one
    pass over the codes per block with an online softmax (engine/tq_fused.py, `attend7`; what it
    cannot map runs v5's route). From PREFIXTRACE_TQ_DECODE, read once."""
    return _TQ_VARIANT.get()


set_tq_variant = _TQ_VARIANT.set


def defer_encode() -> bool:
    """Whether a TurboQuant decode step may defer encoding its token (variant v2, CUDA)."""
    return mode() != "off" and tq_variant() != "v1" and available()


def one_launch() -> bool:
    """Whether TurboQuant attention may reduce in its own launch's last blocks (variant v2; v5 on
    small grids): the step then hands `tq_attend` the cache's counters."""
    return tq_variant() in ("v2", "v5")


@lru_cache(maxsize=1)
def available() -> bool:
    """A CUDA build of MLX with the GPU as default device (decided once per process)."""
    try:
        return mx.default_device() == mx.gpu and mx.cuda.is_available()
    except AttributeError:
        return False


@lru_cache(maxsize=1)
def _dense_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_dense", input_names=["q", "k", "v", "lp", "params"],
                               output_names=["o_part", "ml_part"], source=_DENSE_SOURCE, header=_HEADER,
                               ensure_row_contiguous=False)


@lru_cache(maxsize=1)
def _tq_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_tq",
                               input_names=["q", "kn", "kc", "vn", "vc", "tk", "tv", "lp", "signs", "cent", "params"],
                               output_names=["o_part", "ml_part"], source=_TQ_SOURCE, header=_HEADER,
                               ensure_row_contiguous=False)


@lru_cache(maxsize=1)
def _tq1_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_tq1",
                               input_names=["q", "kn", "kc", "vn", "vc", "tk", "tv", "lp", "signs", "cent", "params",
                                            "cnt"],
                               output_names=["o_part", "ml_part", "out"], source=_TQ1_SOURCE, header=_HEADER,
                               ensure_row_contiguous=False)


@lru_cache(maxsize=1)
def _reduce_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_reduce", input_names=["o_part", "ml_part", "signs"],
                               output_names=["out"], source=_REDUCE_SOURCE, header=_HEADER)


def split_chunk(tokens: int, kv_heads: int, rows: int, g: int, at_least: int = 0,
                target: int = _TARGET_BLOCKS) -> int | None:
    """Context columns per pass-1 block: the smallest power of two from 64 that keeps the
    grid near `target` blocks, up to 1024 and to the G x CHUNK scores of a block fitting
    16 KB of shared memory, and at least `at_least` (a TurboQuant row's dense columns are
    one block's). None when `at_least` does not fit."""
    top = min(MAX_CHUNK, _SMEM_SCORES // g)
    chunk = MIN_CHUNK
    while chunk < at_least or (chunk < top and -(-tokens // chunk) * kv_heads * rows > target):
        chunk *= 2
    return chunk if chunk <= top else None


def tq_bounds(end: int, left_padding: list[int], group: int, queries: int = 1) -> list[int]:
    """Per row, the first column the kernel reads dense (`_TQ_SOURCE`'s rule; equal to
    `BatchTurboQuantKVCache.update_and_fetch`'s `bounds`, tested)."""
    prev = end - queries
    return [p + min(prev - p, (end - p) // group * group) for p in left_padding]


DENSE_BLOCKS = (1024, 2048, 4096)
DENSE_UNROLLS = (4, 8)
_dense_shape: tuple[int, int] | None = None


def dense_shape() -> tuple[int, int]:
    """The dense kernel's (target blocks per launch, tokens per lane group per loop step).
    Default (1024, 4), session 4's. The kernel takes 80 registers a thread at D = 128, G = 4
    (ptxas, sm_90): 6 blocks of 128 threads per SM, 792 on an H200, so 1,024 blocks (8 rows x
    4k) run as 1.3 waves; 2,048 / 4,096 (smaller chunks) even those waves out, U = 8 puts
    twice the loads in flight per lane. From PREFIXTRACE_DENSE_BLOCKS and
    PREFIXTRACE_DENSE_UNROLL, read once; `set_dense_shape` for benchmarks."""
    global _dense_shape
    if _dense_shape is None:
        blocks = os.environ.get("PREFIXTRACE_DENSE_BLOCKS", "")
        unroll = os.environ.get("PREFIXTRACE_DENSE_UNROLL", "")
        _dense_shape = (int(blocks) if blocks in {str(b) for b in DENSE_BLOCKS} else DENSE_BLOCKS[0],
                        int(unroll) if unroll in {str(u) for u in DENSE_UNROLLS} else DENSE_UNROLLS[0])
    return _dense_shape


def set_dense_shape(blocks: int, unroll: int) -> None:
    if blocks not in DENSE_BLOCKS or unroll not in DENSE_UNROLLS:
        raise ValueError(f"dense kernel shape must be blocks in {DENSE_BLOCKS}, unroll in {DENSE_UNROLLS}")
    global _dense_shape
    _dense_shape = (blocks, unroll)


DENSE_VARIANTS = ("v1", "mma")
# mma: at the byte floor on the H200 (8 x 32k: 301 us per layer against v1's 529 and fused SDPA's 303; ncu
# 4.1 TB/s, 85 % of DRAM peak; 8 x 4k: 86 against 100 / 97), every dense check passed (session 8).
DEFAULT_DENSE_VARIANT = "mma"
_DENSE_VARIANT = EnvChoice("PREFIXTRACE_DENSE_DECODE", DENSE_VARIANTS, DEFAULT_DENSE_VARIANT, "dense decode variant")


def dense_variant() -> str:
    """How `dense_attend`'s first pass runs on CUDA: "mma" (default; engine/dense_mma.py: scores
    and values on the tensor cores; bf16 / f16 caches at head sizes 64 / 128 / 256, else v1) or
    "v1" (session 4's kernel, `_DENSE_SOURCE`, CUDA cores). Both hand the same partial outputs
    to `_reduce`. From PREFIXTRACE_DENSE_DECODE, read once; `set_dense_variant` for benchmarks."""
    return _DENSE_VARIANT.get()


@lru_cache(maxsize=1)
def _dense_mma():
    from engine import dense_mma  # (imports this module: not at the top; looked up once, the hook runs per layer)

    return dense_mma


set_dense_variant = _DENSE_VARIANT.set


# Why the kernels' constants (the scale, the start offsets) are padded to a page of their own: MLX's CUDA
# allocator serves every allocation of <= 8 bytes from one 64 KB managed pool advised read-mostly
# (mlx/backend/cuda/allocator.cpp, SmallSizePool), shared with every scalar the host makes (an op with a
# Python number, a token id), and on the H200 a kernel reading a constant there waited ~33-43 us a launch
# (bench/bench_small_pool.py, with or without a host write in between): v5's one-row split kernel took
# 71.4 us at 32k with its constants there, 34.9 on their own pages (docs/PERFORMANCE.md, session 9). An array of OWN_PAGE bytes is its own
# managed allocation (MLX rounds sizes >= 16 KB to its 16 KB page): it moves to the GPU on its first read
# and stays there, since the host never writes it again.
OWN_PAGE = 16384
# PREFIXTRACE_KERNEL_CONSTANTS=small: the old unpadded constants, for an A/B on the device (read at import).
_PAD_CONSTANTS = os.environ.get("PREFIXTRACE_KERNEL_CONSTANTS", "own-page") != "small"


def own_page(values, dtype) -> mx.array:
    """`values` (1-D) as the first elements of a zero-padded array of `OWN_PAGE` bytes: a kernel input
    no other array shares a page with (see above). Kernels read only its first elements."""
    v = np.asarray(values, dtype).reshape(-1)
    if not _PAD_CONSTANTS:
        return mx.array(v)
    a = np.zeros(OWN_PAGE // np.dtype(dtype).itemsize, dtype)
    assert v.size <= a.size
    a[:v.size] = v
    return mx.array(a)  # from numpy: no lazy array tied to one thread's stream


@lru_cache(maxsize=None)
def _scalar(value: float) -> mx.array:
    return own_page([value], np.float32)


@lru_cache(maxsize=None)
def _zeros(rows: int) -> mx.array:
    return own_page(np.zeros(rows), np.int32)


_STARTS: dict[int, tuple[mx.array, mx.array]] = {}


def kernel_starts(left_padding: mx.array) -> mx.array:
    """A cache's row start offsets (int32) as a kernel input on a page of its own (see `OWN_PAGE`): a copy
    made on the device once per left-padding array (the caches make a new one whenever their rows change),
    then reused. Keyed by identity, holding the source so its id is not reused while the entry lives."""
    hit = _STARTS.get(id(left_padding))
    if hit is not None and hit[0] is left_padding:
        return hit[1]
    lp = left_padding if left_padding.dtype == mx.int32 else left_padding.astype(mx.int32)
    if not _PAD_CONSTANTS:
        return lp
    pad = OWN_PAGE // 4 - lp.size
    copy = mx.concatenate([lp.reshape(-1), _zeros(0)[:pad]]) if pad > 0 else lp
    if len(_STARTS) >= 64:  # a few caches live at a time; old entries go first
        _STARTS.pop(next(iter(_STARTS)))
    _STARTS[id(left_padding)] = (left_padding, copy)
    return copy


def counters(owner, size: int) -> mx.array:
    """`owner`'s int32 counters for the one-launch TurboQuant kernel (zeros, `size` of them;
    made once per size, from numpy: no lazy array tied to one thread's stream)."""
    c = getattr(owner, "_decode_counters", None)
    if c is None or c.size < size:
        c = own_page(np.zeros(size), np.int32) if 4 * size <= OWN_PAGE else mx.array(np.zeros(size, np.int32))
        owner._decode_counters = c
    return c


@lru_cache(maxsize=None)
def _no_signs(dim: int) -> mx.array:
    return mx.array(np.ones(dim, np.float32))


def _gqa(queries: mx.array, kv_heads: int) -> int | None:
    B, hq, n, d = queries.shape
    # Shared memory: G x D floats of queries and NW x G x D of partial outputs per block.
    if n != 1 or d not in DIMS or hq % kv_heads or hq // kv_heads > 8 or hq // kv_heads * d > 1024:
        return None
    return hq // kv_heads


def use_dense(cache, queries: mx.array, keys: mx.array, mask) -> bool:
    """Whether a dense batched decode step goes through `dense_attend` (mlx-lm's
    `BatchKVCache` and subclasses: their `left_padding` says where each row starts).
    The kernel applies no mask, so this relies on a one-token `BatchKVCache` mask being
    the left-padding mask alone: mlx-lm gives sliding-window layers a `RotatingKVCache`,
    whose batched form is not a `BatchKVCache`, and rows past right padding are rolled
    back (`finalize`) before decoding (`_right_padding` is checked)."""
    kind = mode()
    if kind == "off" or (mask is None and kind != "all") or not available():
        return False  # the CPU and every unpadded step stop here, before any array is looked at
    return (isinstance(cache, _batch_kv_cache()) and getattr(cache, "_right_padding", None) is None
            and keys.dtype in _DENSE_DTYPES and queries.dtype == keys.dtype
            and _gqa(queries, keys.shape[1]) is not None)


_DENSE_DTYPES = (mx.bfloat16, mx.float16, mx.float32)


@lru_cache(maxsize=1)
def _batch_kv_cache() -> type:
    # Imported once, on the first decode step (the hook runs this per layer per step).
    from mlx_lm.models.cache import BatchKVCache

    return BatchKVCache


def use_tq(queries: mx.array, kv_heads: int, bits: int, dim: int) -> bool:
    """Whether a TurboQuant decode step goes through `tq_attend`."""
    return (mode() != "off" and available() and 8 % bits == 0 and dim == queries.shape[-1]
            and queries.dtype in (mx.bfloat16, mx.float16, mx.float32) and _gqa(queries, kv_heads) is not None)


@lru_cache(maxsize=None)
def _templates(kind: str, dtype, dim: int, g: int, chunk: int, bits: int = 0, group: int = 0, unroll: int = 4) -> list:
    t = [("T", dtype), ("D", dim), ("G", g), ("CHUNK", chunk), ("NW", NW)]
    if kind == "tq":
        t += [("BITS", bits), ("GROUP", group), ("NQ", 1), ("U", unroll)]
    return t


@lru_cache(maxsize=None)
def _dense_templates(dtype, dim: int, g: int, chunk: int, unroll: int) -> list:
    return _templates("dense", dtype, dim, g, chunk) + [("U", unroll)]


UNROLLS = (4, 8, 16)
_TQ_UNROLL = EnvChoice("PREFIXTRACE_TQ_UNROLL", UNROLLS, 4, "TurboQuant unroll")


def tq_unroll() -> int:
    """Tokens each lane group of the TurboQuant kernel loads before it uses them (more
    loads in flight per lane; a long context is latency-bound on them), for variants v2 /
    v2s (v1: 4, session 4's). Default 4: 8 and 16 were slower on the H200 except at one row
    of 100k (session 5). From PREFIXTRACE_TQ_UNROLL, read once."""
    return _TQ_UNROLL.get()


set_tq_unroll = _TQ_UNROLL.set


def _reduce(o_part: mx.array, ml_part: mx.array, signs: mx.array, rows: int, q_heads: int, dim: int, dtype,
            rotated: bool) -> mx.array:
    return _reduce_kernel()(inputs=[o_part, ml_part, signs],
                            template=[("T", dtype), ("D", dim), ("ROT", rotated)],
                            grid=(rows * q_heads * dim, 1, 1), threadgroup=(dim, 1, 1),
                            output_shapes=[(rows, q_heads, 1, dim)], output_dtypes=[dtype])[0]


def dense_attend(queries: mx.array, keys: mx.array, values: mx.array, left_padding: mx.array,
                 scale: float) -> mx.array | None:
    """softmax(q K^T * scale) V for one query token per row, row b attending to columns
    [left_padding[b], T) of keys/values (B, H, T, D). CUDA only (`use_dense`); None
    where no chunk size fits (the caller falls back to MLX)."""
    B, hq, _, dim = queries.shape
    _, H, T, _ = keys.shape
    g = hq // H
    blocks, unroll = dense_shape()
    chunk = split_chunk(T, H, B, g, target=blocks)
    if chunk is None:
        return None
    splits = -(-T // chunk)
    lp = kernel_starts(left_padding)
    parts = None
    if _DENSE_VARIANT.get() == "mma":
        parts = _dense_mma().attend(queries, keys, values, lp, scale, chunk, splits)  # None: float32, other sizes
    if parts is None:  # v1, and what the MMA kernel does not map
        parts = _dense_kernel()(
            inputs=[queries, keys, values, lp, _scalar(scale)],
            template=_dense_templates(keys.dtype, dim, g, chunk, unroll),
            grid=(splits * NW * 32, H, B), threadgroup=(NW * 32, 1, 1),
            output_shapes=[(B * hq * splits * dim,), (B * hq, splits, 2)], output_dtypes=[mx.float32, mx.float32])
    o_part, ml_part = parts
    return _reduce(o_part, ml_part, _no_signs(dim), B, hq, dim, queries.dtype, False)


def tq_attend(queries: mx.array, k_norms: mx.array, k_codes: mx.array, v_norms: mx.array, v_codes: mx.array,
              win_k: mx.array, win_v: mx.array, left_padding: mx.array | None, scale: float, codec,
              group: int, counters: mx.array | None = None, end: int | None = None) -> mx.array | None:
    """Attention of one query token per row over TurboQuant codes for columns [0, T)
    (norms (B, H, T, 1), codes (B, H, T, W)) and the dense window (B, H, Tw, D) of
    columns [T - Tw, T), unrotated; row b starts at left_padding[b] (None: 0). The
    output is in the original basis. CUDA only (`use_tq`); None where the dense window
    does not fit one block (the caller falls back to MLX). `counters` (int32 zeros, at
    least B x H, owned by one cache: `_LAST_BLOCK_REDUCE`): one launch instead of two. `end`:
    T when the norms and codes are whole buffers of a larger capacity (columns [0, end) are
    the cache's): v3 / v4 take it as a parameter, the older kernels get slices."""
    B, hq, _, dim = queries.shape
    H, tw = k_codes.shape[1], win_k.shape[2]
    T = k_codes.shape[2] if end is None else end
    assert T <= min(k_norms.shape[2], k_codes.shape[2], v_norms.shape[2], v_codes.shape[2])
    g = hq // H
    lp = _zeros(B) if left_padding is None else kernel_starts(left_padding)
    variant = tq_variant()
    if variant == "v7":
        from engine import tq_fused  # (imports this module: not at the top)

        out = tq_fused.attend7(queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, scale, codec, group, T)
        if out is not None:
            return out
        variant, counters = "v5", None  # what v7 cannot map takes v5's route (unfolded, and so v4's, v3's)
    if variant == "v5":
        from engine import tq_mma  # (imports this module: not at the top)

        out = tq_mma.attend5(queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, scale, codec, group,
                             counters, T)
        if out is not None:
            return out
        variant, counters = "v4", None  # what v5 cannot map takes v4's route (and so v3's)
    chunk = split_chunk(T, H, B, g, at_least=tw)
    if chunk is None:
        return None
    splits = -(-T // chunk) + 1  # + the dense block
    unroll = 4 if variant == "v1" else tq_unroll()
    if k_codes.shape[2] != T and not (variant in ("v3", "v4") and counters is None):
        # the older kernels (and v2's one launch) take T from the codes' shape
        cols = (slice(None), slice(None), slice(0, T))
        k_norms, k_codes, v_norms, v_codes = k_norms[cols], k_codes[cols], v_norms[cols], v_codes[cols]
    if counters is not None:
        assert counters.dtype == mx.int32 and counters.size >= B * H
        return _tq1_kernel()(
            inputs=[queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, codec.signs, codec.centroids,
                    _scalar(scale), counters],
            template=_templates("tq", win_k.dtype, dim, g, chunk, codec.bits, group, unroll),
            grid=(splits * NW * 32, H, B), threadgroup=(NW * 32, 1, 1),
            output_shapes=[(B * hq * splits * dim,), (B * hq, splits, 2), (B, hq, 1, dim)],
            output_dtypes=[mx.float32, mx.float32, queries.dtype])[2]
    if variant == "v4":
        from engine import tq_mma  # (imports this module: not at the top)

        out = tq_mma.attend(queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, scale, codec, group,
                            chunk, splits, T)
        if out is not None:
            return out
    if variant in ("v3", "v4"):  # v4 runs v3 where it cannot map the step (tq_mma.usable)
        cpl = tq3_cpl(g, dim, codec.bits)
        if cpl is not None:
            return _tq3_attend(queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, scale, codec, group,
                               chunk, splits, cpl, T)
        if k_codes.shape[2] != T:  # no v3 lane mapping: the v2 kernel, which takes T from the shape
            cols = (slice(None), slice(None), slice(0, T))
            k_norms, k_codes, v_norms, v_codes = k_norms[cols], k_codes[cols], v_norms[cols], v_codes[cols]
    o_part, ml_part = _tq_kernel()(
        inputs=[queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, codec.signs, codec.centroids,
                _scalar(scale)],
        template=_templates("tq", win_k.dtype, dim, g, chunk, codec.bits, group, unroll),
        grid=(splits * NW * 32, H, B), threadgroup=(NW * 32, 1, 1),
        output_shapes=[(B * hq * splits * dim,), (B * hq, splits, 2)], output_dtypes=[mx.float32, mx.float32])
    return _reduce(o_part, ml_part, codec.signs, B, hq, dim, queries.dtype, True)


# --- v3 (`_TQ3_SOURCE`) --------------------------------------------------------------------------

TQ3_LOADS = (16, 8, 4)
# 8: faster than 16 at every shape on the H200 (one row and B = 8, 32k and 100k: 119 registers and
# 4 blocks per SM against 168 and 3; docs/PERFORMANCE.md, session 6), and than 4 (more load and
# shuffle instructions per coordinate).
DEFAULT_TQ3_LOAD = 8
_TQ3_REGS = 128  # G x CPL query (and accumulator) registers a lane may hold: ptxas, no spills
_TQ3_LOAD = EnvChoice("PREFIXTRACE_TQ3_LOAD", TQ3_LOADS, DEFAULT_TQ3_LOAD, "v3 load bytes")


def tq3_load() -> int:
    """Bytes of codes a v3 lane loads per token, at most (16: 32 codes at 4 bits; 8 (default):
    16 codes, fewer query registers per lane, more blocks per SM; 4). From PREFIXTRACE_TQ3_LOAD,
    read once."""
    return _TQ3_LOAD.get()


set_tq3_load = _TQ3_LOAD.set


def tq3_cpl(g: int, dim: int, bits: int, load: int | None = None) -> int | None:
    """Coordinates per lane of v3's code path: the widest load (of `load`, 8, 4 bytes) whose
    CPL = bytes * 8 / bits coordinates fit the head (D / CPL lanes per token, a power of two
    <= 32) with G x CPL <= `_TQ3_REGS`. None where none fits (D x bits < 32: the v2 kernel)."""
    for lb in TQ3_LOADS:
        if lb > (load or tq3_load()):
            continue
        cpl = lb * 8 // bits
        if cpl <= dim and dim % cpl == 0 and g * cpl <= _TQ3_REGS:
            return cpl
    return None


def tq3_unroll(cpl: int, bits: int) -> int:
    """Tokens a v3 lane loads per pass before using them: 32 bytes of codes in flight."""
    return max(1, 32 // (cpl * bits // 8))


@lru_cache(maxsize=1)
def _tq3_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_tq3",
                               input_names=["q", "kn", "kc", "vn", "vc", "tk", "tv", "lp", "signs", "cent", "params"],
                               output_names=["o_part", "ml_part"], source=_TQ3_SOURCE, header=_HEADER + _TQ3_HEADER,
                               ensure_row_contiguous=False)


@lru_cache(maxsize=1)
def _tq3_reduce_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_tq3_reduce", input_names=["o_part", "ml_part", "signs"],
                               output_names=["out"], source=_TQ3_REDUCE_SOURCE, header=_HEADER + _TQ3_HEADER)


TQ3_RW = 4  # warps per v3 reduce block
# From TQ3_WIDE_SPLITS splits on, TQ3_RW_WIDE warps. Why: the reduce has one block per (row, query head),
# so at one row there are only 32 blocks of 4 warps on 132 SMs, each warp walking S / 4 splits one
# dependent round of loads after another: 8.7 us at one row of 32k (75 splits) and 13.7 us at 100k (158;
# ncu, session 8) for 1.2-2.6 MB of partials. 16 warps walk a quarter of the splits each.
TQ3_RW_WIDE, TQ3_WIDE_SPLITS = 16, 48


def tq3_reduce_warps(splits: int) -> int:
    return TQ3_RW_WIDE if splits >= TQ3_WIDE_SPLITS else TQ3_RW


def tq3_reduce(o_part: mx.array, ml_part: mx.array, signs: mx.array, shape: tuple, dtype) -> mx.array:
    """v3's reduce of a split kernel's partials (`ml_part`: (B x HQ, splits, 2)) into the output of
    `shape` (B, HQ, 1, D), `tq3_reduce_warps` warps per (row, query head)."""
    rw = tq3_reduce_warps(ml_part.shape[1])
    return _tq3_reduce_kernel()(inputs=[o_part, ml_part, signs], template=[("T", dtype), ("D", shape[-1]), ("RW", rw)],
                                grid=(ml_part.shape[0] * rw * 32, 1, 1), threadgroup=(rw * 32, 1, 1),
                                output_shapes=[tuple(shape)], output_dtypes=[dtype])[0]


_tq3_nibble: bool | None = None


def tq3_nibble() -> bool:
    """Whether v3 at 4 bits extracts code offsets with byte permutes (`centroid`'s NIB path: ~1.5
    integer instructions per code instead of ~2.7, ptxas SASS) rather than shift-and-mask. From
    PREFIXTRACE_TQ3_NIBBLE ("0": off), read once."""
    global _tq3_nibble
    if _tq3_nibble is None:
        _tq3_nibble = os.environ.get("PREFIXTRACE_TQ3_NIBBLE", "1") != "0"
    return _tq3_nibble


def set_tq3_nibble(on: bool) -> None:
    global _tq3_nibble
    _tq3_nibble = bool(on)


@lru_cache(maxsize=None)
def _templates3(dtype, dim: int, g: int, chunk: int, bits: int, group: int, cpl: int, nib: bool = True) -> list:
    return [("T", dtype), ("D", dim), ("G", g), ("CHUNK", chunk), ("NW", NW), ("BITS", bits), ("GROUP", group),
            ("NQ", 1), ("CPL", cpl), ("U", tq3_unroll(cpl, bits)), ("NIB", bool(nib and bits == 4))]


def _params(scale: float, end: int) -> mx.array:
    """v3 / v4's float parameters: the scale and the cache's column count (exact in float32 below 2^24).
    A fresh array every step, so it stays 8 bytes, in MLX's read-mostly small pool: padded to a page of
    its own (`own_page`), every step's host write would move that page to the host and the kernel's
    read back (v5's 12-byte params did that in session 8: 205-420 us a kernel). v5 takes `end` from
    the K norms' shape instead and its params are made once."""
    assert end < 1 << 24
    return mx.array(np.array([scale, end], np.float32))  # from numpy: no lazy array tied to one thread's stream


def _tq3_attend(queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, scale, codec, group, chunk, splits,
                cpl, end):
    B, hq, _, dim = queries.shape
    H = k_codes.shape[1]
    o_part, ml_part = _tq3_kernel()(
        inputs=[queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, codec.signs, codec.centroids,
                _params(scale, end)],
        template=_templates3(win_k.dtype, dim, hq // H, chunk, codec.bits, group, cpl, tq3_nibble()),
        grid=(splits * NW * 32, H, B), threadgroup=(NW * 32, 1, 1),
        output_shapes=[(B * hq * splits * dim,), (B * hq, splits, 2)], output_dtypes=[mx.float32, mx.float32])
    return tq3_reduce(o_part, ml_part, codec.signs, (B, hq, 1, dim), queries.dtype)
