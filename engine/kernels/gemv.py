"""One-row projections of a decode step on CUDA: a bf16 GEMV that streams the weights.

Why this is hand-written: at B = 1 a decode step is almost entirely `x @ W.T` with x of one row,
which MLX's CUDA backend sends to its own gemv kernel; measured on the lent H200 (issue 35) that
kernel reads a Qwen3-8B's weights at ~2.8-3.0 TB/s, 58-63 % of the HBM's 4.8 TB/s, which caps
B = 1 at ~184 tok/s where the memory allows ~317. No library at hand has a faster GEMV for MLX
arrays. This one (cuda/gemv.cu) keeps more bytes in flight per lane: 16-byte loads, RW weight rows
per warp sharing one load of x, U loads per row issued before any multiply, and split-K (SPLIT
warps per row group, summed in shared memory) so that a narrow projection (the K/V projections'
1,024 outputs) still fills every SM.

`gemv(x, w, parts=...)` also serves a stacked weight (q/k/v, gate/up: skinny_gemm's `_Stack`), one
launch for the stack, as the skinny GEMM does for 2-8 rows. Whether the decode path uses it is
PREFIXTRACE_GEMV ("1": on; default off until bench/bench_decode_roofline.py has shown it faster than
MLX's on the H200); the variable is read on each call, so that bench compares both in one process.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx

from engine.kernels.common import available, source

__all__ = ["gemv", "plan", "fits", "usable", "enabled", "SOURCE", "WARPS"]

SOURCE = source("gemv.cu")
WARPS = 8  # warps per block (the kernel's own constant)
# Warps that keep an H200's HBM streaming: ptxas leaves each lane only 3-5 16-byte loads in flight
# (cuda/gemv.cu), so the bytes in flight come from ~64 warps on each of its 132 SMs. Little's law:
# 4.8 TB/s x ~1 us of latency is ~36 KB in flight per SM; 62 warps x 32 lanes x 3 x 16 B is ~95 KB.
_TARGET_WARPS = 8192

def enabled() -> bool:
    """Whether one-row projections take this kernel: PREFIXTRACE_GEMV=1, read on each call, so a bench
    compares both paths in one process by setting the variable (no module-level switch)."""
    return os.environ.get("PREFIXTRACE_GEMV", "0") == "1"


def fits(n: int, k: int, dtype) -> bool:
    """Shapes the kernel takes: bf16/fp16, K a multiple of 256 (32 lanes x 8 per load), N of 2 rows' multiple."""
    return dtype in (mx.bfloat16, mx.float16) and k % 256 == 0 and n % 2 == 0


@lru_cache(maxsize=None)
def plan(n: int, k: int) -> tuple[int, int]:
    """(RW, SPLIT) for an N x K weight: 2 rows per warp (4 where N is so wide that occupancy is no
    concern), then split K until N / RW x SPLIT warps reach the target, each slice a whole number
    of 256-wide loads and SPLIT dividing the block's 8 warps."""
    rw = 4 if n >= 32768 and n % 4 == 0 else 2
    split = 1
    while split < WARPS and n // rw * split < _TARGET_WARPS and k % (256 * split * 2) == 0:
        split *= 2
    return rw, split


@lru_cache(maxsize=1)
def _kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_gemv", input_names=["x", "w"], output_names=["out"], source=SOURCE)


@lru_cache(maxsize=None)
def _launch(k: int, n: int, dtype, rw: int, split: int):
    # Computed once per shape: a decode step asks for the same few shapes hundreds of times and the
    # host's time per launch is what a one-row step waits on.
    rows_per_block = WARPS // split * rw
    blocks = -(-n // rows_per_block)
    return dict(template=[("T", dtype), ("K", k), ("N", n), ("RW", rw), ("SPLIT", split)],
                grid=(blocks * 32 * WARPS, 1, 1), threadgroup=(32 * WARPS, 1, 1),
                output_shapes=[(blocks * rows_per_block,)], output_dtypes=[dtype])


def gemv(x: mx.array, w: mx.array, parts: tuple[int, ...] | None = None,
         rw: int | None = None, split: int | None = None) -> mx.array | list[mx.array]:
    """x (1, K) @ w (N, K).T as one pass over w (CUDA only); with `parts` (widths summing to N) one
    (1, width) array per stacked projection. N must be a multiple of a block's rows (`usable`)."""
    k, n = x.shape[-1], w.shape[0]
    prw, psplit = plan(n, k)
    rw, split = rw or prw, split or psplit
    launch = _launch(k, n, w.dtype, rw, split)
    if launch["output_shapes"][0][0] != n:
        raise ValueError(f"gemv: N={n} is not a multiple of {WARPS // split * rw} rows per block")
    flat = _kernel()(inputs=[x.reshape(k).astype(w.dtype), w], **launch)[0]
    if not parts:
        return flat.reshape(1, n)
    out, start = [], 0
    for width in parts:
        out.append(flat[start:start + width].reshape(1, width))
        start += width
    return out


def usable(n: int, k: int, dtype) -> bool:
    """The kernel runs here for this weight: CUDA, the shape fits, N a multiple of a block's rows."""
    if not (available() and fits(n, k, dtype)):
        return False
    rw, split = plan(n, k)
    return n % (WARPS // split * rw) == 0
