"""TurboQuant encode of new K and V vectors in one launch (cuda/tq_encode.cu), instead of the twenty-odd
MLX ops of engine/turboquant.py's `encode`: norm, unit vector, signs, Walsh-Hadamard / sqrt(D), codes =
how many thresholds a coordinate exceeds, packed BITS to a code from bit 0 of word 0. One warp per
vector, E = D / 32 consecutive coordinates per lane: the butterfly's first log2(E) stages are within a
lane, the rest between lanes. Warps [0, NV) take K, [NV, 2 NV) V.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine.kernels.common import DTYPES, HEADER, source

__all__ = ["encode", "usable", "SOURCE", "DIMS"]

SOURCE = source("tq_encode.cu")
DIMS = (32, 64, 128, 256)


@lru_cache(maxsize=1)
def _encode_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_tq_encode", input_names=["k", "v", "signs", "thr"],
                               output_names=["kn", "kc", "vn", "vc"], source=SOURCE, header=HEADER)


def usable(keys: mx.array, values: mx.array, codec) -> bool:
    """Whether new K/V go through `encode` (a Hadamard codec, bits dividing 8, the same head size for
    K and V)."""
    return (codec.hadamard and 8 % codec.bits == 0 and keys.shape == values.shape
            and keys.shape[-1] == codec.dim and codec.dim in DIMS and keys.dtype in DTYPES and keys.size > 0)


def encode(keys: mx.array, values: mx.array, codec):
    """(k_norms, k_codes, v_norms, v_codes) of keys/values (..., D), as `codec.encode` gives them, in one
    launch. CUDA only (`usable`)."""
    lead = keys.shape[:-1]
    nv = keys.size // keys.shape[-1]
    words = codec.words
    kn, kc, vn, vc = _encode_kernel()(
        inputs=[keys, values.astype(keys.dtype), codec.signs, codec.thresholds],
        # T: MLX names a kernel by its template arguments only and writes the inputs' dtypes into
        # its source, so without it a second dtype in one process ran the first one's build.
        template=[("T", keys.dtype), ("D", codec.dim), ("BITS", codec.bits)],
        grid=(2 * nv * 32, 1, 1), threadgroup=(32, 1, 1),
        output_shapes=[(nv,), (nv, words), (nv,), (nv, words)],
        output_dtypes=[mx.float32, mx.uint32, mx.float32, mx.uint32])
    return (kn.reshape(*lead, 1), kc.reshape(*lead, words), vn.reshape(*lead, 1), vc.reshape(*lead, words))
