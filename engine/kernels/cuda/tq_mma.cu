
    #include "tq_layout.cuh"
    #include "block_ids.cuh"
    #include "tq5_columns.cuh"
    for (int i = tid; i < (1 << BITS); i += NT) cs[i] = cent[i];

    __shared__ __align__(16) uint32_t tab[256 * TC];
    for (int i = tid; i < 64 * TC; i += NT) {
        const int e = (4 * i) / TC;
        const uint32_t v = pack_half2(cent[e & 15], cent[e >> 4]);
        reinterpret_cast<uint4*>(tab)[i] = make_uint4(v, v, v, v);
    }
    #include "tq_queries.cuh"
    __syncthreads();
    if (!tail) {
        // Scores on the tensor cores (layout: engine/kernels/tq_mma.py). Lane (gq, tq).
        constexpr int KW = D / 32;        // code words of a token a lane loads: D / 4 coordinates
        constexpr int KM = D / 16;        // k-steps (MMAs) per 16-token tile
        const int gq = lane >> 2, tq = lane & 3;
        const int gr = gq < G ? gq : 0;
        uint32_t qb[KM][2];
        #pragma unroll
        for (int j = 0; j < KM; ++j) {
            const int d = (D / 4) * tq + 4 * j;
            qb[j][0] = gq < G ? pack_half2(qs[gr][d], qs[gr][d + 1]) : 0u;
            qb[j][1] = gq < G ? pack_half2(qs[gr][d + 2], qs[gr][d + 3]) : 0u;
        }
        const uint32_t* tabl = tab + (lane % TC);
        const uint32_t* kcb = kc + b * kc_strides[0] + h * kc_strides[1] + tq * KW;
        const float* knb = kn + b * kn_strides[0] + h * kn_strides[1];
        for (int base = warp * 16; base < n; base += NW * 16 * U) {  // (warp-uniform: every lane reaches the MMAs)
            uint32_t w[U][2][KW];
            float nr[U][2];
            #pragma unroll
            for (int u = 0; u < U; ++u)
                #pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int t = base + u * NW * 16 + gq + 8 * r;
                    if (t < n) {
                        ldg_words<KW>(kcb + (size_t)(c0 + t) * kc_strides[2], w[u][r]);
                        nr[u][r] = knb[(size_t)(c0 + t) * kn_strides[2]];
                    } else {
                        #pragma unroll
                        for (int i = 0; i < KW; ++i) w[u][r][i] = 0u;
                        nr[u][r] = 0.f;
                    }
                }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                float c[4] = {0.f, 0.f, 0.f, 0.f};
                #pragma unroll
                for (int j = 0; j < KM; ++j) {
                    const uint32_t x0 = w[u][0][j >> 1], x1 = w[u][1][j >> 1];
                    const int by = 2 * (j & 1);
                    mma_f16(c, pair<TC>(tabl, x0, by), pair<TC>(tabl, x1, by), pair<TC>(tabl, x0, by + 1),
                            pair<TC>(tabl, x1, by + 1), qb[j][0], qb[j][1]);
                }
                const int t0 = base + u * NW * 16 + gq, t1 = t0 + 8;
                if (t0 < n) {
                    if (2 * tq < G) sc[2 * tq][t0] = c[0] * nr[u][0];
                    if (2 * tq + 1 < G) sc[2 * tq + 1][t0] = c[1] * nr[u][0];
                }
                if (t1 < n) {
                    if (2 * tq < G) sc[2 * tq][t1] = c[2] * nr[u][1];
                    if (2 * tq + 1 < G) sc[2 * tq + 1][t1] = c[3] * nr[u][1];
                }
            }
        }
    } else {
        #include "tail_scores.cuh"
    }
    __syncthreads();
    float mx_[G], l_[G];
    #include "block_softmax.cuh"
    if (!tail) {
        // Values on the tensor cores: O^T = V^T P^T (layout: engine/kernels/tq_mma.py). Lane (gq, tq).
        constexpr int VW = D / 64;        // code words of a token a lane loads: D / 8 coordinates
        constexpr int VM = D / 16;        // M-tiles of 16 coordinates (two per lane group each)
        const int gq = lane >> 2, tq = lane & 3;
        const int gr = gq < G ? gq : 0;
        float o[VM][4];
        #pragma unroll
        for (int m = 0; m < VM; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.f;
        const uint32_t* tabl = tab + (lane % TC);
        const uint32_t* vcb = vc + b * vc_strides[0] + h * vc_strides[1] + gq * VW;
        const float* vnb = vn + b * vn_strides[0] + h * vn_strides[1];
        for (int base = warp * 16; base < n; base += NW * 16 * U) {
            uint32_t w[U][4][VW];
            float p[U][4];
            #pragma unroll
            for (int u = 0; u < U; ++u)
                #pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int t = base + u * NW * 16 + 4 * tq + r;
                    if (t < n) {
                        ldg_words<VW>(vcb + (size_t)(c0 + t) * vc_strides[2], w[u][r]);
                        p[u][r] = gq < G ? sc[gr][t] * vnb[(size_t)(c0 + t) * vn_strides[2]] : 0.f;
                    } else {
                        #pragma unroll
                        for (int i = 0; i < VW; ++i) w[u][r][i] = 0u;
                        p[u][r] = 0.f;
                    }
                }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint32_t b0 = pack_half2(p[u][0], p[u][1]), b1 = pack_half2(p[u][2], p[u][3]);
                #pragma unroll
                for (int j = 0; j < VW; ++j) {
                    // Byte k of lo01 = low nibble of token 0's byte k | low nibble of token 1's << 4, ...
                    const uint32_t lo01 = (w[u][0][j] & 0x0F0F0F0Fu) | ((w[u][1][j] << 4) & 0xF0F0F0F0u);
                    const uint32_t hi01 = ((w[u][0][j] >> 4) & 0x0F0F0F0Fu) | (w[u][1][j] & 0xF0F0F0F0u);
                    const uint32_t lo23 = (w[u][2][j] & 0x0F0F0F0Fu) | ((w[u][3][j] << 4) & 0xF0F0F0F0u);
                    const uint32_t hi23 = ((w[u][2][j] >> 4) & 0x0F0F0F0Fu) | (w[u][3][j] & 0xF0F0F0F0u);
                    #pragma unroll
                    for (int k = 0; k < 4; ++k)
                        mma_f16(o[4 * j + k], pair<TC>(tabl, lo01, k), pair<TC>(tabl, hi01, k),
                                pair<TC>(tabl, lo23, k), pair<TC>(tabl, hi23, k), b0, b1);
                }
            }
        }
        #pragma unroll
        for (int m = 0; m < VM; ++m) {
            const int d = (D / 8) * gq + 2 * m;
            if (2 * tq < G) {
                red[warp][2 * tq][d] = o[m][0];
                red[warp][2 * tq][d + 1] = o[m][2];
            }
            if (2 * tq + 1 < G) {
                red[warp][2 * tq + 1][d] = o[m][1];
                red[warp][2 * tq + 1][d + 1] = o[m][3];
            }
        }
    } else {
        #include "tail_values.cuh"
        }
    }
    __syncthreads();
    #include "write_partials.cuh"
