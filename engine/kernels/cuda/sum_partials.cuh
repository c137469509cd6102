//! The warps' partial outputs red[w][g][d] summed into o_part.
for (int i = tid; i < G * D; i += NT) {
    const int g = i / D, d = i % D;
    float v = 0.f;
    #pragma unroll
    for (int w = 0; w < NW; ++w) v += red[w][g][d];
    o_part[((size_t)(b * HQ + h * G + g) * S + s) * D + d] = v;
}
