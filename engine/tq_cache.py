"""TurboQuant KV caches: one row (`TurboQuantKVCache`) and left-padded rows
(`BatchTurboQuantKVCache`); engine/tq_config.py builds them for a model.

Every token's K and V are encoded on arrival (norm + packed codes, see
`engine.turboquant`); on CUDA a decode step defers that to the step that first
reads the codes (the kernels' `defer_encode`: same codes, from the same dense
values, in one launch per group), and the public `k` / `v` attributes encode
anything pending before they are read. A position p of a row holding n tokens is *represented*
by its decoded value once p < floor(n / group) * group, and by its dense value
before that (the dense tail, fewer than `group` tokens); tokens that arrive
in the current call are always seen dense by that call. The representation is
a function of (row, position, how the row's tokens arrived) only, never of the
batch it sits in, so a row decodes to the same K/V alone or batched.

Attention follows the paper: the query is rotated once and attends over
codebook values x norms in the rotated basis, and the output is rotated back
once; no cached vector is inverse-rotated. That needs a hook into mlx-lm's
attention call (engine/attention_hook.py, installed by `make_tq_cache`);
without it `update_and_fetch`'s return value, decoded unrotated K/V in the
keys' dtype, gives the same attention more slowly. The class has no `bits`
attribute on purpose: mlx-lm's `scaled_dot_product_attention` dispatches on
`hasattr(cache, "bits")` to its affine quantised kernel, which cannot read
these codes.

The batched form mirrors mlx-lm's `BatchKVCache` (merge/extend/filter/extract,
left padding, per-row `offset`) and masks each row to its own columns.
"""

from __future__ import annotations


import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from engine.kernels import selector
from engine.tq_buffers import DEFAULT_GROUP, Codes, Window, encode_into, floor_group, view, window
from engine.turboquant import get_codec

__all__ = ["TurboQuantKVCache", "BatchTurboQuantKVCache", "DEFAULT_GROUP", "encode_into", "floor_group"]


class TurboQuantKVCache(_BaseCache):
    """One row of TurboQuant-coded K/V with a dense tail of < `group` recent tokens.

    Args:
        kv_bits: bits per coordinate (1..8; default 4).
        seed: seed of the rotation; with (head_dim, kv_bits) it fixes the codec.
        group: tokens stay dense until a whole group of them is complete.
    """

    def __init__(self, kv_bits: int = 4, seed: int = 0, group: int = DEFAULT_GROUP):
        self.kv_bits, self.seed, self.group = kv_bits, seed, group
        self.offset = 0
        self._k = Codes()
        self._v = Codes()
        self._tail_k: Window | None = None  # dense values of positions [floor(offset), offset)
        self._tail_v: Window | None = None
        self._pending = 0  # the last _pending positions have no codes yet (`_flush`)
        self._step = None  # what the latest update_and_fetch's attention sees, for `attend`
        self.hooked = False  # the model's attention calls `attend` (see `_returns_unused`)

    # Class defaults too: mlx-lm's `from_state` (engine/spill.py's resume) skips __init__.
    hooked, _pending, _step = False, 0, None

    # Everything outside the decode step reads complete codes: the public names flush.
    k = property(lambda self: self._flushed()._k, lambda self, c: setattr(self, "_k", c))
    v = property(lambda self: self._flushed()._v, lambda self, c: setattr(self, "_v", c))
    tail_k = property(lambda self: view(self._tail_k), lambda self, a: setattr(self, "_tail_k", window(a)))
    tail_v = property(lambda self: view(self._tail_v), lambda self, a: setattr(self, "_tail_v", window(a)))

    def codec(self, dim: int):
        return get_codec(dim, self.kv_bits, self.seed)

    def _flushed(self):
        """Encode the positions a deferred decode step left without codes (from the tail)."""
        if self._pending:
            n = self._pending
            self._pending = 0
            tk, tv = self._tail_k.view(), self._tail_v.view()
            encode_into(self._k, self._v, self.offset - n, tk[:, :, -n:], tv[:, :, -n:],
                         self.codec(tk.shape[-1]), self.codec(tv.shape[-1]))
        return self

    def update_and_fetch(self, keys, values):
        self._step = None  # its views of the tail would keep MLX from writing the buffer in place
        prev, n = self.offset, self.offset + keys.shape[2]
        ck, cv = self.codec(keys.shape[-1]), self.codec(values.shape[-1])
        b = min(prev, floor_group(n, self.group))  # positions < b are seen decoded
        cut = b - floor_group(prev, self.group)
        keep = floor_group(n, self.group) - b
        if keys.shape[2] == 1 and self._tail_k is not None and self._k.codes is not None \
                and selector.select().defer_encode:
            # A decode step: append to the tail in place; encode only when a position
            # without codes is about to be seen decoded or to leave the tail.
            self.offset = n  # (`_flushed` counts the pending positions back from it)
            self._tail_k.append(keys)
            self._tail_v.append(values)
            self._pending += 1
            first = n - self._pending
            if b > first or floor_group(n, self.group) > first:
                self._flushed()
            self._k.reserve(n)
            self._v.reserve(n)
            dense_k, dense_v = self._tail_k.view(cut), self._tail_v.view(cut)
            self._tail_k.drop(cut + keep)
            self._tail_v.drop(cut + keep)
        else:
            self._flushed()
            encode_into(self._k, self._v, prev, keys, values, ck, cv)
            # Positions [b, n), seen dense. The new tail is cut from these alone, so it
            # never depends on (and never forces) a decode of the whole cache.
            tail_k, tail_v = view(self._tail_k), view(self._tail_v)
            dense_k = keys if tail_k is None else mx.concatenate([tail_k[:, :, cut:], keys], axis=2)
            dense_v = values if tail_v is None else mx.concatenate([tail_v[:, :, cut:], values], axis=2)
            self.tail_k, self.tail_v = dense_k[:, :, keep:], dense_v[:, :, keep:]
        self._step = (b, dense_k, dense_v)
        self.offset = n
        if _returns_unused(self, keys):
            return dense_k, dense_v
        return self._fetch(rotated=False)

    def _fetch(self, rotated: bool):
        """The K/V of this step's attention: decoded positions [0, b) then the dense ones;
        in the rotated basis (no inverse rotation of the cache) when `rotated`."""
        b, dense_k, dense_v = self._step
        out = []
        for codes, dense in ((self._k, dense_k), (self._v, dense_v)):
            codec = self.codec(dense.shape[-1])
            decode = codec.decode_rotated if rotated else codec.decode
            if rotated:
                dense = codec.rotate(dense.astype(mx.float32)).astype(dense.dtype)
            if b:
                dense = mx.concatenate([decode(codes.norms[:, :, :b], codes.codes[:, :, :b], dense.dtype), dense], 2)
            out.append(dense)
        return out[0], out[1]

    def attend(self, queries: mx.array, scale: float, mask) -> mx.array:
        """Attention of `queries` over this step's K/V (see engine/attention_hook.py)."""
        return _attend_rotated(self, queries, scale, mask)

    @classmethod
    def from_dense(cls, cache: KVCache, **kwargs) -> "TurboQuantKVCache":
        """Quantise a dense `KVCache` (as if its tokens arrived in one call)."""
        tq = cls(**kwargs)
        if cache.keys is not None and cache.offset:
            tq.update_and_fetch(cache.keys[:, :, : cache.offset], cache.values[:, :, : cache.offset])
        return tq

    def to_dense(self) -> KVCache:
        """The K/V this cache represents, as a dense `KVCache`."""
        dense = KVCache()
        if self.offset:
            b = floor_group(self.offset, self.group)
            parts = []
            for codes, tail in ((self.k, self.tail_k), (self.v, self.tail_v)):
                codec = self.codec(tail.shape[-1])
                decoded = codec.decode(codes.norms[:, :, :b], codes.codes[:, :, :b], tail.dtype)
                parts.append(mx.concatenate([decoded, tail], axis=2))
            dense.state = (parts[0], parts[1], self.offset)
        return dense

    # --- mlx-lm cache protocol ---------------------------------------------------

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @classmethod
    def merge(cls, caches) -> "BatchTurboQuantKVCache":
        return BatchTurboQuantKVCache.merge(caches)

    def size(self):
        return self.offset

    def empty(self):
        return self.offset == 0

    def is_trimmable(self):
        return True

    def trim(self, n):
        """Drop the last n tokens. Positions that were already quantised and fall
        back into the dense tail keep their decoded value (it is all we have)."""
        n = min(self.offset, n)
        if not n:
            return 0
        self._flushed()
        new = self.offset - n
        old_floor, new_floor = floor_group(self.offset, self.group), floor_group(new, self.group)
        if new_floor >= old_floor:
            self.tail_k, self.tail_v = self.tail_k[:, :, : new - old_floor], self.tail_v[:, :, : new - old_floor]
        else:
            dense = self.to_dense()
            self.tail_k = dense.keys[:, :, new_floor:new]
            self.tail_v = dense.values[:, :, new_floor:new]
        self.offset = new
        return n

    @property
    def state(self):
        if not self.offset:
            return []
        o = self.offset
        return (self.k.norms[:, :, :o], self.k.codes[:, :, :o], self.v.norms[:, :, :o], self.v.codes[:, :, :o],
                self.tail_k, self.tail_v)

    @state.setter
    def state(self, v):
        self.k, self.v = Codes(), Codes()
        self.tail_k = self.tail_v = None
        self._pending, self._step = 0, None
        if v:
            self.k.norms, self.k.codes, self.v.norms, self.v.codes, self.tail_k, self.tail_v = v

    @property
    def meta_state(self):
        return tuple(map(str, (self.offset, self.kv_bits, self.seed, self.group)))

    @meta_state.setter
    def meta_state(self, v):
        self.offset, self.kv_bits, self.seed, self.group = map(int, v)

    @property
    def nbytes(self):
        if not self.offset:
            return 0  # (not from `state`: that would encode what a decode step deferred)
        o = self.offset
        codes = [a[:, :, :o] for a in (self._k.norms, self._k.codes, self._v.norms, self._v.codes)]
        return sum(a.nbytes for a in codes) + self.tail_k.nbytes + self.tail_v.nbytes

    def _live_arrays(self) -> list:
        """The arrays a step writes (for benchmarks to evaluate), without flushing."""
        return [self._k.codes, self._v.codes, self._k.norms, self._v.norms, self._tail_k.buf, self._tail_v.buf]


class BatchTurboQuantKVCache(_BaseCache):
    """Left-padded rows of TurboQuant-coded K/V, batched like mlx-lm's `BatchKVCache`.

    Codes cover columns [0, _idx); a dense window covers columns [_ws, _idx),
    which holds every row's dense tail (fewer than `group` columns per row).
    """

    def __init__(self, left_padding: list[int], kv_bits: int = 4, seed: int = 0, group: int = DEFAULT_GROUP):
        self.kv_bits, self.seed, self.group = kv_bits, seed, group
        self._pads = list(left_padding)
        self.left_padding = mx.array(self._pads)
        self.offset = mx.array([-p for p in self._pads])
        self._idx = 0
        self._ws = 0
        self._k = Codes()
        self._v = Codes()
        self._win_k: Window | None = None
        self._win_v: Window | None = None
        self._pending = 0  # columns [_idx - _pending, _idx) have no codes yet (`_flushed`)
        self._step = None
        self.hooked = False

    k = property(lambda self: self._flushed()._k, lambda self, c: setattr(self, "_k", c))
    v = property(lambda self: self._flushed()._v, lambda self, c: setattr(self, "_v", c))
    win_k = property(lambda self: view(self._win_k), lambda self, a: setattr(self, "_win_k", window(a)))
    win_v = property(lambda self: view(self._win_v), lambda self, a: setattr(self, "_win_v", window(a)))

    def _flushed(self):
        """Encode the columns deferred decode steps left without codes (from the window)."""
        if self._pending:
            n = self._pending
            self._pending = 0
            wk, wv = self._win_k.view(), self._win_v.view()
            encode_into(self._k, self._v, self._idx - n, wk[:, :, -n:], wv[:, :, -n:],
                         get_codec(wk.shape[-1], self.kv_bits, self.seed),
                         get_codec(wv.shape[-1], self.kv_bits, self.seed))
        return self

    def _lengths(self) -> list[int]:
        return [self._idx - p for p in self._pads]

    def _window_start(self) -> int:
        return min(p + floor_group(self._idx - p, self.group) for p in self._pads)

    def update_and_fetch(self, keys, values):
        self._step = None  # its views of the window would keep MLX from writing the buffer in place
        prev, N = self._idx, keys.shape[2]
        new_idx = prev + N
        ck, cv = get_codec(keys.shape[-1], self.kv_bits, self.seed), get_codec(values.shape[-1], self.kv_bits, self.seed)
        ws = self._ws if self._win_k is not None else prev
        # Per row, columns >= its boundary are seen dense.
        bounds = [p + min(prev - p, floor_group(new_idx - p, self.group)) for p in self._pads]
        self._idx = new_idx
        self.offset = self.offset + N
        new_ws = self._window_start()
        if N == 1 and self._win_k is not None and self._k.codes is not None and selector.select().defer_encode:
            # A decode step: append to the window in place; encode the columns without
            # codes only when one is about to be seen decoded by some row or to leave the window.
            self._win_k.append(keys)
            self._win_v.append(values)
            self._pending += 1
            first = new_idx - self._pending
            if max(bounds) > first or new_ws > first:
                self._flushed()
            self._k.reserve(new_idx)
            self._v.reserve(new_idx)
            dense_k, dense_v = self._win_k.view(), self._win_v.view()  # columns [ws, new_idx)
            self._win_k.drop(new_ws - ws)
            self._win_v.drop(new_ws - ws)
        else:
            self._idx = prev
            self._flushed()
            self._idx = new_idx
            encode_into(self._k, self._v, prev, keys, values, ck, cv)
            win_k, win_v = view(self._win_k), view(self._win_v)
            dense_k = keys if win_k is None else mx.concatenate([win_k, keys], axis=2)  # columns [ws, new_idx)
            dense_v = values if win_v is None else mx.concatenate([win_v, values], axis=2)
            self.win_k, self.win_v = dense_k[:, :, new_ws - ws :], dense_v[:, :, new_ws - ws :]
        self._step = (prev, new_idx, ws, bounds, dense_k, dense_v)
        self._ws = new_ws
        if _returns_unused(self, keys):
            return dense_k, dense_v
        return self._fetch(rotated=False)

    def _fetch(self, rotated: bool):
        prev, new_idx, ws, bounds, dense_k, dense_v = self._step
        out = []
        for codes, dense in ((self._k, dense_k), (self._v, dense_v)):
            codec = get_codec(dense.shape[-1], self.kv_bits, self.seed)
            if rotated:
                dense = codec.rotate(dense.astype(mx.float32)).astype(dense.dtype)
            if prev == 0:
                out.append(dense)
                continue
            decode = codec.decode_rotated if rotated else codec.decode
            cols = mx.arange(ws, new_idx)[None, None, :, None]
            use_dense = cols >= mx.array(bounds)[:, None, None, None]
            dec = decode(codes.norms[:, :, :new_idx], codes.codes[:, :, :new_idx], dense.dtype)
            out.append(mx.concatenate([dec[:, :, :ws], mx.where(use_dense, dense, dec[:, :, ws:])], axis=2))
        return out[0], out[1]

    def attend(self, queries: mx.array, scale: float, mask) -> mx.array:
        return _attend_rotated(self, queries, scale, mask)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        if N == 1 and not any(self._pads):
            return None
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    # --- rows joining and leaving ------------------------------------------------

    @classmethod
    def merge(cls, caches: list[TurboQuantKVCache]) -> "BatchTurboQuantKVCache":
        first = caches[0]
        lengths = [c.offset for c in caches]
        top = max(lengths)
        pads = [top - n for n in lengths]
        batch = cls(pads, first.kv_bits, first.seed, first.group)
        batch.hooked = all(c.hooked for c in caches)
        full = [c for c in caches if c.offset]
        if not full:
            return batch
        batch._idx = top
        batch.offset = batch.offset + top
        batch._ws = batch._window_start()
        for name in ("k", "v"):
            ref = getattr(full[0], name)
            norms = mx.zeros((len(caches), ref.norms.shape[1], top, 1), ref.norms.dtype)
            codes = mx.zeros((len(caches), ref.codes.shape[1], top, ref.codes.shape[3]), ref.codes.dtype)
            tail_ref = getattr(full[0], "tail_" + name)
            win = mx.zeros((len(caches), tail_ref.shape[1], top - batch._ws, tail_ref.shape[3]), tail_ref.dtype)
            for i, (p, c) in enumerate(zip(pads, caches)):
                if not c.offset:
                    continue
                src = getattr(c, name)
                norms[i : i + 1, :, p:] = src.norms[:, :, : c.offset]
                codes[i : i + 1, :, p:] = src.codes[:, :, : c.offset]
                start = p + floor_group(c.offset, c.group) - batch._ws
                win[i : i + 1, :, start:] = getattr(c, "tail_" + name)
            codes_obj = getattr(batch, name)
            codes_obj.norms, codes_obj.codes = norms, codes
            setattr(batch, "win_" + name, win)
        return batch

    def extract(self, idx: int) -> TurboQuantKVCache:
        cache = TurboQuantKVCache(self.kv_bits, self.seed, self.group)
        cache.hooked = self.hooked
        p = self._pads[idx]
        n = self._idx - p
        if not n:
            return cache
        cache.offset = n
        for name in ("k", "v"):
            src, dst = getattr(self, name), getattr(cache, name)
            dst.norms = mx.contiguous(src.norms[idx : idx + 1, :, p : self._idx])
            dst.codes = mx.contiguous(src.codes[idx : idx + 1, :, p : self._idx])
            win = getattr(self, "win_" + name)
            setattr(cache, "tail_" + name, mx.contiguous(win[idx : idx + 1, :, p + floor_group(n, self.group) - self._ws :]))
        return cache

    def filter(self, batch_indices):
        if not batch_indices:
            raise ValueError("filter() needs at least one row to keep")
        old_ws = self._ws
        self._pads = [self._pads[i] for i in batch_indices]
        self.left_padding = mx.array(self._pads)
        self.offset = self.offset[mx.array(batch_indices)]
        if self.k.codes is None:
            return
        new_ws = self._window_start()
        shift = min(self._pads)
        take = mx.array(batch_indices)
        for codes in (self.k, self.v):
            codes.norms = codes.norms[take, :, shift:]
            codes.codes = codes.codes[take, :, shift:]
        self.win_k = self.win_k[take, :, new_ws - old_ws :]
        self.win_v = self.win_v[take, :, new_ws - old_ws :]
        self._pads = [p - shift for p in self._pads]
        self.left_padding = mx.array(self._pads)
        self._idx -= shift
        self._ws = new_ws - shift

    def extend(self, other: "BatchTurboQuantKVCache"):
        if self.k.codes is None and other.k.codes is None:
            self._pads += other._pads
            self.left_padding = mx.array(self._pads)
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        top = max(self._idx, other._idx)
        ref = self if self.k.codes is not None else other
        sides = []
        for c in (self, other):
            left = top - c._idx
            pads = [p + left for p in c._pads]
            ws = (c._ws if c.k.codes is not None else c._idx) + left
            sides.append((c, left, pads, ws))
        new_ws = min(s[3] for s in sides)

        def cols(a, like, batch, left, total):
            """`a` (or zeros shaped like `like`) left-padded to `total` columns."""
            if a is None:
                return mx.zeros((batch, like.shape[1], total, like.shape[3]), like.dtype)
            return mx.pad(a, [(0, 0), (0, 0), (left, total - left - a.shape[2]), (0, 0)])

        merged = {}
        for name in ("norms_k", "codes_k", "norms_v", "codes_v", "win_k", "win_v"):
            parts = []
            for c, left, pads, ws in sides:
                b = len(c._pads)
                if name.startswith("win"):
                    a = getattr(c, name)
                    like = getattr(ref, name)
                    pad_left = ws - new_ws
                    parts.append(cols(a, like, b, pad_left, top - new_ws))
                else:
                    field, kv = name.split("_")
                    src = getattr(c, kv)
                    a = getattr(src, field)
                    a = a[:, :, : c._idx] if a is not None else None
                    parts.append(cols(a, getattr(getattr(ref, kv), field), b, left, top))
            merged[name] = mx.concatenate(parts, axis=0)
        self.k.norms, self.k.codes = merged["norms_k"], merged["codes_k"]
        self.v.norms, self.v.codes = merged["norms_v"], merged["codes_v"]
        self.win_k, self.win_v = merged["win_k"], merged["win_v"]
        self._pads = sides[0][2] + sides[1][2]
        self.left_padding = mx.array(self._pads)
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx, self._ws = top, new_ws

    # --- protocol ----------------------------------------------------------------

    def size(self):
        return self._idx

    def empty(self):
        return self._k.codes is None

    def is_trimmable(self):
        return False

    @property
    def state(self):
        return []

    @property
    def nbytes(self):
        if self._k.codes is None:
            return 0
        used = [c[:, :, : self._idx] for c in (self._k.norms, self._k.codes, self._v.norms, self._v.codes)]
        return sum(a.nbytes for a in used) + self.win_k.nbytes + self.win_v.nbytes

    def _live_arrays(self) -> list:
        """The arrays a step writes (for benchmarks to evaluate), without flushing."""
        return [self._k.codes, self._v.codes, self._k.norms, self._v.norms, self._win_k.buf, self._win_v.buf]


def _returns_unused(cache, keys: mx.array) -> bool:
    """Whether `update_and_fetch` may skip building the decoded K/V it returns: nobody
    reads them when the model's attention goes through the hook (`cache.hooked`, set by
    `make_tq_cache` and `TQConfig.adapt`, whose models have it installed), which attends
    from `_step` instead. Building that graph costs more Python time than the whole dense
    step (~0.1 ms per layer). CUDA only, so the CPU keeps returning what it always has."""
    return cache.hooked and selector.select().cuda


# --- attention in the rotated basis ------------------------------------------------


def _attend_rotated(cache, queries: mx.array, scale: float, mask) -> mx.array:
    """softmax(q K^T) V with q and K, V all rotated by the codec's Pi: scores are
    unchanged (Pi is orthogonal), the output comes out rotated and is turned back
    once per query instead of once per cached vector every step. A decode step on
    CUDA reads the codes directly instead (`_fused_decode`)."""
    fused = _fused_decode(cache, queries, scale)
    if fused is not None:
        return fused
    keys, values = cache._fetch(rotated=True)
    qc = get_codec(queries.shape[-1], cache.kv_bits, cache.seed)
    vc = get_codec(values.shape[-1], cache.kv_bits, cache.seed)
    q = qc.rotate(queries.astype(mx.float32)).astype(queries.dtype)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return vc.unrotate(out.astype(mx.float32)).astype(queries.dtype)


def _fused_decode(cache, queries: mx.array, scale: float) -> mx.array | None:
    """One decode token per row on CUDA: the kernels' TurboQuant attention over this step's codes
    (positions below each row's boundary) and dense columns, the same positions `_fetch` decodes;
    None where it does not apply (CPU, prefill chunks, head sizes or bits it has no kernel for)."""
    kernels = selector.select()
    if not kernels.cuda or cache._step is None or queries.shape[2] != 1:
        return None
    dense_k, dense_v = cache._step[-2:]
    dim = queries.shape[-1]
    if dense_k.shape[-1] != dim or dense_v.shape[-1] != dim:
        return None
    codec = get_codec(dim, cache.kv_bits, cache.seed)
    if not codec.hadamard:
        return None
    if isinstance(cache, BatchTurboQuantKVCache):
        end, lp = cache._step[1], cache.left_padding
    else:
        end, lp = cache.offset, None
    k, v = cache._k, cache._v  # not `cache.k`: that would encode what this step deferred
    # The whole buffers (capacity >= end: `reserve`) and `end`: the kernels read columns [0, end)
    # only, and four slices were ~28 us of host time per layer.
    return kernels.tq_attend(queries, k.norms, k.codes, v.norms, v.codes, dense_k, dense_v, lp, scale, codec,
                             cache.group, end)
