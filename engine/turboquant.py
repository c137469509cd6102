"""TurboQuant (MSE variant) vector codec for KV caches.

Per "TurboQuant: Online Vector Quantization with Near-optimal Distortion Rate"
(arXiv 2504.19874): a vector x is stored as its norm plus `bits`-bit codes of
the rotated unit vector y = Pi (x/|x|). After a random rotation every
coordinate of a uniformly random unit vector in d dimensions has the density
f(t) ~ (1 - t^2)^((d-3)/2) on [-1, 1] (about N(0, 1/d)), so one scalar
Lloyd-Max codebook for that density quantises every coordinate near-optimally.

* Rotation: a randomised Hadamard transform (seeded signs, `mx.hadamard_transform`)
  when d is a power of two, else a seeded random orthogonal matrix (QR).
* Codebook: Lloyd iterations on the exact density, integrated on a fine grid
  with numpy once per (d, bits), cached. Offline only; encode/decode are MLX.
* Codes are bit-packed into uint32 words (any bits in 2..8, plus 1 for tests).

Everything is a deterministic function of (head_dim, bits, seed), so a stored
block needs only its norms and codes. Distortion of unit vectors,
E|x - x_hat|^2 (the paper's D_mse, a per-vector total): about 0.36, 0.117,
0.03, 0.009 at 1..4 bits; see tests/test_turboquant.py.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

__all__ = ["TurboQuantCodec", "get_codec", "lloyd_max_codebook"]


@lru_cache(maxsize=None)
def lloyd_max_codebook(dim: int, bits: int, iters: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """(centroids, thresholds) of the Lloyd-Max quantiser for one coordinate of a
    uniformly random unit vector in `dim` dimensions. Deterministic."""
    if dim < 2:
        raise ValueError("head_dim must be at least 2")
    levels = 1 << bits
    # The density is negligible beyond ~12 standard deviations (sd = 1/sqrt(dim)).
    edge = min(1.0, 12.0 / np.sqrt(dim))
    grid = np.linspace(-edge, edge, 200_001)
    logf = 0.5 * (dim - 3) * np.log(np.clip(1.0 - grid * grid, 1e-300, None))
    f = np.exp(logf - logf.max())
    # Cumulative integrals of f and t*f (trapezoid), for O(levels) cell integrals.
    dx = grid[1] - grid[0]
    cf = np.concatenate([[0.0], np.cumsum(0.5 * (f[1:] + f[:-1]) * dx)])
    tf = grid * f
    ctf = np.concatenate([[0.0], np.cumsum(0.5 * (tf[1:] + tf[:-1]) * dx)])
    total = cf[-1]
    # Start from the quantiles of the distribution.
    centroids = np.interp((np.arange(levels) + 0.5) / levels * total, cf, grid)
    for _ in range(iters):
        thresholds = 0.5 * (centroids[1:] + centroids[:-1])
        edges = np.concatenate([[-edge], thresholds, [edge]])
        mass = np.diff(np.interp(edges, grid, cf))
        moment = np.diff(np.interp(edges, grid, ctf))
        new = np.where(mass > 1e-300, moment / np.maximum(mass, 1e-300), centroids)
        if np.max(np.abs(new - centroids)) < 1e-12:
            centroids = new
            break
        centroids = new
    centroids = np.sort(centroids)
    return centroids, 0.5 * (centroids[1:] + centroids[:-1])


def _pack_plan(dim: int, bits: int):
    """Index/shift tables that bit-pack `dim` codes of `bits` bits into uint32 words."""
    words = -(-dim * bits // 32)
    contrib = [[] for _ in range(words)]  # per word: (code index, left shift, right shift)
    for i in range(dim):
        o = i * bits
        w, s = divmod(o, 32)
        contrib[w].append((i, s, 0))
        if s + bits > 32:
            contrib[w + 1].append((i, 0, 32 - s))
    k = max(len(c) for c in contrib)
    idx = np.zeros((words, k), np.int32)
    lsh = np.zeros((words, k), np.uint32)
    rsh = np.zeros((words, k), np.uint32)
    keep = np.zeros((words, k), np.uint32)
    for w, c in enumerate(contrib):
        for j, (i, ls, rs) in enumerate(c):
            idx[w, j], lsh[w, j], rsh[w, j], keep[w, j] = i, ls, rs, 1
    # Unpacking: code i = (word[w] >> s) | (word[w+1] << (32 - s)) for spanning codes.
    w0 = np.array([(i * bits) // 32 for i in range(dim)], np.int32)
    s0 = np.array([(i * bits) % 32 for i in range(dim)], np.uint32)
    spans = (s0 + bits > 32)
    w1 = np.where(spans, np.minimum(w0 + 1, words - 1), w0).astype(np.int32)
    s1 = np.where(spans, 32 - s0, 0).astype(np.uint32)
    return words, idx, lsh, rsh, keep, w0, s0, w1, s1, spans.astype(np.uint32)


class TurboQuantCodec:
    """Encode/decode vectors of length `dim` (last axis) to norms + packed codes."""

    def __init__(self, dim: int, bits: int = 4, seed: int = 0):
        if not 1 <= bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {bits}")
        self.dim, self.bits, self.seed = dim, bits, seed
        centroids, thresholds = lloyd_max_codebook(dim, bits)
        self.centroids = mx.array(centroids.astype(np.float32))
        self.thresholds = mx.array(thresholds.astype(np.float32))
        rng = np.random.default_rng(seed)
        self.hadamard = dim & (dim - 1) == 0
        if self.hadamard:
            self.signs = mx.array(rng.choice([-1.0, 1.0], size=dim).astype(np.float32))
        else:
            q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
            q = q * np.sign(np.diag(r))  # Haar-distributed
            self.matrix = mx.array(q.astype(np.float32))  # rotate: y = x @ matrix.T
        plan = _pack_plan(dim, bits)
        self.words = plan[0]
        self._pidx, self._lsh, self._rsh, self._keep = (mx.array(a) for a in plan[1:5])
        self._w0, self._s0, self._w1, self._s1, self._spans = (mx.array(a) for a in plan[5:])
        self._mask = mx.array((1 << bits) - 1, dtype=mx.uint32)
        # When bits divide 32 no code spans two words: unpack with shifts, no gathers.
        # Built from numpy, not mx.arange: a lazy array would be tied to the creating thread's
        # stream, and codecs are cached and shared across engine threads.
        self._shifts = mx.array(np.arange(0, 32, bits, dtype=np.uint32)) if 32 % bits == 0 else None
        # When bits divide 8, one gather per byte of codes yields its 8 // bits codebook
        # values at once (a 256-row table): the decode reads the codes once.
        self._byte_table = None
        if 8 % bits == 0:
            per = 8 // bits
            byte = np.arange(256)[:, None] >> (np.arange(per)[None, :] * bits) & ((1 << bits) - 1)
            self._byte_table = mx.array(centroids.astype(np.float32)[byte])  # (256, per)

    # --- rotation ----------------------------------------------------------------

    def rotate(self, x: mx.array) -> mx.array:
        if self.hadamard:
            return mx.hadamard_transform(x * self.signs)
        return x @ self.matrix.T

    def unrotate(self, y: mx.array) -> mx.array:
        if self.hadamard:
            return mx.hadamard_transform(y) * self.signs
        return y @ self.matrix

    # --- scalar quantisation -----------------------------------------------------

    def quantize(self, y: mx.array) -> mx.array:
        """Codes (uint32, unpacked) of rotated unit coordinates: how many thresholds each
        coordinate exceeds. Up to 4 bits one broadcast comparison against all thresholds
        is cheaper than a binary search's gather per level; above that, binary search."""
        if self.bits <= 4:
            return (y[..., None] > self.thresholds).astype(mx.uint32).sum(axis=-1).astype(mx.uint32)
        code = mx.zeros(y.shape, dtype=mx.uint32)
        step = 1 << (self.bits - 1)
        while step:
            probe = self.thresholds[(code + (step - 1)).astype(mx.int32)]
            code = mx.where(y > probe, code + step, code)
            step >>= 1
        return code

    def pack(self, codes: mx.array) -> mx.array:
        """(..., dim) codes -> (..., words) uint32."""
        if self._shifts is not None:  # no code spans two words: shift each into place, add
            per = 32 // self.bits
            pad = self.words * per - self.dim
            if pad:
                codes = mx.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
            codes = codes.reshape(*codes.shape[:-1], self.words, per)
            return (codes << self._shifts).sum(axis=-1).astype(mx.uint32)
        parts = codes[..., self._pidx]  # (..., words, k)
        parts = ((parts << self._lsh) >> self._rsh) * self._keep
        return parts.sum(axis=-1).astype(mx.uint32)

    def unpack(self, packed: mx.array) -> mx.array:
        if self._shifts is not None:
            codes = (packed[..., None] >> self._shifts) & self._mask  # (..., words, 32 // bits)
            return codes.reshape(*packed.shape[:-1], -1)[..., : self.dim]
        lo = packed[..., self._w0] >> self._s0
        hi = (packed[..., self._w1] << self._s1) * self._spans
        return (lo | hi) & self._mask

    # --- vectors -----------------------------------------------------------------

    def encode(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (..., dim) -> (norms (..., 1) float32, packed codes (..., words) uint32)."""
        x = x.astype(mx.float32)
        norms = mx.linalg.norm(x, axis=-1, keepdims=True)
        unit = x / mx.maximum(norms, 1e-30)
        return norms, self.pack(self.quantize(self.rotate(unit)))

    def lookup(self, packed: mx.array) -> mx.array:
        """Codebook values (float32, rotated basis, unit norm) of packed codes."""
        if self._byte_table is not None:
            lead = packed.shape[:-1]
            values = self._byte_table[mx.view(packed, mx.uint8)]  # little-endian: byte j holds codes j*per..
            return values.reshape(*lead, -1)[..., : self.dim]
        return self.centroids[self.unpack(packed).astype(mx.int32)]

    def decode(self, norms: mx.array, packed: mx.array, dtype=mx.float32) -> mx.array:
        if packed.size == 0:
            return mx.zeros((*packed.shape[:-1], self.dim), dtype)
        return (self.unrotate(self.lookup(packed)) * norms).astype(dtype)

    def decode_rotated(self, norms: mx.array, packed: mx.array, dtype=mx.float32) -> mx.array:
        """The vectors in the rotated basis (codebook value x norm, no inverse rotation):
        attention with rotated queries needs only these, since Pi is orthogonal."""
        if packed.size == 0:
            return mx.zeros((*packed.shape[:-1], self.dim), dtype)
        return (self.lookup(packed) * norms).astype(dtype)

    def nbytes_per_vector(self) -> int:
        return 4 * self.words + 4  # packed codes + a float32 norm


@lru_cache(maxsize=None)
def get_codec(dim: int, bits: int = 4, seed: int = 0) -> TurboQuantCodec:
    return TurboQuantCodec(dim, bits, seed)
