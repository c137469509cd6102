
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
