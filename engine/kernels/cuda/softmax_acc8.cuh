//! The scores written: each query's softmax statistics (block_softmax.cuh), and the lanes' output
//! accumulators acc[g][8] zeroed.
__syncthreads();
float mx_[G], l_[G];
#include "block_softmax.cuh"
float acc[G][8];
#pragma unroll
for (int g = 0; g < G; ++g)
    #pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
