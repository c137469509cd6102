//! The columns [c0, c1) of a block of the tensor-core TurboQuant kernels (params[1]: columns per code block),
//! n of them; a block with none writes its empty outputs and returns.
const int start = lp[b];
const float scale = params[0];
const int end = kn_shape[2];  // the cache's columns: kn is [0, end), kc may be its whole buffer
#include "tq_window.cuh"
const int CH5 = static_cast<int>(params[1]);  // columns per code block (<= CHUNK)
const int c0 = tail ? max(bound, start) : max(s * CH5, start);
const int c1 = tail ? end : min((s + 1) * CH5, bound);
if (c0 >= c1) {
    #include "empty_block.cuh"
    return;
}
const int n = c1 - c0;
