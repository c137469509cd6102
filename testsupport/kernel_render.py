"""A kernel body as MLX's `mx.fast.cuda_kernel` renders it, and nvcc's report on it: a CPU-side check of
the CUDA sources for machines with nvcc but no GPU (the kernel tests, bench/time_kernel_builds.py). A GPU
run costs device time that a typo would waste; this catches the typos on the CPU.

MLX's rendering (mlx/backend/cuda/custom_kernel.cpp, `build_kernel`): `const T* name` per input, with
`name_shape` / `name_strides` where the body names them, `T* name` per output, the template arguments as
constexprs / type aliases, then the body.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

__all__ = ["render", "ptxas_report", "PRELUDE", "TQ_INPUTS"]

# What MLX's default header brings that the bodies use: the dtypes and the Shape / Strides
# arrays (cuda::std::array of int32 / int64 in MLX; an indexable struct here).
PRELUDE = """
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
struct Shape { int32_t v[8]; __device__ int32_t operator[](int i) const { return v[i]; } };
struct Strides { int64_t v[8]; __device__ int64_t operator[](int i) const { return v[i]; } };
"""

_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half", "uint32": "uint32_t",
          "int32": "int32_t"}

# The TurboQuant decode kernels' inputs: (name, dtype ("T": the cache's), ndim).
TQ_INPUTS = [("q", "T", 4), ("kn", "float32", 4), ("kc", "uint32", 4), ("vn", "float32", 4), ("vc", "uint32", 4),
             ("tk", "T", 4), ("tv", "T", 4), ("lp", "int32", 1), ("signs", "float32", 1), ("cent", "float32", 1),
             ("params", "float32", 1)]


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


def ptxas_report(src: Path, headers: str, shapes: list[tuple[str, str]], timeout: int) -> dict:
    """Compiles the kernels `shapes` ((name, rendered body)) after `headers` for sm_90 into `src` and
    returns ptxas's report per kernel: {name: (registers, shared memory bytes, stack frame bytes,
    (spill store, spill load bytes), the report's text)}."""
    src.write_text(PRELUDE + headers + "\n".join(body for _, body in shapes))
    run = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(src.with_suffix(".o")),
                          "-Xptxas", "-v"], capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-4000:])
    report = {}
    for block in re.split(r"Compiling entry function", run.stderr)[1:]:
        mangled = block.split("'")[1]
        name = next(n for n, _ in shapes if re.search(rf"\d{n}P", mangled))
        smem = re.search(r"(\d+) bytes smem", block)
        report[name] = (int(re.search(r"Used (\d+) registers", block).group(1)), int(smem.group(1)) if smem else 0,
                        int(re.search(r"(\d+) bytes stack frame", block).group(1)),
                        re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block).groups(), block)
    return report
