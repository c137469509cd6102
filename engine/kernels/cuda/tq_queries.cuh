//! The queries of a TurboQuant block into qs, scaled; for a code block rotated as the codec rotates keys.
// Queries, scaled; for the code blocks rotated as the codec rotates keys: q' = H (q * signs) / sqrt(D).
for (int g = warp; g < G; g += NW) {
    float x[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = lane * E + e;
        x[e] = d < D ? scale * static_cast<float>(q[b * q_strides[0] + (h * G + g) * q_strides[1]
                                                    + d * q_strides[3]]) : 0.f;
        if (!tail && d < D) x[e] *= signs[d];
    }
    if (!tail) {
        warp_hadamard<D, E>(x, lane);
        #pragma unroll
        for (int e = 0; e < E; ++e) x[e] *= rsqrtf((float)D);
    }
    #pragma unroll
    for (int e = 0; e < E; ++e)
        if (lane * E + e < D) qs[g][lane * E + e] = x[e];
}
