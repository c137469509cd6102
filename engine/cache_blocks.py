"""One cached block of KV: cut from a live cache, joined back into one, and as bytes.

A block holds positions [start, start + n) of every layer's keys and values
(n = block_size for a full block, fewer for a sequence's tail). Because
attention is causal and positions are absolute (RoPE is applied before the
keys are cached), the KV at those positions depends only on the tokens up to
them; that is what lets a block keyed by its token prefix serve any prompt
with the same prefix, and a prefix of a block serve a prompt that shares only
part of it (docs/CACHE.md, "Exactness").

Bytes: the payload is the arrays back to back, described in the block file's
header (engine/disk_cache.py) by name, dtype, shape and byte offset. Format
"dense" names them "<layer>.k" / "<layer>.v"; a codec's format (TurboQuant)
can name its own arrays (norms, codes) under the same header scheme.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

DENSE = "dense"

# numpy has no bfloat16: those arrays travel as their uint16 bit patterns.
_AS_BITS = {mx.bfloat16: mx.uint16}


@dataclass(eq=False, slots=True)
class Block:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    layers: list[tuple[mx.array, mx.array]]  # per layer (keys, values), shape (1, heads, n, head_dim)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


def is_dense(cache: list) -> bool:
    """Only plain single-row `KVCache` layers are paged (rotating/SSM states are not prefix-sliceable)."""
    return bool(cache) and all(type(layer) is KVCache for layer in cache)


def cut(cache: list[KVCache], start: int, stop: int) -> list[tuple[mx.array, mx.array]]:
    """Private copies of positions [start, stop) of every layer, evaluated.

    A copy, not a slice view: a view would keep the whole live buffer alive
    and make the byte budget a lie (`mx.contiguous` of a slice allocates its
    own buffer, checked with mx.get_active_memory for 1 and 2 KV heads).
    """
    layers = [
        (mx.contiguous(layer.keys[..., start:stop, :]), mx.contiguous(layer.values[..., start:stop, :]))
        for layer in cache
    ]
    mx.eval(layers)
    return layers


def join(parts: list[tuple[list[tuple[mx.array, mx.array]], int]]) -> list[KVCache]:
    """Fresh per-layer caches holding the first `n` positions of each part, in order."""
    num_layers = len(parts[0][0])
    cache = []
    for i in range(num_layers):
        keys = [layers[i][0][..., :n, :] for layers, n in parts]
        values = [layers[i][1][..., :n, :] for layers, n in parts]
        layer = KVCache()
        layer.keys = keys[0] if len(keys) == 1 else mx.concatenate(keys, axis=2)
        layer.values = values[0] if len(values) == 1 else mx.concatenate(values, axis=2)
        layer.offset = layer.keys.shape[2]
        cache.append(layer)
    mx.eval([(c.keys, c.values) for c in cache])
    return cache


def to_numpy(layers: list[tuple[mx.array, mx.array]]) -> dict[str, tuple[np.ndarray, str]]:
    """Host copies for the disk writer (engine thread: it owns MLX), named for format "dense"."""
    out = {}
    for i, (k, v) in enumerate(layers):
        for suffix, a in (("k", k), ("v", v)):
            dtype = str(a.dtype).removeprefix("mlx.core.")
            out[f"{i}.{suffix}"] = (np.array(a.view(_AS_BITS[a.dtype]) if a.dtype in _AS_BITS else a), dtype)
    return out


def from_numpy(arrays: dict[str, tuple[np.ndarray, str]]) -> list[tuple[mx.array, mx.array]]:
    """The inverse of `to_numpy` (engine thread)."""
    layers = []
    for i in range(len(arrays) // 2):
        pair = []
        for suffix in ("k", "v"):
            a, dtype = arrays[f"{i}.{suffix}"]
            target = getattr(mx, dtype)
            x = mx.array(a)
            pair.append(x.view(target) if target in _AS_BITS else x)
        layers.append(tuple(pair))
    mx.eval(layers)
    return layers
