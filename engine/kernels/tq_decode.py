"""TurboQuant decode attention on CUDA: which kernel takes a step, fastest first.

Over a TurboQuant cache with stock MLX ops, attention writes the T x d codebook values of every layer
to memory before SDPA reads them back (5.6-13x a dense step on the H200). These kernels read the packed
codes where they lie. A step falls through:

1. the fused kernel (engine/kernels/tq_fused.py): 4-bit codes, bf16 / f16, head size 64 / 128;
2. the tensor-core split kernel (engine/kernels/tq_mma.py): 4-bit codes, bf16 / f16, head size 256;
3. the CUDA-core split kernel (engine/kernels/tq_split.py): everything else it has a lane mapping for
   (float32 caches, 1 / 2 / 8-bit codes);
4. the generic split kernel (tq_split.py, `attend_generic`): the rest (head size x bits < 32, or
   1-bit codes at G > 4).
Each returns None where it cannot map the step; `attend` returns None only where the dense window does
not fit one block (the caller then attends with MLX's ops).
"""

from __future__ import annotations

import mlx.core as mx

from engine.kernels.common import DTYPES, gqa, kernel_starts, split_chunk, zeros
from engine.kernels.tq_fused import attend7
from engine.kernels.tq_mma import attend5
from engine.kernels.tq_split import attend as attend_split
from engine.kernels.tq_split import attend_generic

__all__ = ["attend", "usable"]


def usable(queries: mx.array, kv_heads: int, bits: int, dim: int) -> bool:
    """Whether a TurboQuant decode step goes through `attend`: bits dividing 8, one query token, a head
    size and GQA group a split block holds (`common.gqa`)."""
    return (8 % bits == 0 and dim == queries.shape[-1] and queries.dtype in DTYPES
            and gqa(queries, kv_heads) is not None)


def attend(queries: mx.array, k_norms: mx.array, k_codes: mx.array, v_norms: mx.array, v_codes: mx.array,
           win_k: mx.array, win_v: mx.array, left_padding: mx.array | None, scale: float, codec,
           group: int, end: int | None = None) -> mx.array | None:
    """Attention of one query token per row over TurboQuant codes for columns [0, T) (norms (B, H, T', 1),
    codes (B, H, T', W), T' >= T) and the dense window (B, H, Tw, D) of columns [T - Tw, T), unrotated;
    row b starts at left_padding[b] (None: 0). `end`: T where the norms and codes are whole buffers of a
    larger capacity (columns [0, end) are the cache's; None: their length). The output is in the
    original basis."""
    B, hq, _, dim = queries.shape
    H, tw = k_codes.shape[1], win_k.shape[2]
    T = k_codes.shape[2] if end is None else end
    assert T <= min(k_norms.shape[2], k_codes.shape[2], v_norms.shape[2], v_codes.shape[2])
    lp = zeros(B) if left_padding is None else kernel_starts(left_padding)
    args = (queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, lp, scale, codec, group)
    out = attend7(*args, T)
    if out is None:
        out = attend5(*args, T)
    if out is not None:
        return out
    chunk = split_chunk(T, H, B, hq // H, at_least=tw)
    if chunk is None:
        return None
    splits = -(-T // chunk) + 1  # + the dense block
    out = attend_split(*args, chunk, splits, T)
    return out if out is not None else attend_generic(*args, chunk, splits, T)
