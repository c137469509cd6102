
    constexpr int NT = NW * 32;
    constexpr int DLPT = D / 8;           // dense path: lanes per token, 8 coordinates each
    constexpr int DTPW = 32 / DLPT;
    constexpr int DTG = NW * DTPW;
    constexpr int E = D >= 32 ? D / 32 : 1;
    constexpr int RAW = 256 * 32;         // words: the 32-copy pair table; later red (and the tail's sc)
    static_assert(G * TW + NW * G * D <= RAW, "the tail's scores and red must fit the table's space");
    __shared__ __align__(16) uint32_t raw7[RAW];
    __shared__ float qs[G][D];
    __shared__ float stat[NW][G];
    __shared__ float st7[2][NW][8];       // per warp and query column: running max (log2), sum
    float (*sc)[TW] = reinterpret_cast<float (*)[TW]>(raw7);              // the tail block's scores
    float (*red)[G][D] = reinterpret_cast<float (*)[G][D]>(raw7 + G * TW);  // partial outputs per warp
    #include "block_ids.cuh"
    #include "tq5_columns.cuh"
    #include "tq_queries.cuh"
    __syncthreads();
    float mx_[G], l_[G];
    if (tail) {
{
        #include "tail_scores.cuh"
    }
    __syncthreads();
    #include "block_softmax.cuh"
{
        #include "tail_values.cuh"
        }
    }
    } else {
        constexpr int KW = D / 32;        // K code words of a token a lane loads: D / 4 coordinates
        constexpr int KM = D / 16;        // k-steps of the scores per tile
        constexpr int VW = D / 64;        // V code words of a token a lane loads: D / 8 coordinates
        constexpr int VM = D / 16;        // M-tiles of the values per tile
        constexpr float LOG2E = 1.4426950408889634f;
        constexpr float M0 = -1e30f;      // running max before any token (finite: exp2(M0 - M0) = 1, no NaN)
        constexpr float TH7 = 3.f;        // lazy rescale threshold (log2 units, below)
        for (int i = tid; i < 64 * 32; i += NT) {  // the table: word e * 32 + copy, 16 bytes a store
            const int e = i >> 3;
            const uint32_t v = pack_half2(cent[e & 15], cent[e >> 4]);
            reinterpret_cast<uint4*>(raw7)[i] = make_uint4(v, v, v, v);
        }
        const int gq = lane >> 2, tq = lane & 3;
        const int gr = gq < G ? gq : 0;
        uint32_t qb[KM][2];
        #pragma unroll
        for (int j = 0; j < KM; ++j) {
            const int d = (D / 4) * tq + 4 * j;
            qb[j][0] = gq < G ? pack_half2(LOG2E * qs[gr][d], LOG2E * qs[gr][d + 1]) : 0u;
            qb[j][1] = gq < G ? pack_half2(LOG2E * qs[gr][d + 2], LOG2E * qs[gr][d + 3]) : 0u;
        }
        __syncthreads();  // the table is built
        const uint32_t lane4 = lane << 2;
        const uint32_t* tab = raw7;
        // Per-lane bases once (64-bit); per tile only 32-bit token offsets, clamped to the block's
        // last token (branch-free loads; such a token's score is -inf, so its probability is 0).
        const uint32_t* kcb = kc + b * kc_strides[0] + h * kc_strides[1] + (size_t)c0 * kc_strides[2] + tq * KW;
        const uint32_t* vcb = vc + b * vc_strides[0] + h * vc_strides[1] + (size_t)c0 * vc_strides[2] + gq * VW;
        const float* knb = kn + b * kn_strides[0] + h * kn_strides[1] + (size_t)c0 * kn_strides[2];
        const float* vnb = vn + b * vn_strides[0] + h * vn_strides[1] + (size_t)c0 * vn_strides[2];
        const uint32_t ksz = 4 * static_cast<uint32_t>(kc_strides[2]), vsz = 4 * static_cast<uint32_t>(vc_strides[2]);
        const uint32_t knz = 4 * static_cast<uint32_t>(kn_strides[2]), vnz = 4 * static_cast<uint32_t>(vn_strides[2]);
        const int last = n - 1;
        const int tv0 = 2 * tq, tv1 = 2 * tq + 1;  // the lane's V tokens: tv0, tv1, tv0 + 8, tv1 + 8
        const int src0 = 8 * tq + (gq >> 1), src1 = src0 + 4;  // score lanes of tokens 2tq, 2tq + 1 (column gq)
        const uint32_t sel = (gq & 1) ? 0x7632u : 0x5410u;
        struct Tile { uint32_t k[2][KW]; uint32_t v[4][VW]; float kn[2], vn[2]; };
        auto load = [&](Tile& x, int t0) {  // tile starting at token t0 (of the block)
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int t = min(t0 + gq + 8 * r, last);
                ldg_words<KW>(row7<uint32_t>(kcb, t, ksz), x.k[r]);
                x.kn[r] = __ldg(row7<float>(knb, t, knz));
                x.vn[r] = __ldg(row7<float>(vnb, t, vnz));
            }
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int t = min(t0 + (r & 1 ? tv1 : tv0) + 8 * (r >> 1), last);
                ldg_words<VW>(row7<uint32_t>(vcb, t, vsz), x.v[r]);
            }
        };
        float o[VM][4];
        #pragma unroll
        for (int m = 0; m < VM; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.f;
        float mr[2] = {M0, M0}, lr[2] = {0.f, 0.f};  // columns 2tq, 2tq + 1: running max (log2), this lane's sum
        auto math = [&](const Tile& x, int t0) {
            float c[4] = {0.f, 0.f, 0.f, 0.f};
            #pragma unroll
            for (int j = 0; j < KM; ++j) {
                const uint32_t x0 = x.k[0][j >> 1], x1 = x.k[1][j >> 1];
                const int by = 2 * (j & 1);
                mma_f16(c, pair7r(tab, x0, lane4, by), pair7r(tab, x1, lane4, by), pair7r(tab, x0, lane4, by + 1), pair7r(tab, x1, lane4, by + 1),
                        qb[j][0], qb[j][1]);
            }
            const bool ok0 = t0 + gq <= last, ok1 = t0 + gq + 8 <= last;
            float sv[4];
            sv[0] = ok0 ? c[0] * x.kn[0] : NEG_INF;
            sv[1] = ok0 ? c[1] * x.kn[0] : NEG_INF;
            sv[2] = ok1 ? c[2] * x.kn[1] : NEG_INF;
            sv[3] = ok1 ? c[3] * x.kn[1] : NEG_INF;
            float t0m = fmaxf(sv[0], sv[2]), t1m = fmaxf(sv[1], sv[3]);
            #pragma unroll
            for (int off = 4; off < 32; off <<= 1) {  // over the 8 token rows gq (same columns)
                t0m = fmaxf(t0m, __shfl_xor_sync(0xffffffff, t0m, off));
                t1m = fmaxf(t1m, __shfl_xor_sync(0xffffffff, t1m, off));
            }
            const float n0 = fmaxf(mr[0], t0m), n1 = fmaxf(mr[1], t1m);
            // Rescale only where a max grew by more than TH7 (log2): until then the old max stays the
            // reference, so a probability may reach 2^TH7 = 8 (f16 holds p |v| up to |v| ~ 8,000); on random
            // scores a warp's max grows at most tiles, by a little, and each rescale costs ~40 instructions.
            if (__any_sync(0xffffffff, n0 > mr[0] + TH7 || n1 > mr[1] + TH7)) {
                const float a0 = ex2_7(mr[0] - n0), a1 = ex2_7(mr[1] - n1);
                lr[0] *= a0;
                lr[1] *= a1;
                #pragma unroll
                for (int m = 0; m < VM; ++m) {
                    o[m][0] *= a0; o[m][2] *= a0;
                    o[m][1] *= a1; o[m][3] *= a1;
                }
                mr[0] = n0;
                mr[1] = n1;
            }
            const float p0 = ex2_7(sv[0] - mr[0]), p1 = ex2_7(sv[1] - mr[1]);
            const float p2 = ex2_7(sv[2] - mr[0]), p3 = ex2_7(sv[3] - mr[1]);
            lr[0] += p0 + p2;
            lr[1] += p1 + p3;
            const uint32_t w0 = pack_half2(p0 * x.vn[0], p1 * x.vn[0]);  // token gq: columns 2tq, 2tq + 1
            const uint32_t w1 = pack_half2(p2 * x.vn[1], p3 * x.vn[1]);  // token gq + 8
            const uint32_t a0 = __shfl_sync(0xffffffff, w0, src0), a1 = __shfl_sync(0xffffffff, w0, src1);
            const uint32_t e0 = __shfl_sync(0xffffffff, w1, src0), e1 = __shfl_sync(0xffffffff, w1, src1);
            const uint32_t b0 = __byte_perm(a0, a1, sel);  // P(tokens 2tq, 2tq + 1; column gq)
            const uint32_t b1 = __byte_perm(e0, e1, sel);  // P(tokens 2tq + 8, 2tq + 9; column gq)
            #pragma unroll
            for (int j = 0; j < VW; ++j) {
                // Byte k of lo01 = low nibble of token 0's byte k | low nibble of token 1's << 4, ...
                const uint32_t lo01 = (x.v[0][j] & 0x0F0F0F0Fu) | ((x.v[1][j] << 4) & 0xF0F0F0F0u);
                const uint32_t hi01 = ((x.v[0][j] >> 4) & 0x0F0F0F0Fu) | (x.v[1][j] & 0xF0F0F0F0u);
                const uint32_t lo23 = (x.v[2][j] & 0x0F0F0F0Fu) | ((x.v[3][j] << 4) & 0xF0F0F0F0u);
                const uint32_t hi23 = ((x.v[2][j] >> 4) & 0x0F0F0F0Fu) | (x.v[3][j] & 0xF0F0F0F0u);
                #pragma unroll
                for (int k = 0; k < 4; ++k)
                    mma_f16(o[4 * j + k], pair7r(tab, lo01, lane4, k), pair7r(tab, hi01, lane4, k),
                            pair7r(tab, lo23, lane4, k), pair7r(tab, hi23, lane4, k), b0, b1);
            }
        };
        // The warp's tiles: tokens [(i NW + warp) 16, + 16) for i < nt, nt the same for every warp (a tile
        // past n is masked): a block-uniform loop, so the table's base stays in a uniform register and
        // folds into every LDS (a warp-dependent count makes it a per-lookup add). No barrier inside.
        const int nt = (n + 16 * NW - 1) / (16 * NW);
        Tile ta, tb2;
        if constexpr (PF) {  // two tile buffers: tile i + 1's loads in flight during tile i's math
            if (nt > 0) load(ta, 16 * warp);
            for (int i = 0; i < nt; i += 2) {
                if (i + 1 < nt) load(tb2, 16 * ((i + 1) * NW + warp));
                math(ta, 16 * (i * NW + warp));
                if (i + 1 >= nt) break;
                if (i + 2 < nt) load(ta, 16 * ((i + 2) * NW + warp));
                math(tb2, 16 * ((i + 1) * NW + warp));
            }
        } else {  // one buffer (fewer registers, more blocks per SM): a tile's V loads overlap its K math only
            for (int i = 0; i < nt; ++i) {
                load(ta, 16 * (i * NW + warp));
                math(ta, 16 * (i * NW + warp));
            }
        }
        // The block's combine: the lane sums over the 8 token rows, then per column the block's max and
        // each warp's output rescaled to it (the split kernel's red array, in the table's space: after the barrier).
        #pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            lr[0] += __shfl_xor_sync(0xffffffff, lr[0], off);
            lr[1] += __shfl_xor_sync(0xffffffff, lr[1], off);
        }
        if (gq == 0) {
            st7[0][warp][2 * tq] = mr[0]; st7[0][warp][2 * tq + 1] = mr[1];
            st7[1][warp][2 * tq] = lr[0]; st7[1][warp][2 * tq + 1] = lr[1];
        }
        __syncthreads();  // every warp is past its table loads; st7 is complete
        float f[2];
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mb = st7[0][0][2 * tq + i];
            #pragma unroll
            for (int w = 1; w < NW; ++w) mb = fmaxf(mb, st7[0][w][2 * tq + i]);
            f[i] = ex2_7(mr[i] - mb);
        }
        #pragma unroll
        for (int m = 0; m < VM; ++m) {
            const int d = (D / 8) * gq + 2 * m;
            if (2 * tq < G) {
                red[warp][2 * tq][d] = o[m][0] * f[0];
                red[warp][2 * tq][d + 1] = o[m][2] * f[0];
            }
            if (2 * tq + 1 < G) {
                red[warp][2 * tq + 1][d] = o[m][1] * f[1];
                red[warp][2 * tq + 1][d + 1] = o[m][3] * f[1];
            }
        }
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            float mb = st7[0][0][g];
            #pragma unroll
            for (int w = 1; w < NW; ++w) mb = fmaxf(mb, st7[0][w][g]);
            float lb = 0.f;
            #pragma unroll
            for (int w = 0; w < NW; ++w) lb += st7[1][w][g] * ex2_7(st7[0][w][g] - mb);
            mx_[g] = mb * 0.6931471805599453f;  // (the split kernels' partials: natural log)
            l_[g] = lb;
        }
    }
    __syncthreads();
    #include "write_partials.cuh"
