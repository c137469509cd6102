//! The Walsh-Hadamard butterfly's stages on x[E] of a warp's D-vector, in place (warp_hadamard's body; the
//! encode kernel's rotation).
#pragma unroll
for (int hh = 1; hh < E; hh <<= 1)
    #pragma unroll
    for (int e = 0; e < E; ++e)
        if ((e & hh) == 0) {
            const float a = x[e], c = x[e + hh];
            x[e] = a + c;
            x[e + hh] = a - c;
        }
#pragma unroll
for (int hh = E; hh < D; hh <<= 1) {
    const int o = hh / E;
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        const float other = __shfl_xor_sync(0xffffffff, x[e], o);
        x[e] = (lane & o) ? other - x[e] : x[e] + other;
    }
