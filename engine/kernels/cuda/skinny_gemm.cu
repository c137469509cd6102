
    constexpr int VEC = 8;
    const int lane = threadIdx.x & 31;
    const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * RW;
    if (row0 >= N) return;
    float acc[RW][R];
    #pragma unroll
    for (int j = 0; j < RW; ++j)
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[j][r] = 0.f;
    #pragma unroll 2
    for (int k = lane * VEC; k < K; k += 32 * VEC) {
        float wf[RW][VEC];
        #pragma unroll
        for (int j = 0; j < RW; ++j) {
            uint4 wv = *reinterpret_cast<const uint4*>(w + (size_t)(row0 + j) * K + k);
            const T* wp = reinterpret_cast<const T*>(&wv);
            #pragma unroll
            for (int i = 0; i < VEC; ++i) wf[j][i] = static_cast<float>(wp[i]);
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (size_t)r * K + k));
            const T* xp = reinterpret_cast<const T*>(&xv);
            float xf[VEC];
            #pragma unroll
            for (int i = 0; i < VEC; ++i) xf[i] = static_cast<float>(xp[i]);
            #pragma unroll
            for (int j = 0; j < RW; ++j)
                #pragma unroll
                for (int i = 0; i < VEC; ++i) acc[j][r] += wf[j][i] * xf[i];
        }
    }
    #pragma unroll
    for (int j = 0; j < RW; ++j)
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = acc[j][r];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
            if (lane == 0) out[(size_t)r * N + row0 + j] = static_cast<T>(v);
        }
