"""engine/kernels/dense.py's tensor-core kernel (cuda/dense_mma.cu) on the CPU.

The kernel cannot run here, so `emulated_dense_mma` replays it in numpy lane by lane, from the
very launch parameters and inputs `dense_attend` hands `mx.fast.cuda_kernel`, at the bit level
where the source works on bits: each lane's 16-byte loads of K and V as uint32 words (which
elements, which token), the A registers as those words (K) or `__byte_perm`s of two tokens'
words (V, the selectors 0x5410 / 0x7632), the query B registers as pairs of its raw 16-bit
elements, P packed to the cache's dtype, the low half of a register as the smaller column / row,
and the m16n8k16 MMA applied through the PTX fragment layout (tests/test_tq_mma.py's `_mma`).
With P's rounding switched off the block outputs must equal the CUDA-core kernel's
(`emulated_dense`) to float precision: that checks the permutations; with it on, the step must stay
within the bf16 / f16 tolerance of masked SDPA. The GPU run is bench/check_decode_kernels.py.
The `emulated` fixture of tests/test_decode_attention.py keeps the CUDA-core kernel for the tests of
its arithmetic; `emulated_mma` here gives bf16 / f16 steps back to the tensor-core one, as in
production."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from engine.kernels import common, dense, prebuild, selector, tq_decode, tq_encode, tq_fused, tq_mma, tq_split  # noqa: F401
from engine.batch_cache import RowBatchKVCache
from engine.attention_hook import _hooked
from tests.test_decode_attention import _blocks, _plain, emulated, emulated_dense  # noqa: F401
from tests.test_tq_mma import _GQ, _TQ, _mma

_USABLE_MMA = dense.usable_mma  # (the `emulated` fixture declines it; `emulated_mma` restores it)

ROUND = {"on": True}


def _bits(a: mx.array) -> np.ndarray:
    """The raw 16-bit patterns of a bf16 / f16 array (as the kernel's loads see them)."""
    return np.array(a.view(mx.uint16)).astype(np.uint32)


def _value(h: np.ndarray, dtype) -> np.ndarray:
    """16-bit patterns (low halves of uint32) -> float64 values of `dtype`."""
    h = (h & np.uint32(0xFFFF)).astype(np.uint32)
    if dtype == mx.bfloat16:
        return (h << np.uint32(16)).view(np.float32).astype(np.float64)
    return h.astype(np.uint16).view(np.float16).astype(np.float64)


def _regs(words: np.ndarray, dtype) -> np.ndarray:
    """uint32 registers (...,) -> (..., 2) values: (low half, high half)."""
    return np.stack([_value(words, dtype), _value(words >> np.uint32(16), dtype)], -1)


def _pack(lo: np.ndarray, hi: np.ndarray, dtype) -> np.ndarray:
    """`pack2<T>`: two f32 values rounded to T, as (low, high) values (or unrounded: ROUND off)."""
    if not ROUND["on"]:
        return np.stack([lo, hi], -1)
    r = mx.array(np.stack([lo, hi], -1).astype(np.float32)).astype(dtype).astype(mx.float32)
    return np.array(r).astype(np.float64)


def _words(bits: np.ndarray, tokens: np.ndarray, first: np.ndarray) -> np.ndarray:
    """The four uint32 words of a 16-byte load of elements [first, first + 8) of `tokens`
    (rows of `bits`, zeros past its end: the kernel's `t < n` guard): (..., 4)."""
    n = bits.shape[0]
    rows = np.where(tokens < n, tokens, 0)
    e = first[..., None] + 2 * np.arange(4)
    w = bits[rows[..., None], e] | (bits[rows[..., None], e + 1] << np.uint32(16))
    return np.where((tokens < n)[..., None], w, np.uint32(0))


def _perm(x: np.ndarray, y: np.ndarray, sel: int) -> np.ndarray:
    """CUDA's __byte_perm, elementwise over arrays x and y: byte i of the result is byte
    (sel >> 4i) & 7 of the 8 bytes y:x."""
    both = (y.astype(np.uint64) << np.uint64(32)) | x.astype(np.uint64)
    out = np.zeros(x.shape, np.uint64)
    for i in range(4):
        out |= ((both >> np.uint64(8 * ((sel >> (4 * i)) & 7))) & np.uint64(0xFF)) << np.uint64(8 * i)
    return out.astype(np.uint32)


def _scores(qbits, kbits, G, D, dtype, scale):
    """One block's scaled scores (G, n) from the K tiles' fragments (`SOURCE`'s score pass)."""
    n = kbits.shape[0]
    nt = -(-n // 16)
    tok0 = np.arange(nt)[:, None] * 16 + _GQ  # (nt, 32)
    tok1 = tok0 + 8
    qg = np.where(_GQ < G, _GQ, 0)
    c = np.zeros((nt, 32, 4))
    for j in range(D // 16):
        i, e = j >> 1, 2 * (j & 1)
        first = np.broadcast_to(32 * i + 8 * _TQ, tok0.shape)
        w0, w1 = _words(kbits, tok0, first), _words(kbits, tok1, first)
        a = np.stack([_regs(w0[..., e], dtype), _regs(w1[..., e], dtype), _regs(w0[..., e + 1], dtype),
                      _regs(w1[..., e + 1], dtype)], -2)
        d = 32 * (j >> 1) + 8 * _TQ + 4 * (j & 1)
        qw = [qbits[qg, d + o] | (qbits[qg, d + o + 1] << np.uint32(16)) for o in (0, 2)]
        b = np.stack([_regs(w, dtype) for w in qw], -2)  # (32, 2, 2)
        b = np.where((_GQ < G)[:, None, None], b, 0.0)
        c += _mma(a, np.broadcast_to(b, (nt, 32, 2, 2)))
    sc = np.full((G, nt * 16), np.nan)
    for i, (tok, qc) in enumerate(((tok0, 2 * _TQ), (tok0, 2 * _TQ + 1), (tok1, 2 * _TQ), (tok1, 2 * _TQ + 1))):
        keep = np.broadcast_to(qc < G, tok.shape) & (tok < n)
        sc[np.broadcast_to(qc, tok.shape)[keep], tok[keep]] = c[..., i][keep] * scale
    return sc[:, :n]


def _values(p, vbits, G, D, dtype):
    """One block's unnormalised output (G, D) from probabilities p (G, n): `SOURCE`'s value pass."""
    n = vbits.shape[0]
    nt = -(-n // 16)
    qg = np.where(_GQ < G, _GQ, 0)
    o = np.zeros((D // 16, 32, 4))
    for tile in range(nt):
        tok = tile * 16 + 4 * _TQ[:, None] + np.arange(4)  # (32, 4): tokens 4tq .. 4tq+3
        pr = np.where((_GQ < G)[:, None] & (tok < n), p[qg[:, None], np.minimum(tok, n - 1)], 0.0)
        b = np.stack([_pack(pr[:, 0], pr[:, 1], dtype), _pack(pr[:, 2], pr[:, 3], dtype)], -2)  # (32, 2, 2)
        for m in range(D // 16):
            i, e = m >> 2, m & 3
            first = 64 * i + 8 * _GQ
            x = [_words(vbits, tok[:, r], first)[:, e] for r in range(4)]
            regs = [_perm(xa, xb, sel) for xa, xb, sel in ((x[0], x[1], 0x5410), (x[0], x[1], 0x7632),
                                                           (x[2], x[3], 0x5410), (x[2], x[3], 0x7632))]
            a = np.stack([_regs(r, dtype) for r in regs], -2)  # (32, 4, 2)
            o[m] += _mma(a, b)
    out = np.zeros((G, D))
    for m in range(D // 16):
        d = 64 * (m >> 2) + 8 * _GQ + 2 * (m & 3)
        for i, (qc, dd) in enumerate(((2 * _TQ, d), (2 * _TQ + 1, d), (2 * _TQ, d + 1), (2 * _TQ + 1, d + 1))):
            keep = qc < G
            out[qc[keep], dd[keep]] = o[m, keep, i]
    return out


def emulated_dense_mma(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
    """`dense.MMA_SOURCE`: v1's blocks (columns [max(s CHUNK, lp[b]), min((s+1) CHUNK, T))) with
    the scores and values through the fragments above."""
    q, k, v, lp, params = inputs
    t, S, H, B = _blocks(template, grid, threadgroup)
    D, G, CHUNK, U, PAD = (t[n] for n in ("D", "G", "CHUNK", "U", "PAD"))
    dtype = t["T"]
    assert dtype in (mx.bfloat16, mx.float16) and q.dtype == k.dtype == v.dtype == dtype
    assert D in dense.MMA_DIMS and 1 <= G <= 8 and U == dense.MMA_UNROLL and PAD == dense.SCORE_PAD
    assert G * CHUNK <= common.SMEM_SCORES and not (D == 256 and U > 2)
    qb, kb, vb = _bits(q), _bits(k), _bits(v)
    lp, scale = np.array(lp), float(np.array(params)[0])
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
                sc = _scores(qb[b, h * G : h * G + G, 0], kb[b, h, c0:c1], G, D, dtype, scale)
                m = sc.max(axis=1)
                p = np.exp(sc - m[:, None])
                ml[r, s, 0], ml[r, s, 1] = m, p.sum(axis=1)  # the statistics: f32 p, before P's rounding
                o[r, s] = _values(p, vb[b, h, c0:c1], G, D, dtype)
    assert (o.size,) == output_shapes[0] and ml.shape == output_shapes[1]
    return [mx.array(o.reshape(-1)), mx.array(ml)]


@pytest.fixture
def emulated_mma(emulated, monkeypatch):  # noqa: F811
    calls = {"mma": 0}

    def counted(**kw):
        calls["mma"] += 1
        return emulated_dense_mma(**kw)

    monkeypatch.setattr(dense, "_mma_kernel", lambda: counted)
    monkeypatch.setattr(dense, "usable_mma", _USABLE_MMA)
    ROUND["on"] = True
    yield calls
    ROUND["on"] = True


def _padded(lengths, heads, dim, dtype, seed=0):
    mx.random.seed(seed)
    rows = []
    for n in lengths:
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, heads, n, dim)).astype(dtype),
                           mx.random.normal((1, heads, n, dim)).astype(dtype))
        rows.append(c)
    return RowBatchKVCache.merge(rows)


def _step(batch, q_heads, kv_heads, dim, dtype):
    mask = batch.make_mask(1)
    B = len(batch.left_padding)
    keys, values = batch.update_and_fetch(mx.random.normal((B, kv_heads, 1, dim)).astype(dtype),
                                          mx.random.normal((B, kv_heads, 1, dim)).astype(dtype))
    return mask, keys, values, mx.random.normal((B, q_heads, 1, dim)).astype(dtype)


SHAPES = [
    ([300, 17, 129], 8, 2, 128),  # G = 4, the Qwen3-8B head shape; a row shorter than one tile
    ([70, 5], 16, 2, 128),  # G = 8: every query column of the MMA
    ([200, 33], 6, 2, 64),  # G = 3, D = 64 (SmolLM2's head size)
    ([90, 40], 2, 2, 128),  # G = 1
    ([150, 1, 64], 8, 2, 256),  # D = 256
]


@pytest.mark.parametrize("lengths,q_heads,kv_heads,dim", SHAPES)
def test_fragments_equal_the_cuda_core_arithmetic_without_rounding(emulated_mma, monkeypatch, lengths, q_heads,
                                                                   kv_heads, dim):
    """The permutations (K's coordinates per lane, V's tokens and coordinates, P's token order,
    the byte-permute selectors): without P's rounding the MMA emulation gives v1's block outputs
    on the very inputs the MMA kernel is launched with, at every launch the step makes."""
    ROUND["on"] = False
    seen = []

    def both(**kw):
        got = emulated_dense_mma(**kw)
        t1 = [(k, v) for k, v in kw["template"] if k not in ("PAD",)]
        ref = emulated_dense(**{**kw, "template": t1})
        for g, r in zip(got, ref):
            g, r = np.array(g), np.array(r)
            assert np.allclose(g, r, atol=1e-4, rtol=1e-4, equal_nan=True), np.abs(g - r).max()
        seen.append(1)
        return got

    monkeypatch.setattr(dense, "_mma_kernel", lambda: both)
    batch = _padded(lengths, kv_heads, dim, mx.bfloat16, seed=dim + q_heads)
    for _ in range(2):
        mask, keys, values, q = _step(batch, q_heads, kv_heads, dim, mx.bfloat16)
        _hooked(_plain)(q, keys, values, cache=batch, scale=dim ** -0.5, mask=mask)
    assert len(seen) == 2


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_padded_steps_within_the_tolerance_of_masked_sdpa(emulated_mma, dtype):
    """With P rounded as the kernel rounds it, left-padded rows (the cache's strided buffer views,
    as the model hands them), several steps: within bench/check_decode_kernels.py's tolerance of
    float32 masked SDPA on the same K/V, and the MMA kernel (not v1) took every step."""
    tol = 2e-2 if dtype == mx.bfloat16 else 4e-3
    batch = _padded([400, 260, 3, 129], 2, 128, dtype, seed=11)
    for step in range(4):
        mask, keys, values, q = _step(batch, 8, 2, 128, dtype)
        got = _hooked(_plain)(q, keys, values, cache=batch, scale=128 ** -0.5, mask=mask)
        ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), keys.astype(mx.float32),
                                                   values.astype(mx.float32), scale=128 ** -0.5, mask=mask)
        e = mx.abs(got.astype(mx.float32) - ref).max().item()
        assert got.dtype == dtype and e <= tol * max(mx.abs(ref).max().item(), 1.0), (step, e)
    assert emulated_mma["mma"] == 4


def test_float32_and_other_head_sizes_take_the_cuda_core_kernel(emulated_mma, monkeypatch):
    """float32 caches (bf16 operands would miss its 1e-4) and head sizes the loads do not tile
    (16, 32) run the CUDA-core kernel."""
    v1 = []
    monkeypatch.setattr(dense, "_kernel", lambda: lambda **kw: v1.append(1) or emulated_dense(**kw))
    for dtype, dim in ((mx.float32, 128), (mx.bfloat16, 16), (mx.bfloat16, 32)):
        batch = _padded([50, 20], 2, dim, dtype, seed=dim)
        mask, keys, values, q = _step(batch, 4, 2, dim, dtype)
        got = _hooked(_plain)(q, keys, values, cache=batch, scale=dim ** -0.5, mask=mask)
        ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), keys.astype(mx.float32),
                                                   values.astype(mx.float32), scale=dim ** -0.5, mask=mask)
        tol = 1e-4 if dtype == mx.float32 else 2e-2 * max(mx.abs(ref).max().item(), 1.0)
        assert mx.abs(got.astype(mx.float32) - ref).max().item() <= tol, (dtype, dim)
    assert len(v1) == 3 and emulated_mma["mma"] == 0


def test_the_source_indexes_as_the_emulation_does():
    """The index expressions the emulation replays, as they stand in the kernel's source (so the
    two cannot drift apart unnoticed): K loads at 32 i + 8 tq, V loads at 64 i + 8 gq, the query
    pairs and output coordinates, the two byte-permute selectors, P's tokens 4 tq + r."""
    src = " ".join(dense.MMA_SOURCE.split())
    for piece in ("+ h * k_strides[1] + 8 * tq;", "(size_t)(c0 + t) * k_strides[2] + 32 * i))",
                  "const int d = 32 * (j >> 1) + 8 * tq + 4 * (j & 1);", "&qs[gr][d + 2]",
                  "const int i = j >> 1, e = 2 * (j & 1);", "word_of(w[u][0][i], e), word_of(w[u][1][i], e), "
                  "word_of(w[u][0][i], e + 1),", "const int t = base + u * NW * 16 + gq + 8 * r;",
                  "+ h * v_strides[1] + 8 * gq;", "(size_t)(c0 + t) * v_strides[2] + 64 * i))", "const int t = base + u * NW * 16 + 4 * tq + r;",
                  "__byte_perm(x0, x1, 0x5410), __byte_perm(x0, x1, 0x7632)",
                  "__byte_perm(x2, x3, 0x5410), __byte_perm(x2, x3, 0x7632), b0, b1",
                  "const int i = m >> 2, e = m & 3;", "const int d = 64 * (m >> 2) + 8 * gq + 2 * (m & 3);",
                  "red[warp][2 * tq][d + 1] = o[m][2];", "red[warp][2 * tq + 1][d] = o[m][1];",
                  "sc[2 * tq + 1][t1] = c[3] * scale;", "pack2<T>(p[0], p[1]), b1 = pack2<T>(p[2], p[3])"):
        assert piece in src, piece
    assert src.count("mma16816<T>(") == 2


def test_on_the_cpu_nothing_takes_either_kernel(monkeypatch):
    """CI's case: without CUDA the hook keeps MLX's masked SDPA and neither kernel is
    built (its `mx.fast.cuda_kernel` would fail here)."""
    assert not common.available()
    monkeypatch.setattr(dense, "_mma_kernel", lambda: pytest.fail("the MMA kernel built on the CPU"))
    monkeypatch.setattr(dense, "_kernel", lambda: pytest.fail("the CUDA-core kernel built on the CPU"))
    batch = _padded([40, 9], 2, 128, mx.bfloat16, seed=2)
    mask, keys, values, q = _step(batch, 8, 2, 128, mx.bfloat16)
    assert selector.select().dense_attend(batch, q, keys, values, 0.1, mask) is None
    got = _hooked(_plain)(q, keys, values, cache=batch, scale=0.1, mask=mask)
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.1, mask=mask)
    assert mx.array_equal(got, ref)


def _engine_shapes() -> list[tuple[str, str]]:
    from testsupport.kernel_render import render

    out = []
    for dtype in ("bfloat16", "float16"):
        for dim, g, chunk in ((128, 4, 1024), (128, 4, 256), (128, 8, 512), (64, 3, 1024), (256, 4, 1024),
                              (128, 1, 1024)):
            name = f"mma_{dtype}_d{dim}_g{g}_c{chunk}"
            inputs = [("q", dtype, 4), ("k", dtype, 4), ("v", dtype, 4), ("lp", "int32", 1), ("params", "float32", 1)]
            t = [(n, dtype if n == "T" else x) for n, x in dense.mma_templates(dtype, dim, g, chunk)]
            out.append((name, render(name, dense.MMA_SOURCE, inputs, [("o_part", "float32"), ("ml_part", "float32")],
                                     t)))
    return out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine (CI): nothing to compile with")
def test_compiles_for_the_h200_without_spills(tmp_path):
    """nvcc for sm_90 at the engine's shapes (bf16 / f16): the MMAs' PTX assembles,
    the static shared memory stays under 48 KB, no spills or stack frame, and the Qwen3-8B shape
    (D 128, G 4) at the default unroll keeps <= 128 registers (4 blocks of 128 threads per SM)."""
    from testsupport.kernel_render import ptxas_report

    shapes = _engine_shapes()
    report = {}
    for name, (regs, smem, frame, spills, block) in ptxas_report(
            tmp_path / "mma.cu", common.HEADER + dense.MMA_HEADER, shapes, timeout=900).items():
        report[name] = (regs, smem)
        assert frame == 0 and spills == ("0", "0") and smem <= 48 * 1024, (name, block)
    assert len(report) == len(shapes)
    assert report["mma_bfloat16_d128_g4_c1024"][0] <= 128, report
    print("ptxas registers, smem:", report)


def test_prebuild_at_load_builds_each_chunk(monkeypatch):
    """engine/kernels/prebuild.py builds through `dense.attend`, so it compiles the kernel this process
    runs (the MMA one for a bf16 model), once per CHUNK a batched decode step of up to max_batch rows
    can pick (64 .. 1,024 at the default target), and the reduce; on the CPU, or at one row, nothing."""
    from types import SimpleNamespace

    args = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096)
    model = SimpleNamespace(args=args, parameters=lambda: {"w": mx.zeros((1,), mx.bfloat16)})
    assert selector.select().prebuild_dense(model, max_batch=8) == {}  # the CPU: no CUDA, nothing built
    built = {"v1": [], "mma": [], "reduce": []}

    def record(kind):
        def run(**kw):
            built[kind].append(dict(kw["template"]))
            return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
        return lambda: run

    monkeypatch.setattr(dense, "_kernel", record("v1"))
    monkeypatch.setattr(dense, "_mma_kernel", record("mma"))
    monkeypatch.setattr(common, "_reduce_kernel", record("reduce"))
    cuda = selector.CudaKernels()
    assert cuda.prebuild_dense(model, max_batch=1) == {}  # one row: never a padded batch
    out = cuda.prebuild_dense(model, max_batch=8)
    assert sorted(out) == [64, 128, 256, 512, 1024]
    assert sorted(t["CHUNK"] for t in built["mma"]) == sorted(out) and not built["v1"]
    assert all(t["G"] == 4 and t["D"] == 128 and t["T"] == mx.bfloat16 for t in built["mma"])
    assert all(t["U"] == dense.MMA_UNROLL for t in built["mma"])
    assert len(built["reduce"]) == len(out)


def test_an_engine_asks_for_the_dense_builds_at_load(monkeypatch):
    """The engine hands its batch size to the dense prebuild while it loads (dense and TurboQuant
    caches alike: a TurboQuant model's dense layers take the dense kernel); on the CPU nothing."""
    from pathlib import Path

    from engine.engine import Engine

    calls = []
    real = selector.DecodeKernels.prebuild_dense
    monkeypatch.setattr(selector.DecodeKernels, "prebuild_dense", lambda self, model, max_batch:
                        calls.append(max_batch) or real(self, model, max_batch))
    engine = Engine(model_dir=str(Path(__file__).resolve().parent.parent / "fixtures" / "tiny-llama"),
                    max_batch=3, cache_bytes=0).start()
    try:
        assert engine.wait_ready(120)
        assert calls == [3] and engine.dense_kernel_build_s == {}
    finally:
        engine.shutdown()
