"""engine/kernels/ on the CPU: the CUDA kernels cannot run here, so their
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

import functools

from engine.kernels import common, selector, tq_decode, tq_encode, tq_split
from engine.batch_cache import RowBatchKVCache
from engine.tq_cache import BatchTurboQuantKVCache, TurboQuantKVCache
from engine.attention_hook import _hooked


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


def tq_split_blocks(lp, B, H, G, S, CHUNK, GROUP, end, prev, ml):
    """(b, h, s, rows, tail, c0, c1) of every TurboQuant split block with columns, by the
    kernels' own boundaries (v2, v3 and v4 share them): blocks of CHUNK code columns up to
    the last full group a row has seen (`bound`), the last split for the dense tail past it.
    An empty block gets the empty partial (-inf, 0) in `ml` and is not yielded."""
    HQ = H * G
    for b in range(B):
        bound = lp[b] + min(prev - lp[b], (end - lp[b]) // GROUP * GROUP)
        for h in range(H):
            for s in range(S):
                r = slice(b * HQ + h * G, b * HQ + h * G + G)
                tail = s == S - 1
                c0 = max(bound, lp[b]) if tail else max(s * CHUNK, lp[b])
                c1 = end if tail else min((s + 1) * CHUNK, bound)
                if c0 >= c1:
                    ml[r, s] = (-np.inf, 0.0)
                    continue
                assert c1 - c0 <= CHUNK
                yield b, h, s, r, tail, c0, c1


def emulated_tq(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
    q, kn, kc, vn, vc, tk, tv, lp, signs, cent, params = (_np(a) for a in inputs)
    t, S, H, B = _blocks(template, grid, threadgroup)
    D, G, CHUNK, BITS, GROUP, NQ = t["D"], t["G"], t["CHUNK"], t["BITS"], t["GROUP"], t["NQ"]
    HQ, end = H * G, kc.shape[2]
    ws, prev = end - tk.shape[2], end - NQ
    kd, vd = cent[_unpack(kc, BITS, D)], cent[_unpack(vc, BITS, D)]  # codebook values, rotated basis
    o = np.zeros((B * HQ, S, D), np.float32)
    ml = np.zeros((B * HQ, S, 2), np.float32)
    for b, h, s, r, tail, c0, c1 in tq_split_blocks(lp, B, H, G, S, CHUNK, GROUP, end, prev, ml):
        qs = params[0] * q[b, h * G : h * G + G, 0]
        if tail:
            m, l, acc = _partial(qs, tk[b, h, c0 - ws : c1 - ws], tv[b, h, c0 - ws : c1 - ws])
        else:
            qr = _butterfly(qs * signs) / np.sqrt(D)
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


def _unpack3(codes: np.ndarray, bits: int, dim: int, cpl: int) -> np.ndarray:
    """Codes as a v3 lane reads them: lane `sub` loads words [sub * LW, (sub + 1) * LW) of the row
    (LW = CPL * BITS / 32, one vector load) and coordinate sub * CPL + j * PER + k is bits
    [k * BITS, (k + 1) * BITS) of its word j (PER = 32 / BITS codes per word)."""
    lw, per = cpl * bits // 32, 32 // bits
    assert lw in (1, 2, 4) and codes.shape[-1] == dim // cpl * lw  # one load covers the lane's codes
    out = np.zeros(codes.shape[:-1] + (dim,), np.int64)
    for sub in range(dim // cpl):
        for j in range(lw):
            word = codes[..., sub * lw + j].astype(np.uint64)
            for k in range(per):
                out[..., sub * cpl + j * per + k] = (word >> np.uint64(k * bits)) & np.uint64((1 << bits) - 1)
    return out


def emulated_tq3(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
    """`_TQ3_SOURCE`: blocks as `_TQ_SOURCE`'s (the same columns and boundaries), the lane
    mapping of its code path (CPL coordinates per lane, D / CPL lanes per token, a power of two
    within a warp, G x CPL query registers within the budget) and its own unpacking."""
    q, kn, kc, vn, vc, tk, tv, lp, signs, cent, params = (_np(a) for a in inputs)
    t, S, H, B = _blocks(template, grid, threadgroup)
    D, G, CHUNK, BITS, GROUP, NQ, CPL, U = (t[k] for k in ("D", "G", "CHUNK", "BITS", "GROUP", "NQ", "CPL", "U"))
    lpt = D // CPL
    assert D % CPL == 0 and 32 % lpt == 0 and G * CPL <= tq_split._REGS and U >= 1
    assert G * CHUNK <= common.SMEM_SCORES
    HQ, end = H * G, int(params[1])  # (kc: the cache's whole buffer, columns [0, end) its own)
    assert end <= min(kn.shape[2], kc.shape[2], vn.shape[2], vc.shape[2])
    ws, prev = end - tk.shape[2], end - NQ
    kd, vd = cent[_unpack3(kc, BITS, D, CPL)], cent[_unpack3(vc, BITS, D, CPL)]
    o = np.zeros((B * HQ, S, D), np.float32)
    ml = np.zeros((B * HQ, S, 2), np.float32)
    for b, h, s, r, tail, c0, c1 in tq_split_blocks(lp, B, H, G, S, CHUNK, GROUP, end, prev, ml):
        qs = params[0] * q[b, h * G : h * G + G, 0]
        if tail:
            assert c0 >= ws  # the dense path reads the window only
            m, l, acc = _partial(qs, tk[b, h, c0 - ws : c1 - ws], tv[b, h, c0 - ws : c1 - ws])
        else:
            qr = _butterfly(qs * signs) / np.sqrt(D)  # one warp per head: the same stages
            m, l, acc = _partial(qr, kd[b, h, c0:c1] * kn[b, h, c0:c1], vd[b, h, c0:c1] * vn[b, h, c0:c1])
        ml[r, s, 0], ml[r, s, 1], o[r, s] = m, l, acc
    assert (o.size,) == output_shapes[0] and ml.shape == output_shapes[1]
    return [mx.array(o.reshape(-1)), mx.array(ml)]


def emulated_tq3_reduce(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
    """`_TQ3_REDUCE_SOURCE`: per (row, query head) one block of RW warps; warp w sums splits
    w, w + RW, ... of the rotated part, then the warps' sums, the inverse rotation and the
    dense slot (the same sums as `_REDUCE_SOURCE`, grouped by warp)."""
    o, ml, signs = (_np(a) for a in inputs)
    t = dict(template)
    D, RW = t["D"], t["RW"]
    R, S = ml.shape[0], ml.shape[1]
    assert threadgroup == (RW * 32, 1, 1) and grid == (R * RW * 32, 1, 1)
    o = o.reshape(R, S, D)
    M = ml[:, :, 0].max(axis=1, keepdims=True)
    w = np.where(np.isinf(ml[:, :, 0]), 0.0, np.exp(ml[:, :, 0] - M))
    L = (w * ml[:, :, 1]).sum(axis=1)
    per_warp = [(w[:, k : S - 1 : RW, None] * o[:, k : S - 1 : RW]).sum(axis=1) for k in range(RW)]
    out = _butterfly(sum(per_warp)) / np.sqrt(D) * signs + w[:, -1:] * o[:, -1]
    out = np.where(L[:, None] > 0, out / np.where(L > 0, L, 1)[:, None], 0.0)
    return [mx.array(out.reshape(output_shapes[0]).astype(np.float32)).astype(output_dtypes[0])]


def use_kernels(monkeypatch, kernels) -> None:
    """This process's kernel table (engine/kernels/selector.py) replaced by `kernels` for one test."""
    monkeypatch.setattr(selector, "select", lambda: kernels)


@pytest.fixture
def emulated(monkeypatch):
    """The CUDA table with the CUDA-core kernels emulated (tests/test_dense_mma.py, test_tq_mma.py and
    test_tq_fused.py emulate the tensor-core ones)."""
    from engine.kernels import dense

    use_kernels(monkeypatch, selector.CudaKernels())
    monkeypatch.setattr(dense, "_kernel", lambda: emulated_dense)
    monkeypatch.setattr(dense, "usable_mma", lambda *a: False)  # these tests emulate the CUDA-core kernel
    monkeypatch.setattr(tq_split, "_tq_kernel", lambda: emulated_tq)
    monkeypatch.setattr(common, "_reduce_kernel", lambda: emulated_reduce)
    monkeypatch.setattr(tq_encode, "_encode_kernel", lambda: emulated_encode)
    monkeypatch.setattr(tq_split, "_tq3_kernel", lambda: emulated_tq3)
    monkeypatch.setattr(tq_split, "_tq3_reduce_kernel", lambda: emulated_tq3_reduce)


def takes_dense(kernels, cache, q, keys, mask) -> bool:
    """Whether `kernels` attends this dense step itself (rather than leaving it to MLX)."""
    return kernels.dense_attend(cache, q, keys, keys, 0.1, mask) is not None


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
    assert takes_dense(selector.select(), batch, q, keys, mask)
    got = _hooked(_plain)(q, keys, values, cache=batch, scale=0.2, mask=mask)
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.2, mask=mask)
    assert got.shape == ref.shape and mx.abs(got - ref).max().item() < 1e-4


def test_unpadded_dense_rows_keep_mlx_attention_unless_asked(emulated):
    batch = _padded_dense([40, 40], 2, 64)
    q = mx.random.normal((2, 4, 1, 64))
    keys, _ = batch.update_and_fetch(mx.random.normal((2, 2, 1, 64)), mx.random.normal((2, 2, 1, 64)))
    assert batch.make_mask(1) is None and not takes_dense(selector.select(), batch, q, keys, None)
    every = selector.CudaKernels(dense="all")  # PREFIXTRACE_DECODE_ATTENTION=all
    assert takes_dense(every, batch, q, keys, None)
    assert not takes_dense(every, KVCache(), q, keys, None)  # one row's cache: MLX's own path
    assert not takes_dense(every, batch, mx.random.normal((2, 4, 3, 64)), keys, None)  # a prefill chunk


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
        assert tq_split.bounds(batch._idx, batch._pads, batch.group) == batch._step[3]
        q = mx.random.normal((4, 6, 1, 32))
        ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.3, mask=mask)
        assert mx.abs(batch.attend(q, 0.3, mask) - ref).max().item() < 1e-4


def test_tq_kernel_takes_decode_steps_only_and_the_cpu_keeps_mlx_ops(emulated, monkeypatch):
    cache = _tq_rows([[100]], 4, 2, 64, group=16)[0]
    calls = []
    real = tq_decode.attend
    monkeypatch.setattr(tq_decode, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
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
    assert not common.available()  # the CPU (CI): MLX's attention everywhere
    kernels = selector.select()
    assert type(kernels) is selector.DecodeKernels and not kernels.cuda and not kernels.defer_encode
    batch = _padded_dense([30, 3], 2, 64)
    mask = batch.make_mask(1)
    keys, _ = batch.update_and_fetch(mx.random.normal((2, 2, 1, 64)), mx.random.normal((2, 2, 1, 64)))
    q = mx.random.normal((2, 4, 1, 64))
    assert not takes_dense(kernels, batch, q, keys, mask)
    assert kernels.encode(keys, keys, None) is None and kernels.prebuild_dense(None, 8) == {}


def test_split_sizes_fill_the_gpu_and_fit_shared_memory():
    assert common.split_chunk(4096, 8, 1, 4) == 64  # 64 splits x 8 heads
    assert common.split_chunk(32768, 8, 1, 4) == 256  # 1,024 blocks
    assert common.split_chunk(100000, 8, 1, 4) == 1024  # 98 x 8 = 784 blocks on 132 SMs
    assert common.split_chunk(100000, 8, 8, 8) == 512  # G = 8: 8 x 512 scores fill 16 KB
    assert common.split_chunk(100, 8, 8, 4, at_least=65) == 128  # a dense window of 65 columns
    assert common.split_chunk(100, 8, 1, 8, at_least=600) is None


def test_greedy_tokens_through_the_kernel_arithmetic_equal_the_mlx_ops_path(emulated, monkeypatch):
    """The fixture model (head dim 16) over 160 greedy tokens, one TurboQuant row: the
    emulated kernel path gives the same tokens as today's MLX-ops path."""
    from engine.model_files import load_model_dir
    from engine.tq_config import make_tq_cache
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
    use_kernels(monkeypatch, selector.DecodeKernels())  # PREFIXTRACE_DECODE_ATTENTION=0 (or the CPU)
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

    monkeypatch.setattr(tq_encode, "_encode_kernel", lambda: emulated_encode)
    codec = get_codec(dim, bits)
    keys, values = mx.random.normal((2, 3, 5, dim)), mx.random.normal((2, 3, 5, dim)) * 3
    assert tq_encode.usable(keys, values, codec)
    kn, kc, vn, vc = tq_encode.encode(keys, values, codec)
    for (norms, codes), x in (((kn, kc), keys), ((vn, vc), values)):
        ref_norms, ref_codes = codec.encode(x)
        assert norms.shape == ref_norms.shape and codes.shape == ref_codes.shape
        assert mx.allclose(norms, ref_norms, rtol=1e-6).item()
        # float32 rounding in another order may move a coordinate sitting on a threshold
        same = (codec.unpack(codes) == codec.unpack(ref_codes)).astype(mx.float32).mean().item()
        assert same > 0.999


def test_tq_cache_encodes_through_the_fused_kernel_where_it_applies(monkeypatch):
    use_kernels(monkeypatch, selector.CudaKernels())
    calls = []
    monkeypatch.setattr(tq_encode, "_encode_kernel", lambda: lambda **kw: calls.append(1) or emulated_encode(**kw))
    cache = TurboQuantKVCache(kv_bits=4, group=16)
    ref = TurboQuantKVCache(kv_bits=4, group=16)
    kv = mx.random.normal((1, 2, 40, 64))
    cache.update_and_fetch(kv, kv)
    assert calls == [1]
    use_kernels(monkeypatch, selector.DecodeKernels())
    ref.update_and_fetch(kv, kv)
    assert calls == [1]
    same = (cache.k.codes[:, :, :40] == ref.k.codes[:, :, :40]).astype(mx.float32).mean().item()
    assert same > 0.99 and mx.allclose(cache.k.norms[:, :, :40], ref.k.norms[:, :, :40]).item()


# --- variant v2: deferred encode, in-place dense tail, one launch ----------------------------


def _feed(caches, steps, heads, dim, seed=3, trim_at=None):
    """The same decode steps into each cache; per step, what each returned."""
    mx.random.seed(seed)
    B = caches[0].left_padding.size if hasattr(caches[0], "left_padding") else 1
    seen = []
    for i in range(steps):
        k, v = mx.random.normal((B, heads, 1, dim)), mx.random.normal((B, heads, 1, dim))
        seen.append([c.update_and_fetch(k, v) for c in caches])
        if trim_at == i:
            assert [c.trim(5) for c in caches] == [5] * len(caches)
    return seen


def _same(a, b, tol=0.0):
    if a.shape != b.shape:
        return False
    return a.size == 0 or mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item() <= tol


class _Deferring(selector.DecodeKernels):
    """No kernels, but a decode step's encode deferred while `switch["on"]`."""

    def __init__(self, switch):
        super().__init__()
        self.switch = switch

    @property
    def defer_encode(self):
        return self.switch["on"]


@pytest.mark.parametrize("trim_at", [None, 30])
def test_deferred_encode_keeps_every_position_represented_as_before_one_row(monkeypatch, trim_at):
    """MLX ops (no kernels), deferral forced on for one cache: every step sees the same K/V,
    and the codes it holds afterwards are the same bits, though most steps encoded nothing."""
    deferred, ref = _tq_rows([[37, 5]], 4, 2, 64, group=16) + _tq_rows([[37, 5]], 4, 2, 64, group=16)
    defer = {"on": False}
    use_kernels(monkeypatch, _Deferring(defer))
    pending = []
    mx.random.seed(3)
    for i in range(70):
        k, v = mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64))
        defer["on"] = True
        got = deferred.update_and_fetch(k, v)
        pending.append(deferred._pending)
        defer["on"] = False
        want = ref.update_and_fetch(k, v)
        assert _same(got[0], want[0]) and _same(got[1], want[1]), i
        if trim_at == i:
            assert deferred.trim(5) == ref.trim(5) == 5
    assert max(pending) == 15 and pending.count(0) <= 70 // 16 + 2  # one encode per group of 16
    for a, b in zip(deferred.state, ref.state):
        assert _same(a, b)
    assert deferred._pending == 0  # `state` encoded what was deferred
    assert deferred.nbytes == ref.nbytes


def test_deferred_encode_over_left_padded_rows_joining_and_leaving(monkeypatch):
    rows = _tq_rows([[300], [7, 30, 1], [16], [40, 3]], 4, 2, 32, group=16, seed=5)
    refs = _tq_rows([[300], [7, 30, 1], [16], [40, 3]], 4, 2, 32, group=16, seed=5)
    defer = {"on": False}
    use_kernels(monkeypatch, _Deferring(defer))
    batches = []
    for group in (rows, refs):
        b = BatchTurboQuantKVCache.merge(group[:3])
        b.extend(BatchTurboQuantKVCache.merge(group[3:]))
        batches.append(b)
    got_b, ref_b = batches
    mx.random.seed(4)

    def steps(n, rows_now):
        for i in range(n):
            k, v = mx.random.normal((rows_now, 2, 1, 32)), mx.random.normal((rows_now, 2, 1, 32))
            mask = ref_b.make_mask(1)  # before the layers add this token, as the model builds it
            defer["on"] = True
            got = got_b.update_and_fetch(k, v)
            defer["on"] = False
            want = ref_b.update_and_fetch(k, v)
            assert _same(got[0], want[0]) and _same(got[1], want[1]), i
            q = mx.random.normal((rows_now, 4, 1, 32))
            assert _same(got_b.attend(q, 0.3, mask), ref_b.attend(q, 0.3, mask), 1e-6)

    steps(40, 4)
    one, two = got_b.extract(1), ref_b.extract(1)  # a row leaving takes complete codes
    for a, b in zip(one.state, two.state):
        assert _same(a, b)
    got_b.filter([0, 2, 3])
    ref_b.filter([0, 2, 3])
    steps(25, 3)
    extra = [BatchTurboQuantKVCache.merge(_tq_rows([[50, 2]], 4, 2, 32, group=16, seed=9)) for _ in range(2)]
    got_b.extend(extra[0])
    ref_b.extend(extra[1])
    steps(25, 4)
    assert got_b.nbytes == ref_b.nbytes


def _kernel_calls(monkeypatch):
    calls = {"encode": 0, "tq": 0, "reduce": 0, "tq3": 0, "tq3_reduce": 0}

    def counted(name, f):
        def run(**kw):
            calls[name] += 1
            return f(**kw)
        return lambda: run

    for module, name, f in ((tq_encode, "encode", emulated_encode), (tq_split, "tq", emulated_tq),
                            (common, "reduce", emulated_reduce), (tq_split, "tq3", emulated_tq3),
                            (tq_split, "tq3_reduce", emulated_tq3_reduce)):
        monkeypatch.setattr(module, f"_{name}_kernel", counted(name, f))
    return calls


def test_a_hooked_step_with_attention_sinks_still_gets_the_decoded_kv(emulated):
    """Attention sinks go to mlx-lm's own function: a hooked step that skipped building the
    decoded K/V must build them there, not hand it the dense columns alone."""
    cache, ref = _tq_rows([[100, 3]], 4, 2, 64, group=16) + _tq_rows([[100, 3]], 4, 2, 64, group=16)
    cache.hooked = True
    k, v = mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64))
    keys, values = cache.update_and_fetch(k, v)
    assert keys.shape[2] < cache.size()  # the cheap return
    want_k, want_v = ref.update_and_fetch(k, v)
    seen = []
    hook = _hooked(lambda q, k, v, cache, scale, mask, sinks=None: seen.append((k, v)) or q)
    hook(mx.random.normal((1, 4, 1, 64)), keys, values, cache=cache, scale=0.125, mask=None, sinks=mx.zeros((4,)))
    assert _same(seen[0][0], want_k) and _same(seen[0][1], want_v)


# --- the split kernel: wide code loads, the dense tail on its own path, a split-parallel reduce -------


@pytest.mark.parametrize("q_heads,kv_heads,dim,bits,load", [
    (8, 2, 128, 4, 8),  # G = 4, 16 codes per lane: the Qwen3-8B shape's lane mapping
    (8, 2, 128, 4, 4),
    (16, 2, 128, 4, 8),  # G = 8: 16 coordinates per lane (G x CPL <= 128)
    (6, 2, 64, 2, 8),  # G = 3, 2 bits: 32 per lane (8 bytes)
    (4, 2, 64, 8, 8),  # G = 2, 8 bits: 8 codes per 8-byte load
    (2, 2, 16, 4, 8),  # G = 1, head dim 16: one lane per token
    (4, 2, 16, 2, 8),  # head dim 16 at 2 bits: one 4-byte word per token
])
def test_split_kernel_arithmetic_over_one_row_and_left_padded_rows(emulated, monkeypatch, q_heads, kv_heads, dim,
                                                                 bits, load):
    calls = _kernel_calls(monkeypatch)
    monkeypatch.setattr(tq_split, "cpl", functools.partial(tq_split.cpl, load=load))
    for rows in ([[150, 9]], [[300], [7, 30, 1], [16], [40, 3]]):
        group = _tq_rows(rows, bits, kv_heads, dim, group=16, seed=len(rows))
        cache = group[0] if len(group) == 1 else BatchTurboQuantKVCache.merge(group)
        cache.hooked = True
        B = len(rows)
        for step in range(20):  # across group boundaries: deferred codes land, the window shifts
            mask = cache.make_mask(1) if B > 1 else None
            keys, values = cache.update_and_fetch(mx.random.normal((B, kv_heads, 1, dim)),
                                                  mx.random.normal((B, kv_heads, 1, dim)))
            q = mx.random.normal((B, q_heads, 1, dim))
            got = cache.attend(q, dim ** -0.5, mask)
            ref_k, ref_v = cache._fetch(rotated=False)
            ref = mx.fast.scaled_dot_product_attention(q, ref_k, ref_v, scale=dim ** -0.5, mask=mask)
            assert got.shape == ref.shape and mx.abs(got - ref).max().item() < 1e-4, (rows, step)
    assert calls["tq3"] == calls["tq3_reduce"] == 40 and calls["tq"] == calls["reduce"] == 0


def test_split_kernel_lane_mapping_rules():
    cpl = tq_split.cpl
    assert cpl(4, 128, 4) == 16  # one 8-byte load of 16 codes per lane, 8 lanes per token (measured fastest)
    assert cpl(4, 128, 4, load=4) == 8
    assert cpl(8, 128, 4) == 16 and cpl(8, 128, 1) is None  # 1 bit at G = 8: 8 x 32 registers, the generic kernel
    assert cpl(4, 128, 8) == 8 and cpl(4, 128, 2) == 32 and cpl(1, 128, 2) == 32
    assert cpl(2, 16, 1) is None  # 16 one-bit codes: less than one word per token
    assert tq_split.unroll(32, 4) == 2 and tq_split.unroll(8, 4) == 8


def test_the_generic_kernel_takes_what_the_split_kernel_has_no_lane_mapping_for(emulated, monkeypatch):
    calls = _kernel_calls(monkeypatch)
    cache = _tq_rows([[100]], 1, 2, 16, group=16)[0]  # 1 bit x 16 coordinates: 2 bytes a token
    cache.update_and_fetch(mx.random.normal((1, 2, 1, 16)), mx.random.normal((1, 2, 1, 16)))
    keys, values = cache._fetch(rotated=False)
    q = mx.random.normal((1, 4, 1, 16))
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.25)
    assert mx.abs(cache.attend(q, 0.25, None) - ref).max().item() < 1e-4
    assert calls["tq3"] == 0 and calls["tq"] == calls["reduce"] == 1


def test_greedy_tokens_through_the_split_arithmetic_equal_the_mlx_ops_path(emulated, monkeypatch):
    """The fixture model (head dim 16, G = 2), a single row and a left-padded batch of three, 120
    greedy tokens: the emulated v3 kernels give today's MLX-ops tokens."""
    from engine.model_files import load_model_dir
    from engine.tq_config import make_tq_cache
    from tests.conftest import TINY_MODEL

    model, _, _ = load_model_dir(TINY_MODEL, "float32")
    prompts = [[(i * 13 + 5) % 500 + 3 for i in range(n)] for n in (190, 17, 75)]

    def greedy(rows):
        per_row = []
        for p in rows:
            cache = make_tq_cache(model, bits=4)
            for a in range(0, len(p) - 1, 64):
                model(mx.array([p[a : min(a + 64, len(p) - 1)]]), cache=cache)
            per_row.append(cache)
        cache = per_row[0] if len(rows) == 1 else [
            RowBatchKVCache.merge([r[i] for r in per_row]) if type(per_row[0][i]) is KVCache
            else per_row[0][i].merge([r[i] for r in per_row]) for i in range(len(per_row[0]))]
        tokens = mx.array([[p[-1]] for p in rows])
        out = []
        for _ in range(120):
            tokens = mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1)[:, None]
            out.append(tokens[:, 0].tolist())
        return out

    cuda = selector.select()
    for rows in (prompts[:1], prompts):
        use_kernels(monkeypatch, selector.DecodeKernels())
        ref = greedy(rows)
        use_kernels(monkeypatch, cuda)
        assert greedy(rows) == ref


def _byte_perm(x: np.ndarray, y: int, sel: int) -> np.ndarray:
    """CUDA's __byte_perm: byte i of the result is byte (sel >> 4i) & 7 of the 8 bytes y:x."""
    both = (np.uint64(y) << np.uint64(32)) | x.astype(np.uint64)
    out = np.zeros_like(x, dtype=np.uint64)
    for i in range(4):
        pick = (sel >> (4 * i)) & 7
        out |= ((both >> np.uint64(8 * pick)) & np.uint64(0xFF)) << np.uint64(8 * i)
    return out.astype(np.uint32)


def test_v3_nibble_offsets_equal_shift_and_mask():
    """`centroid`'s NIB path (4 bits): the byte offset of code k from two shifted, masked copies of
    the word and one byte permute equals 4 x ((w >> 4k) & 15), for every k and random words."""
    w = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    w[:2] = (0, 0xFFFFFFFF)
    lo = (w << np.uint32(2)) & np.uint32(0x3C3C3C3C)
    hi = (w >> np.uint32(2)) & np.uint32(0x3C3C3C3C)
    for k in range(8):
        off = _byte_perm(hi if k & 1 else lo, 0, 0x4440 + (k >> 1))
        assert (off == ((w >> np.uint32(4 * k)) & np.uint32(15)) * np.uint32(4)).all(), k
