"""engine/kernels/tq_fused.py (the fused TurboQuant decode kernel: one pass, online softmax) on the CPU.

The kernel cannot run here, so `emulated_tq7` replays its code blocks in numpy lane by lane, as
tests/test_tq_mma.py does for the MMA split kernel: per warp its tiles in the kernel's order (tile i of warp w holds
tokens (i NW + w) 16 ..; every warp runs the block's tile count, tiles past n masked), each lane's
K / V fragment registers from the codes it loads (tokens clamped to the block's last, as the kernel
loads them), the scores' MMA through the PTX fragment layout, the online softmax per lane (tile max
over the 8 token rows, the rescale when a running max grows, exp2 in the log2 domain), the f16
probabilities times the V norms packed per score lane and moved to the P^T B fragment by the
kernel's shuffle sources and half selection, the values' MMA, then the block's combine (every
warp's output rescaled to the block's max) into the split kernels' partial layout. Rounding to f16 where the
kernel packs. `PLANT` switches one index of the emulation to a wrong one: each planted error must
make the step miss the reference (so these checks can fail). What runs on the GPU is checked by
bench/check_decode_kernels.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kernels import common, dense, prebuild, selector, tq_decode, tq_encode, tq_fused, tq_mma, tq_split  # noqa: F401
from tests.test_decode_attention import (  # noqa: F401
    _blocks, _butterfly, _kernel_calls, _np, emulated, emulated_tq3_reduce, tq_split_blocks,
)
from tests.test_tq_mma import (  # noqa: F401
    _GQ, _TQ, _byte, _f16, _mma, _pairs, _rows, assert_attends_as_the_decoded_cache, emulated_tq4, emulated_tq5,
    v_word_mmas,
)

LOG2E = 1.4426950408889634
PLANT = {"which": None}  # None, "half" (the other f16 half), "src" (the other token pair), "vtok" (v4's V token order), "rescale" (no rescale)


def _code_block(qr, kw, kn, vw, vn, cent, G, D, NW):
    """One code block's (max in natural log, sum, unnormalised output) per query column, (G,), (G,), (G, D)."""
    n = kw.shape[0]
    KW, KM, VW, VM = D // 32, D // 16, D // 64, D // 16
    plant = PLANT["which"]
    qg = np.where(_GQ < G, _GQ, 0)
    qb = []
    for j in range(KM):
        d = (D // 4) * _TQ + 4 * j
        b = np.stack([np.stack([qr[qg, d], qr[qg, d + 1]], -1), np.stack([qr[qg, d + 2], qr[qg, d + 3]], -1)], -2)
        qb.append(np.where((_GQ < G)[:, None, None], _f16(LOG2E * b), 0.0))
    nt = -(-n // (16 * NW))
    warps = []
    for w in range(NW):
        mr = np.full((32, 2), -1e30)
        lr = np.zeros((32, 2))
        o = np.zeros((VM, 32, 4))
        for i in range(nt):
            t0 = (i * NW + w) * 16
            tok = [np.minimum(t0 + _GQ + 8 * r, n - 1) for r in range(2)]
            ok = [t0 + _GQ + 8 * r < n for r in range(2)]
            c = np.zeros((32, 4))
            for j in range(KM):
                word = _TQ * KW + (j >> 1)
                by = 2 * (j & 1)
                x0, x1 = kw[tok[0], word], kw[tok[1], word]
                a = np.stack([_pairs(cent, _byte(x0, by)), _pairs(cent, _byte(x1, by)),
                              _pairs(cent, _byte(x0, by + 1)), _pairs(cent, _byte(x1, by + 1))], -2)
                c += _mma(a, qb[j])
            sv = np.stack([np.where(ok[0], c[:, 0] * kn[tok[0]], -np.inf), np.where(ok[0], c[:, 1] * kn[tok[0]], -np.inf),
                           np.where(ok[1], c[:, 2] * kn[tok[1]], -np.inf), np.where(ok[1], c[:, 3] * kn[tok[1]], -np.inf)], 1)
            tmax = np.maximum(sv[:, :2], sv[:, 2:])  # (32, 2): columns 2tq, 2tq + 1
            tmax = np.stack([tmax[_TQ == q].max(axis=0) for q in _TQ], 0)  # over the 8 lanes of one tq
            new = np.maximum(mr, tmax)
            if (new > mr + 3.0).any() and plant != "rescale":  # the kernel's lazy rescale (TH7 = 3, log2)
                a = np.exp2(mr - new)
                lr *= a
                o *= np.stack([a[:, 0], a[:, 1], a[:, 0], a[:, 1]], -1)[None]
                mr = new
            elif plant == "rescale":
                mr = new
            p = np.exp2(sv - np.concatenate([mr, mr], 1))
            lr += p[:, :2] + p[:, 2:]
            w0 = _f16(np.stack([p[:, 0], p[:, 1]], 1) * vn[tok[0]][:, None])  # token gq: columns 2tq, 2tq + 1
            w1 = _f16(np.stack([p[:, 2], p[:, 3]], 1) * vn[tok[1]][:, None])  # token gq + 8
            src0 = 8 * _TQ + (_GQ >> 1)
            src1 = src0 + 4
            if plant == "src":
                src0, src1 = src1, src0
            half = (_GQ & 1) ^ (1 if plant == "half" else 0)
            b0 = np.stack([w0[src0, half], w0[src1, half]], -1)  # P(tokens 2tq, 2tq + 1; column gq)
            b1 = np.stack([w1[src0, half], w1[src1, half]], -1)  # P(tokens 2tq + 8, 2tq + 9)
            b = np.stack([b0, b1], 1)
            if plant == "vtok":
                vt = [4 * _TQ + r for r in range(4)]
            else:
                vt = [2 * _TQ + (r & 1) + 8 * (r >> 1) for r in range(4)]
            vt = [np.minimum(t0 + t, n - 1) for t in vt]
            for j in range(VW):
                v_word_mmas(o, 4 * j, [vw[vt[r], _GQ * VW + j] for r in range(4)], cent, b)
        lsum = np.stack([lr[_TQ == q].sum(axis=0) for q in _TQ], 0)  # over the 8 lanes of one tq
        warps.append((mr, lsum, o))
    # the block's combine: columns 2tq + i of lane tq
    M = np.full(8, -np.inf)
    for mr, _, _ in warps:
        for i in range(2):
            M[2 * _TQ + i] = np.maximum(M[2 * _TQ + i], mr[:, i])
    out = np.zeros((G, D))
    L = np.zeros(8)
    for mr, lsum, o in warps:
        for i in range(2):
            col = 2 * _TQ + i
            f = np.exp2(mr[:, i] - M[col])
            L[col[_GQ == 0]] += (lsum[:, i] * f)[_GQ == 0]
            for m in range(VM):
                d = (D // 8) * _GQ + 2 * m
                keep = col < G
                out[col[keep], d[keep]] += (o[m, :, i] * f)[keep]
                out[col[keep], d[keep] + 1] += (o[m, :, 2 + i] * f)[keep]
    return M[:G] * np.log(2.0), L[:G], out


def emulated_tq7(seen: list | None = None):
    """`TQ7_SOURCE`: v5's blocks (the runtime chunk params[1], `end` the K norms' columns), the
    dense tail's block as v3, the code blocks as `_code_block`."""
    def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        q, kn, kc, vn, vc, tk, tv, lp, signs, cent, params = (_np(a) for a in inputs)
        t, S, H, B = _blocks(template, grid, threadgroup)
        D, G, GROUP, NQ, TW, NW = (t[k] for k in ("D", "G", "GROUP", "NQ", "TW", "NW"))
        assert D in tq_fused.DIMS7 and G <= 8 and TW == GROUP and t["PF"] is True
        assert G * TW + NW * G * D <= 256 * 32
        scale, chunk = float(params[0]), int(params[1])
        end = kn.shape[2]  # (the K norms are passed as columns [0, end))
        assert end <= min(kc.shape[2], vn.shape[2], vc.shape[2]) and chunk % 64 == 0
        if seen is not None:
            seen.append(chunk)
        HQ, ws, prev = H * G, end - tk.shape[2], end - NQ
        o = np.zeros((B * HQ, S, D), np.float32)
        ml = np.zeros((B * HQ, S, 2), np.float32)
        for b, h, s, r, tail, c0, c1 in tq_split_blocks(lp, B, H, G, S, chunk, GROUP, end, prev, ml):
            qs = scale * q[b, h * G : h * G + G, 0]
            if tail:
                assert c1 - c0 <= TW
                sc = qs @ tk[b, h, c0 - ws : c1 - ws].T
                m = sc.max(axis=1)
                p = np.exp(sc - m[:, None])
                ml[r, s, 0], ml[r, s, 1], o[r, s] = m, p.sum(axis=1), p @ tv[b, h, c0 - ws : c1 - ws]
            else:
                qr = _butterfly(qs * signs) / np.sqrt(D)
                m, lsum, acc = _code_block(qr, kc[b, h, c0:c1], kn[b, h, c0:c1, 0], vc[b, h, c0:c1],
                                           vn[b, h, c0:c1, 0], cent, G, D, NW)
                ml[r, s, 0], ml[r, s, 1], o[r, s] = m, lsum, acc
        assert (o.size,) == output_shapes[0] and ml.shape == output_shapes[1]
        return [mx.array(o.reshape(-1)), mx.array(ml)]
    return run


ROUTE = {"fused": True}  # False: the fused kernel declines every step (the MMA split kernel takes it)


@pytest.fixture
def emulated7(emulated, monkeypatch):
    """The CUDA table with the fused and the MMA split kernels emulated; `ROUTE` picks which one takes
    a step. Yields the chunks the fused kernel ran at; `MMA_STEPS` the MMA kernel's."""
    seen = []
    real7 = tq_decode.attend7
    monkeypatch.setattr(tq_decode, "attend7", lambda *a: real7(*a) if ROUTE["fused"] else None)
    monkeypatch.setattr(tq_fused, "_tq7_kernel", lambda: emulated_tq7(seen))
    MMA_STEPS.clear()
    monkeypatch.setattr(tq_mma, "_tq5_kernel", lambda: emulated_tq5(MMA_STEPS))
    tq_fused.split7.cache_clear()
    PLANT["which"] = None
    ROUTE["fused"] = True
    yield seen
    PLANT["which"] = None
    ROUTE["fused"] = True


MMA_STEPS: list = []


def _lockstep(rows, q_heads, kv_heads, dim, dtype, steps, seed=5):
    """The MMA split kernel ("v4") and the fused one ("v7") on twin caches, step by step: [(fused output,
    MMA split output, SDPA over the decoded cache)]."""
    caches = {}
    for variant in ("v4", "v7"):
        caches[variant] = _rows(rows, kv_heads, dim, dtype, seed=seed + len(rows))
        caches[variant].hooked = True
    B = len(rows)
    mx.random.seed(21)
    out = []
    for _ in range(steps):
        k = mx.random.normal((B, kv_heads, 1, dim)).astype(dtype)
        v = mx.random.normal((B, kv_heads, 1, dim)).astype(dtype)
        q = mx.random.normal((B, q_heads, 1, dim)).astype(dtype)
        got = {}
        for variant, cache in caches.items():
            ROUTE["fused"] = variant == "v7"
            mask = cache.make_mask(1) if B > 1 else None
            cache.update_and_fetch(k, v)
            got[variant] = cache.attend(q, dim ** -0.5, mask).astype(mx.float32)
        ROUTE["fused"] = True
        keys, values = caches["v7"]._fetch(rotated=False)
        ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), keys.astype(mx.float32),
                                                   values.astype(mx.float32), scale=dim ** -0.5, mask=mask)
        out.append((got["v7"], got["v4"], ref))
    return out


@pytest.mark.parametrize("q_heads,kv_heads,dim,dtype", [
    (8, 2, 128, mx.bfloat16),  # G = 4, the Qwen3-8B shape
    (8, 2, 128, mx.float16),
    (16, 2, 128, mx.bfloat16),  # G = 8: every query column of the MMA
    (6, 2, 64, mx.bfloat16),  # G = 3, D = 64: one V word, two K words a token and lane
    (2, 2, 128, mx.float16),  # G = 1
])
def test_fused_step_equals_the_mma_split_and_the_decoded_cache(emulated7, monkeypatch, q_heads, kv_heads, dim, dtype):
    """One row and left-padded rows across group boundaries: the fused kernel's output stays within the
    bf16 / f16 tolerance of SDPA over the decoded cache and within f16 rounding of the MMA split kernel's,
    and every fused step launched the fused kernel (+ the parallel reduce), none the CUDA-core one."""
    calls = _kernel_calls(monkeypatch)
    tol = 2e-2 if dtype == mx.bfloat16 else 4e-3
    steps = 0
    for rows in ([[150, 9]], [[300], [7, 30, 1], [16], [40, 3]]):
        for i, (v7, v4, ref) in enumerate(_lockstep(rows, q_heads, kv_heads, dim, dtype, 10)):
            scale = max(mx.abs(ref).max().item(), 1.0)
            e_ref, e_v4 = mx.abs(v7 - ref).max().item(), mx.abs(v7 - v4).max().item()
            assert e_ref <= tol * scale, (rows, i, e_ref)
            assert e_v4 <= tol / 2 * scale, (rows, i, e_v4)  # (outputs rounded to bf16 / f16: an ulp or two apart)
            steps += 1
    seen = emulated7
    assert len(seen) == steps and len(MMA_STEPS) == steps and calls["tq3"] == 0
    assert calls["tq3_reduce"] == 2 * steps  # the fused kernel's and the MMA split kernel's


def _force_chunk(monkeypatch, chunk):
    """v7's blocks at `chunk` columns (small test caches would get 64: one tile per warp)."""
    monkeypatch.setattr(tq_fused, "split7", lambda *a: chunk)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [192, 576, 1024])
def test_fused_long_blocks_stream_several_tiles_per_warp(emulated7, monkeypatch, chunk):
    """Blocks of 192 / 576 / 1,024 columns: 3 / 9 / 16 tiles per warp (both tile buffers, an odd
    count, the running max growing inside a warp's stream), one row and left-padded rows, against
    the decoded cache and v4."""
    _force_chunk(monkeypatch, chunk)
    for rows in ([[1024, 1024, 52]], [[1500], [7, 300, 1], [700, 3]]):
        for v7, v4, ref in _lockstep(rows, 8, 2, 128, mx.bfloat16, 3, seed=9):
            scale = max(mx.abs(ref).max().item(), 1.0)
            assert mx.abs(v7 - ref).max().item() <= 2e-2 * scale
            assert mx.abs(v7 - v4).max().item() <= 1e-2 * scale
    assert set(emulated7) == {chunk}


@pytest.mark.parametrize("plant", ["half", "src", "vtok", "rescale"])
def test_a_planted_index_error_misses_the_reference(emulated7, monkeypatch, plant):
    """Each index of the emulation that the kernel's layout fixes (which f16 half, which score lane,
    the V tokens' order, the rescale when a max grows) switched to a wrong one: the step leaves the
    tolerance, so the checks above can fail."""
    PLANT["which"] = plant
    _force_chunk(monkeypatch, 1024)
    worst = 0.0
    for v7, _, ref in _lockstep([[1100, 9]], 8, 2, 128, mx.bfloat16, 2, seed=3):
        worst = max(worst, mx.abs(v7 - ref).max().item() / max(mx.abs(ref).max().item(), 1.0))
    assert worst > 2e-2, (plant, worst)


def test_what_the_fused_kernel_cannot_map_falls_through(emulated7, monkeypatch):
    """D = 256 (registers) runs the MMA split kernel; float32 and 2-bit caches the CUDA-core split
    kernel; never the fused one."""
    monkeypatch.setattr(tq_fused, "_tq7_kernel", lambda: pytest.fail("the fused kernel launched a step it cannot map"))
    v5 = MMA_STEPS
    calls = _kernel_calls(monkeypatch)
    for dtype, bits, dim in ((mx.bfloat16, 4, 256), (mx.float32, 4, 128), (mx.bfloat16, 2, 128)):
        mx.random.seed(bits + dim)
        cache = tq_mma_rows(dtype, bits, dim)
        q = mx.random.normal((1, 4, 1, dim)).astype(dtype)
        assert_attends_as_the_decoded_cache(cache, q, (dtype, bits, dim))
    assert len(v5) == 1 and calls["tq3"] == 2  # D = 256 by the MMA split; float32 and 2 bits by the CUDA-core one


def tq_mma_rows(dtype, bits, dim):
    from engine.tq_cache import TurboQuantKVCache

    cache = TurboQuantKVCache(kv_bits=bits, group=16)
    cache.update_and_fetch(mx.random.normal((1, 2, 40, dim)).astype(dtype), mx.random.normal((1, 2, 40, dim)).astype(dtype))
    cache.hooked = True
    cache.update_and_fetch(mx.random.normal((1, 2, 1, dim)).astype(dtype), mx.random.normal((1, 2, 1, dim)).astype(dtype))
    return cache


def test_fused_rules_and_source():
    q = mx.zeros((1, 32, 1, 128), mx.bfloat16)
    assert tq_fused.usable7(q, 4, 4, 128, 64) and not tq_fused.usable7(q, 2, 4, 128, 64)
    assert not tq_fused.usable7(q.astype(mx.float32), 4, 4, 128, 64)
    assert not tq_fused.usable7(mx.zeros((1, 32, 1, 256), mx.bfloat16), 4, 4, 256, 64)
    assert not tq_fused.usable7(q, 4, 8, 128, 2048)  # the tail's scores + red past the table's space
    s = tq_fused.SOURCE
    # one pass: no score array per token (the tail's sc is GROUP wide), no barrier in the code path's loop
    assert "[CHUNK]" not in s and s.count("mma_f16(") == 2
    loop = s[s.index("Tile ta, tb2;"):s.index("// The block's combine")]
    assert "__syncthreads" not in loop and "math(ta" in loop and "load(tb2" in loop and "if constexpr (PF)" in loop
    # the layout the emulation assumes
    for text in ("src0 = 8 * tq + (gq >> 1), src1 = src0 + 4", "(gq & 1) ? 0x7632u : 0x5410u",
                 "(r & 1 ? tv1 : tv0) + 8 * (r >> 1)", "const int nt = (n + 16 * NW - 1) / (16 * NW);",
                 "mx_[g] = mb * 0.6931471805599453f", "constexpr float TH7 = 3.f;", "n0 > mr[0] + TH7 || n1 > mr[1] + TH7"):
        assert text in s, text
    assert "float qr[G][8];" in s and "float acc[G][8];" in s  # the dense tail: the split kernel's


def test_split7_uses_its_own_occupancy():
    """split7 is the MMA split kernel's cost model at the fused kernel's resident blocks (registers: 4 blocks of 4 warps per SM at
    128), the chunk a multiple of 64 of at least the window's."""
    slots = tq_fused.slots7(4, 128)
    assert slots == common.sm_count() * 4
    for tokens, rows in ((100_000, 1), (32768, 1), (100_000, 8), (700, 3)):
        chunk = tq_fused.split7(-(-tokens // 64), 8, rows, 4, 128, 2)
        assert chunk % 64 == 0 and 128 <= chunk <= tq_mma.chunk_capacity(4)
        assert chunk == tq_mma.split5(64 * -(-tokens // 64), 8, rows, 4, 128, 128, slots=slots)


def _prebuild(monkeypatch, heads: tuple[int, int, int], attention: dict) -> dict:
    """The CUDA table's prebuild_tq for a model of (query heads, KV heads, head dim), bf16, with the
    encode and reduce kernels recorded as zeros and `attention` ({kernel getter name on its module:
    replacement}) set; returns the build's {chunk: s}."""
    from types import SimpleNamespace

    from engine.tq_config import TQConfig

    def zeros(**kw):
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(tq_encode, "_encode_kernel", lambda: zeros)
    monkeypatch.setattr(tq_split, "_tq3_reduce_kernel", lambda: zeros)
    for (module, name), getter in attention.items():
        monkeypatch.setattr(module, name, getter)
    hq, kv, dim = heads
    args = SimpleNamespace(num_attention_heads=hq, num_key_value_heads=kv, head_dim=dim, hidden_size=4096)
    model = SimpleNamespace(args=args, parameters=lambda: {"w": mx.zeros((1,), mx.bfloat16)})
    return selector.CudaKernels().prebuild_tq(model, TQConfig(), max_batch=8)


def test_prebuild_builds_the_fused_kernel_once(monkeypatch):
    built = []

    def record(**kw):
        built.append(dict(kw["template"]))
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    out = _prebuild(monkeypatch, (32, 8, 128), {
        (tq_mma, "_tq5_kernel"): lambda: pytest.fail("the MMA split kernel built where the fused one maps"),
        (tq_fused, "_tq7_kernel"): lambda: record})
    assert len([c for c in out if c > 0]) == 1 and sum("TW" in t for t in built) == 1  # (-1: the reduces)


def test_prebuild_builds_the_fallbacks_kernel_where_the_fused_one_cannot_map_the_model(monkeypatch):
    """Head dim 256: the load-time build compiles the MMA split kernel, not the fused one."""
    built = []

    def record(**kw):
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    out = _prebuild(monkeypatch, (16, 4, 256), {
        (tq_fused, "_tq7_kernel"): lambda: pytest.fail("the fused kernel built for a head dim it cannot map"),
        (tq_mma, "_tq5_kernel"): lambda: built.append(1) or record})
    assert len([c for c in out if c > 0]) == 1 and built == [1]


@pytest.mark.slow
@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="no nvcc on this machine (CI)")
def test_fused_kernel_compiles_for_the_h200_within_its_register_budget(tmp_path):
    """nvcc for sm_90 at every shape the fused kernel maps: no spills or stack frame, at most `V7_REGS` registers
    (4 blocks of 4 warps per SM at 128) and `v7_shared_bytes` of static shared memory."""
    from testsupport.kernel_render import TQ_INPUTS, ptxas_report, render

    shapes = []
    for dtype, dim, g in (("bfloat16", 128, 4), ("float16", 128, 4), ("bfloat16", 128, 8), ("bfloat16", 64, 3),
                          ("bfloat16", 128, 1)):
        name = f"v7_{dtype}_d{dim}_g{g}"
        inputs = [(n, dtype if t == "T" else t, nd) for n, t, nd in TQ_INPUTS]
        shapes.append((name, render(name, tq_fused.SOURCE, inputs, [("o_part", "float32"), ("ml_part", "float32")],
                                    tq_fused.templates7(dtype, dim, g, 64))))
    report = ptxas_report(tmp_path / "v7.cu", common.HEADER + tq_split.SPLIT_HEADER
                          + tq_mma.MMA_HEADER + tq_fused.FUSED_HEADER, shapes, timeout=900)
    assert len(report) == len(shapes)
    for name, (regs, smem, frame, spills, block) in report.items():
        g, dim = int(name.split("_g")[1]), int(name.split("_d")[1].split("_")[0])
        assert frame == 0 and spills == ("0", "0"), (name, block)
        assert tq_fused.v7_shared_bytes(g, dim) - 128 <= smem <= tq_fused.v7_shared_bytes(g, dim), (name, smem)
        assert regs <= tq_fused.v7_regs(g, dim), (name, regs)
        if (dim, g) == (128, 4):  # Qwen3-8B: the blocks per SM `split7` plans with
            assert common.blocks_per_sm(smem, regs) == 4, (name, regs)
    print("ptxas registers, smem:", {n: r[:2] for n, r in report.items()})
