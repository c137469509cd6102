
    __shared__ float xs[D];
    const int r = blockIdx.x, d = threadIdx.x;
    const int S = ml_part_shape[1];
    const float* ml = ml_part + (size_t)r * S * 2;
    const float* op = o_part + (size_t)r * S * D + d;
    float M = NEG_INF;
    for (int s = 0; s < S; ++s) M = fmaxf(M, ml[2 * s]);
    float L = 0.f, rot = 0.f, plain = 0.f;
    for (int s = 0; s < S; ++s) {
        const float m = ml[2 * s];
        if (m == NEG_INF) continue;
        const float w = __expf(m - M);
        L += w * ml[2 * s + 1];
        if (ROT && s < S - 1) rot += w * op[(size_t)s * D];
        else plain += w * op[(size_t)s * D];
    }
    if (ROT) {
        xs[d] = rot;
        #pragma unroll
        for (int hh = 1; hh < D; hh <<= 1) {
            __syncthreads();
            if (d < D / 2) {
                const int lo = (d / hh) * 2 * hh + (d % hh), hi = lo + hh;
                const float a = xs[lo], c = xs[hi];
                xs[lo] = a + c;
                xs[hi] = a - c;
            }
        }
        __syncthreads();
        plain += xs[d] * rsqrtf((float)D) * signs[d];
    }
    out[(size_t)r * D + d] = static_cast<T>(L > 0.f ? plain / L : 0.f);
