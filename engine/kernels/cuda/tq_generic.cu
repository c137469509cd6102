
    #include "lane_layout.cuh"

    constexpr int MASK = (1 << BITS) - 1;
    __shared__ float cs[1 << BITS];
    const int end = kc_shape[2];
    #include "tq_window.cuh"
    const int c0 = tail ? max(bound, start) : max(s * CHUNK, start);
    const int c1 = tail ? end : min((s + 1) * CHUNK, bound);

    if (c0 >= c1) {
        #include "empty_block.cuh"

        return;
    }

    const int n = c1 - c0;
    for (int i = tid; i < G * D; i += NT)
        qs[i / D][i % D] = scale * static_cast<float>(
            q[b * q_strides[0] + (h * G + i / D) * q_strides[1] + (i % D) * q_strides[3]]);
    for (int i = tid; i < (1 << BITS); i += NT) cs[i] = cent[i];
    if (!tail) {
        // q' = H (q * signs) / sqrt(D): the codec's rotation, as mx.hadamard_transform computes it.
        __syncthreads();
        for (int i = tid; i < G * D; i += NT) qs[i / D][i % D] *= signs[i % D];
        #pragma unroll
        for (int hh = 1; hh < D; hh <<= 1) {
            __syncthreads();
            for (int i = tid; i < G * D / 2; i += NT) {
                const int g = i / (D / 2), j = i % (D / 2);
                const int lo = (j / hh) * 2 * hh + (j % hh), hi = lo + hh;
                const float a = qs[g][lo], c = qs[g][hi];
                qs[g][lo] = a + c;
                qs[g][hi] = a - c;
            }
        }
    }
    __syncthreads();
    const float qscale = tail ? 1.f : rsqrtf((float)D);
    float qr[G][8];
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int i = 0; i < 8; ++i) qr[g][i] = qscale * qs[g][sub * 8 + i];
    const size_t kcb = b * kc_strides[0] + h * kc_strides[1];
    const size_t knb = b * kn_strides[0] + h * kn_strides[1];
    const size_t vcb = b * vc_strides[0] + h * vc_strides[1];
    const size_t vnb = b * vn_strides[0] + h * vn_strides[1];
    const T* tkb = tk + b * tk_strides[0] + h * tk_strides[1] + sub * 8;
    const T* tvb = tv + b * tv_strides[0] + h * tv_strides[1] + sub * 8;
    constexpr int BIT0 = 8 * BITS;       // a lane's 8 codes start at bit sub * BIT0 of the row
    for (int base = 0; base < n; base += TG * U) {
        float x[U][8];
        uint32_t w0[U], w1[U];
        float norm[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            w0[u] = 0u; w1[u] = 0u; norm[u] = 0.f;
            #pragma unroll
            for (int i = 0; i < 8; ++i) x[u][i] = 0.f;
            if (t < n) {
                const int c = c0 + t;
                if (tail) {
                    load8(tkb + (size_t)(c - ws) * tk_strides[2], x[u]);
                    norm[u] = 1.f;
                } else {
                    const uint32_t* row = kc + kcb + (size_t)c * kc_strides[2] + (sub * BIT0) / 32;
                    w0[u] = row[0];
                    if (BIT0 > 32) w1[u] = row[1];
                    norm[u] = kn[knb + (size_t)c * kn_strides[2]];
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            if (!tail) {
                #pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const int bit = (sub * BIT0) % 32 + i * BITS;
                    x[u][i] = cs[(bit < 32 ? (w0[u] >> bit) : (w1[u] >> (bit - 32))) & MASK];
                }
            }
            #include "dot_lanes.cuh"
            if (t < n && sub == 0) {
                #pragma unroll
                for (int g = 0; g < G; ++g) sc[g][t] = a[g] * norm[u];
            }
        }
    }

    #include "softmax_acc8.cuh"
    // U tokens per group per step, loads first: more bytes in flight per lane.
    for (int base = 0; base < n; base += TG * U) {
        
        float x[U][8];
        uint32_t w0[U], w1[U];
        float norm[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            w0[u] = 0u; w1[u] = 0u; norm[u] = 1.f;
            if (t < n) {
                const int c = c0 + t;
                if (tail) {
                    load8(tvb + (size_t)(c - ws) * tv_strides[2], x[u]);
                } else {
                    const uint32_t* row = vc + vcb + (size_t)c * vc_strides[2] + (sub * BIT0) / 32;
                    w0[u] = row[0];
                    if (BIT0 > 32) w1[u] = row[1];
                    norm[u] = vn[vnb + (size_t)c * vn_strides[2]];
                }
            }
        }

        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            if (t < n) {
                
                if (!tail) {
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const int bit = (sub * BIT0) % 32 + i * BITS;
                        x[u][i] = cs[(bit < 32 ? (w0[u] >> bit) : (w1[u] >> (bit - 32))) & MASK];
                    }
                }
                #pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float p = sc[g][t] * norm[u];
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) acc[g][i] += p * x[u][i];
                }

            }
        }
    #include "dense_outputs.cuh"
