//! The scores of a TurboQuant block's dense window (tk: its last columns, held uncompressed): DLPT lanes a
//! token, eight elements each, dot it with the queries qs into sc[g][t], t in [0, n).
const int sub = lane % DLPT, tg = warp * DTPW + lane / DLPT;
float qr[G][8];
#pragma unroll
for (int g = 0; g < G; ++g)
    #pragma unroll
    for (int i = 0; i < 8; ++i) qr[g][i] = qs[g][sub * 8 + i];
const T* tkb = tk + b * tk_strides[0] + h * tk_strides[1] + sub * 8;
for (int base = 0; base < n; base += DTG) {
    const int t = base + tg;
    float x[8];
    if (t < n) load8(tkb + (size_t)(c0 + t - ws) * tk_strides[2], x);
    else {
        #pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = 0.f;
    }
    float a[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        a[g] = 0.f;
        #pragma unroll
        for (int i = 0; i < 8; ++i) a[g] = fmaf(qr[g][i], x[i], a[g]);
    }
    #pragma unroll
    for (int o = DLPT / 2; o > 0; o >>= 1)
        #pragma unroll
        for (int g = 0; g < G; ++g) a[g] += __shfl_xor_sync(0xffffffff, a[g], o);
    if (t < n && sub == 0) {
        #pragma unroll
        for (int g = 0; g < G; ++g) sc[g][t] = a[g];
    }
}
