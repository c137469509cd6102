//! Each query's dot product with token u's eight coordinates x[u] of this lane, summed over the LPT lanes of
//! the token: a[g].
float a[G];
#pragma unroll
for (int g = 0; g < G; ++g) {
    a[g] = 0.f;
    #pragma unroll
    for (int i = 0; i < 8; ++i) a[g] += qr[g][i] * x[u][i];
}
#pragma unroll
for (int o = LPT / 2; o > 0; o >>= 1)
    #pragma unroll
    for (int g = 0; g < G; ++g) a[g] += __shfl_xor_sync(0xffffffff, a[g], o);
