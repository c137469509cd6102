//! A split block's outputs: the warps' partial outputs red[w][g][d] summed into o_part, and each query's max
//! and sum of exponentials into ml_part (the reduce's inputs).
for (int i = tid; i < G * D; i += NT) {
    const int g = i / D, d = i % D;
    float v = 0.f;
    #pragma unroll
    for (int w = 0; w < NW; ++w) v += red[w][g][d];
    o_part[((size_t)(b * HQ + h * G + g) * S + s) * D + d] = v;
}
#pragma unroll
for (int g = 0; g < G; ++g)  // (not mx_[tid]: a register array indexed at run time goes to the stack)
    if (tid == g) {
        ml_part[((size_t)(b * HQ + h * G + g) * S + s) * 2] = mx_[g];
        ml_part[((size_t)(b * HQ + h * G + g) * S + s) * 2 + 1] = l_[g];
    }
