"""The one-row GEMV (engine/kernels/gemv.py, cuda/gemv.cu): its arithmetic replayed lane by lane in numpy,
its launches unpacked as the kernel stores them, the decode path's routing of one row, and the source
compiled for sm_90 with nvcc where this machine has it. What it reads on the H200:
bench/bench_decode_roofline.py."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest

from engine.kernels import gemv, skinny_gemm
from engine.kernels.render import ptxas_report, render
from tests.test_skinny_gemm import small_qwen3


def replay(x: np.ndarray, w: np.ndarray, rw: int, split: int) -> np.ndarray:
    """What cuda/gemv.cu computes, block by block and lane by lane in float32: each warp of a group sums
    its K / SPLIT slice of RW rows, 8 consecutive k per lane per load, loads U at a time; the lanes are
    summed by the xor butterfly, the slices through shared memory."""
    n, k = w.shape
    warps, groups, kp = gemv.WARPS, gemv.WARPS // split, k // split
    iters = kp // 256
    u_step = 4 if iters % 4 == 0 else 2 if iters % 2 == 0 else 1
    out = np.full(n, np.nan, np.float32)
    for block in range(n // (groups * rw)):
        partial = np.zeros((warps, rw), np.float32)
        for warp in range(warps):
            group, part = warp // split, warp % split
            row0 = (block * groups + group) * rw
            acc = np.zeros((rw, 32), np.float32)  # per row, per lane
            for it in range(0, iters, u_step):
                for u in range(u_step):
                    cols = part * kp + (it + u) * 256 + np.arange(32)[:, None] * 8 + np.arange(8)  # (lane, 8)
                    for j in range(rw):
                        for i in range(8):
                            acc[j] += w[row0 + j, cols[:, i]] * x[cols[:, i]]
            for j in range(rw):
                v = acc[j].copy()
                for o in (16, 8, 4, 2, 1):
                    v = v + v[np.arange(32) ^ o]
                partial[warp, j] = v[0]
                if split == 1:
                    out[row0 + j] = v[0]  # lane j writes row j: every lane holds the sum
        if split > 1:
            for group in range(groups):
                row0 = (block * groups + group) * rw
                out[row0:row0 + rw] = partial[group * split:(group + 1) * split].sum(0)
    return out


@pytest.mark.parametrize("n,k", [(64, 1024), (32, 2048), (48, 512), (128, 256)])
def test_replay_of_every_plan_equals_the_product(n, k):
    rng = np.random.default_rng(n + k)
    x = rng.standard_normal(k).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    want = w @ x
    for rw in (2, 4):
        for split in (1, 2, 4, 8):
            if k % (256 * split) or n % (gemv.WARPS // split * rw):
                continue
            got = replay(x, w, rw, split)
            assert not np.isnan(got).any(), (rw, split)  # every output row written
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_plan_fills_the_gpu_and_keeps_k_whole():
    assert gemv.plan(4096, 4096) == (2, 4)  # 2,048 row pairs x 4 slices: ~64 warps per SM
    assert gemv.plan(1024, 4096) == (2, 8)  # the K/V projections: as split as a block allows
    assert gemv.plan(24576, 4096) == (2, 1)  # gate|up stacked: wide enough unsplit
    assert gemv.plan(4096, 12288) == (2, 4)  # down_proj
    assert gemv.plan(151936, 4096) == (4, 1)  # LM head
    rw, split = gemv.plan(64, 512)
    assert 512 % (256 * split) == 0  # never a partial 256-wide load


def emulated_kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
    x, w = inputs
    t = dict(template)
    rows_per_block = gemv.WARPS // t["SPLIT"] * t["RW"]
    assert grid[0] == output_shapes[0][0] // rows_per_block * 32 * gemv.WARPS and threadgroup[0] == 32 * gemv.WARPS
    assert x.shape == (t["K"],) and w.shape == (t["N"], t["K"])
    return [(w @ x).astype(output_dtypes[0])]


def test_stacked_parts_unpack_in_order(monkeypatch):
    monkeypatch.setattr(gemv, "_kernel", lambda: emulated_kernel)
    x = mx.random.normal((1, 256)).astype(mx.bfloat16)
    w = (mx.random.normal((384, 256)) * 0.1).astype(mx.bfloat16)
    assert mx.allclose(gemv.gemv(x, w), x @ w.T, atol=1e-2).item()
    q, k, v = gemv.gemv(x, w, parts=(256, 64, 64))
    for part, rows in ((q, w[:256]), (k, w[256:320]), (v, w[320:])):
        assert part.shape == (1, rows.shape[0]) and mx.allclose(part, x @ rows.T, atol=1e-2).item()


def test_one_row_decode_takes_the_gemv_only_when_enabled(monkeypatch):
    launches = []

    def counted(x, w, parts=None):
        launches.append(parts)
        y = x.reshape(1, -1) @ w.T
        if not parts:
            return y
        cuts = [sum(parts[:i]) for i in range(1, len(parts))]
        return list(mx.split(y, cuts, axis=-1))

    model = small_qwen3()
    step = mx.array([[7]])
    before = model(step)
    monkeypatch.setattr(skinny_gemm, "available", lambda: True)
    monkeypatch.setattr(gemv, "available", lambda: True)
    monkeypatch.setattr(gemv, "gemv", counted)
    skinny_gemm.install(model)
    monkeypatch.setenv("PREFIXTRACE_GEMV", "0")
    model(step)
    assert launches == []  # off: MLX's own matmul
    monkeypatch.setenv("PREFIXTRACE_GEMV", "1")
    after = model(step)
    # per layer q|k|v, o, gate|up, down; the LM head (300 outputs, not whole blocks of 16 rows) keeps MLX's
    assert len(launches) == 4 * len(model.layers)
    assert sorted({p for p in launches if p}) == [(256, 128, 128), (512, 512)]
    assert mx.allclose(after, before, atol=1e-2, rtol=1e-2).item()


def test_off_by_default_and_untouched_on_the_cpu(monkeypatch):
    monkeypatch.delenv("PREFIXTRACE_GEMV", raising=False)
    assert not gemv.enabled()
    monkeypatch.setenv("PREFIXTRACE_GEMV", "1")
    assert gemv.enabled()
    assert not gemv.usable(4096, 4096, mx.bfloat16) or gemv.available()  # no CUDA here: never usable


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_compiles_for_sm90_without_spills(tmp_path):
    shapes = []
    for n, k in ((4096, 4096), (1024, 4096), (4096, 12288), (151936, 4096), (6144, 4096)):
        rw, split = gemv.plan(n, k)
        for dtype in ("bfloat16", "float16"):
            name = f"gemv_{n}_{k}_{dtype}"
            shapes.append((name, render(name, gemv.SOURCE, [("x", dtype, 1), ("w", dtype, 2)], [("out", dtype)],
                                        [("T", dtype), ("K", k), ("N", n), ("RW", rw), ("SPLIT", split)])))
    report = ptxas_report(tmp_path / "gemv.cu", "", shapes, timeout=240)
    assert sorted(report) == sorted(n for n, _ in shapes)
    for name, (regs, _smem, frame, spills, _text) in report.items():
        assert spills == ("0", "0") and frame == 0, name
        assert regs <= 128, (name, regs)  # 8 warps x 32 lanes x 128 registers: two blocks per SM at least
