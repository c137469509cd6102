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
"dense" names them "<layer>.k" / "<layer>.v". Format "turboquant/<bits>/<seed>/<group>"
names a quantised layer's arrays "<layer>.kn"/".kc"/".vn"/".vc" (norms and
packed codes of the block's positions, bit for bit what the live cache held)
and, where the cut cache still held the block's last positions dense (its
dense tail, fewer than `group` tokens), "<layer>.kd"/".vd"; layers the
engine keeps dense (`dense_layers`) are "<layer>.k"/".v" in the same block.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

DENSE = "dense"
TURBOQUANT = "turboquant"

# numpy has no bfloat16: those arrays travel as their uint16 bit patterns.
_AS_BITS = {mx.bfloat16: mx.uint16}


@dataclass(eq=False, slots=True)
class TQLayer:
    """One TurboQuant layer of a block of n positions: norms (1, H, n, 1) and packed
    codes (1, H, n, words) of K and V, and the dense K/V of its last m positions
    [n - m, n) where the cut cache still held them dense (None when m = 0)."""

    k_norms: mx.array
    k_codes: mx.array
    v_norms: mx.array
    v_codes: mx.array
    dense_k: mx.array | None = None
    dense_v: mx.array | None = None

    @property
    def arrays(self) -> list[mx.array]:
        return [a for a in (self.k_norms, self.k_codes, self.v_norms, self.v_codes, self.dense_k, self.dense_v)
                if a is not None]

    @property
    def num_positions(self) -> int:
        return self.k_norms.shape[2]

    @property
    def dense_from(self) -> int:
        """The first position (in the block) whose dense K/V the block holds."""
        return self.num_positions - (0 if self.dense_k is None else self.dense_k.shape[2])


Layer = tuple  # (keys, values) of a dense layer, shape (1, heads, n, head_dim); or a TQLayer


def _layer_arrays(layer) -> list[mx.array]:
    return layer.arrays if isinstance(layer, TQLayer) else list(layer)


@dataclass(eq=False, slots=True)
class Block:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    layers: list  # per layer: (keys, values) for a dense layer, a TQLayer for a TurboQuant one
    # Its size, fixed when it is made (a block's arrays are never replaced): what the memory tier adds
    # and takes off its total.
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(a.nbytes for layer in self.layers for a in _layer_arrays(layer))

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def is_dense(cache: list) -> bool:
    """Only plain single-row `KVCache` layers are paged (rotating/SSM states are not prefix-sliceable)."""
    return bool(cache) and all(type(layer) is KVCache for layer in cache)


def _copy(a: mx.array) -> mx.array:
    return mx.contiguous(a)


def cut(cache: list, start: int, stop: int, *, evaluate: bool = True) -> list:
    """Private copies of positions [start, stop) of every layer, evaluated unless
    `evaluate` is False (the caller then evaluates `block_arrays` of them with its own
    work: a prefill chunk commits its blocks inside the chunk's one `mx.eval`).

    A copy, not a slice view: a view would keep the whole live buffer alive
    and make the byte budget a lie (`mx.contiguous` of a slice allocates its
    own buffer, checked with mx.get_active_memory for 1 and 2 KV heads).
    A `TurboQuantKVCache` layer gives its norms and codes of those positions
    and the dense K/V of those of them in its dense tail.
    """
    layers = [_cut_layer(layer, start, stop) for layer in cache]
    if evaluate:
        mx.eval(block_arrays(layers))
    return layers


def block_arrays(layers: list) -> list[mx.array]:
    """Every array of a block's layers (what to evaluate)."""
    return [a for layer in layers for a in _layer_arrays(layer)]


def _cut_layer(layer, start: int, stop: int):
    if type(layer) is KVCache:
        return _copy(layer.keys[..., start:stop, :]), _copy(layer.values[..., start:stop, :])
    tail_start = layer.offset - layer.tail_k.shape[2]  # the dense tail covers [tail_start, offset)
    first = max(start, tail_start)
    dense_k = dense_v = None
    if first < stop:
        dense_k = _copy(layer.tail_k[:, :, first - tail_start : stop - tail_start])
        dense_v = _copy(layer.tail_v[:, :, first - tail_start : stop - tail_start])
    return TQLayer(_copy(layer.k.norms[:, :, start:stop]), _copy(layer.k.codes[:, :, start:stop]),
                   _copy(layer.v.norms[:, :, start:stop]), _copy(layer.v.codes[:, :, start:stop]), dense_k, dense_v)


def join(parts: list[tuple[list, int]], *, tq=None, dims=None, room: int = 0) -> list:
    """Fresh per-layer caches holding the first `n` positions of each part, in order.

    `room`: dense layers get that many free positions after the joined ones, in the
    same single copy, so the prefill of the prompt's rest and the first decode steps
    write in place instead of mlx-lm's `KVCache` re-allocating (another copy of the
    whole prefix) on its first update.

    Dense layers become `KVCache`s. TurboQuant layers become `TurboQuantKVCache`s
    (`tq`: the engine's `TQConfig`; `dims`: per layer (k_dim, v_dim, dtype)) whose
    norms and codes are the blocks' own, and whose dense tail (positions from the
    last multiple of `group` on) takes each position's dense K/V where a block
    holds it, else its decoded value, as `TurboQuantKVCache.trim` does.
    """
    num_layers = len(parts[0][0])
    cache = []
    for i in range(num_layers):
        if isinstance(parts[0][0][i], TQLayer):
            cache.append(_join_tq([(layers[i], n) for layers, n in parts], tq, dims[i]))
            continue
        layer = KVCache()
        # A part used whole (every full block) goes in as it is: a slice per part and layer
        # is ~9,000 graph nodes of Python time on a 32k-token hit.
        keys = [_first(layers[i][0], n) for layers, n in parts]
        values = [_first(layers[i][1], n) for layers, n in parts]
        layer.offset = sum(k.shape[2] for k in keys)
        if room > 0:
            keys.append(mx.zeros((*keys[0].shape[:2], room, keys[0].shape[3]), keys[0].dtype))
            values.append(mx.zeros((*values[0].shape[:2], room, values[0].shape[3]), values[0].dtype))
        layer.keys, layer.values = _cat(keys), _cat(values)
        cache.append(layer)
    mx.eval([c.state for c in cache])
    return cache


def _join_tq(parts: list[tuple[TQLayer, int]], tq, dims):
    from engine.tq_cache import TurboQuantKVCache  # tq_cache needs nothing from here; keep imports one-way
    from engine.turboquant import get_codec

    k_dim, v_dim, dtype = dims
    ck, cv = get_codec(k_dim, tq.bits, tq.seed), get_codec(v_dim, tq.bits, tq.seed)

    def cat(arrays):  # the tail mixes decoded (lazy) and stored parts: small, left to MLX
        return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=2)

    total = sum(n for _, n in parts)
    tail_start = total - total % tq.group
    tail_k, tail_v, s = [], [], 0
    for layer, n in parts:
        lo, hi = max(s, tail_start) - s, s + n - s  # this part's positions in the tail, block-local
        if lo < hi:
            split = min(max(layer.dense_from, lo), hi)  # [lo, split) decoded, [split, hi) dense
            if lo < split:
                tail_k.append(ck.decode(layer.k_norms[:, :, lo:split], layer.k_codes[:, :, lo:split], dtype))
                tail_v.append(cv.decode(layer.v_norms[:, :, lo:split], layer.v_codes[:, :, lo:split], dtype))
            if split < hi:
                d = layer.dense_from
                tail_k.append(layer.dense_k[:, :, split - d : hi - d])
                tail_v.append(layer.dense_v[:, :, split - d : hi - d])
        s += n
    first = parts[0][0]
    heads = first.k_norms.shape[1]
    tq_cache = TurboQuantKVCache(tq.bits, tq.seed, tq.group)
    tq_cache.state = (
        _cat([layer.k_norms[:, :, :n] for layer, n in parts]), _cat([layer.k_codes[:, :, :n] for layer, n in parts]),
        _cat([layer.v_norms[:, :, :n] for layer, n in parts]), _cat([layer.v_codes[:, :, :n] for layer, n in parts]),
        cat(tail_k) if tail_k else mx.zeros((1, heads, 0, k_dim), dtype),
        cat(tail_v) if tail_v else mx.zeros((1, first.v_norms.shape[1], 0, v_dim), dtype),
    )
    tq_cache.offset = total
    return tq_cache


def _first(a: mx.array, n: int) -> mx.array:
    return a if a.shape[2] == n else a[..., :n, :]


def _cat(arrays: list[mx.array]) -> mx.array:
    """The blocks' arrays joined along the positions axis (2), in a fresh array.

    On the CPU this goes through numpy: zero-copy views of the (evaluated)
    blocks, `np.concatenate`, one `mx.array` copy. That is 1.3–2× as fast
    as MLX's CPU `concatenate` on the 2-core box of docs/PERFORMANCE.md ("Cache
    tiers"). On a GPU, MLX's own kernel stays.
    """
    if len(arrays) == 1:
        return arrays[0]
    if mx.default_device().type != mx.DeviceType.cpu:
        return mx.concatenate(arrays, axis=2)
    bits = _AS_BITS.get(arrays[0].dtype)
    if bits is not None:  # numpy has no bfloat16: join the bit patterns
        return _cat([a.view(bits) for a in arrays]).view(arrays[0].dtype)
    return mx.array(np.concatenate([np.asarray(a) for a in arrays], axis=2))


_TQ_NAMES = ("kn", "kc", "vn", "vc", "kd", "vd")


def _host(a: mx.array) -> tuple[np.ndarray, str]:
    dtype = str(a.dtype).removeprefix("mlx.core.")
    return np.array(a.view(_AS_BITS[a.dtype]) if a.dtype in _AS_BITS else a), dtype


def _device(a: np.ndarray, dtype: str) -> mx.array:
    target = getattr(mx, dtype)
    x = mx.array(a)
    return x if x.dtype == target else x.view(target)  # bits stored as an integer type (bfloat16, float16)


def named_arrays(layers: list) -> dict[str, mx.array]:
    """A block's arrays by their file names (module docstring)."""
    out = {}
    for i, layer in enumerate(layers):
        if isinstance(layer, TQLayer):
            fields = (layer.k_norms, layer.k_codes, layer.v_norms, layer.v_codes, layer.dense_k, layer.dense_v)
            for name, a in zip(_TQ_NAMES, fields):
                if a is not None:
                    out[f"{i}.{name}"] = a
        else:
            out[f"{i}.k"], out[f"{i}.v"] = layer[0], layer[1]
    return out


def to_numpy(layers: list) -> dict[str, tuple[np.ndarray, str]]:
    """Host copies for the disk writer (engine thread: it owns MLX), named as in the module docstring."""
    return {name: _host(a) for name, a in named_arrays(layers).items()}


# How a GPU block reaches the host for the disk writer (docs/CACHE.md, "Writes"):
# "dtoh" (the default where the CUDA driver loads): the block staged as one flat device array
# and copied by the writer thread with the driver's cuMemcpyDtoH, GIL released (engine/host_copy.py);
# "writer": the writer thread reads per-array device copies through MLX (`memoryview`: MLX moves
# each buffer into managed memory, holding the GIL); "cpu": a copy on MLX's CPU stream, started
# after the chunk. Measured side by side on the H200 (bench_engine_speed.py, 32k prompt, chunk
# 2048; docs/PERFORMANCE.md, issue 17): cold TTFT 1.15x plain mlx-lm with "writer", 3.0x with
# "cpu", 1.48x reading it on the engine thread; "dtoh" brought the disk tier's cost at chunk
# 2048 from 1.15x to 0.97x (docs/PERFORMANCE.md), which is why it is the default.
HOST_COPY = os.environ.get("PREFIXTRACE_DISK_HOST_COPY", "dtoh")


@dataclass(eq=False, slots=True)
class FlatBlock:
    """A block staged for the disk writer as one flat uint8 array: the block file's payload.

    specs: per array (name, dtype name, numpy dtype string, shape, byte offset, nbytes), in
    payload order (the header's "arrays"). address: a (1,) uint64 array with `flat`'s device
    address (engine/host_copy.py), None where the writer reads `flat` through MLX instead."""

    specs: list
    flat: mx.array
    address: mx.array | None = None

    @property
    def arrays(self) -> list[mx.array]:
        return [self.flat] if self.address is None else [self.flat, self.address]

    def payload(self) -> np.ndarray:
        """The payload bytes on the host (writer thread). Through the driver copy: a view of the
        calling thread's pinned buffer, valid until its next call (the writer writes it first)."""
        if self.address is not None:
            from engine import host_copy

            where = int(self.address.item())  # an 8-byte output in MLX's host-visible pool: no move
            if where and host_copy.available():
                return host_copy.host_bytes(where, self.flat.nbytes)
        return host_view(self.flat)


def _flat(named: dict[str, mx.array], *, address: bool) -> FlatBlock:
    specs, parts, offset = [], [], 0
    for name, a in named.items():
        dtype = str(a.dtype).removeprefix("mlx.core.")
        bits = a.view(_AS_BITS[a.dtype]) if a.dtype in _AS_BITS else a
        np_dtype = np.dtype(str(bits.dtype).removeprefix("mlx.core.")).str
        specs.append((name, dtype, np_dtype, list(a.shape), offset, a.nbytes))
        parts.append(bits.view(mx.uint8).reshape(-1))
        offset += a.nbytes
    flat = mx.concatenate(parts)  # a fresh buffer, even for one part
    if not address:
        return FlatBlock(specs, flat)
    from engine.host_copy import device_address

    return FlatBlock(specs, flat, device_address(flat))


def flat_staging(copy: bool) -> bool:
    """Whether a GPU block goes to the disk writer as one flat payload (HOST_COPY "dtoh" and the
    CUDA driver copy available)."""
    return copy and HOST_COPY == "dtoh" and _driver_copy()


def cut_shared(cache: list, start: int, stop: int, *, address: bool) -> tuple[list, FlatBlock] | None:
    """Positions [start, stop) of a dense cache in ONE fresh device array that is both the disk
    payload and, through views, the block's layers; None unless every layer is a `KVCache` of one
    head count, head dim and dtype (then `cut` + `stage` do it in two copies).

    One copy per array instead of two (the block's own, then the disk's): a 32k prompt of the
    8B shape is 128 blocks of 72 arrays, and each copy is a launch on the prefill's critical path.
    The views are slices of a contiguous array (no copy, no launch); the writer reads the payload
    through the driver (engine/host_copy.py), which moves nothing, so the memory tier's views stay
    on the device. Lazy: evaluate `FlatBlock.arrays` and the layers with the chunk."""
    if not is_dense(cache):
        return None
    k0 = cache[0].keys
    heads, dim, dtype = k0.shape[1], k0.shape[3], k0.dtype
    if any(a.shape[1] != heads or a.shape[3] != dim or a.dtype != dtype for c in cache for a in (c.keys, c.values)):
        return None
    joined = mx.concatenate([a[..., start:stop, :] for c in cache for a in (c.keys, c.values)], axis=0)
    layers = [(joined[2 * i : 2 * i + 1], joined[2 * i + 1 : 2 * i + 2]) for i in range(len(cache))]
    bits = joined.view(_AS_BITS[dtype]) if dtype in _AS_BITS else joined
    flat = bits.reshape(-1).view(mx.uint8)
    name = str(dtype).removeprefix("mlx.core.")
    np_dtype = np.dtype(str(bits.dtype).removeprefix("mlx.core.")).str
    each = joined.nbytes // joined.shape[0]
    shape = [1, heads, stop - start, dim]
    specs = [(f"{i // 2}.{'kv'[i % 2]}", name, np_dtype, shape, i * each, each) for i in range(joined.shape[0])]
    if not address:
        return layers, FlatBlock(specs, flat)
    from engine.host_copy import device_address

    return layers, FlatBlock(specs, flat, device_address(flat))


def stage(named: dict[str, mx.array], *, copy: bool, flat: bool | None = None):
    """What the disk writer will read of a block, and the device arrays to evaluate with
    the caller's work: (staged, [device arrays]); staged is a `FlatBlock` or {name: (array, dtype)}.

    The staged arrays are in a dtype numpy has (bfloat16 as its uint16 bits: a view).
    copy (a GPU): the writer must not read the memory tier's own block through MLX: handing a
    CUDA buffer to the host moves it there, and the next hit on that block would pay the way
    back (a memory hit with the disk tier present took 0.94 s against 0.20 s without, in
    issue 17). So a device copy of its own is made with the chunk (~15 us per 38 MB block):
    with HOST_COPY "dtoh" one flat array the driver copies (nothing of MLX's moves), with
    "writer" per-array copies MLX moves, with "cpu" a host copy of those on MLX's CPU stream,
    which `settle` starts asynchronously. On the CPU the block's buffer is read as it is.
    flat: force (True) or refuse (False) the flat staging; None: HOST_COPY decides (tests
    force it on the CPU, where the writer then reads the flat array through MLX).
    """
    if flat is None:
        flat = flat_staging(copy)
    if flat:
        block = _flat(named, address=copy and _driver_copy())
        return block, block.arrays
    out, device = {}, []
    for name, a in named.items():
        dtype = str(a.dtype).removeprefix("mlx.core.")
        if copy:
            a = a + mx.array(0, dtype=a.dtype)
            device.append(a)
            if HOST_COPY == "cpu":
                bits = a.view(mx.uint16) if a.dtype in (mx.bfloat16, mx.float16) else a  # no half math on the CPU
                a = mx.add(bits, mx.array(0, dtype=bits.dtype), stream=mx.cpu)
        out[name] = (a.view(_AS_BITS[a.dtype]) if a.dtype in _AS_BITS else a, dtype)
    return out, device


def _driver_copy() -> bool:
    from engine import host_copy

    return host_copy.available()


def staged_arrays(staged) -> list[mx.array]:
    if isinstance(staged, FlatBlock):
        return staged.arrays
    return [a for a, _ in staged.values()]


def host_view(a) -> np.ndarray:
    """A numpy view of an evaluated (staged) MLX array's buffer; numpy arrays pass through.

    Called on the disk writer thread, not the engine thread: on CUDA, handing an array's
    buffer to the host is a device-to-host copy inside MLX (synchronous), which must not
    stall the prefill. The array is private to the disk path (`stage`) and already
    evaluated, so nothing else touches it meanwhile."""
    return a if isinstance(a, np.ndarray) else np.asarray(memoryview(a))


def from_numpy(arrays: dict[str, tuple[np.ndarray, str]]) -> list:
    """The inverse of `to_numpy` (engine thread)."""
    layers = []
    num_layers = 1 + max(int(name.split(".")[0]) for name in arrays) if arrays else 0
    for i in range(num_layers):
        if f"{i}.k" in arrays:
            layers.append((_device(*arrays[f"{i}.k"]), _device(*arrays[f"{i}.v"])))
        else:
            fields = [_device(*arrays[f"{i}.{n}"]) if f"{i}.{n}" in arrays else None for n in _TQ_NAMES]
            layers.append(TQLayer(*fields))
    mx.eval([_layer_arrays(layer) for layer in layers])
    return layers
