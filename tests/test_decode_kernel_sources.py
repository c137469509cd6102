"""engine/kernels/'s CUDA sources, rendered as MLX's `mx.fast.cuda_kernel` renders
them (mlx/backend/cuda/custom_kernel.cpp, `build_kernel`: `const T* name` per input, with
`name_shape` / `name_strides` where the body names them, `T* name` per output, the template
arguments as constexprs / type aliases, then the body) and compiled for the H200 (sm_90)
with nvcc where this machine has it. A GPU run costs device time that a typo would waste;
this catches the typos on the CPU. The arithmetic is tested by tests/test_decode_attention.py's
emulation; what runs on the GPU by bench/check_decode_kernels.py."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from engine.kernels import common, dense, tq_encode, tq_split
from testsupport.kernel_render import PRELUDE as _PRELUDE
from testsupport.kernel_render import TQ_INPUTS as _TQ_INPUTS
from testsupport.kernel_render import ptxas_report, render

__all__ = ["render", "ptxas_report", "_PRELUDE", "_TQ_INPUTS"]  # (the other kernel tests import them from here)


def _variants(dtypes=("bfloat16", "float32", "float16")) -> list[str]:
    """Every kernel the engine launches, at the template values it uses (a spread of them)."""
    out = []
    i = 0
    for dtype in dtypes:
        for dim, g, chunk, bits in ((128, 4, 256, 4), (64, 3, 1024, 2), (16, 2, 64, 8), (256, 4, 1024, 1)):  # G x D <= 1024 (`_gqa`)
            base = [("T", dtype), ("D", dim), ("G", g), ("CHUNK", chunk), ("NW", common.NW)]
            tq = base + [("BITS", bits), ("GROUP", 64), ("NQ", 1), ("U", tq_split.GENERIC_UNROLL)]
            inputs = [(n, dtype if t == "T" else t, nd) for n, t, nd in _TQ_INPUTS]
            out.append(render(f"tq_{i}", tq_split.GENERIC_SOURCE, inputs,
                              [("o_part", "float32"), ("ml_part", "float32")], tq))
            out.append(render(f"dense_{i}", dense.SOURCE,
                              [("q", dtype, 4), ("k", dtype, 4), ("v", dtype, 4), ("lp", "int32", 1),
                               ("params", "float32", 1)], [("o_part", "float32"), ("ml_part", "float32")],
                              base + [("U", dense.UNROLL)]))
            for rot in (True, False):
                out.append(render(f"reduce_{i}_{int(rot)}", common.source("reduce.cu"),
                                  [("o_part", "float32", 1), ("ml_part", "float32", 3), ("signs", "float32", 1)],
                                  [("out", dtype)], [("T", dtype), ("D", dim), ("ROT", rot)]))
            if dim >= 32:
                out.append(render(f"encode_{i}", tq_encode.SOURCE,
                                  [("k", dtype, 4), ("v", dtype, 4), ("signs", "float32", 1), ("thr", "float32", 1)],
                                  [("kn", "float32"), ("kc", "uint32"), ("vn", "float32"), ("vc", "uint32")],
                                  [("T", dtype), ("D", dim), ("BITS", bits)]))
            for load in tq_split.LOADS:
                cpl = tq_split.cpl(g, dim, bits, load)
                if cpl is not None:
                    out.append(render(f"tq3_{i}_{load}", tq_split.SOURCE, inputs,
                                      [("o_part", "float32"), ("ml_part", "float32")],
                                      tq_split.templates(dtype, dim, g, chunk, bits, 64, cpl)))
            out.append(render(f"tq3_reduce_{i}", tq_split.REDUCE_SOURCE,
                              [("o_part", "float32", 1), ("ml_part", "float32", 3), ("signs", "float32", 1)],
                              [("out", dtype)], [("T", dtype), ("D", dim), ("RW", tq_split.RW)]))
            i += 1
    return out


def _v3_engine_shapes(dtype="bfloat16") -> list[tuple[str, str]]:
    """The split kernel at the shapes the engine runs (Qwen3-8B: D 128, G 4, 4 bits; G 8; SmolLM2: D 64, G 3),
    every load width, as (name, source)."""
    out = []
    for dim, g, chunk, bits in ((128, 4, 1024, 4), (128, 4, 256, 4), (128, 8, 512, 4), (64, 3, 1024, 4)):
        for load in tq_split.LOADS:
            for nib in (True, False):
                cpl = tq_split.cpl(g, dim, bits, load)
                name = f"v3_d{dim}_g{g}_c{chunk}_b{bits}_l{load}" + ("" if nib else "_plain")
                inputs = [(n, dtype if t == "T" else t, nd) for n, t, nd in _TQ_INPUTS]
                out.append((name, render(name, tq_split.SOURCE, inputs,
                                         [("o_part", "float32"), ("ml_part", "float32")],
                                         tq_split.templates(dtype, dim, g, chunk, bits, 64, cpl, nib))))
    return out


def test_every_kernel_renders_with_the_names_its_body_uses():
    sources = _variants()
    # per dtype and shape: generic, dense, 2 reduces, the split kernel per load width that fits, its reduce;
    # encode if D >= 32
    split = sum(tq_split.cpl(g, d, b, load) is not None
                for d, g, b in ((128, 4, 4), (64, 3, 2), (16, 2, 8), (256, 4, 1)) for load in tq_split.LOADS)
    assert len(sources) == 3 * (4 * 5 + split) + 3 * 3
    assert tq_split.GENERIC_SOURCE.count("return;") == 1
    assert "constexpr int U" not in tq_split.GENERIC_SOURCE and "constexpr int U" not in dense.SOURCE  # U: a template


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine (CI): nothing to compile with")
def test_every_kernel_compiles_for_the_h200(tmp_path):
    src = tmp_path / "kernels.cu"
    # bf16 (what the engine decodes in) and float32 (the GPU check's exact comparisons).
    src.write_text(_PRELUDE + common.HEADER + tq_split.SPLIT_HEADER + "\n".join(_variants(("bfloat16", "float32"))))
    run = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine (CI): nothing to compile with")
def test_the_split_kernel_keeps_its_registers_without_spills(tmp_path):
    """ptxas's resource report for the split kernel at the engine's shapes: no spills, no stack frame (a
    register array indexed at run time would land there), and at G = 4 the narrower load costs fewer
    registers (more blocks per SM) than the 8-byte one."""
    shapes = _v3_engine_shapes()
    report = {}
    for name, (regs, _smem, frame, spills, block) in ptxas_report(
            tmp_path / "v3.cu", common.HEADER + tq_split.SPLIT_HEADER, shapes, timeout=600).items():
        report[name] = regs
        assert frame == 0 and spills == ("0", "0"), (name, block)
    assert len(report) == len(shapes)
    g4 = [report[f"v3_d128_g4_c1024_b4_l{load}"] for load in (8, 4)]
    assert g4[0] > g4[1] and g4[0] <= 128, g4
    print("ptxas registers:", report)
