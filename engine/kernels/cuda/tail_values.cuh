//! The dense window's values weighted by the probabilities sc[g][t]: DLPT lanes a token, eight elements each,
//! summed over the warp's tokens into red[warp][g][d].
const int sub = lane % DLPT, tg = warp * DTPW + lane / DLPT;
float acc[G][8];
#pragma unroll
for (int g = 0; g < G; ++g)
    #pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
const T* tvb = tv + b * tv_strides[0] + h * tv_strides[1] + sub * 8;
for (int base = 0; base < n; base += DTG) {
    const int t = base + tg;
    if (t < n) {
        float x[8];
        load8(tvb + (size_t)(c0 + t - ws) * tv_strides[2], x);
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            const float p = sc[g][t];
            #pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(p, x[i], acc[g][i]);
        }
    }
}
#pragma unroll
for (int o = DLPT; o < 32; o <<= 1)
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] += __shfl_xor_sync(0xffffffff, acc[g][i], o);
if (lane < DLPT) {
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int i = 0; i < 8; ++i) red[warp][g][sub * 8 + i] = acc[g][i];
