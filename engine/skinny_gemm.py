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

__all__ = ["SkinnyLinear", "install", "skinny_matmul", "skinny_matmul_mma", "available", "mode", "set_mode", "project", "use_kernel", "MAX_ROWS"]

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

# Tensor-core variant for bf16: a block of WARPS warps computes 16 output features x 8
# rows of x with mma.sync m16n8k16, weight rows as A, x as B; its warps take interleaved
# 32-wide slices of K (split-K) and add their partial tiles in shared memory. Without the
# split a 4096-output projection has only 256 tiles, one warp each: 64 blocks on 132 SMs,
# which looked fast only while independent products overlapped (bench/bench_skinny_gemm.py
# now times dependent chains, as in a decode step). A lane loads 8 consecutive k of a
# weight row (one 16-byte load) and the same 8 k of its x row and feeds them to two mma
# steps; the k order inside a 32-wide slice is permuted identically for A and B, which a
# sum over k does not see. Rows of x past R read as zeros. U slices are loaded before any
# is multiplied, so each lane keeps 3 x U loads in flight.
_MMA_SOURCE = """
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

# Warps that keep every SM of an H200 (132) streaming: the split-K factor is raised until
# N/16 tiles x WARPS reaches it.
_TARGET_WARPS = 2048


def mma_warps(n: int, k: int) -> int:
    """Warps per 16-feature tile: enough to occupy the GPU, at most 16, dividing K into 32-wide slices."""
    warps = 1
    while warps < 16 and (n // 16) * warps < _TARGET_WARPS and k % (64 * warps) == 0:
        warps *= 2
    return warps


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


def skinny_matmul_mma(x: mx.array, w: mx.array, warps: int | None = None) -> mx.array:
    """x (R, K) @ w (N, K).T for R in 1..8 on tensor cores; bf16, N % 16 == 0, K % 32 == 0. CUDA only."""
    rows, k = x.shape
    n = w.shape[0]
    warps = warps or mma_warps(n, k)
    return _mma_kernel()(
        inputs=[x.astype(w.dtype), w],
        template=[("T", w.dtype), ("R", rows), ("K", k), ("N", n), ("WARPS", warps)],
        grid=(n // 16 * 32 * warps, 1, 1),
        threadgroup=(32 * warps, 1, 1),
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


def project(flat: mx.array, weight: mx.array) -> mx.array | None:
    """flat (R, K) @ weight.T through the kernel this mode picks for R rows and this
    weight, or None where MLX's own matmul is the better choice."""
    rows, n = flat.shape[0], weight.shape[0]
    kind = mode()
    if kind == "off" or not 2 <= rows <= MAX_ROWS:
        return None
    if kind == "mma" and use_mma(n, weight.dtype):
        return skinny_matmul_mma(flat, weight)
    if use_kernel(rows, n):
        return skinny_matmul(flat, weight)
    return None


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
        if 2 <= rows <= MAX_ROWS and _fits(self.weight) and available():
            y = project(x.reshape(rows, x.shape[-1]), self.weight)
            if y is not None:
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
