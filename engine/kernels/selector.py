"""The one seam between the engine core and the kernels: a small table of what the core may ask of
them, chosen once per process by `select`.

The core (the caches in engine/tq_cache.py, the attention hook in engine/attention_hook.py, the engine's
load in engine/engine.py) calls the kernels only through a `DecodeKernels`, as vLLM's model code reaches
attention only through the backend `get_attn_backend` returns (vllm/attention/selector.py). Every method
answers None (or False, or nothing built) where the kernels do not take the call, and the core then runs
MLX's own ops, which is also all `DecodeKernels` itself does: the table on the CPU (where CI runs) and
with PREFIXTRACE_DECODE_ATTENTION=0. `CudaKernels` is the table on a CUDA build of MLX with the GPU as
default device. The one environment switch (docs/CONFIG.md):

  PREFIXTRACE_DECODE_ATTENTION  "on" (default): TurboQuant decode and encode, and dense batched decode
                                steps with left-padded rows (where MLX would take its masked path);
                                "all": every dense batched decode step too; "0": MLX's attention
                                everywhere (the skinny GEMM and its own switch are unaffected).

Tests and benchmarks pass a table explicitly (`CudaKernels(dense="all")`) where they need one other
than this process's.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx

from engine.kernels import common, dense, prebuild, skinny_gemm, tq_decode, tq_encode

__all__ = ["DecodeKernels", "CudaKernels", "select", "for_setting"]


class DecodeKernels:
    """No kernels: every call answers "not taken" and the core runs MLX's own ops.

    `cuda`: whether this process runs on a CUDA device (the hook is installed there for dense models too,
    and a hooked TurboQuant cache skips building decoded K/V nobody reads). `defer_encode`: whether a
    TurboQuant decode step may append its token dense and encode a group's worth later in one launch."""

    name = "mlx"
    defer_encode = False

    def __init__(self, cuda: bool = False):
        self.cuda = cuda

    def encode(self, keys: mx.array, values: mx.array, codec):
        """(k_norms, k_codes, v_norms, v_codes) of new keys/values in one launch, or None."""
        return None

    def tq_attend(self, queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, left_padding, scale, codec,
                  group: int, end: int | None = None) -> mx.array | None:
        """One decode token per row over a TurboQuant cache's codes and dense window
        (engine/kernels/tq_decode.py's `attend`), or None."""
        return None

    def dense_attend(self, cache, queries, keys, values, scale: float, mask) -> mx.array | None:
        """One decode token per row over a dense batched cache, each row from its own start offset, or None."""
        return None

    def prebuild_tq(self, model, tq, max_batch: int) -> dict[int, float]:
        """Compile the TurboQuant decode kernels a model can launch now: {chunk: seconds}."""
        return {}

    def prebuild_dense(self, model, max_batch: int) -> dict[int, float]:
        """Compile the dense decode kernels a model can launch now: {chunk: seconds}."""
        return {}

    def install_projections(self, model) -> int:
        """Swap the model's linear layers for the skinny-GEMM ones (batched decode reads each weight once);
        how many were swapped."""
        return 0


@lru_cache(maxsize=1)
def _batch_kv_cache() -> type:
    # Imported once, on the first decode step (the hook runs this per layer per step).
    from mlx_lm.models.cache import BatchKVCache

    return BatchKVCache


class CudaKernels(DecodeKernels):
    """The CUDA kernels of engine/kernels/. `dense`: "padded" (dense batched decode steps only when their
    rows are left-padded, i.e. `mask` is not None) or "all"."""

    name = "cuda"
    defer_encode = True

    def __init__(self, dense: str = "padded"):
        super().__init__(cuda=True)
        if dense not in ("padded", "all"):
            raise ValueError(f"dense must be 'padded' or 'all', not {dense!r}")
        self.dense = dense

    def encode(self, keys, values, codec):
        return tq_encode.encode(keys, values, codec) if tq_encode.usable(keys, values, codec) else None

    def tq_attend(self, queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, left_padding, scale, codec,
                  group, end=None):
        if not tq_decode.usable(queries, k_codes.shape[1], codec.bits, codec.dim):
            return None
        return tq_decode.attend(queries, k_norms, k_codes, v_norms, v_codes, win_k, win_v, left_padding, scale,
                                codec, group, end)

    def dense_attend(self, cache, queries, keys, values, scale, mask):
        """mlx-lm's `BatchKVCache` and subclasses (their `left_padding` says where each row starts). The kernel
        applies no mask, so this relies on a one-token `BatchKVCache` mask being the left-padding mask alone:
        mlx-lm gives sliding-window layers a `RotatingKVCache`, whose batched form is not a `BatchKVCache`,
        and rows past right padding are rolled back (`finalize`) before decoding (`_right_padding`)."""
        if mask is None and self.dense != "all":
            return None  # every unpadded step stops here, before any array is looked at
        if not (isinstance(cache, _batch_kv_cache()) and getattr(cache, "_right_padding", None) is None
                and keys.dtype in common.DTYPES and queries.dtype == keys.dtype
                and common.gqa(queries, keys.shape[1]) is not None):
            return None
        return dense.attend(queries, keys, values, cache.left_padding, scale)

    def prebuild_tq(self, model, tq, max_batch):
        return prebuild.prebuild_tq(model, tq, max_batch)

    def prebuild_dense(self, model, max_batch):
        return prebuild.prebuild_dense(model, max_batch)

    def install_projections(self, model):
        return skinny_gemm.install(model)


def for_setting(setting: str) -> DecodeKernels:
    """The table for a PREFIXTRACE_DECODE_ATTENTION value on this machine."""
    if not common.available():
        return DecodeKernels()
    if setting in ("0", "off"):
        return _NoDecodeKernels()
    return CudaKernels(dense="all" if setting == "all" else "padded")


class _NoDecodeKernels(DecodeKernels):
    """A CUDA device with the decode kernels switched off: MLX's attention, the skinny GEMM kept."""

    def __init__(self):
        super().__init__(cuda=True)

    def install_projections(self, model):
        return skinny_gemm.install(model)


@lru_cache(maxsize=1)
def select() -> DecodeKernels:
    """This process's kernels, chosen once (PREFIXTRACE_DECODE_ATTENTION, the device)."""
    return for_setting(os.environ.get("PREFIXTRACE_DECODE_ATTENTION", "on"))
