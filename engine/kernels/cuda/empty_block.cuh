//! A split block with no columns of its row: zero outputs, and a max of -inf that the reduce weighs to nothing.
for (int i = tid; i < G * D; i += NT)
    o_part[((size_t)(b * HQ + h * G + i / D) * S + s) * D + i % D] = 0.f;
if (tid < G) {
    ml_part[((size_t)(b * HQ + h * G + tid) * S + s) * 2] = NEG_INF;
    ml_part[((size_t)(b * HQ + h * G + tid) * S + s) * 2 + 1] = 0.f;
}
