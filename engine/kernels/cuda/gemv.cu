    // out (N) = w (N, K) . x (K) for one row of x. Block: WARPS warps in groups of SPLIT; a group
    // takes RW consecutive weight rows, each warp of it one K / SPLIT slice of them (split-K: a
    // narrow projection still puts enough warps on every SM). A lane reads 8 consecutive k per
    // 16-byte load, U loads per weight row before any is multiplied, so each lane keeps RW x U
    // loads in flight as written; its slice of x is loaded once for all RW rows. The weights stream past L1
    // (L1::no_allocate). ptxas still sinks the loads towards their first use (the SASS of this file keeps
    // 3-5 of them in flight per lane), so the bytes in flight come from occupancy: gemv.py's `plan` splits
    // K until ~64 warps per SM are streaming.
    constexpr int WARPS = 8;
    constexpr int GROUPS = WARPS / SPLIT;
    constexpr int KP = K / SPLIT;      // k of one warp's slice
    constexpr int ITERS = KP / 256;    // 32 lanes x 8 k per load
    constexpr int U = (ITERS % 4 == 0) ? 4 : ((ITERS % 2 == 0) ? 2 : 1);
    __shared__ float partial[WARPS][RW];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = warp / SPLIT, part = warp % SPLIT;
    const int row0 = (blockIdx.x * GROUPS + group) * RW;
    const T* xk = x + part * KP + lane * 8;
    const T* wk = w + (size_t)row0 * K + part * KP + lane * 8;
    float acc[RW];
    #pragma unroll
    for (int j = 0; j < RW; ++j) acc[j] = 0.f;
    for (int it = 0; it < ITERS; it += U) {
        uint4 wv[RW][U];
        uint4 xv[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) xv[u] = __ldg(reinterpret_cast<const uint4*>(xk + (it + u) * 256));
        #pragma unroll
        for (int j = 0; j < RW; ++j)
            #pragma unroll
            for (int u = 0; u < U; ++u)
                asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(wv[j][u].x), "=r"(wv[j][u].y), "=r"(wv[j][u].z), "=r"(wv[j][u].w)
                             : "l"(wk + (size_t)j * K + (it + u) * 256));
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const T* xp = reinterpret_cast<const T*>(&xv[u]);
            float xf[8];
            #pragma unroll
            for (int i = 0; i < 8; ++i) xf[i] = static_cast<float>(xp[i]);
            #pragma unroll
            for (int j = 0; j < RW; ++j) {
                const T* wp = reinterpret_cast<const T*>(&wv[j][u]);
                #pragma unroll
                for (int i = 0; i < 8; ++i) acc[j] += static_cast<float>(wp[i]) * xf[i];
            }
        }
    }
    #pragma unroll
    for (int j = 0; j < RW; ++j) {
        float v = acc[j];
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
        acc[j] = v;
    }
    if (SPLIT == 1) {
        if (lane < RW) {
            float v = acc[0];
            #pragma unroll
            for (int j = 1; j < RW; ++j) v = (lane == j) ? acc[j] : v;
            out[row0 + lane] = static_cast<T>(v);
        }
        return;
    }
    if (lane == 0) {
        #pragma unroll
        for (int j = 0; j < RW; ++j) partial[warp][j] = acc[j];
    }
    __syncthreads();
    if (part == 0 && lane < RW) {
        float v = 0.f;
        #pragma unroll
        for (int s = 0; s < SPLIT; ++s) v += partial[group * SPLIT + s][lane];
        out[row0 + lane] = static_cast<T>(v);
    }
