
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
    #include "hadamard_stages.cuh"
    }
}
