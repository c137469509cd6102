//! The one-layout split kernels' lanes (LPT a token, eight coordinates each) and shared memory.
constexpr int LPT = D / 8;            // lanes per token: 8 coordinates each
constexpr int TPW = 32 / LPT;         // tokens per warp step
constexpr int TG = NW * TPW;          // token groups per block
constexpr int NT = NW * 32;
__shared__ float sc[G][CHUNK];
__shared__ float qs[G][D];
__shared__ float red[NW][G][D];
__shared__ float stat[NW][G];
#include "block_ids.cuh"
const int tg = warp * TPW + lane / LPT, sub = lane % LPT;
const int start = lp[b];
const float scale = params[0];
