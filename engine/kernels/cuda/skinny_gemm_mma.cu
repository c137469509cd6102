
    constexpr int U = 4;
    constexpr int STEP = 32 * WARPS;
    __shared__ float part[WARPS][4][32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n0 = blockIdx.x * 16;
    const int g = lane >> 2, t = lane & 3;
    const T* wg = w + (size_t)(n0 + g) * K + t * 8;
    const T* wg8 = wg + (size_t)8 * K;
    const bool has_x = g < R;
    const T* xg = x + (size_t)(has_x ? g : 0) * K + t * 8;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
    for (int k = warp * 32; k < K; k += STEP * U) {
        uint4 a[U], a8[U], b[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kk = k + u * STEP;
            const bool in = kk < K;
            a[u] = in ? *reinterpret_cast<const uint4*>(wg + kk) : zero;
            a8[u] = in ? *reinterpret_cast<const uint4*>(wg8 + kk) : zero;
            b[u] = in && has_x ? __ldg(reinterpret_cast<const uint4*>(xg + kk)) : zero;
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            asm(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                : "r"(a[u].x), "r"(a8[u].x), "r"(a[u].y), "r"(a8[u].y), "r"(b[u].x), "r"(b[u].y));
            asm(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                : "r"(a[u].z), "r"(a8[u].z), "r"(a[u].w), "r"(a8[u].w), "r"(b[u].z), "r"(b[u].w));
        }
    }
    if (WARPS > 1) {
        part[warp][0][lane] = c0; part[warp][1][lane] = c1;
        part[warp][2][lane] = c2; part[warp][3][lane] = c3;
        __syncthreads();
        if (warp != 0) return;
        #pragma unroll
        for (int v = 1; v < WARPS; ++v) {
            c0 += part[v][0][lane]; c1 += part[v][1][lane];
            c2 += part[v][2][lane]; c3 += part[v][3][lane];
        }
    }
    // Outputs are stored part by part (features [0, P1), [P1, P2), [P2, N)), each part
    // R x width row-major, so fused projections come back as contiguous arrays. A tile
    // never straddles two parts (their widths are multiples of 16).
    const size_t base = n0 < P1 ? 0 : n0 < P2 ? (size_t)R * P1 : (size_t)R * P2;
    const int width = n0 < P1 ? P1 : n0 < P2 ? P2 - P1 : N - P2;
    const int col = (n0 < P1 ? n0 : n0 < P2 ? n0 - P1 : n0 - P2) + g;
    const int r0 = 2 * t, r1 = 2 * t + 1;
    if (r0 < R) {
        out[base + (size_t)r0 * width + col] = static_cast<T>(c0);
        out[base + (size_t)r0 * width + col + 8] = static_cast<T>(c2);
    }
    if (r1 < R) {
        out[base + (size_t)r1 * width + col] = static_cast<T>(c1);
        out[base + (size_t)r1 * width + col + 8] = static_cast<T>(c3);
    }
