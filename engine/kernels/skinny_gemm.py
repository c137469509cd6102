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

Two kernels, both reading weight bytes once whatever R is. The default one
(`_MMA_SOURCE`) runs on tensor cores: a block of warps computes 16 output
features x 8 rows with mma.sync (bf16), splitting K among its warps so that
even a 1,024-output projection occupies every SM. At 8 rows a Qwen3-8B decode
step's projections, issued as a dependent chain, cost 1.24x the one-row gemv
chain (cuBLAS 1.61x; bench/bench_skinny_gemm.py --only step). The other
(`_SOURCE`, CUDA cores; fp16 weights, and where `use_mma` declines) gives
each warp `RW` weight rows and multiplies every 16-byte load with each row of
x; above 4 rows its FMAs become the limit.

One row goes to engine/kernels/gemv.py's GEMV where PREFIXTRACE_GEMV=1 (stacks included).

`install(model)` swaps the model's `nn.Linear` layers for `SkinnyLinear`,
which takes this path only on a CUDA device for 2..8 rows of bf16/fp16 with
K a multiple of 256 and falls back to the layer's own matmul otherwise (so on
a CPU, where CI runs, nothing changes), and stacks q/k/v and gate/up into one
launch each (`_Stack`). PREFIXTRACE_SKINNY_GEMM=0 leaves the model untouched.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from engine.kernels import gemv
from engine.kernels.common import available, source

__all__ = ["SkinnyLinear", "install", "skinny_matmul", "skinny_matmul_mma", "available", "enabled",
           "project", "stack_projections", "use_kernel", "use_mma", "MAX_ROWS"]

log = logging.getLogger("prefixtrace.engine")

MAX_ROWS = 8
_K_MULTIPLE = 256  # 32 lanes x 8 bf16 per 16-byte load

_SOURCE = source("skinny_gemm.cu")

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
_MMA_SOURCE = source("skinny_gemm_mma.cu")

# Warps that keep every SM of an H200 (132) streaming: the split-K factor is raised until
# N/16 tiles x WARPS reaches it.
_TARGET_WARPS = 2048


@lru_cache(maxsize=None)
def mma_warps(n: int, k: int) -> int:
    """Warps per 16-feature tile: enough to occupy the GPU, at most 16, dividing K into 32-wide slices."""
    warps = 1
    while warps < 16 and (n // 16) * warps < _TARGET_WARPS and k % (64 * warps) == 0:
        warps *= 2
    return warps


def enabled() -> bool:
    """Whether `install` swaps the projections: PREFIXTRACE_SKINNY_GEMM ("0": leave the model as it is)."""
    return os.environ.get("PREFIXTRACE_SKINNY_GEMM", "1") != "0"


@lru_cache(maxsize=1)
def _kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_skinny_gemm", input_names=["x", "w"], output_names=["out"],
                               source=_SOURCE)


@lru_cache(maxsize=1)
def _mma_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_skinny_gemm_mma", input_names=["x", "w"], output_names=["out"],
                               source=_MMA_SOURCE)


@lru_cache(maxsize=None)
def _mma_launch(rows: int, k: int, n: int, dtype, warps: int, parts: tuple[int, ...] | None):
    """The launch arguments for one shape, and where each part starts: computed once, since
    a decode step asks for the same few shapes hundreds of times and the host's time per
    launch is what a batched step waits on (docs/PERFORMANCE.md)."""
    cuts = [sum(parts[:i]) for i in range(1, len(parts))] if parts else []
    p1, p2 = (cuts + [n, n])[:2]
    launch = dict(template=[("T", dtype), ("R", rows), ("K", k), ("N", n), ("WARPS", warps), ("P1", p1), ("P2", p2)],
                  grid=(n // 16 * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
                  output_shapes=[(rows * n,)], output_dtypes=[dtype])
    bounds = [(rows * a, rows * (a + width), width) for a, width in zip([0] + cuts, parts or ())]
    return launch, bounds


def skinny_matmul_mma(x: mx.array, w: mx.array, warps: int | None = None,
                      parts: tuple[int, ...] | None = None) -> mx.array | list[mx.array]:
    """x (R, K) @ w (N, K).T for R in 1..8 on tensor cores; bf16, N % 16 == 0, K % 32 == 0. CUDA only.
    With `parts` (up to three widths summing to N, multiples of 16), w is several projections
    stacked and the result is one contiguous (R, width) array per part."""
    rows, k = x.shape
    n = w.shape[0]
    launch, bounds = _mma_launch(rows, k, n, w.dtype, warps or mma_warps(n, k), parts)
    flat = _mma_kernel()(inputs=[x if x.dtype == w.dtype else x.astype(w.dtype), w], **launch)[0]
    if not parts:
        return flat.reshape(rows, n)
    return [flat[start:end].reshape(rows, width) for start, end, width in bounds]


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
    bf16 projections of up to 65,535 outputs. For the LM head (152k outputs) cuBLAS reads
    the weights as fast and is flat in the row count."""
    return dtype == mx.bfloat16 and n % 16 == 0 and n < 65536


def use_kernel(rows: int, n: int) -> bool:
    """Where the kernel beat MLX's matmul on the H200 (bench/bench_skinny_gemm.py,
    docs/PERFORMANCE.md): 2-4 rows, except the LM head (N = 152k, where cuBLAS is
    flat in the row count), and up to 8 rows for narrow outputs (N <= 2048, the
    K/V projections). At 5-8 rows a wide projection becomes compute-bound on CUDA
    cores (8 FMAs per weight per row) and cuBLAS's tensor-core kernels win."""
    return (2 <= rows <= 4 and n < 65536) or (2 <= rows <= MAX_ROWS and n <= 2048)


def project(flat: mx.array, weight: mx.array) -> mx.array | None:
    """flat (R, K) @ weight.T through the kernel that measured fastest for R rows and this
    weight, or None where MLX's own matmul is the better choice."""
    rows, n = flat.shape[0], weight.shape[0]
    if not 2 <= rows <= MAX_ROWS:
        return None
    if use_mma(n, weight.dtype):
        return skinny_matmul_mma(flat, weight)
    if use_kernel(rows, n):
        return skinny_matmul(flat, weight)
    return None


def _fits(weight: mx.array) -> bool:
    return weight.ndim == 2 and weight.dtype in (mx.bfloat16, mx.float16) and weight.shape[1] % _K_MULTIPLE == 0


class _Stack:
    """Projections a model applies to the same input one after another (q, k, v; gate,
    up), multiplied as one stacked weight on the skinny path: one kernel launch instead
    of three, and a wider product that fills the GPU better. In a host-bound decode step
    every launch saved is time (a custom-kernel call costs the host more than MLX's
    matmul). The members keep zero-copy views of the stacked weight for every other
    path (one row, prefill, CPU). The first member computes all parts and keeps them
    for the others, which take theirs when called with the very same input array; a
    model calling them otherwise gets each product computed separately, as before."""

    def __init__(self, members: list["SkinnyLinear"]):
        self.weight = mx.concatenate([m.weight for m in members])
        self.widths = tuple(m.weight.shape[0] for m in members)
        offsets = [sum(self.widths[:i]) for i in range(len(members) + 1)]
        for i, m in enumerate(members):
            m.weight = self.weight[offsets[i]:offsets[i + 1]]
            m.stack, m.stack_index = self, i
        mx.eval(self.weight, [m.weight for m in members])
        self.source: mx.array | None = None
        self.parts: list[mx.array] = []

    def take(self, member: "SkinnyLinear", x: mx.array, flat: mx.array) -> mx.array | None:
        def stack():
            return skinny_matmul_mma(flat, self.weight, parts=self.widths) if use_mma(
                self.weight.shape[0], self.weight.dtype) else None
        return self._take(member, x, stack, lambda: project(flat, member.weight))

    def take_one(self, member: "SkinnyLinear", x: mx.array) -> mx.array:
        """The one-row form of `take`, through the GEMV (gemv.py): one launch for the stack."""
        def stack():
            return gemv.gemv(x, self.weight, parts=self.widths) if gemv.usable(
                self.weight.shape[0], self.weight.shape[1], self.weight.dtype) else None
        return self._take(member, x, stack, lambda: gemv.gemv(x, member.weight))

    def _take(self, member: "SkinnyLinear", x: mx.array, stack, alone) -> mx.array:
        """The stack's first member launches once for all (`stack()`: the parts, or None where the kernel
        does not serve this shape); the others take their part while `x` is the same input; otherwise
        `alone()`, the member's own product."""
        if member.stack_index == 0:
            self.source = None
            parts = stack()
            if parts is not None:
                self.parts, self.source = parts, x
                return parts[0]
        elif self.source is x:
            part = self.parts[member.stack_index]
            if member.stack_index == len(self.widths) - 1:
                self.source, self.parts = None, []
            return part
        return alone()


class SkinnyLinear(nn.Linear):
    """`nn.Linear` whose 2..8-row products go through the skinny kernels on CUDA."""

    stack: _Stack | None = None
    stack_index = 0

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
        if rows == 1 and gemv.enabled() and gemv.usable(*self.weight.shape, self.weight.dtype):
            y = self.stack.take_one(self, x) if self.stack else gemv.gemv(x, self.weight)
            y = y.reshape(*x.shape[:-1], -1)
            return y + self.bias if "bias" in self else y
        if 2 <= rows <= MAX_ROWS and available() and _fits(self.weight):
            flat = x.reshape(rows, x.shape[-1])
            y = self.stack.take(self, x, flat) if self.stack else project(flat, self.weight)
            if y is not None:
                y = y.reshape(*x.shape[:-1], -1)
                return y + self.bias if "bias" in self else y
        return super().__call__(x)


STACKS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def stack_projections(model: nn.Module) -> int:
    """Stack each module's q/k/v and gate/up `SkinnyLinear`s (same input width and dtype,
    no bias, widths multiples of 16); how many stacks were made."""
    made = 0
    for _, module in model.named_modules():
        for names in STACKS:
            members = [getattr(module, name, None) for name in names]
            if not all(isinstance(m, SkinnyLinear) and m.stack is None and "bias" not in m for m in members):
                continue
            w0 = members[0].weight
            if all(m.weight.shape[1] == w0.shape[1] and m.weight.dtype == w0.dtype and m.weight.shape[0] % 16 == 0
                   for m in members):
                _Stack(members)
                made += 1
    if made:
        mx.clear_cache()  # the unstacked weights' buffers would otherwise stay in MLX's pool
    return made


def install(model: nn.Module, stack: bool = True) -> int:
    """Swap every eligible `nn.Linear` of `model` for a `SkinnyLinear`; how many were
    swapped (0 where the kernel cannot run, leaving the model as it was). `stack`: also
    stack q/k/v and gate/up (`stack_projections`; off only to compare, each layer keeping
    its own weight array)."""
    if not available() or not enabled():
        return 0
    swaps = [(name, SkinnyLinear.from_linear(m)) for name, m in model.named_modules()
             if type(m) is nn.Linear and _fits(m.weight)]
    if swaps:
        model.update_modules(tree_unflatten(swaps))
        stacks = stack_projections(model) if stack else 0
        log.info("decode projections of 2-%d rows use the skinny GEMM kernels (%s; %d layers, %d stacked groups)",
                 MAX_ROWS, "tensor cores for bf16", len(swaps), stacks)
    return len(swaps)
