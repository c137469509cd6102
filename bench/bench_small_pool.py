"""Does a kernel that reads a constant from MLX's small pool wait on a page fault? (CUDA only.)

MLX's CUDA allocator serves every allocation of <= 8 bytes from one 64 KB managed pool advised
read-mostly (mlx/backend/cuda/allocator.cpp, SmallSizePool). The hypothesis (docs/PERFORMANCE.md,
"Kernel constants on pages of their own", session 9): a host write anywhere in that pool drops the
GPU's copy of the page, so the next kernel that reads a constant there waits on a GPU page fault.
This times one trivial kernel (one block per SM, each thread reads the constant once) per synced
step, side by side in one process, the constant being:

* small: a cached 4-byte array (the pool), nothing else written between steps;
* small, host writes: the same, with one new host scalar (`mx.array(float)`, the pool) made and
  evaluated before each step, as any op with a Python number does;
* own page, host writes: a 16 KB zero-padded array (`engine.kernels.common.own_page`) with the same writes.

If the hypothesis holds, the second is slower than the other two by the fault's service time.
Measured on the H200 (session 9): both small-pool cases were slower, by ~33-43 us a step, with or
without the host write: reading the pool is slow every launch, not only after a write.

    python bench/bench_small_pool.py [--steps 300] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import numpy as np

from engine.kernels import common

_SOURCE = """
    const float v = c[0];
    o[blockIdx.x * blockDim.x + threadIdx.x] = v + static_cast<float>(threadIdx.x);
"""


def _kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_small_pool_probe", input_names=["c"], output_names=["o"],
                               source=_SOURCE, ensure_row_contiguous=False)


def time_steps(const: mx.array, steps: int, host_writes: bool, blocks: int = 132, threads: int = 128) -> list[float]:
    k = _kernel()
    out = []
    for i in range(steps):
        if host_writes:
            mx.eval(mx.array(float(i)))  # a 4-byte host-written array: the small pool
        t0 = time.perf_counter()
        o = k(inputs=[const], grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
              output_shapes=[(blocks * threads,)], output_dtypes=[mx.float32])[0]
        mx.eval(o)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not common.available():
        print("no CUDA device: nothing to measure (the probe kernel is CUDA only)")
        return
    small = mx.array(np.array([1.5], np.float32))
    own = mx.array(np.full(common.OWN_PAGE // 4, 1.5, np.float32))  # what `own_page` makes, whatever the env says
    mx.eval(small, own)
    cases = {"small": (small, False), "small_host_writes": (small, True), "own_page_host_writes": (own, True),
             "small_again": (small, False)}
    time_steps(small, 20, False)  # build the kernel, warm the path
    rows = {}
    for name, (const, writes) in cases.items():
        t = time_steps(const, args.steps, writes)[10:]
        rows[name] = {"median_us": round(1e6 * statistics.median(t), 2), "p90_us": round(1e6 * float(np.percentile(t, 90)), 2)}
        print(json.dumps({name: rows[name]}), flush=True)
    base = rows["own_page_host_writes"]["median_us"]
    rows["small_host_writes_minus_own_page_us"] = round(rows["small_host_writes"]["median_us"] - base, 2)
    print(json.dumps({"small_host_writes_minus_own_page_us": rows["small_host_writes_minus_own_page_us"]}))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
