"""engine/kernels/tq_mma.py (the TurboQuant tensor-core split kernel) on the CPU.

The kernel cannot run here, so `emulated_tq4` replays its blocks in numpy lane by lane: each lane's
MMA fragment registers are built from the codes exactly as the source builds them (which 16
bytes a lane loads, which code byte feeds which register, the two-token nibble merge of the
values, the permuted token order of P, the query columns >= G left zero), every element is
rounded to f16 where the kernel packs it, and the m16n8k16 MMA is applied through the PTX
fragment layout (A, B scattered into 16x16 / 16x8 matrices by lane, C gathered back). With the
rounding switched off the emulation must equal the CUDA-core split kernel's arithmetic
(`emulated_tq3`) on the same inputs to float precision: that checks the permutations; with it on,
the step must stay within the bf16 tolerance of attention over the decoded cache. What runs on the
GPU is checked by bench/check_decode_kernels.py; the sources compile here where nvcc is."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kernels import common, dense, prebuild, selector, tq_decode, tq_encode, tq_fused, tq_mma, tq_split  # noqa: F401
from engine.tq_cache import BatchTurboQuantKVCache, TurboQuantKVCache
from tests.test_decode_attention import (  # noqa: F401
    _blocks, _butterfly, _kernel_calls, _np, emulated, emulated_tq3, emulated_tq3_reduce, tq_split_blocks,
)

ROUND = {"on": True}

# PTX m16n8k16 fragment layout, per lane (gq = lane >> 2, tq = lane & 3): A reg r, half e ->
# (row, col); B reg r, half e -> (row, col); C element i -> (row, col).
_LANE = np.arange(32)
_GQ, _TQ = _LANE >> 2, _LANE & 3
_AR = np.stack([_GQ, _GQ + 8, _GQ, _GQ + 8], 1)[:, :, None].repeat(2, 2)
_AC = np.stack([2 * _TQ, 2 * _TQ, 2 * _TQ + 8, 2 * _TQ + 8], 1)[:, :, None] + np.arange(2)
_BR = np.stack([2 * _TQ, 2 * _TQ + 8], 1)[:, :, None] + np.arange(2)
_BC = np.broadcast_to(_GQ[:, None, None], (32, 2, 2))
_CR = np.stack([_GQ, _GQ, _GQ + 8, _GQ + 8], 1)
_CC = np.stack([2 * _TQ, 2 * _TQ + 1, 2 * _TQ, 2 * _TQ + 1], 1)


def _f16(x):
    x = np.asarray(x, np.float64)
    return x.astype(np.float16).astype(np.float64) if ROUND["on"] else x


def _mma(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (..., 32, 4, 2), b (..., 32, 2, 2) lane registers (low half first) -> C (..., 32, 4)."""
    A = np.zeros(a.shape[:-3] + (16, 16))
    B = np.zeros(b.shape[:-3] + (16, 8))
    A[..., _AR, _AC] = a
    B[..., _BR, _BC] = b
    C = A @ B
    return C[..., _CR, _CC]


def _pairs(cent: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The pair table's entry for code bytes idx: (c[low nibble], c[high nibble]), f16."""
    return np.stack([_f16(cent[idx & 15]), _f16(cent[idx >> 4])], -1)


def _byte(x: np.ndarray, by) -> np.ndarray:
    return (x >> np.uint32(8 * by)) & np.uint32(0xFF)


def _scores(qr, kw, kn, cent, G, D):
    """One block's scores (G, n): tiles of 16 tokens, the K fragments of `_K4`."""
    n = kw.shape[0]
    nt = -(-n // 16)
    w = np.zeros((nt * 16, kw.shape[1]), np.uint32)
    w[:n] = kw
    KW, KM = D // 32, D // 16
    tok0 = np.arange(nt)[:, None] * 16 + _GQ  # (nt, 32): rows gq
    tok1 = tok0 + 8
    qg = np.where(_GQ < G, _GQ, 0)
    c = np.zeros((nt, 32, 4))
    for j in range(KM):
        word = _TQ * KW + (j >> 1)  # the lane's words: [tq * KW, (tq + 1) * KW)
        by = 2 * (j & 1)
        x0, x1 = w[tok0, word], w[tok1, word]
        a = np.stack([_pairs(cent, _byte(x0, by)), _pairs(cent, _byte(x1, by)),
                      _pairs(cent, _byte(x0, by + 1)), _pairs(cent, _byte(x1, by + 1))], -2)
        d = (D // 4) * _TQ + 4 * j
        b = np.stack([np.stack([qr[qg, d], qr[qg, d + 1]], -1), np.stack([qr[qg, d + 2], qr[qg, d + 3]], -1)], -2)
        b = np.where((_GQ < G)[:, None, None], _f16(b), 0.0)
        c += _mma(a, np.broadcast_to(b, (nt, 32, 2, 2)))
    sc = np.full((G, nt * 16), np.nan)
    nr = np.zeros(nt * 16)
    nr[:n] = kn
    for i, (tok, q) in enumerate(((tok0, 2 * _TQ), (tok0, 2 * _TQ + 1), (tok1, 2 * _TQ), (tok1, 2 * _TQ + 1))):
        keep = np.broadcast_to(q < G, tok.shape)
        sc[np.broadcast_to(q, tok.shape)[keep], tok[keep]] = (c[..., i] * nr[tok])[keep]
    return sc[:, :n]


def _values(p, vw, vn, cent, G, D):
    """One block's unnormalised output (G, D) from probabilities p (G, n): `_V4`'s fragments."""
    n = vw.shape[0]
    nt = -(-n // 16)
    w = np.zeros((nt * 16, vw.shape[1]), np.uint32)
    w[:n] = vw
    pp = np.zeros((G, nt * 16))
    pp[:, :n] = p * vn[None, :]
    VW, VM = D // 64, D // 16
    qg = np.where(_GQ < G, _GQ, 0)
    o = np.zeros((VM, 32, 4))
    for tile in range(nt):
        tok = tile * 16 + 4 * _TQ[:, None] + np.arange(4)  # (32, 4): tokens 4tq .. 4tq+3
        pr = np.where((_GQ < G)[:, None], pp[qg[:, None], tok], 0.0)
        b = _f16(pr.reshape(32, 2, 2))  # b0 = (tok 0, tok 1), b1 = (tok 2, tok 3)
        for j in range(VW):
            v_word_mmas(o, 4 * j, [w[tok[:, r], _GQ * VW + j] for r in range(4)], cent, b)
    out = np.zeros((G, D))
    for m in range(VM):
        d = (D // 8) * _GQ + 2 * m
        for i, (q, dd) in enumerate(((2 * _TQ, d), (2 * _TQ + 1, d), (2 * _TQ, d + 1), (2 * _TQ + 1, d + 1))):
            keep = q < G
            out[q[keep], dd[keep]] = o[m, keep, i]
    return out


def v_word_mmas(o, m0: int, ws: list, cent, b) -> None:
    """One code word of four tokens' V codes (`ws`, per lane) into the O^T accumulators o[m0 .. m0 + 3]:
    the two-token nibble merge (byte k of lo01 = token 0's low nibble | token 1's << 4, ...), the pair
    table, and one MMA per byte against P's B fragment `b` (v4's and v7's values path)."""
    m4 = np.uint32(0x0F0F0F0F)
    lo01 = (ws[0] & m4) | ((ws[1] << np.uint32(4)) & ~m4)
    hi01 = ((ws[0] >> np.uint32(4)) & m4) | (ws[1] & ~m4)
    lo23 = (ws[2] & m4) | ((ws[3] << np.uint32(4)) & ~m4)
    hi23 = ((ws[2] >> np.uint32(4)) & m4) | (ws[3] & ~m4)
    for k in range(4):
        a = np.stack([_pairs(cent, _byte(x, k)) for x in (lo01, hi01, lo23, hi23)], -2)
        o[m0 + k] += _mma(a, b)


def assert_attends_as_the_decoded_cache(cache, q, label) -> None:
    """`cache.attend` of one query step within the checks' tolerance (float32 1e-4; else 2e-2 of the
    output's scale) of SDPA over the cache's decoded K / V."""
    dim = q.shape[-1]
    keys, values = cache._fetch(rotated=False)
    ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), keys.astype(mx.float32),
                                               values.astype(mx.float32), scale=dim ** -0.5)
    got = cache.attend(q, dim ** -0.5, None)
    tol = 1e-4 if q.dtype == mx.float32 else 2e-2 * max(mx.abs(ref).max().item(), 1.0)
    assert mx.abs(got.astype(mx.float32) - ref).max().item() <= tol, label


def emulated_tq4(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
    """The split kernel's blocks at a fixed CHUNK (columns, boundaries, the dense tail's block) with the
    code blocks' scores and values through `_scores` / `_values`; `emulated_tq5` feeds it the runtime
    chunk. params[1]: the cache's column count."""
    q, kn, kc, vn, vc, tk, tv, lp, signs, cent, params = (_np(a) for a in inputs)
    t, S, H, B = _blocks(template, grid, threadgroup)
    D, G, CHUNK, BITS, GROUP, NQ, TC = (t[k] for k in ("D", "G", "CHUNK", "BITS", "GROUP", "NQ", "TC"))
    assert BITS == 4 and D in tq_mma.DIMS4 and G <= 8 and TC == tq_mma.table_copies(G, D, CHUNK)
    assert G * CHUNK <= common.SMEM_SCORES
    HQ, end = H * G, int(params[1])  # (kc: the cache's whole buffer, columns [0, end) its own)
    assert end <= min(kn.shape[2], kc.shape[2], vn.shape[2], vc.shape[2])
    ws, prev = end - tk.shape[2], end - NQ
    o = np.zeros((B * HQ, S, D), np.float32)
    ml = np.zeros((B * HQ, S, 2), np.float32)
    for b, h, s, r, tail, c0, c1 in tq_split_blocks(lp, B, H, G, S, CHUNK, GROUP, end, prev, ml):
        qs = params[0] * q[b, h * G : h * G + G, 0]
        if tail:
            sc = qs @ tk[b, h, c0 - ws : c1 - ws].T
            m = sc.max(axis=1)
            p = np.exp(sc - m[:, None])
            acc = p @ tv[b, h, c0 - ws : c1 - ws]
        else:
            qr = _butterfly(qs * signs) / np.sqrt(D)
            sc = _scores(qr, kc[b, h, c0:c1], kn[b, h, c0:c1, 0], cent, G, D)
            m = sc.max(axis=1)
            p = np.exp(sc - m[:, None])
            acc = _values(p, vc[b, h, c0:c1], vn[b, h, c0:c1, 0], cent, G, D)
        ml[r, s, 0], ml[r, s, 1], o[r, s] = m, p.sum(axis=1), acc
    assert (o.size,) == output_shapes[0] and ml.shape == output_shapes[1]
    return [mx.array(o.reshape(-1)), mx.array(ml)]



def emulated_tq5(seen: list | None = None, inner=None):
    """cuda/tq_mma.cu: `emulated_tq4`'s blocks at the runtime chunk (params[1], within the score array's
    capacity, the template CHUNK), the cache's column count from the K norms' shape."""
    inner = inner or emulated_tq4

    def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        t = dict(template)
        scale, chunk = (float(x) for x in np.array(inputs[10])[:2])  # (the rest: its own page's zeros)
        end = inputs[1].shape[2]  # (the K norms are passed as columns [0, end): their shape carries it)
        inputs = list(inputs)
        inputs[10] = mx.array(np.array([scale, end], np.float32))  # what `emulated_tq4` reads
        chunk = int(chunk)
        assert t["CHUNK"] == tq_mma.chunk_capacity(t["G"]) and t["TC"] == tq_mma.table_copies(t["G"], t["D"], t["CHUNK"])
        assert 64 <= chunk <= t["CHUNK"] and chunk % 64 == 0
        t4 = [(k, chunk if k == "CHUNK" else tq_mma.table_copies(t["G"], t["D"], chunk) if k == "TC" else v)
              for k, v in template]
        if seen is not None:
            seen.append(chunk)
        assert len(inputs) == 11 and len(output_shapes) == 2
        return inner(inputs, t4, grid, threadgroup, output_shapes, output_dtypes)
    return run


@pytest.fixture
def emulated_mma(emulated, monkeypatch):
    """The CUDA table with the tensor-core split kernel emulated and the fused kernel declining every
    step (as it does at head size 256), so the steps these tests make take the MMA split kernel."""
    seen = []
    monkeypatch.setattr(tq_mma, "_tq5_kernel", lambda: emulated_tq5(seen))
    monkeypatch.setattr(tq_decode, "attend7", lambda *a: None)
    ROUND["on"] = True
    yield seen
    ROUND["on"] = True


def _rows(chunks_per_row, heads, dim, dtype, group=16, seed=0):
    mx.random.seed(seed)
    rows = []
    for chunks in chunks_per_row:
        c = TurboQuantKVCache(kv_bits=4, group=group)
        for n in chunks:
            c.update_and_fetch(mx.random.normal((1, heads, n, dim)).astype(dtype),
                               mx.random.normal((1, heads, n, dim)).astype(dtype))
        rows.append(c)
    return rows[0] if len(rows) == 1 else BatchTurboQuantKVCache.merge(rows)


@pytest.mark.parametrize("q_heads,kv_heads,dim", [
    (8, 2, 128),  # G = 4, the Qwen3-8B shape
    (16, 2, 128),  # G = 8: every query column of the MMA
    (6, 2, 64),  # G = 3, D = 64: one word per token and lane for V, two for K
    (2, 2, 128),  # G = 1
    (8, 2, 256),  # D = 256: two 16-byte loads per token for K
])
def test_mma_fragments_equal_the_split_arithmetic_without_rounding(emulated_mma, monkeypatch, q_heads, kv_heads,
                                                                   dim):
    """The permutations (coordinates of K, tokens and coordinates of V, P's token order): the emulation
    without f16 rounding gives the CUDA-core split kernel's block outputs on the very inputs the MMA
    kernel is launched with."""
    ROUND["on"] = False
    seen = []

    def both(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        kw = dict(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                  output_shapes=output_shapes, output_dtypes=output_dtypes)
        got = emulated_tq4(**kw)
        t3 = [(k, v) for k, v in template if k not in ("TC",)] + [("CPL", 16)]
        ref = emulated_tq3(**{**kw, "template": t3})
        seen.append(1)
        for g, r in zip(got, ref):
            g, r = np.array(g), np.array(r)
            assert np.allclose(g, r, atol=1e-5, rtol=1e-5, equal_nan=True), np.abs(g - r).max()
        return got

    monkeypatch.setattr(tq_mma, "_tq5_kernel", lambda: emulated_tq5(inner=both))
    for rows in ([[150, 9]], [[300], [7, 30, 1], [16], [40, 3]]):
        cache = _rows(rows, kv_heads, dim, mx.bfloat16, seed=len(rows))
        cache.hooked = True
        B = len(rows)
        for _ in range(4):
            mask = cache.make_mask(1) if B > 1 else None
            cache.update_and_fetch(mx.random.normal((B, kv_heads, 1, dim)).astype(mx.bfloat16),
                                   mx.random.normal((B, kv_heads, 1, dim)).astype(mx.bfloat16))
            cache.attend(mx.random.normal((B, q_heads, 1, dim)).astype(mx.bfloat16), dim ** -0.5, mask)
    assert len(seen) == 8


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_mma_step_within_the_bf16_tolerance_of_attention_over_the_decoded_cache(emulated_mma, monkeypatch, dtype):
    """With the f16 rounding the kernel does, one row and left-padded rows, steps across group
    boundaries: within bench/check_decode_kernels.py's tolerance of SDPA over the decoded
    cache; every step ran the MMA split kernel, at a chunk that is a multiple of 64."""
    calls = _kernel_calls(monkeypatch)
    tol = 2e-2 if dtype == mx.bfloat16 else 4e-3
    for rows in ([[150, 9]], [[300], [7, 30, 1], [16], [40, 3]]):
        cache = _rows(rows, 2, 128, dtype, seed=7 + len(rows))
        cache.hooked = True
        B = len(rows)
        for step in range(20):
            mask = cache.make_mask(1) if B > 1 else None
            cache.update_and_fetch(mx.random.normal((B, 2, 1, 128)).astype(dtype),
                                   mx.random.normal((B, 2, 1, 128)).astype(dtype))
            q = mx.random.normal((B, 8, 1, 128)).astype(dtype)
            got = cache.attend(q, 128 ** -0.5, mask)
            keys, values = cache._fetch(rotated=False)
            ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), keys.astype(mx.float32),
                                                       values.astype(mx.float32), scale=128 ** -0.5, mask=mask)
            e = mx.abs(got.astype(mx.float32) - ref).max().item()
            assert got.dtype == dtype and e <= tol * max(mx.abs(ref).max().item(), 1.0), (rows, step, e)
    assert len(emulated_mma) == 40 and calls["tq3_reduce"] == 40 and calls["tq3"] == 0


def test_what_the_mma_kernel_cannot_map_runs_the_split_kernel(emulated_mma, monkeypatch):
    """float32 caches (f16 operands would miss the float32 tolerance), 2 / 8-bit codes and head
    dim 16 run the CUDA-core split kernel."""
    calls = _kernel_calls(monkeypatch)
    monkeypatch.setattr(tq_mma, "_tq5_kernel", lambda: pytest.fail("the MMA kernel launched a step it cannot map"))
    cases = [(mx.float32, 4, 128), (mx.bfloat16, 2, 128), (mx.bfloat16, 8, 64), (mx.bfloat16, 4, 16)]
    for dtype, bits, dim in cases:
        mx.random.seed(bits + dim)
        cache = TurboQuantKVCache(kv_bits=bits, group=16)
        cache.update_and_fetch(mx.random.normal((1, 2, 40, dim)).astype(dtype),
                               mx.random.normal((1, 2, 40, dim)).astype(dtype))
        cache.hooked = True
        cache.update_and_fetch(mx.random.normal((1, 2, 1, dim)).astype(dtype),
                               mx.random.normal((1, 2, 1, dim)).astype(dtype))
        q = mx.random.normal((1, 4, 1, dim)).astype(dtype)
        assert_attends_as_the_decoded_cache(cache, q, (dtype, bits, dim))
    assert calls["tq3"] == len(cases) and calls["tq3_reduce"] == len(cases)


def test_table_rules_and_source():
    assert tq_mma.table_copies(4, 128, 256) == 32  # conflict-free where the scores leave room
    assert tq_mma.table_copies(4, 128, 1024) == 16  # a 1024-column split: at most two-way conflicts
    assert tq_mma.table_copies(8, 128, 512) == 8
    q = mx.zeros((1, 32, 1, 128), mx.bfloat16)
    assert tq_mma.usable(q, 4, 4, 128, 1024) and not tq_mma.usable(q, 2, 4, 128, 1024)
    assert not tq_mma.usable(q.astype(mx.float32), 4, 4, 128, 1024) and not tq_mma.usable(q, 4, 4, 32, 1024)
    # the body is the split kernel's with both code paths replaced: none of its per-coordinate FMA loops left
    assert "centroid<" not in tq_mma.SOURCE and tq_mma.SOURCE.count("mma_f16(") == 2
    assert "float qr[G][8];" in tq_mma.SOURCE and "float acc[G][8];" in tq_mma.SOURCE  # the dense tail
    assert "CH5 = static_cast<int>(params[1])" in tq_mma.SOURCE and "s * CHUNK" not in tq_mma.SOURCE
    assert "const int end = kn_shape[2];" in tq_mma.SOURCE and "params[2]" not in tq_mma.SOURCE
    assert tq_mma.SOURCE.count("return;") == 1 and "cnt" not in tq_mma.SOURCE


def test_the_split_kernel_takes_the_whole_code_buffers_and_the_cache_end(emulated, monkeypatch):
    """The step hands the split kernel the cache's norm and code buffers unsliced (capacity past the
    cache's columns) and the column count in params[1] (four slices were ~28 us of host time per
    layer); the kernel reads [0, end) only, so the output still matches the decoded cache."""
    seen = []

    def spy(f):
        def run(**kw):
            kc, params = kw["inputs"][2], np.array(kw["inputs"][10])
            seen.append((kc.shape[2], int(params[1])))
            return f(**kw)
        return lambda: run

    monkeypatch.setattr(tq_split, "_tq3_kernel", spy(emulated_tq3))
    cache = _rows([[150, 9]], 2, 128, mx.float32, seed=3)
    cache.hooked = True
    for _ in range(3):
        cache.update_and_fetch(mx.random.normal((1, 2, 1, 128)), mx.random.normal((1, 2, 1, 128)))
        assert_attends_as_the_decoded_cache(cache, mx.random.normal((1, 8, 1, 128)), "float32")
    assert len(seen) == 3 and all(cap > end for cap, end in seen) and [e for _, e in seen] == [160, 161, 162]


def test_split5_follows_the_waves():
    """split5 on an H200 (132 SMs, 5 resident blocks of the kernel's shape: 660 slots), Qwen3-8B's layer:
    one row of 100k gets 640 columns (157 x 8 = 1,256 blocks: two full waves) where a 1,024-column
    split left a second wave a fifth full; one row of 32k one wave of 448 (592 blocks); B = 8 keeps
    large chunks; the chunk is at least the dense window's and a multiple of 64."""
    assert common.blocks_per_sm(tq_mma.v5_shared_bytes(4, 128), tq_mma.v5_regs(4, 128)) == 5
    assert tq_mma.split5(100_000, 8, 1, 4, 128, 65, sms=132) == 640
    assert tq_mma.split5(32768, 8, 1, 4, 128, 65, sms=132) == 448
    assert tq_mma.split5(100_000, 8, 8, 4, 128, 65, sms=132) >= 768
    for tokens, rows, at_least in ((5000, 1, 65), (1000, 3, 200), (64, 1, 1), (2_000_000, 8, 65)):
        chunk = tq_mma.split5(tokens, 8, rows, 4, 128, at_least, sms=132)
        assert chunk % 64 == 0 and at_least <= chunk <= tq_mma.chunk_capacity(4)
    assert tq_mma.split5(100, 8, 1, 4, 128, tq_mma.chunk_capacity(4) + 1, sms=132) is None
    assert tq_mma.chunk_capacity(8) == 512 and tq_mma.chunk_capacity(1) == 1024
    # registers: 96 a thread is 3,072 a warp, 21 warps, 5 blocks of 4; shared memory alone would allow 5
    assert common.blocks_per_sm(20_000, regs=64) == 8 and common.blocks_per_sm(60_000, regs=64) == 3


@pytest.mark.slow
@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="no nvcc on this machine (CI)")
def test_mma_kernel_compiles_for_the_h200_within_its_occupancy_model(tmp_path):
    """nvcc for sm_90: no spills or stack frame, the static shared memory `v5_shared_bytes` counts (at most,
    within 128 bytes), and at most `v5_regs` registers (`V5_REGS`): the figures `split5`'s blocks per SM
    come from."""
    from testsupport.kernel_render import TQ_INPUTS, ptxas_report, render

    shapes = []
    for dtype, dim, g in (("bfloat16", 128, 4), ("float16", 128, 4), ("bfloat16", 128, 8), ("bfloat16", 64, 3),
                          ("bfloat16", 256, 4)):
        name = f"v5_{dtype}_d{dim}_g{g}"
        inputs = [(n, dtype if t == "T" else t, nd) for n, t, nd in TQ_INPUTS]
        shapes.append((name, render(name, tq_mma.SOURCE, inputs, [("o_part", "float32"), ("ml_part", "float32")],
                                    tq_mma.templates5(dtype, dim, g, 4, 64))))
    report = ptxas_report(tmp_path / "v5.cu", common.HEADER + tq_split.SPLIT_HEADER + tq_mma.MMA_HEADER,
                          shapes, timeout=900)
    assert len(report) == len(shapes)
    for name, (regs, smem, frame, spills, block) in report.items():
        assert frame == 0 and spills == ("0", "0") and smem <= 48 * 1024, (name, block)
        g, dim = int(name.split("_g")[1]), int(name.split("_d")[1].split("_")[0])
        assert tq_mma.v5_shared_bytes(g, dim) - 128 <= smem <= tq_mma.v5_shared_bytes(g, dim), (name, smem)
        assert regs <= tq_mma.v5_regs(g, dim), (name, regs)
    print("ptxas registers, smem:", {n: r[:2] for n, r in report.items()})


def test_prebuild_at_head_size_256_builds_the_mma_kernel_once(monkeypatch):
    """engine/kernels/prebuild.py at a head size the fused kernel does not take: the MMA split kernel,
    one build at the capacity chunk (the chunk is a runtime parameter), never the CUDA-core one."""
    from types import SimpleNamespace

    from engine.tq_config import TQConfig

    built = []

    def record(name):
        def run(**kw):
            built.append((name, dict(kw["template"]).get("CHUNK")))
            return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
        return lambda: run

    monkeypatch.setattr(tq_encode, "_encode_kernel", record("encode"))
    monkeypatch.setattr(tq_split, "_tq3_reduce_kernel", record("reduce"))
    monkeypatch.setattr(tq_split, "_tq3_kernel", lambda: pytest.fail("the CUDA-core split kernel built"))
    monkeypatch.setattr(tq_fused, "_tq7_kernel", lambda: pytest.fail("the fused kernel built at D = 256"))
    monkeypatch.setattr(tq_mma, "_tq5_kernel", record("mma"))
    args = SimpleNamespace(num_attention_heads=16, num_key_value_heads=4, head_dim=256, hidden_size=4096)
    model = SimpleNamespace(args=args, parameters=lambda: {"w": mx.zeros((1,), mx.bfloat16)})
    out = selector.CudaKernels().prebuild_tq(model, TQConfig(), max_batch=8)
    assert len([c for c in out if c > 0]) == 1 and -1 in out and 0 in out
    assert [c for n, c in built if n == "mma"] == [tq_mma.chunk_capacity(4)]


def test_mma_kernel_writes_no_host_array_per_step(emulated_mma, monkeypatch):
    """The params array is one object per (scale, chunk) across steps (a host-written array each
    step may cost a GPU page fault: `params5`), and the column count reaches the kernel as the K
    norms' shape, the cache's [0, end), while the codes stay whole buffers."""
    seen = []

    def spy():
        run = emulated_tq5()

        def f(**kw):
            seen.append((id(kw["inputs"][10]), kw["inputs"][1].shape[2], kw["inputs"][2].shape[2]))
            return run(**kw)
        return f

    monkeypatch.setattr(tq_mma, "_tq5_kernel", spy)
    cache = _rows([[150, 9]], 2, 128, mx.bfloat16, seed=4)
    cache.hooked = True
    for _ in range(4):
        cache.update_and_fetch(mx.random.normal((1, 2, 1, 128)).astype(mx.bfloat16),
                               mx.random.normal((1, 2, 1, 128)).astype(mx.bfloat16))
        cache.attend(mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16), 128 ** -0.5, None)
    assert len({p for p, _, _ in seen}) == 1
    assert [e for _, e, _ in seen] == [160, 161, 162, 163] and all(cap > e for _, e, cap in seen)
