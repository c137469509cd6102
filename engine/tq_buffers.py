"""The buffers a TurboQuant cache keeps (engine/tq_cache.py): norms and packed codes growing in steps
(`Codes`), a dense window of consecutive columns with room after them (`Window`), and the one encode
that writes new tokens into them (`encode_into`: the kernels' fused encode on CUDA, the codec's MLX
ops elsewhere).
"""

from __future__ import annotations

import mlx.core as mx

from engine.kernels import selector

__all__ = ["DEFAULT_GROUP", "Codes", "Window", "encode_into", "floor_group", "grow", "view", "window"]

DEFAULT_GROUP = 64


def floor_group(n: int, group: int) -> int:
    return n - n % group


def grow(buf: mx.array | None, used: int, new: mx.array, step: int = 256) -> mx.array:
    """Write `new` at columns [used, used + n) of `buf` (axis 2), growing it in steps."""
    n = new.shape[2]
    if buf is None or used + n > buf.shape[2]:
        shape = list(new.shape)
        shape[2] = ((used + n + step - 1) // step) * step
        grown = mx.zeros(shape, new.dtype)
        if buf is not None and used:
            grown[:, :, :used] = buf[:, :, :used]
        buf = grown
    buf[:, :, used : used + n] = new
    return buf


class Codes:
    """Norms and packed codes of K or V for columns [0, used) of a (B, H, cap, .) buffer."""

    def __init__(self):
        self.norms: mx.array | None = None
        self.codes: mx.array | None = None

    def write(self, used: int, norms: mx.array, codes: mx.array) -> None:
        self.norms = grow(self.norms, used, norms)
        self.codes = grow(self.codes, used, codes)

    def reserve(self, columns: int) -> None:
        """Room for `columns` columns (a deferred step's views must span the whole context)."""
        if self.codes is not None and self.codes.shape[2] < columns:
            used = self.codes.shape[2]
            self.norms = grow(self.norms, used, mx.zeros((*self.norms.shape[:2], columns - used, 1), self.norms.dtype))
            self.codes = grow(self.codes, used, mx.zeros((*self.codes.shape[:2], columns - used, self.codes.shape[3]),
                                                          self.codes.dtype))


class Window:
    """Dense K or V of consecutive columns, kept in a buffer with room after them, so that a
    decode step appends its token with one in-place slice write (as mlx-lm's `KVCache`
    does; MLX reuses the buffer when nothing else holds it) instead of concatenating the
    whole tail every step. `view()` is the columns held; `drop(n)` forgets the first n."""

    STEP = 256

    def __init__(self, arr: mx.array):
        self.buf, self.lo, self.hi = arr, 0, arr.shape[2]

    def view(self, skip: int = 0) -> mx.array:
        """Columns held, less the first `skip` (one slice, not two: a slice costs ~7 us of host time,
        and a decode step takes its views once per layer)."""
        lo = self.lo + skip
        return self.buf if lo == 0 and self.hi == self.buf.shape[2] else self.buf[:, :, lo : self.hi]

    def append(self, new: mx.array) -> None:
        n = new.shape[2]
        if self.hi + n > self.buf.shape[2]:  # full: move the held columns to the front of a new buffer
            held = self.hi - self.lo
            shape = list(self.buf.shape)
            shape[2] = -(-(held + n + self.STEP) // self.STEP) * self.STEP
            grown = mx.zeros(shape, self.buf.dtype)
            if held:
                grown[:, :, :held] = self.buf[:, :, self.lo : self.hi]
            self.buf, self.lo, self.hi = grown, 0, held
        self.buf[:, :, self.hi : self.hi + n] = new
        self.hi += n

    def drop(self, n: int) -> None:
        self.lo += n


def window(arr: mx.array | None) -> Window | None:
    return None if arr is None else Window(arr)


def view(w: Window | None) -> mx.array | None:
    return None if w is None else w.view()


def encode_into(k: Codes, v: Codes, used: int, keys: mx.array, values: mx.array, ck, cv) -> None:
    """Encode new keys/values and write them at column `used`: on CUDA one fused launch
    for both (the kernels' `encode`) instead of some twenty MLX ops."""
    coded = selector.select().encode(keys, values, ck) if ck is cv else None
    if coded is not None:
        kn, kc, vn, vc = coded
        k.write(used, kn, kc)
        v.write(used, vn, vc)
        return
    k.write(used, *ck.encode(keys))
    v.write(used, *cv.encode(values))
