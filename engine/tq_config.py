"""An engine's TurboQuant settings (`TQConfig`) and the per-layer caches built from them: `make_tq_cache`,
`to_turboquant`, and the restored-prefix prefill's dense copy (`dense_copy`, `append_suffix`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engine.attention_hook import install_attention_hook
from engine.tq_buffers import DEFAULT_GROUP, encode_into, floor_group
from engine.tq_cache import TurboQuantKVCache
from engine.turboquant import TurboQuantCodec, get_codec

__all__ = ["TQConfig", "make_tq_cache", "to_turboquant", "dense_copy", "dense_copy_bytes", "append_suffix"]


def _dense_set(num_layers: int, dense_layers) -> set[int]:
    return {i % num_layers for i in dense_layers}


def make_tq_cache(model, bits: int = 4, seed: int = 0, dense_layers=(-1,), group: int = DEFAULT_GROUP) -> list:
    """One cache per layer: `TurboQuantKVCache`, or a dense `KVCache` for `dense_layers`."""
    install_attention_hook(model)
    dense = _dense_set(len(model.layers), dense_layers)
    caches = [KVCache() if i in dense else TurboQuantKVCache(bits, seed, group) for i in range(len(model.layers))]
    for c in caches:
        c.hooked = not isinstance(c, KVCache)
    return caches


def to_turboquant(cache_list: list, bits: int = 4, seed: int = 0, dense_layers=(-1,), group: int = DEFAULT_GROUP):
    """Per-layer caches with every dense `KVCache` outside `dense_layers` turned
    into a `TurboQuantKVCache` (its tokens quantised). TurboQuant caches and
    other cache types pass through unchanged."""
    dense = _dense_set(len(cache_list), dense_layers)
    out = []
    for i, c in enumerate(cache_list):
        if i not in dense and type(c) is KVCache:
            c = TurboQuantKVCache.from_dense(c, kv_bits=bits, seed=seed, group=group)
        out.append(c)
    return out


@dataclass(frozen=True, slots=True)
class TQConfig:
    """An engine's TurboQuant settings: what its caches are made of and what the
    prefix cache keys and stores (docs/CACHE.md, "TurboQuant blocks")."""

    bits: int = 4
    seed: int = 0
    group: int = DEFAULT_GROUP
    dense_layers: tuple[int, ...] = (-1,)

    @property
    def block_format(self) -> str:
        # Which layers are dense is part of the format: blocks of another layout must miss.
        # The default layout keeps the name blocks were first written under.
        dense = "" if self.dense_layers == (-1,) else "/dense" + ",".join(map(str, self.dense_layers))
        return f"turboquant/{self.bits}/{self.seed}/{self.group}{dense}"

    def codec(self, dim: int) -> TurboQuantCodec:
        """The codec these settings encode vectors of `dim` with (handed to the kernels' prebuild,
        which imports nothing of the engine core)."""
        return get_codec(dim, self.bits, self.seed)

    def dense_set(self, num_layers: int) -> set[int]:
        return _dense_set(num_layers, self.dense_layers)

    def make_cache(self, model) -> list:
        return make_tq_cache(model, self.bits, self.seed, self.dense_layers, self.group)

    def adapt(self, cache_list: list) -> list:
        """`to_turboquant` with these settings: dense layers of a hit are quantised,
        TurboQuant layers (a TurboQuant hit) pass through untouched. The engine's model
        has the attention hook (it made its caches with `make_cache`), so they are marked
        `hooked`."""
        out = to_turboquant(cache_list, self.bits, self.seed, self.dense_layers, self.group)
        for c in out:
            if type(c) is TurboQuantKVCache:
                c.hooked = True
        return out

    def matches(self, layer) -> bool:
        return (type(layer) is TurboQuantKVCache and layer.kv_bits == self.bits and layer.seed == self.seed
                and layer.group == self.group)


# --- restored-prefix prefill: a dense copy for the suffix, then quantise only the suffix ---


def dense_copy(cache_list: list, suffix: int) -> list:
    """Dense `KVCache`s for a prefill of `suffix` more tokens after `cache_list`.

    A TurboQuant layer of P tokens becomes a `KVCache` holding what a single
    `update_and_fetch` of the whole suffix would see of it: positions below
    min(P, floor(P + suffix)) decoded, the rest of its dense tail as is. Dense
    layers are passed through (the same object). The TurboQuant caches are left
    untouched; `append_suffix` adds the suffix to them afterwards."""
    out = []
    for c in cache_list:
        if type(c) is not TurboQuantKVCache or not c.offset:
            out.append(c)
            continue
        prev = c.offset
        b = min(prev, floor_group(prev + suffix, c.group))
        cut = b - floor_group(prev, c.group)
        # Room for the whole suffix up front: a KVCache that is exactly full copies all it
        # holds into a bigger buffer on every chunk (mlx-lm grows it `step` tokens at a time).
        room = -(-(prev + suffix) // KVCache.step) * KVCache.step
        dense = KVCache()
        bufs = []
        for codes, tail in ((c.k, c.tail_k), (c.v, c.tail_v)):
            decoded = c.codec(tail.shape[-1]).decode(codes.norms[:, :, :b], codes.codes[:, :, :b], tail.dtype)
            buf = mx.zeros((*tail.shape[:2], room, tail.shape[3]), tail.dtype)
            buf[:, :, :prev] = mx.concatenate([decoded, tail[:, :, cut:]], axis=2)
            bufs.append(buf)
        dense.keys, dense.values, dense.offset = bufs[0], bufs[1], prev
        out.append(dense)
    mx.eval([c.state for c in out if c.offset])
    return out


def dense_copy_bytes(cache_list: list, total: int) -> int:
    """Bytes the dense copies of `cache_list`'s TurboQuant layers take at `total` tokens."""
    n = 0
    for c in cache_list:
        if type(c) is TurboQuantKVCache and c.offset:
            n += (c.tail_k.shape[1] * c.tail_k.shape[3] + c.tail_v.shape[1] * c.tail_v.shape[3]) \
                * c.tail_k.dtype.size * total
    return n


def append_suffix(quantised: list, dense: list) -> list:
    """`quantised` with the positions `dense` holds past each TurboQuant layer's offset
    encoded and appended; the prefix's norms and codes are not touched (bit for bit).
    The dense tail becomes `dense`'s values from the last multiple of `group` on.
    Dense layers are taken from `dense` (they are the same objects).

    With empty `quantised` caches (a cold prefill run dense) the result is exactly
    `TurboQuantKVCache.from_dense` of each layer. The suffix is encoded as new tokens
    are (`encode_into`: one fused launch on CUDA). `dense` is consumed: each entry is
    replaced by its quantised layer as soon as that is evaluated, so its dense K/V can
    be freed and the peak stays near the dense KV alone, not dense plus all codes."""
    out = []
    for i, (q, d) in enumerate(zip(quantised, dense)):
        if type(q) is not TurboQuantKVCache or q is d:
            out.append(d)
            continue
        prev, n = q.offset, d.offset
        keys, values = d.keys[:, :, :n], d.values[:, :, :n]
        if n > prev:
            encode_into(q.k, q.v, prev, keys[:, :, prev:], values[:, :, prev:],
                         q.codec(keys.shape[-1]), q.codec(values.shape[-1]))
        keep = floor_group(n, q.group)
        q.tail_k, q.tail_v = mx.contiguous(keys[:, :, keep:]), mx.contiguous(values[:, :, keep:])
        q.offset = n
        if n:
            mx.eval(q.state)
        dense[i] = q
        out.append(q)
    return out
