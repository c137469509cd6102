"""engine/decode_attention.py on the CPU: the CUDA kernels cannot run here, so their
arithmetic is emulated in numpy block by block, from the very launch parameters and
inputs the Python side hands `mx.fast.cuda_kernel` (grid, template, views), following
the kernels' index rules (a block's columns, each row's code/dense boundary, the bit
position of each code, the in-place butterfly, the split reduce). The real kernels are
checked on the GPU by bench/check_decode_kernels.py; here: the launch code and index
arithmetic, the routing, and that nothing changes where CUDA is absent."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from engine import decode_attention
from engine.batch_cache import RowBatchKVCache
from engine.tq_cache import BatchTurboQuantKVCache, TurboQuantKVCache, _hooked


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)) if a.dtype != mx.uint32 and a.dtype != mx.int32 else np.array(a)


def _blocks(template, grid, threadgroup):
    t = dict(template)
    nt = t["NW"] * 32
    assert threadgroup == (nt, 1, 1) and grid[0] % nt == 0
    return t, grid[0] // nt, grid[1], grid[2]


def _butterfly(x: np.ndarray) -> np.ndarray:
    """The kernels' in-place Walsh-Hadamard stages over the last axis (no scaling)."""
    x = x.copy()
    d = x.shape[-1]
    hh = 1
    while hh < d:
        j = np.arange(d // 2)
        lo = (j // hh) * 2 * hh + j % hh
        a, c = x[..., lo].copy(), x[..., lo + hh].copy()
        x[..., lo], x[..., lo + hh] = a + c, a - c
        hh *= 2
    return x


def _unpack(codes: np.ndarray, bits: int, dim: int) -> np.ndarray:
    """Codes of coordinate d = 8 * sub + i as a lane reads them: from bit
    (sub * 8 * bits) % 32 + i * bits of word (sub * 8 * bits) // 32 (and the next word past 32)."""
    out = np.zeros(codes.shape[:-1] + (dim,), np.int64)
    for sub in range(dim // 8):
        first = sub * 8 * bits
        w0 = codes[..., first // 32].astype(np.uint64)
        w1 = codes[..., first // 32 + 1].astype(np.uint64) if 8 * bits > 32 else np.zeros_like(w0)
        for i in range(8):
            bit = first % 32 + i * bits
            out[..., sub * 8 + i] = ((w0 >> bit) if bit < 32 else (w1 >> (bit - 32))) & ((1 << bits) - 1)
    return out


def _partial(qs, keys, values):
    """One block's softmax statistics and unnormalised output over its columns."""
    sc = qs @ keys.T
    m = sc.max(axis=1)
    p = np.exp(sc - m[:, None])
    return m, p.sum(axis=1), p @ values


def emulated_dense(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
    q, k, v, lp, params = (_np(a) for a in inputs)
    t, S, H, B = _blocks(template, grid, threadgroup)
    D, G, CHUNK = t["D"], t["G"], t["CHUNK"]
    HQ, end = H * G, k.shape[2]
    o = np.zeros((B * HQ, S, D), np.float32)
    ml = np.zeros((B * HQ, S, 2), np.float32)
    for b in range(B):
        for h in range(H):
            for s in range(S):
                r = slice(b * HQ + h * G, b * HQ + h * G + G)
                c0, c1 = max(s * CHUNK, lp[b]), min((s + 1) * CHUNK, end)
                if c0 >= c1:
                    ml[r, s] = (-np.inf, 0.0)
                    continue
                assert c1 - c0 <= CHUNK
                m, l, acc = _partial(params[0] * q[b, h * G : h * G + G, 0], k[b, h, c0:c1], v[b, h, c0:c1])
                ml[r, s, 0], ml[r, s, 1], o[r, s] = m, l, acc
    assert (o.size,) == output_shapes[0] and ml.shape == output_shapes[1]
    return [mx.array(o.reshape(-1)), mx.array(ml)]


def emulated_tq(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
    q, kn, kc, vn, vc, tk, tv, lp, signs, cent, params = (_np(a) for a in inputs)
    t, S, H, B = _blocks(template, grid, threadgroup)
    D, G, CHUNK, BITS, GROUP, NQ = t["D"], t["G"], t["CHUNK"], t["BITS"], t["GROUP"], t["NQ"]
    HQ, end = H * G, kc.shape[2]
    ws, prev = end - tk.shape[2], end - NQ
    kd, vd = cent[_unpack(kc, BITS, D)], cent[_unpack(vc, BITS, D)]  # codebook values, rotated basis
    o = np.zeros((B * HQ, S, D), np.float32)
    ml = np.zeros((B * HQ, S, 2), np.float32)
    for b in range(B):
        bound = lp[b] + min(prev - lp[b], (end - lp[b]) // GROUP * GROUP)
        for h in range(H):
            qs = params[0] * q[b, h * G : h * G + G, 0]
            qr = _butterfly(qs * signs) / np.sqrt(D)
            for s in range(S):
                r = slice(b * HQ + h * G, b * HQ + h * G + G)
                tail = s == S - 1
                c0 = max(bound, lp[b]) if tail else max(s * CHUNK, lp[b])
                c1 = end if tail else min((s + 1) * CHUNK, bound)
                if c0 >= c1:
                    ml[r, s] = (-np.inf, 0.0)
                    continue
                assert c1 - c0 <= CHUNK
                if tail:
                    m, l, acc = _partial(qs, tk[b, h, c0 - ws : c1 - ws], tv[b, h, c0 - ws : c1 - ws])
                else:
                    m, l, acc = _partial(qr, kd[b, h, c0:c1] * kn[b, h, c0:c1], vd[b, h, c0:c1] * vn[b, h, c0:c1])
                ml[r, s, 0], ml[r, s, 1], o[r, s] = m, l, acc
    assert (o.size,) == output_shapes[0] and ml.shape == output_shapes[1]
    return [mx.array(o.reshape(-1)), mx.array(ml)]


def emulated_reduce(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
    o, ml, signs = (_np(a) for a in inputs)
    t = dict(template)
    D, rot = t["D"], t["ROT"]
    R, S = ml.shape[0], ml.shape[1]
    assert threadgroup == (D, 1, 1) and grid == (R * D, 1, 1)
    o = o.reshape(R, S, D)
    M = ml[:, :, 0].max(axis=1, keepdims=True)
    w = np.where(np.isinf(ml[:, :, 0]), 0.0, np.exp(ml[:, :, 0] - M))
    L = (w * ml[:, :, 1]).sum(axis=1)
    if rot:
        out = _butterfly((w[:, :-1, None] * o[:, :-1]).sum(axis=1)) / np.sqrt(D) * signs + w[:, -1:] * o[:, -1]
    else:
        out = (w[:, :, None] * o).sum(axis=1)
    out = out / L[:, None]
    return [mx.array(out.reshape(output_shapes[0]).astype(np.float32)).astype(output_dtypes[0])]


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(decode_attention, "available", lambda: True)
    monkeypatch.setattr(decode_attention, "_dense_kernel", lambda: emulated_dense)
    monkeypatch.setattr(decode_attention, "_tq_kernel", lambda: emulated_tq)
    monkeypatch.setattr(decode_attention, "_reduce_kernel", lambda: emulated_reduce)
    monkeypatch.setattr(decode_attention, "_encode_kernel", lambda: emulated_encode)
    decode_attention.set_mode("on")
    yield
    decode_attention.set_mode("on")


def _plain(q, k, v, cache, scale, mask, sinks=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _padded_dense(lengths, heads, dim, seed=0):
    mx.random.seed(seed)
    rows = []
    for n in lengths:
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, heads, n, dim)), mx.random.normal((1, heads, n, dim)))
        rows.append(c)
    return RowBatchKVCache.merge(rows)


@pytest.mark.parametrize("lengths,q_heads,kv_heads,dim", [
    ([300, 17, 129], 8, 2, 64),  # GQA 4, several splits, a row shorter than one split
    ([70, 5], 4, 2, 16),  # the fixture's shape
    ([1100, 1000], 3, 1, 32),  # G = 3
])
def test_dense_kernel_arithmetic_equals_masked_sdpa_over_padded_rows(emulated, lengths, q_heads, kv_heads, dim):
    batch = _padded_dense(lengths, kv_heads, dim)
    mask = batch.make_mask(1)  # as the model builds it, before the layers add this token
    B = len(lengths)
    keys, values = batch.update_and_fetch(mx.random.normal((B, kv_heads, 1, dim)), mx.random.normal((B, kv_heads, 1, dim)))
    q = mx.random.normal((B, q_heads, 1, dim))
    assert decode_attention.use_dense(batch, q, keys, mask)
    got = _hooked(_plain)(q, keys, values, cache=batch, scale=0.2, mask=mask)
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.2, mask=mask)
    assert got.shape == ref.shape and mx.abs(got - ref).max().item() < 1e-4


def test_unpadded_dense_rows_keep_mlx_attention_unless_asked(emulated):
    batch = _padded_dense([40, 40], 2, 64)
    q = mx.random.normal((2, 4, 1, 64))
    keys, _ = batch.update_and_fetch(mx.random.normal((2, 2, 1, 64)), mx.random.normal((2, 2, 1, 64)))
    assert batch.make_mask(1) is None and not decode_attention.use_dense(batch, q, keys, None)
    decode_attention.set_mode("all")
    assert decode_attention.use_dense(batch, q, keys, None)
    assert not decode_attention.use_dense(KVCache(), q, keys, None)  # one row's cache: MLX's own path
    assert not decode_attention.use_dense(batch, mx.random.normal((2, 4, 3, 64)), keys, None)  # a prefill chunk


def _tq_rows(chunks_per_row, bits, heads, dim, group, seed=0):
    mx.random.seed(seed)
    rows = []
    for chunks in chunks_per_row:
        c = TurboQuantKVCache(kv_bits=bits, group=group)
        for n in chunks:
            c.update_and_fetch(mx.random.normal((1, heads, n, dim)), mx.random.normal((1, heads, n, dim)))
        rows.append(c)
    return rows


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_tq_kernel_arithmetic_equals_attention_over_the_decoded_row(emulated, bits):
    cache = _tq_rows([[150, 9]], bits, 2, 64, group=16)[0]  # codes and a dense tail
    for _ in range(20):  # crosses group boundaries: the dense window shifts
        keys, values = cache.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
        q = mx.random.normal((1, 8, 1, 64))
        ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125)
        got = cache.attend(q, 0.125, None)
        assert mx.abs(got - ref).max().item() < 1e-4


def test_tq_kernel_arithmetic_over_left_padded_rows(emulated):
    rows = _tq_rows([[300], [7, 30, 1], [16], [40, 3]], 4, 2, 32, group=16, seed=5)
    batch = BatchTurboQuantKVCache.merge(rows[:3])
    batch.extend(BatchTurboQuantKVCache.merge(rows[3:]))
    for _ in range(40):
        mask = batch.make_mask(1)
        keys, values = batch.update_and_fetch(mx.random.normal((4, 2, 1, 32)), mx.random.normal((4, 2, 1, 32)))
        assert decode_attention.tq_bounds(batch._idx, batch._pads, batch.group) == batch._step[3]
        q = mx.random.normal((4, 6, 1, 32))
        ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.3, mask=mask)
        assert mx.abs(batch.attend(q, 0.3, mask) - ref).max().item() < 1e-4


def test_tq_kernel_takes_decode_steps_only_and_the_cpu_keeps_mlx_ops(emulated, monkeypatch):
    cache = _tq_rows([[100]], 4, 2, 64, group=16)[0]
    calls = []
    real = decode_attention.tq_attend
    monkeypatch.setattr(decode_attention, "tq_attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache.update_and_fetch(mx.random.normal((1, 2, 5, 64)), mx.random.normal((1, 2, 5, 64)))
    cache.attend(mx.random.normal((1, 4, 5, 64)), 0.125, "causal")  # a prefill chunk: MLX ops
    assert not calls
    cache.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
    cache.attend(mx.random.normal((1, 4, 1, 64)), 0.125, None)
    assert calls == [1]
    cache3 = _tq_rows([[100]], 3, 2, 64, group=16)[0]  # 3 bits: codes straddle words, no kernel variant
    cache3.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
    cache3.attend(mx.random.normal((1, 4, 1, 64)), 0.125, None)
    assert calls == [1]


def test_without_cuda_nothing_takes_the_kernels():
    assert not decode_attention.available()  # the CPU (CI): MLX's attention everywhere
    batch = _padded_dense([30, 3], 2, 64)
    mask = batch.make_mask(1)
    keys, _ = batch.update_and_fetch(mx.random.normal((2, 2, 1, 64)), mx.random.normal((2, 2, 1, 64)))
    q = mx.random.normal((2, 4, 1, 64))
    assert not decode_attention.use_dense(batch, q, keys, mask)
    assert not decode_attention.use_tq(q, 2, 4, 64)


def test_split_sizes_fill_the_gpu_and_fit_shared_memory():
    assert decode_attention.split_chunk(4096, 8, 1, 4) == 64  # 64 splits x 8 heads
    assert decode_attention.split_chunk(32768, 8, 1, 4) == 256  # 1,024 blocks
    assert decode_attention.split_chunk(100000, 8, 1, 4) == 1024  # 98 x 8 = 784 blocks on 132 SMs
    assert decode_attention.split_chunk(100000, 8, 8, 8) == 512  # G = 8: 8 x 512 scores fill 16 KB
    assert decode_attention.split_chunk(100, 8, 8, 4, at_least=65) == 128  # a dense window of 65 columns
    assert decode_attention.split_chunk(100, 8, 1, 8, at_least=600) is None


def test_greedy_tokens_through_the_kernel_arithmetic_equal_the_mlx_ops_path(emulated):
    """The fixture model (head dim 16) over 160 greedy tokens, one TurboQuant row: the
    emulated kernel path gives the same tokens as today's MLX-ops path."""
    from engine.model_files import load_model_dir
    from engine.tq_cache import make_tq_cache
    from tests.conftest import TINY_MODEL

    model, _, _ = load_model_dir(TINY_MODEL, "float32")
    prompt = mx.array([[(i * 37 + 11) % 500 + 3 for i in range(90)]])

    def greedy():
        cache = make_tq_cache(model, bits=4)
        token = mx.argmax(model(prompt, cache=cache)[:, -1:], axis=-1)
        out = []
        for _ in range(160):
            token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
            out.append(token.item())
        return out

    with_kernel = greedy()
    decode_attention.set_mode("off")
    assert greedy() == with_kernel


def emulated_encode(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
    """`_ENCODE_SOURCE` per warp: norm, unit vector x signs, the butterfly / sqrt(D), codes
    counted against the thresholds, packed from bit (i * BITS) % 32 of word (i * BITS) // 32."""
    k, v, signs, thr = (_np(a) for a in inputs)
    t = dict(template)
    D, BITS = t["D"], t["BITS"]
    assert threadgroup == (32, 1, 1) and grid[0] == 2 * (k.size // D) * 32
    outs = []
    for x in (k.reshape(-1, D), v.reshape(-1, D)):
        norm = np.sqrt((x * x).sum(axis=1)).astype(np.float32)
        y = _butterfly(x / np.maximum(norm, 1e-30)[:, None] * signs) / np.float32(np.sqrt(D))
        codes = (y[:, :, None] > thr).sum(axis=2).astype(np.uint64)
        words = np.zeros((x.shape[0], D * BITS // 32), np.uint64)
        for i in range(D):
            words[:, i * BITS // 32] |= codes[:, i] << np.uint64(i * BITS % 32)
        outs += [mx.array(norm), mx.array(words.astype(np.uint32))]
    return outs


@pytest.mark.parametrize("bits,dim", [(4, 128), (2, 64), (8, 256), (1, 32), (8, 64)])
def test_fused_encode_packs_codes_as_the_codec_does(monkeypatch, bits, dim):
    from engine.turboquant import get_codec

    monkeypatch.setattr(decode_attention, "available", lambda: True)
    monkeypatch.setattr(decode_attention, "_encode_kernel", lambda: emulated_encode)
    codec = get_codec(dim, bits)
    keys, values = mx.random.normal((2, 3, 5, dim)), mx.random.normal((2, 3, 5, dim)) * 3
    assert decode_attention.use_encode(keys, values, codec)
    kn, kc, vn, vc = decode_attention.encode_kv(keys, values, codec)
    for (norms, codes), x in (((kn, kc), keys), ((vn, vc), values)):
        ref_norms, ref_codes = codec.encode(x)
        assert norms.shape == ref_norms.shape and codes.shape == ref_codes.shape
        assert mx.allclose(norms, ref_norms, rtol=1e-6).item()
        # float32 rounding in another order may move a coordinate sitting on a threshold
        same = (codec.unpack(codes) == codec.unpack(ref_codes)).astype(mx.float32).mean().item()
        assert same > 0.999


def test_tq_cache_encodes_through_the_fused_kernel_where_it_applies(monkeypatch):
    monkeypatch.setattr(decode_attention, "available", lambda: True)
    calls = []
    monkeypatch.setattr(decode_attention, "_encode_kernel", lambda: lambda **kw: calls.append(1) or emulated_encode(**kw))
    cache = TurboQuantKVCache(kv_bits=4, group=16)
    ref = TurboQuantKVCache(kv_bits=4, group=16)
    kv = mx.random.normal((1, 2, 40, 64))
    cache.update_and_fetch(kv, kv)
    assert calls == [1]
    monkeypatch.setattr(decode_attention, "available", lambda: False)
    ref.update_and_fetch(kv, kv)
    assert calls == [1]
    same = (cache.k.codes[:, :, :40] == ref.k.codes[:, :, :40]).astype(mx.float32).mean().item()
    assert same > 0.99 and mx.allclose(cache.k.norms[:, :, :40], ref.k.norms[:, :, :40]).item()
