//! The columns [c0, c1) of a dense split block, n of them; a block with none writes its empty outputs and
//! returns.
const int end = k_shape[2];
const int c0 = max(s * CHUNK, start), c1 = min((s + 1) * CHUNK, end);

if (c0 >= c1) {
    #include "empty_block.cuh"

    return;
}

const int n = c1 - c0;
