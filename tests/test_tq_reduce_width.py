"""The parallel reduce (every TurboQuant split kernel's second launch, engine/kernels/tq_split.py) runs 16
warps per (row, query head) from `WIDE_SPLITS` splits on: at one row there are only 32 blocks, so 4 warps
each walked a quarter of 75-158 splits one round of loads after another (8.7-13.7 us on the H200)."""

from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.kernels import common, dense, prebuild, selector, tq_decode, tq_encode, tq_fused, tq_mma, tq_split  # noqa: F401
from tests.test_decode_attention import emulated_tq3_reduce

ROOT = Path(__file__).resolve().parents[1]


def _partials(rows, splits, dim, seed=0):
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((rows, splits, dim)).astype(np.float32)
    ml = np.stack([rng.standard_normal((rows, splits)), rng.uniform(0.5, 2.0, (rows, splits))], -1).astype(np.float32)
    ml[0, 3, 0] = -np.inf  # an empty split (a padded row's block before its start)
    return o, ml


def _reference(o, ml, signs):
    """softmax-weighted sum of the splits: the rotated ones turned back (H / sqrt(D), signs), the last dense."""
    D = o.shape[-1]
    M = ml[:, :, 0].max(1, keepdims=True)
    w = np.where(np.isinf(ml[:, :, 0]), 0.0, np.exp(ml[:, :, 0] - M))
    L = (w * ml[:, :, 1]).sum(1)
    rot = (w[:, :-1, None] * o[:, :-1]).sum(1)
    h = np.array([[(-1) ** bin(i & j).count("1") for j in range(D)] for i in range(D)], np.float32)
    back = rot @ h.T / np.sqrt(D) * signs
    return (back + w[:, -1:] * o[:, -1]) / L[:, None]


def test_many_splits_take_the_wide_reduce_and_give_the_same_output(monkeypatch):
    seen = []

    def kernel(**kw):
        seen.append((dict(kw["template"])["RW"], kw["grid"], kw["threadgroup"]))
        return emulated_tq3_reduce(**kw)

    monkeypatch.setattr(tq_split, "_tq3_reduce_kernel", lambda: kernel)
    rows, dim = 4, 16
    signs = np.where(np.random.default_rng(1).random(dim) < 0.5, -1.0, 1.0).astype(np.float32)
    for splits, rw in ((5, tq_split.RW), (tq_split.WIDE_SPLITS - 1, tq_split.RW), (tq_split.WIDE_SPLITS, tq_split.RW_WIDE),
                       (158, tq_split.RW_WIDE)):
        o, ml = _partials(rows, splits, dim, seed=splits)
        out = tq_split.reduce_split(mx.array(o.reshape(-1)), mx.array(ml), mx.array(signs), (1, rows, 1, dim), mx.float32)
        assert seen[-1] == (rw, (rows * rw * 32, 1, 1), (rw * 32, 1, 1))
        assert out.shape == (1, rows, 1, dim)
        np.testing.assert_allclose(np.array(out).reshape(rows, dim), _reference(o, ml, signs), rtol=1e-4, atol=1e-5)
    assert tq_split.reduce_warps(1) == tq_split.RW and tq_split.RW_WIDE > tq_split.RW


def test_the_engine_builds_both_reduce_widths_at_load(monkeypatch):
    """v5's attention plan (one row of 4,096 columns) reaches only the narrow reduce: the wide one
    is built beside it, so a long context's first step compiles nothing."""
    from mlx_lm.utils import load

    widths = []

    def kernel(**kw):
        widths.append(dict(kw["template"])["RW"])
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(tq_split, "_tq3_reduce_kernel", lambda: kernel)
    model, _ = load(str(ROOT / "fixtures" / "tiny-llama"))
    outs = prebuild.reduce_launches(model)
    hq, _, dim = prebuild.model_shape(model)
    assert sorted(widths) == [tq_split.RW, tq_split.RW_WIDE] and all(o.shape == (1, hq, 1, dim) for o in outs)


@__import__("pytest").mark.skipif(__import__("shutil").which("nvcc") is None, reason="no nvcc on this machine (CI)")
def test_the_wide_reduce_compiles_for_the_h200(tmp_path):
    from tests.test_decode_kernel_sources import ptxas_report, render

    shapes = [(f"r{rw}_{dtype}", render(f"r{rw}_{dtype}", tq_split.REDUCE_SOURCE,
                                        [("o_part", "float32", 1), ("ml_part", "float32", 3), ("signs", "float32", 1)],
                                        [("out", dtype)], [("T", dtype), ("D", 128), ("RW", rw)]))
              for rw in (tq_split.RW, tq_split.RW_WIDE) for dtype in ("bfloat16", "float16")]
    report = ptxas_report(tmp_path / "r.cu", common.HEADER + tq_split.SPLIT_HEADER, shapes, timeout=600)
    assert len(report) == len(shapes)
    for name, (regs, smem, frame, spills, block) in report.items():
        assert frame == 0 and spills == ("0", "0") and smem <= 48 * 1024, (name, block)
        assert regs * 32 * (tq_split.RW_WIDE if name.startswith(f"r{tq_split.RW_WIDE}_") else tq_split.RW) <= 65536, name
