
    #include "lane_layout.cuh"

    #include "dense_columns.cuh"
    for (int i = tid; i < G * D; i += NT)
        qs[i / D][i % D] = scale * static_cast<float>(
            q[b * q_strides[0] + (h * G + i / D) * q_strides[1] + (i % D) * q_strides[3]]);
    __syncthreads();
    float qr[G][8];
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int i = 0; i < 8; ++i) qr[g][i] = qs[g][sub * 8 + i];
    const T* kb = k + b * k_strides[0] + h * k_strides[1] + sub * 8;
    const T* vb = v + b * v_strides[0] + h * v_strides[1] + sub * 8;
    // Every lane runs every step (the shuffles need the whole warp); past n it loads nothing.
    for (int base = 0; base < n; base += TG * U) {
        float x[U][8];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            if (t < n) load8(kb + (size_t)(c0 + t) * k_strides[2], x[u]);
            else {
                #pragma unroll
                for (int i = 0; i < 8; ++i) x[u][i] = 0.f;
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            #include "dot_lanes.cuh"
            if (t < n && sub == 0) {
                #pragma unroll
                for (int g = 0; g < G; ++g) sc[g][t] = a[g];
            }
        }
    }

    #include "softmax_acc8.cuh"
    // U tokens per group per step, loads first: more bytes in flight per lane.
    for (int base = 0; base < n; base += TG * U) {
        
        float x[U][8];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            if (t < n) load8(vb + (size_t)(c0 + t) * v_strides[2], x[u]);
        }

        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TG + tg;
            if (t < n) {
                
                #pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float p = sc[g][t];
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) acc[g][i] += p * x[u][i];
                }

            }
        }
    #include "dense_outputs.cuh"
