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

from engine.kernels import common, dense, prebuild, selector, tq_decode, tq_encode, tq_fused, tq_mma, tq_split  # noqa: F401

# What MLX's default header brings that the bodies use: the dtypes and the Shape / Strides
# arrays (cuda::std::array of int32 / int64 in MLX; an indexable struct here).
_PRELUDE = """
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
struct Shape { int32_t v[8]; __device__ int32_t operator[](int i) const { return v[i]; } };
struct Strides { int64_t v[8]; __device__ int64_t operator[](int i) const { return v[i]; } };
"""

_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half", "uint32": "uint32_t",
          "int32": "int32_t"}


def render(name: str, source: str, inputs: list[tuple[str, str, int]], outputs: list[tuple[str, str]],
           template: list[tuple[str, object]]) -> str:
    """One kernel as `build_kernel` writes it. inputs: (name, dtype, ndim); outputs: (name, dtype)."""
    params = []
    for n, dtype, ndim in inputs:
        params.append(f"    const {_TYPES[dtype]}* {n}")
        if ndim:
            if f"{n}_shape" in source:
                params.append(f"    const __grid_constant__ Shape {n}_shape")
            if f"{n}_strides" in source:
                params.append(f"    const __grid_constant__ Strides {n}_strides")
    params += [f"    {_TYPES[dtype]}* {n}" for n, dtype in outputs]
    consts = []
    for n, v in template:
        if isinstance(v, bool):
            consts.append(f"  constexpr bool {n} = {'true' if v else 'false'};")
        elif isinstance(v, int):
            consts.append(f"  constexpr int {n} = {v};")
        else:
            consts.append(f"  using {n} = {_TYPES[v]};")
    return f"__global__ void {name}(\n" + ",\n".join(params) + ") {\n" + "\n".join(consts) + "\n" + source + "\n}\n"


_TQ_INPUTS = [("q", "T", 4), ("kn", "float32", 4), ("kc", "uint32", 4), ("vn", "float32", 4), ("vc", "uint32", 4),
              ("tk", "T", 4), ("tv", "T", 4), ("lp", "int32", 1), ("signs", "float32", 1), ("cent", "float32", 1),
              ("params", "float32", 1)]


def _variants(dtypes=("bfloat16", "float32", "float16")) -> list[str]:
    """Every kernel the engine launches, at the template values it uses (a spread of them)."""
    out = []
    i = 0
    for dtype in dtypes:
        for dim, g, chunk, bits in ((128, 4, 256, 4), (64, 3, 1024, 2), (16, 2, 64, 8), (256, 4, 1024, 1)):  # G x D <= 1024 (`_gqa`)
            base = [("T", dtype), ("D", dim), ("G", g), ("CHUNK", chunk), ("NW", common.NW)]
            tq = base + [("BITS", bits), ("GROUP", 64), ("NQ", 1), ("U", da.UNROLLS[i % len(da.UNROLLS)])]
            inputs = [(n, dtype if t == "T" else t, nd) for n, t, nd in _TQ_INPUTS]
            out.append(render(f"tq_{i}", da._TQ_SOURCE, inputs, [("o_part", "float32"), ("ml_part", "float32")],
                              tq))
            out.append(render(f"tq1_{i}", da._TQ1_SOURCE, inputs + [("cnt", "int32", 1)],
                              [("o_part", "float32"), ("ml_part", "float32"), ("out", dtype)], tq))
            out.append(render(f"dense_{i}", da._DENSE_SOURCE,
                              [("q", dtype, 4), ("k", dtype, 4), ("v", dtype, 4), ("lp", "int32", 1),
                               ("params", "float32", 1)], [("o_part", "float32"), ("ml_part", "float32")],
                              base + [("U", da.DENSE_UNROLLS[i % len(da.DENSE_UNROLLS)])]))
            for rot in (True, False):
                out.append(render(f"reduce_{i}_{int(rot)}", da._REDUCE_SOURCE,
                                  [("o_part", "float32", 1), ("ml_part", "float32", 3), ("signs", "float32", 1)],
                                  [("out", dtype)], [("T", dtype), ("D", dim), ("ROT", rot)]))
            if dim >= 32:
                out.append(render(f"encode_{i}", da._ENCODE_SOURCE,
                                  [("k", dtype, 4), ("v", dtype, 4), ("signs", "float32", 1), ("thr", "float32", 1)],
                                  [("kn", "float32"), ("kc", "uint32"), ("vn", "float32"), ("vc", "uint32")],
                                  [("T", dtype), ("D", dim), ("BITS", bits)]))
            for load in da.TQ3_LOADS:
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
    """v3 at the shapes the engine runs (Qwen3-8B: D 128, G 4, 4 bits; G 8; SmolLM2: D 64, G 3),
    every load width, as (name, source)."""
    out = []
    for dim, g, chunk, bits in ((128, 4, 1024, 4), (128, 4, 256, 4), (128, 8, 512, 4), (64, 3, 1024, 4)):
        for load in da.TQ3_LOADS:
            for nib in (True, False):
                cpl = tq_split.cpl(g, dim, bits, load)
                name = f"v3_d{dim}_g{g}_c{chunk}_b{bits}_l{load}" + ("" if nib else "_plain")
                inputs = [(n, dtype if t == "T" else t, nd) for n, t, nd in _TQ_INPUTS]
                out.append((name, render(name, tq_split.SOURCE, inputs,
                                         [("o_part", "float32"), ("ml_part", "float32")],
                                         tq_split.templates(dtype, dim, g, chunk, bits, 64, cpl, nib))))
    return out


def ptxas_report(src, headers: str, shapes: list[tuple[str, str]], timeout: int) -> dict:
    """Compiles the kernels `shapes` ((name, rendered body)) after `headers` for sm_90 into
    `src` and returns ptxas's report per kernel: {name: (registers, shared memory bytes,
    stack frame bytes, (spill store, spill load bytes), the report's text)}."""
    import re

    src.write_text(_PRELUDE + headers + "\n".join(body for _, body in shapes))
    run = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(src.with_suffix(".o")),
                          "-Xptxas", "-v"], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    report = {}
    for block in re.split(r"Compiling entry function", run.stderr)[1:]:
        mangled = block.split("'")[1]
        name = next(n for n, _ in shapes if re.search(rf"\d{n}P", mangled))
        smem = re.search(r"(\d+) bytes smem", block)
        report[name] = (int(re.search(r"Used (\d+) registers", block).group(1)), int(smem.group(1)) if smem else 0,
                        int(re.search(r"(\d+) bytes stack frame", block).group(1)),
                        re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block).groups(), block)
    return report


def test_every_kernel_renders_with_the_names_its_body_uses():
    sources = _variants()
    # per dtype and shape: tq, tq1, dense, 2 reduces, v3 per load width that fits, the v3 reduce; encode if D >= 32
    v3 = sum(tq_split.cpl(g, d, b, load) is not None for d, g, b in ((128, 4, 4), (64, 3, 2), (16, 2, 8), (256, 4, 1))
             for load in da.TQ3_LOADS)
    assert len(sources) == 3 * (4 * 6 + v3) + 3 * 3
    one = da._TQ1_SOURCE
    # The one-launch kernel: empty blocks take a branch, not a return, so each reaches its counter.
    assert one.count("return;") == 1 and "if (!last_) return;" in one and "cnt" in one
    assert da._TQ_SOURCE.count("return;") == 1
    assert "constexpr int U" not in da._TQ_SOURCE and "constexpr int U" not in da._DENSE_SOURCE  # U: a template


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine (CI): nothing to compile with")
def test_every_kernel_compiles_for_the_h200(tmp_path):
    src = tmp_path / "kernels.cu"
    # bf16 (what the engine decodes in) and float32 (the GPU check's exact comparisons).
    src.write_text(_PRELUDE + common.HEADER + tq_split.SPLIT_HEADER + "\n".join(_variants(("bfloat16", "float32"))))
    run = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine (CI): nothing to compile with")
def test_v3_keeps_its_registers_without_spills(tmp_path):
    """ptxas's resource report for v3 at the engine's shapes: no spills, no stack frame (a register
    array indexed at run time would land there), and at G = 4 the narrower loads cost fewer
    registers (more blocks per SM) than the 16-byte one."""
    shapes = _v3_engine_shapes()
    report = {}
    for name, (regs, _smem, frame, spills, block) in ptxas_report(
            tmp_path / "v3.cu", common.HEADER + tq_split.SPLIT_HEADER, shapes, timeout=600).items():
        report[name] = regs
        assert frame == 0 and spills == ("0", "0"), (name, block)
    assert len(report) == len(shapes)
    g4 = [report[f"v3_d128_g4_c1024_b4_l{load}"] for load in (16, 8, 4)]
    assert g4[0] > g4[1] > g4[2] and g4[0] <= 192, g4
    print("ptxas registers:", report)
