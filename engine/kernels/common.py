"""What every decode kernel shares: where the sources live, the device check, the split of the
context into blocks, the kernel constants on pages of their own, and the generic reduce.

The decode kernels are flash-decoding style (split-K): block (s, h, b) takes context columns
[s*CHUNK, (s+1)*CHUNK) of KV head h of row b, intersected with the row's own columns
[left_padding[b], end), and scores every query head of its GQA group against them (the K/V bytes
are read once for the G = q_heads / kv_heads queries). Each block writes its unnormalised output
with its max and sum of exponentials (`o_part`, `ml_part`); a reduce combines the splits of each
(row, query head) with max/sum rescaling (`reduce` here; engine/kernels/tq_split.py's parallel one
for the TurboQuant kernels).

Sources: each kernel's body is a file under engine/kernels/cuda/ (`source`; a block several kernels share,
e.g. block_softmax.cuh, is a file of its own that a line `#include "piece.cuh"` splices in, so the string MLX
compiles is the one with the block written out: tests/test_kernel_sources_identity.py holds every kernel
string to its recorded hash, bench/kernel_strings.py), compiled by MLX
(`mx.fast.cuda_kernel`, NVRTC) the first time it runs with new template arguments. MLX writes the
signature: `const T* name` per input, `name_shape` / `name_strides` where the body names them,
`T* name` per output, the template arguments as constexprs (tests/test_decode_kernel_sources.py
renders them the same way to compile them with nvcc).
"""

from __future__ import annotations

import ctypes
import re
from collections import Counter
from functools import lru_cache
from importlib import resources

import mlx.core as mx
import numpy as np

__all__ = ["source", "available", "split_chunk", "own_page", "scalar", "zeros", "kernel_starts", "no_signs", "gqa",
           "reduce", "sm_count", "blocks_per_sm", "launches", "HEADER", "NW", "DIMS", "DTYPES", "MIN_CHUNK",
           "MAX_CHUNK", "SMEM_SCORES", "TARGET_BLOCKS", "OWN_PAGE"]


# A line `#include "piece.cuh"` in a kernel file: the piece is spliced in where it stands.
_INCLUDE = re.compile(r'^([ \t]*)#include "([\w.-]+)"[ \t]*$', re.M)


def source(name: str, _within: tuple[str, ...] = ()) -> str:
    """The text of engine/kernels/cuda/<name> (package data), with each line `#include "piece.cuh"` replaced by
    that file of the same folder (recursively): a block that several kernels share is written once, and the
    string MLX compiles is what it would be with the block written out. The piece's lines take the include
    line's indentation (blank lines stay empty); its leading `//!` lines say what it is and are left out; its
    last newline is the include line's own. A piece that includes itself, directly or not, is an error."""
    if name in _within:
        raise ValueError(f"kernel source includes itself: {' -> '.join(_within + (name,))}")
    text = resources.files("engine.kernels").joinpath("cuda", name).read_text()

    def splice(m: re.Match) -> str:
        indent, piece = m.groups()
        lines = source(piece, _within + (name,)).removesuffix("\n").split("\n")
        while lines and lines[0].startswith("//!"):
            lines.pop(0)
        return "\n".join(indent + line if line else line for line in lines)

    return _INCLUDE.sub(splice, text)


HEADER = source("common.cuh")  # load8, warp_max, warp_sum, NEG_INF: every decode kernel's header starts with it

NW = 4  # warps per split block
TARGET_BLOCKS = 1024  # ~8 blocks per SM on an H200's 132: enough to keep its memory system busy
MIN_CHUNK, MAX_CHUNK = 64, 1024
SMEM_SCORES = 4096  # G x CHUNK floats of scores per block (16 KB)
DIMS = (16, 32, 64, 128, 256)  # D / 8 lanes per token must divide a warp
DTYPES = (mx.bfloat16, mx.float16, mx.float32)

# Steps each kernel took in this process, by kernel ("tq_fused", "tq_mma", "tq_split", "tq_generic",
# "dense_mma", "dense_split"): bench/check_decode_kernels.py checks that the route it expects ran.
launches: Counter = Counter()


@lru_cache(maxsize=1)
def available() -> bool:
    """A CUDA build of MLX with the GPU as default device (decided once per process)."""
    try:
        return mx.default_device() == mx.gpu and mx.cuda.is_available()
    except AttributeError:  # an MLX without the CUDA module
        return False


def split_chunk(tokens: int, kv_heads: int, rows: int, g: int, at_least: int = 0,
                target: int = TARGET_BLOCKS) -> int | None:
    """Context columns per split block: the smallest power of two from 64 that keeps the grid near
    `target` blocks, up to 1024 and to the G x CHUNK scores of a block fitting 16 KB of shared
    memory, and at least `at_least` (a TurboQuant row's dense columns are one block's). None when
    `at_least` does not fit."""
    top = min(MAX_CHUNK, SMEM_SCORES // g)
    chunk = MIN_CHUNK
    while chunk < at_least or (chunk < top and -(-tokens // chunk) * kv_heads * rows > target):
        chunk *= 2
    return chunk if chunk <= top else None


def gqa(queries: mx.array, kv_heads: int) -> int | None:
    """G (query heads per KV head) where a split kernel takes the step: one query token, D in `DIMS`,
    G <= 8 and G x D <= 1024 (G x D floats of queries and NW x G x D of partial outputs per block)."""
    _, hq, n, d = queries.shape
    if n != 1 or d not in DIMS or hq % kv_heads or hq // kv_heads > 8 or hq // kv_heads * d > 1024:
        return None
    return hq // kv_heads


# Why the kernels' constants (the scale, the start offsets) are padded to a page of their own: MLX's CUDA
# allocator serves every allocation of <= 8 bytes from one 64 KB managed pool advised read-mostly
# (mlx/backend/cuda/allocator.cpp, SmallSizePool), shared with every scalar the host makes (an op with a
# Python number, a token id), and on the H200 a kernel reading a constant there waited ~33-43 us a launch
# (bench/bench_small_pool.py, with or without a host write in between): the TurboQuant MMA split
# kernel took 71.4 us at one row of 32k with its constants there, 34.9 on their own pages
# (docs/PERFORMANCE.md). An array of OWN_PAGE bytes is its own managed allocation (MLX rounds sizes
# >= 16 KB to its 16 KB page): it moves to the GPU on its first read and stays there, since the host
# never writes it again.
OWN_PAGE = 16384


def own_page(values, dtype) -> mx.array:
    """`values` (1-D) as the first elements of a zero-padded array of `OWN_PAGE` bytes: a kernel input
    no other array shares a page with (see above). Kernels read only its first elements."""
    v = np.asarray(values, dtype).reshape(-1)
    a = np.zeros(OWN_PAGE // np.dtype(dtype).itemsize, dtype)
    assert v.size <= a.size
    a[:v.size] = v
    return mx.array(a)  # from numpy: no lazy array tied to one thread's stream


@lru_cache(maxsize=None)
def scalar(value: float) -> mx.array:
    return own_page([value], np.float32)


@lru_cache(maxsize=None)
def zeros(rows: int) -> mx.array:
    return own_page(np.zeros(rows), np.int32)


_STARTS: dict[int, tuple[mx.array, mx.array]] = {}


def kernel_starts(left_padding: mx.array) -> mx.array:
    """A cache's row start offsets (int32) as a kernel input on a page of its own (see `OWN_PAGE`): a copy
    made on the device once per left-padding array (the caches make a new one whenever their rows change),
    then reused. Keyed by identity, holding the source so its id is not reused while the entry lives."""
    hit = _STARTS.get(id(left_padding))
    if hit is not None and hit[0] is left_padding:
        return hit[1]
    lp = left_padding if left_padding.dtype == mx.int32 else left_padding.astype(mx.int32)
    pad = OWN_PAGE // 4 - lp.size
    copy = mx.concatenate([lp.reshape(-1), zeros(0)[:pad]]) if pad > 0 else lp
    if len(_STARTS) >= 64:  # a few caches live at a time; old entries go first
        _STARTS.pop(next(iter(_STARTS)))
    _STARTS[id(left_padding)] = (left_padding, copy)
    return copy


@lru_cache(maxsize=None)
def no_signs(dim: int) -> mx.array:
    return mx.array(np.ones(dim, np.float32))


@lru_cache(maxsize=1)
def _reduce_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_decode_reduce", input_names=["o_part", "ml_part", "signs"],
                               output_names=["out"], source=source("reduce.cu"), header=HEADER)


def reduce(o_part: mx.array, ml_part: mx.array, signs: mx.array, rows: int, q_heads: int, dim: int, dtype,
           rotated: bool) -> mx.array:
    """One block of D threads per (row, query head) combines the S partials (cuda/reduce.cu). `rotated`:
    slots [0, S-1) are in a TurboQuant codec's rotated basis (turned back with `signs`), slot S-1 dense."""
    return _reduce_kernel()(inputs=[o_part, ml_part, signs],
                            template=[("T", dtype), ("D", dim), ("ROT", rotated)],
                            grid=(rows * q_heads * dim, 1, 1), threadgroup=(dim, 1, 1),
                            output_shapes=[(rows, q_heads, 1, dim)], output_dtypes=[dtype])[0]


# Occupancy of a Hopper SM, for the kernels that size their split from the blocks resident at once.
_SM_SMEM = 228 * 1024  # shared memory per SM (a block also reserves 1 KB)
_SM_REGS, _SM_THREADS, _SM_BLOCKS = 65536, 2048, 32


@lru_cache(maxsize=1)
def sm_count() -> int:
    """Multiprocessors of device 0 (the CUDA driver's attribute 16), else an H200's 132."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        dev, n = ctypes.c_int(), ctypes.c_int()
        if cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0 \
                and cu.cuDeviceGetAttribute(ctypes.byref(n), 16, dev) == 0 and n.value > 0:
            return n.value
    except (OSError, AttributeError):
        pass
    return 132


def blocks_per_sm(shared: int, regs: int = 96, threads: int = NW * 32) -> int:
    """Resident blocks per SM by registers (allocated per warp in 256s), shared memory and threads."""
    warp_regs = -(-regs * 32 // 256) * 256
    by_regs = (_SM_REGS // warp_regs) // (threads // 32)
    by_smem = _SM_SMEM // (shared + 1024)
    return max(1, min(by_regs, by_smem, _SM_THREADS // threads, _SM_BLOCKS))
