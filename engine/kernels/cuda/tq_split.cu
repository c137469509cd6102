
    #include "tq_layout.cuh"
    #include "block_ids.cuh"
    const int start = lp[b];
    const float scale = params[0];
    const int end = static_cast<int>(params[1]);  // the cache's columns: kc may be its whole buffer
    #include "tq_window.cuh"
    const int c0 = tail ? max(bound, start) : max(s * CHUNK, start);
    const int c1 = tail ? end : min((s + 1) * CHUNK, bound);
    if (c0 >= c1) {
        #include "empty_block.cuh"
        return;
    }
    const int n = c1 - c0;
    for (int i = tid; i < (1 << BITS); i += NT) cs[i] = cent[i];
    #include "tq_queries.cuh"
    __syncthreads();
    if (!tail) {
        const int sub = lane % LPT, tg = warp * TPW + lane / LPT;
        float qr[G][CPL];
        #pragma unroll
        for (int g = 0; g < G; ++g)
            #pragma unroll
            for (int i = 0; i < CPL; ++i) qr[g][i] = qs[g][sub * CPL + i];
        const uint32_t* kcb = kc + b * kc_strides[0] + h * kc_strides[1] + sub * LW;
        const float* knb = kn + b * kn_strides[0] + h * kn_strides[1];
        for (int base = 0; base < n; base += TG * U) {
            uint32_t w[U][LW];
            float nr[U];
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = base + u * TG + tg;
                if (t < n) {
                    load_words<LW>(kcb + (size_t)(c0 + t) * kc_strides[2], w[u]);
                    nr[u] = knb[(size_t)(c0 + t) * kn_strides[2]];
                } else {
                    #pragma unroll
                    for (int j = 0; j < LW; ++j) w[u][j] = 0u;
                    nr[u] = 0.f;
                }
            }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = base + u * TG + tg;
                float a[G];
                #pragma unroll
                for (int g = 0; g < G; ++g) a[g] = 0.f;
                #pragma unroll
                for (int j = 0; j < LW; ++j)
                    #pragma unroll
                    for (int k = 0; k < PER; ++k) {
                        const float c = centroid<BITS, NIB, PER>(cs, w[u][j], k);
                        #pragma unroll
                        for (int g = 0; g < G; ++g) a[g] = fmaf(qr[g][j * PER + k], c, a[g]);
                    }
                #pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1)
                    #pragma unroll
                    for (int g = 0; g < G; ++g) a[g] += __shfl_xor_sync(0xffffffff, a[g], o);
                if (t < n && sub == 0) {
                    #pragma unroll
                    for (int g = 0; g < G; ++g) sc[g][t] = a[g] * nr[u];
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
        const int sub = lane % LPT, tg = warp * TPW + lane / LPT;
        float acc[G][CPL];
        #pragma unroll
        for (int g = 0; g < G; ++g)
            #pragma unroll
            for (int i = 0; i < CPL; ++i) acc[g][i] = 0.f;
        const uint32_t* vcb = vc + b * vc_strides[0] + h * vc_strides[1] + sub * LW;
        const float* vnb = vn + b * vn_strides[0] + h * vn_strides[1];
        for (int base = 0; base < n; base += TG * U) {
            uint32_t w[U][LW];
            float nr[U];
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = base + u * TG + tg;
                if (t < n) {
                    load_words<LW>(vcb + (size_t)(c0 + t) * vc_strides[2], w[u]);
                    nr[u] = vnb[(size_t)(c0 + t) * vn_strides[2]];
                }
            }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = base + u * TG + tg;
                if (t < n) {
                    float p[G];
                    #pragma unroll
                    for (int g = 0; g < G; ++g) p[g] = sc[g][t] * nr[u];
                    #pragma unroll
                    for (int j = 0; j < LW; ++j)
                        #pragma unroll
                        for (int k = 0; k < PER; ++k) {
                            const float c = centroid<BITS, NIB, PER>(cs, w[u][j], k);
                            #pragma unroll
                            for (int g = 0; g < G; ++g) acc[g][j * PER + k] = fmaf(p[g], c, acc[g][j * PER + k]);
                        }
                }
            }
        }
        // Token groups of a warp hold the same coordinates: add them, then the warps (below).
        #pragma unroll
        for (int o = LPT; o < 32; o <<= 1)
            #pragma unroll
            for (int g = 0; g < G; ++g)
                #pragma unroll
                for (int i = 0; i < CPL; ++i) acc[g][i] += __shfl_xor_sync(0xffffffff, acc[g][i], o);
        if (lane < LPT) {
            #pragma unroll
            for (int g = 0; g < G; ++g)
                #pragma unroll
                for (int i = 0; i < CPL; ++i) red[warp][g][sub * CPL + i] = acc[g][i];
        }
    } else {
        #include "tail_values.cuh"
        }
    }
    __syncthreads();
    #include "write_partials.cuh"
