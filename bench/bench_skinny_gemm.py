"""The skinny GEMM kernel (engine/skinny_gemm.py) against MLX's own matmul, on CUDA.

For each projection of a Qwen3-8B layer and the LM head, and R = 1..8 rows:
the kernel's result against `x @ W.T` (max relative error), and the time of
20 chained products per evaluation (so synchronisation does not dominate),
side by side. Also the bytes/s of the weight stream against the copy bandwidth.

    python bench/bench_skinny_gemm.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.skinny_gemm import available, skinny_matmul, skinny_matmul_mma  # noqa: E402

SHAPES = {"qo": (4096, 4096), "kv": (1024, 4096), "gate_up": (12288, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
CHAIN = 20


def timed(fn, repeat: int = 10) -> float:
    fn()
    best = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t0)
    best.sort()
    return best[len(best) // 2] / CHAIN


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--rw", default="1,2,4,8", help="rows-per-warp variants to time")
    args = ap.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    rws = [int(r) for r in args.rw.split(",")]
    if not available():
        sys.exit("needs MLX's CUDA backend with the GPU as default device")
    report = {}
    for name, (n, k) in SHAPES.items():
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        mx.eval(w)
        for rows in row_counts:
            xs = [mx.random.normal((rows, k)).astype(mx.bfloat16) for _ in range(CHAIN)]
            mx.eval(xs)
            ref = (xs[0] @ w.T).astype(mx.float32)
            got = skinny_matmul(xs[0], w).astype(mx.float32)
            err = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
            t_mlx = timed(lambda: mx.eval([x @ w.T for x in xs]))
            t_ours = timed(lambda: mx.eval([skinny_matmul(x, w) for x in xs]))
            per_rw = {}
            for rw in rws:
                got = skinny_matmul(xs[0], w, rw).astype(mx.float32)
                err = max(err, (mx.abs(got - ref).max() / mx.abs(ref).max()).item())
                per_rw[rw] = round(1e6 * timed(lambda: mx.eval([skinny_matmul(x, w, rw) for x in xs])), 1)
            got = skinny_matmul_mma(xs[0], w).astype(mx.float32)
            err_mma = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
            t_mma = timed(lambda: mx.eval([skinny_matmul_mma(x, w) for x in xs]))
            report[f"{name}_R{rows}"] = {"max_rel_err": round(err, 5), "mlx_us": round(t_mlx * 1e6, 1),
                                         "mma_us": round(t_mma * 1e6, 1), "mma_max_rel_err": round(err_mma, 5),
                                         "mma_speedup": round(t_mlx / t_mma, 2),
                                         "skinny_us": round(t_ours * 1e6, 1), "speedup": round(t_mlx / t_ours, 2),
                                         "skinny_weight_gb_s": round(w.nbytes / t_ours / 1e9, 1),
                                         "skinny_us_by_rows_per_warp": per_rw}
    for key, v in report.items():
        print(key, json.dumps(v))
    bad = {key: v for key, v in report.items() if max(v["max_rel_err"], v["mma_max_rel_err"]) > 2e-2}
    if bad:
        sys.exit(f"kernel disagrees with x @ W.T: {bad}")


if __name__ == "__main__":
    main()
