
__device__ inline uint32_t pack_half2(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);  // .x (low 16 bits) = lo
    return *reinterpret_cast<const uint32_t*>(&v);
}

// D = A B + D, m16n8k16, f16 operands, f32 accumulators (layout: engine/kernels/tq_mma.py).
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
