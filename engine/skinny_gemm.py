"""Projections of a batched decode step (2-8 rows) on CUDA: read each weight once.

Why this is hand-written: MLX's CUDA backend multiplies `x @ W.T` with its own
bandwidth-bound gemv kernel only when x has a single row (`can_use_gemv`:
M == 1); two to eight rows go to cuBLAS, whose kernels for such skinny
products read the weights at about half that speed on an H200 (measured with
`bench/profile_batch_step.py`: a 4096 -> 12288 projection, 78 us at M=1 and
104 us at M=2..8 including ~50 us of synchronisation). A decode step is almost
entirely such products, so on the lent H200 a B=2 step of a Qwen3-8B shape
cost 1.9x a B=1 step (mlx-lm's `GenerationBatch` alone: 1.06-1.22x the
tokens/s of B=1). No library at hand has a skinny bf16 GEMM for MLX arrays.

The kernel gives each warp `RW` weight rows: its 32 lanes stream them in
16-byte loads, multiply every load with the same columns of each of the R
input rows (x is at most 8 x K and stays in cache), and reduce the partial
sums across the warp. Weight bytes are read once whatever R is: at 2-4 rows
one Qwen3-8B layer costs 1.33-1.37x a one-row layer (cuBLAS: 1.85x). Above 4
rows the CUDA cores become the limit (R FMAs per weight element) and cuBLAS,
or the tensor-core variant below, does better.

`install(model)` swaps the model's `nn.Linear` layers for `SkinnyLinear`,
which takes this path only on a CUDA device for 2..8 rows of bf16/fp16 with
K a multiple of 256 and falls back to the layer's own matmul otherwise (so on
a CPU, where CI runs, nothing changes). Set PREFIXTRACE_SKINNY_GEMM=0 to
leave the model untouched, or =mma to use the tensor-core variant (`_MMA_SOURCE`)
for bf16 projections of 2,048-65,535 outputs (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

__all__ = ["SkinnyLinear", "install", "skinny_matmul", "skinny_matmul_mma", "available", "mode", "set_mode", "use_kernel", "MAX_ROWS"]

log = logging.getLogger("prefixtrace.engine")

MAX_ROWS = 8
_K_MULTIPLE = 256  # 32 lanes x 8 bf16 per 16-byte load

_SOURCE = """
    constexpr int VEC = 8;
    const int lane = threadIdx.x & 31;
    const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * RW;
    if (row0 >= N) return;
    float acc[RW][R];
    #pragma unroll
    for (int j = 0; j < RW; ++j)
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[j][r] = 0.f;
    #pragma unroll 2
    for (int k = lane * VEC; k < K; k += 32 * VEC) {
        float wf[RW][VEC];
        #pragma unroll
        for (int j = 0; j < RW; ++j) {
            uint4 wv = *reinterpret_cast<const uint4*>(w + (size_t)(row0 + j) * K + k);
            const T* wp = reinterpret_cast<const T*>(&wv);
            #pragma unroll
            for (int i = 0; i < VEC; ++i) wf[j][i] = static_cast<float>(wp[i]);
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (size_t)r * K + k));
            const T* xp = reinterpret_cast<const T*>(&xv);
            float xf[VEC];
            #pragma unroll
            for (int i = 0; i < VEC; ++i) xf[i] = static_cast<float>(xp[i]);
            #pragma unroll
            for (int j = 0; j < RW; ++j)
                #pragma unroll
                for (int i = 0; i < VEC; ++i) acc[j][r] += wf[j][i] * xf[i];
        }
    }
    #pragma unroll
    for (int j = 0; j < RW; ++j)
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = acc[j][r];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
            if (lane == 0) out[(size_t)r * N + row0 + j] = static_cast<T>(v);
        }
"""

_WARPS_PER_BLOCK = 8

# Tensor-core variant for bf16: each warp computes 16 output features x 8 rows of x
# with mma.sync m16n8k16, weight rows as A, x as B. A lane loads 8 consecutive k of
# a weight row (one 16-byte load) and the same 8 k of its x row, and feeds them to
# two mma steps; the k order inside a 32-wide tile is permuted identically for A and
# B, which a sum over k does not see. Rows of x past R read as zeros.
_MMA_SOURCE = """
    const int lane = threadIdx.x & 31;
    const int n0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * 16;
    if (n0 >= N) return;
    const int g = lane >> 2, t = lane & 3;
    const T* wg = w + (size_t)(n0 + g) * K + t * 8;
    const T* wg8 = wg + (size_t)8 * K;
    const bool has_x = g < R;
    const T* xg = x + (size_t)(has_x ? g : 0) * K + t * 8;
    float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
    #pragma unroll 4
    for (int k = 0; k < K; k += 32) {
        uint4 a = *reinterpret_cast<const uint4*>(wg + k);
        uint4 a8 = *reinterpret_cast<const uint4*>(wg8 + k);
        uint4 b = has_x ? __ldg(reinterpret_cast<const uint4*>(xg + k)) : make_uint4(0, 0, 0, 0);
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
            : "r"(a.x), "r"(a8.x), "r"(a.y), "r"(a8.y), "r"(b.x), "r"(b.y));
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
            : "r"(a.z), "r"(a8.z), "r"(a.w), "r"(a8.w), "r"(b.z), "r"(b.w));
    }
    const int r0 = 2 * t, r1 = 2 * t + 1;
    if (r0 < R) {
        out[(size_t)r0 * N + n0 + g] = static_cast<T>(c0);
        out[(size_t)r0 * N + n0 + g + 8] = static_cast<T>(c2);
    }
    if (r1 < R) {
        out[(size_t)r1 * N + n0 + g] = static_cast<T>(c1);
        out[(size_t)r1 * N + n0 + g + 8] = static_cast<T>(c3);
    }
"""


MODES = ("off", "cuda", "mma")
_mode: str | None = None


def mode() -> str:
    """Which kernel 2-8-row projections use: "cuda" (CUDA cores, the default), "mma"
    (tensor cores where `use_mma`), or "off" (MLX's matmul). From PREFIXTRACE_SKINNY_GEMM
    (0 / mma), read once; `set_mode` changes it for benchmarks comparing kernels in one run."""
    global _mode
    if _mode is None:
        env = os.environ.get("PREFIXTRACE_SKINNY_GEMM", "1")
        _mode = "off" if env == "0" else "mma" if env == "mma" else "cuda"
    return _mode


def set_mode(new: str) -> None:
    if new not in MODES:
        raise ValueError(f"skinny GEMM mode must be one of {MODES}, not {new!r}")
    global _mode
    _mode = new


@lru_cache(maxsize=1)
def available() -> bool:
    """True where the kernel can run: a CUDA build of MLX with the GPU as default device.
    Decided once per process: every projection of every decode step asks."""
    try:
        return mx.default_device() == mx.gpu and mx.cuda.is_available()
    except AttributeError:  # an MLX without the CUDA module
        return False


@lru_cache(maxsize=1)
def _kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_skinny_gemm", input_names=["x", "w"], output_names=["out"],
                               source=_SOURCE)


@lru_cache(maxsize=1)
def _mma_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_skinny_gemm_mma", input_names=["x", "w"], output_names=["out"],
                               source=_MMA_SOURCE)


def skinny_matmul_mma(x: mx.array, w: mx.array) -> mx.array:
    """x (R, K) @ w (N, K).T for R in 1..8 on tensor cores; bf16, N % 16 == 0, K % 32 == 0. CUDA only."""
    rows, k = x.shape
    n = w.shape[0]
    return _mma_kernel()(
        inputs=[x.astype(w.dtype), w],
        template=[("T", w.dtype), ("R", rows), ("K", k), ("N", n)],
        grid=(n // 16 * 32, 1, 1),
        threadgroup=(32 * 4, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[w.dtype],
    )[0]


def rows_per_warp(rows: int, n: int) -> int:
    """Weight rows each warp streams: more when x has more rows, so that each load of
    x (from cache) serves several weight rows (measured, bench/bench_skinny_gemm.py)."""
    rw = 2 if rows <= 2 else 4
    while n % rw:
        rw //= 2
    return rw


def skinny_matmul(x: mx.array, w: mx.array, rw: int | None = None) -> mx.array:
    """x (R, K) @ w (N, K).T for R in 1..8, as one pass over w. CUDA only."""
    rows, k = x.shape
    n = w.shape[0]
    rw = rw or rows_per_warp(rows, n)
    return _kernel()(
        inputs=[x.astype(w.dtype), w],
        template=[("T", w.dtype), ("R", rows), ("K", k), ("N", n), ("RW", rw)],
        grid=(n // rw * 32, 1, 1),
        threadgroup=(32 * _WARPS_PER_BLOCK, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[w.dtype],
    )[0]


def use_mma(n: int, dtype) -> bool:
    """The tensor-core kernel, where it measured fastest for 2-8 rows (bench/bench_skinny_gemm.py):
    bf16 projections of 2,048 to 65,535 outputs. Narrower ones have too few 16-row tiles to
    fill the GPU, and for the LM head (152k outputs) cuBLAS stays ahead."""
    return dtype == mx.bfloat16 and n % 16 == 0 and 2048 <= n < 65536


def use_kernel(rows: int, n: int) -> bool:
    """Where the kernel beat MLX's matmul on the H200 (bench/bench_skinny_gemm.py,
    docs/PERFORMANCE.md): 2-4 rows, except the LM head (N = 152k, where cuBLAS is
    flat in the row count), and up to 8 rows for narrow outputs (N <= 2048, the
    K/V projections). At 5-8 rows a wide projection becomes compute-bound on CUDA
    cores (8 FMAs per weight per row) and cuBLAS's tensor-core kernels win."""
    return (2 <= rows <= 4 and n < 65536) or (2 <= rows <= MAX_ROWS and n <= 2048)


def _fits(weight: mx.array) -> bool:
    return weight.ndim == 2 and weight.dtype in (mx.bfloat16, mx.float16) and weight.shape[1] % _K_MULTIPLE == 0


class SkinnyLinear(nn.Linear):
    """`nn.Linear` whose 2..8-row products go through `skinny_matmul` on CUDA."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "SkinnyLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)  # not nn.Linear's: it would allocate fresh random weights
        new.weight = linear.weight
        if "bias" in linear:
            new.bias = linear.bias
        return new

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        n = self.weight.shape[0]
        if 2 <= rows <= MAX_ROWS and _fits(self.weight) and available() and (kind := mode()) != "off":
            flat = x.reshape(rows, x.shape[-1])
            if kind == "mma" and use_mma(n, self.weight.dtype):
                y = skinny_matmul_mma(flat, self.weight)
            elif use_kernel(rows, n):
                y = skinny_matmul(flat, self.weight)
            else:
                return super().__call__(x)
            y = y.reshape(*x.shape[:-1], -1)
            return y + self.bias if "bias" in self else y
        return super().__call__(x)


def install(model: nn.Module) -> int:
    """Swap every eligible `nn.Linear` of `model` for a `SkinnyLinear`; how many were
    swapped (0 where the kernel cannot run, leaving the model as it was)."""
    if not available() or mode() == "off":
        return 0
    swaps = [(name, SkinnyLinear.from_linear(m)) for name, m in model.named_modules()
             if type(m) is nn.Linear and _fits(m.weight)]
    if swaps:
        model.update_modules(tree_unflatten(swaps))
        log.info("decode projections of 2-%d rows use the skinny GEMM kernel (%d layers)", MAX_ROWS, len(swaps))
    return len(swaps)
