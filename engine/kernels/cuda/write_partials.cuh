//! A split block's outputs: the warps' partial outputs red[w][g][d] summed into o_part, and each query's max
//! and sum of exponentials into ml_part (the reduce's inputs).
#include "sum_partials.cuh"
#pragma unroll
for (int g = 0; g < G; ++g)  // (not mx_[tid]: a register array indexed at run time goes to the stack)
    if (tid == g) {
        ml_part[((size_t)(b * HQ + h * G + g) * S + s) * 2] = mx_[g];
        ml_part[((size_t)(b * HQ + h * G + g) * S + s) * 2 + 1] = l_[g];
    }
