"""engine/decode_attention.py's CUDA sources, rendered as MLX's `mx.fast.cuda_kernel` renders
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

from engine import decode_attention as da

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
            base = [("T", dtype), ("D", dim), ("G", g), ("CHUNK", chunk), ("NW", da.NW)]
            tq = base + [("BITS", bits), ("GROUP", 64), ("NQ", 1), ("U", da.UNROLLS[i % len(da.UNROLLS)])]
            inputs = [(n, dtype if t == "T" else t, nd) for n, t, nd in _TQ_INPUTS]
            out.append(render(f"tq_{i}", da._TQ_SOURCE, inputs, [("o_part", "float32"), ("ml_part", "float32")],
                              tq))
            out.append(render(f"tq1_{i}", da._TQ1_SOURCE, inputs + [("cnt", "int32", 1)],
                              [("o_part", "float32"), ("ml_part", "float32"), ("out", dtype)], tq))
            out.append(render(f"dense_{i}", da._DENSE_SOURCE,
                              [("q", dtype, 4), ("k", dtype, 4), ("v", dtype, 4), ("lp", "int32", 1),
                               ("params", "float32", 1)], [("o_part", "float32"), ("ml_part", "float32")], base))
            for rot in (True, False):
                out.append(render(f"reduce_{i}_{int(rot)}", da._REDUCE_SOURCE,
                                  [("o_part", "float32", 1), ("ml_part", "float32", 3), ("signs", "float32", 1)],
                                  [("out", dtype)], [("T", dtype), ("D", dim), ("ROT", rot)]))
            if dim >= 32:
                out.append(render(f"encode_{i}", da._ENCODE_SOURCE,
                                  [("k", dtype, 4), ("v", dtype, 4), ("signs", "float32", 1), ("thr", "float32", 1)],
                                  [("kn", "float32"), ("kc", "uint32"), ("vn", "float32"), ("vc", "uint32")],
                                  [("D", dim), ("BITS", bits)]))
            i += 1
    return out


def test_every_kernel_renders_with_the_names_its_body_uses():
    sources = _variants()
    assert len(sources) == 3 * 4 * 5 + 3 * 3
    one = da._TQ1_SOURCE
    # The one-launch kernel: empty blocks take a branch, not a return, so each reaches its counter.
    assert one.count("return;") == 1 and "if (!last_) return;" in one and "cnt" in one
    assert da._TQ_SOURCE.count("return;") == 1
    assert "constexpr int U" not in da._TQ_SOURCE and "constexpr int U = 4;" in da._DENSE_SOURCE  # U: a template


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine (CI): nothing to compile with")
def test_every_kernel_compiles_for_the_h200(tmp_path):
    src = tmp_path / "kernels.cu"
    # bf16 (what the engine decodes in) and float32 (the GPU check's exact comparisons).
    src.write_text(_PRELUDE + da._HEADER + "\n".join(_variants(("bfloat16", "float32"))))
    run = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
