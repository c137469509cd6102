
    constexpr int NT = NW * 32;
    constexpr int KL = D / 32;            // 16-byte K loads per token and lane (D / 4 coordinates)
    constexpr int KM = D / 16;            // k-steps per tile
    constexpr int VL = D / 64;            // 16-byte V loads per token and lane (D / 8 coordinates)
    constexpr int VM = D / 16;            // M-tiles of V (16 coordinates each)
    constexpr int SP = CHUNK + PAD;       // score row pitch
    __shared__ __align__(16) float sc[G][SP];
    __shared__ __align__(16) uint16_t qs[G][D];  // the queries' raw bits (exact, no conversion)
    __shared__ float red[NW][G][D];
    __shared__ float stat[NW][G];
    #include "block_ids.cuh"
    const int start = lp[b];
    const float scale = params[0];
    #include "dense_columns.cuh"
    for (int i = tid; i < G * D; i += NT)
        qs[i / D][i % D] = *reinterpret_cast<const uint16_t*>(
            q + b * q_strides[0] + (h * G + i / D) * q_strides[1] + (i % D) * q_strides[3]);
    __syncthreads();
    const int gq = lane >> 2, tq = lane & 3;
    const int gr = gq < G ? gq : 0;
    {
        // Scores on the tensor cores. Lane (gq, tq): tokens gq and gq + 8 of each tile.
        uint32_t qb[KM][2];
        #pragma unroll
        for (int j = 0; j < KM; ++j) {
            const int d = 32 * (j >> 1) + 8 * tq + 4 * (j & 1);
            qb[j][0] = gq < G ? *reinterpret_cast<const uint32_t*>(&qs[gr][d]) : 0u;
            qb[j][1] = gq < G ? *reinterpret_cast<const uint32_t*>(&qs[gr][d + 2]) : 0u;
        }
        const T* kb = k + b * k_strides[0] + h * k_strides[1] + 8 * tq;
        for (int base = warp * 16; base < n; base += NW * 16 * U) {  // (warp-uniform: every lane reaches the MMAs)
            uint4 w[U][2][KL];
            #pragma unroll
            for (int u = 0; u < U; ++u)
                #pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int t = base + u * NW * 16 + gq + 8 * r;
                    #pragma unroll
                    for (int i = 0; i < KL; ++i)
                        w[u][r][i] = t < n ? __ldg(reinterpret_cast<const uint4*>(kb + (size_t)(c0 + t) * k_strides[2]
                                                                                  + 32 * i))
                                           : make_uint4(0u, 0u, 0u, 0u);
                }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                float c[4] = {0.f, 0.f, 0.f, 0.f};
                #pragma unroll
                for (int j = 0; j < KM; ++j) {
                    const int i = j >> 1, e = 2 * (j & 1);
                    mma16816<T>(c, word_of(w[u][0][i], e), word_of(w[u][1][i], e), word_of(w[u][0][i], e + 1),
                                word_of(w[u][1][i], e + 1), qb[j][0], qb[j][1]);
                }
                const int t0 = base + u * NW * 16 + gq, t1 = t0 + 8;
                if (t0 < n) {
                    if (2 * tq < G) sc[2 * tq][t0] = c[0] * scale;
                    if (2 * tq + 1 < G) sc[2 * tq + 1][t0] = c[1] * scale;
                }
                if (t1 < n) {
                    if (2 * tq < G) sc[2 * tq][t1] = c[2] * scale;
                    if (2 * tq + 1 < G) sc[2 * tq + 1][t1] = c[3] * scale;
                }
            }
        }
    }

    __syncthreads();
    float mx_[G], l_[G];
    #include "block_softmax.cuh"

    {
        // Values on the tensor cores: O^T = V^T P^T. Lane (gq, tq): tokens 4 tq .. 4 tq + 3 of each tile.
        float o[VM][4];
        #pragma unroll
        for (int m = 0; m < VM; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.f;
        const T* vb = v + b * v_strides[0] + h * v_strides[1] + 8 * gq;
        for (int base = warp * 16; base < n; base += NW * 16 * U) {
            uint4 w[U][4][VL];
            #pragma unroll
            for (int u = 0; u < U; ++u)
                #pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int t = base + u * NW * 16 + 4 * tq + r;
                    #pragma unroll
                    for (int i = 0; i < VL; ++i)  // (zeros past n: 0 x a stale value could be NaN)
                        w[u][r][i] = t < n ? __ldg(reinterpret_cast<const uint4*>(vb + (size_t)(c0 + t) * v_strides[2]
                                                                                  + 64 * i))
                                           : make_uint4(0u, 0u, 0u, 0u);
                }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = base + u * NW * 16 + 4 * tq;
                float p[4];
                #pragma unroll
                for (int r = 0; r < 4; ++r) p[r] = gq < G && t + r < n ? sc[gr][t + r] : 0.f;
                const uint32_t b0 = pack2<T>(p[0], p[1]), b1 = pack2<T>(p[2], p[3]);
                #pragma unroll
                for (int m = 0; m < VM; ++m) {
                    const int i = m >> 2, e = m & 3;
                    const uint32_t x0 = word_of(w[u][0][i], e), x1 = word_of(w[u][1][i], e);
                    const uint32_t x2 = word_of(w[u][2][i], e), x3 = word_of(w[u][3][i], e);
                    mma16816<T>(o[m], __byte_perm(x0, x1, 0x5410), __byte_perm(x0, x1, 0x7632),
                                __byte_perm(x2, x3, 0x5410), __byte_perm(x2, x3, 0x7632), b0, b1);
                }
            }
        }
        #pragma unroll
        for (int m = 0; m < VM; ++m) {
            const int d = 64 * (m >> 2) + 8 * gq + 2 * (m & 3);
            if (2 * tq < G) {
                red[warp][2 * tq][d] = o[m][0];
                red[warp][2 * tq][d + 1] = o[m][2];
            }
            if (2 * tq + 1 < G) {
                red[warp][2 * tq + 1][d] = o[m][1];
                red[warp][2 * tq + 1][d + 1] = o[m][3];
            }
        }
    }
    __syncthreads();
    #include "write_partials.cuh"
