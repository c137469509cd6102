//! Each query's max and sum of exponentials over the block's scores sc[g][0, n): mx_[g], l_[g], and
//! sc[g][t] = exp(score - max). Spliced into a kernel body where its shared sc and stat are declared.
#pragma unroll
for (int g = 0; g < G; ++g) {
    float m = NEG_INF;
    for (int t = tid; t < n; t += NT) m = fmaxf(m, sc[g][t]);
    m = warp_max(m);
    if (lane == 0) stat[warp][g] = m;
}
__syncthreads();
#pragma unroll
for (int g = 0; g < G; ++g) {
    float m = stat[0][g];
    #pragma unroll
    for (int w = 1; w < NW; ++w) m = fmaxf(m, stat[w][g]);
    mx_[g] = m;
}
__syncthreads();
#pragma unroll
for (int g = 0; g < G; ++g) {
    float l = 0.f;
    for (int t = tid; t < n; t += NT) {
        const float p = __expf(sc[g][t] - mx_[g]);
        sc[g][t] = p;
        l += p;
    }
    l = warp_sum(l);
    if (lane == 0) stat[warp][g] = l;
}
__syncthreads();
#pragma unroll
for (int g = 0; g < G; ++g) {
    float l = 0.f;
    #pragma unroll
    for (int w = 0; w < NW; ++w) l += stat[w][g];
    l_[g] = l;
}
