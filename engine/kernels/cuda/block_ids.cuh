//! Which split s of S, KV head h and row b this block is; HQ query heads a row.
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int s = blockIdx.x, S = gridDim.x;
const int h = blockIdx.y, b = blockIdx.z;
const int HQ = gridDim.y * G;
