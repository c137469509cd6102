
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
    #include "hadamard_stages.cuh"
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
