//! A block with one lane layout for all its columns (LPT lanes a token, eight coordinates each): the lanes'
//! accumulators acc summed over the warp's tokens, then over the warps, into o_part, and mx_ and l_ into ml_part.
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
__syncthreads();
#include "sum_partials.cuh"
if (tid < G) {
    ml_part[((size_t)(b * HQ + h * G + tid) * S + s) * 2] = mx_[tid];
    ml_part[((size_t)(b * HQ + h * G + tid) * S + s) * 2 + 1] = l_[tid];
}
