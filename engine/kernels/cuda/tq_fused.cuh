
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
