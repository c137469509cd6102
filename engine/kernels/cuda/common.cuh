
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
