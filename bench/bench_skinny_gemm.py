"""The skinny GEMM kernels (engine/kernels/skinny_gemm.py) against MLX's own matmul, on CUDA.

Two measurements, each for R = 1..8 rows of x, side by side in one run:

* per projection of a Qwen3-8B layer and the LM head: the result of each kernel
  against `x @ W.T` (max relative error; the bench exits non-zero beyond 2%) and
  the time of 20 *independent* products per evaluation. MLX may run independent
  kernels of one graph concurrently, so a kernel that leaves SMs idle can look
  faster here than it is inside a decode step;
* the projections of a whole decode step as a *dependent* chain (36 layers of
  q, k, v -> o -> gate, up -> down, then the LM head), the way the model issues
  them: this is the figure that predicts a batched decode step.

    python bench/bench_skinny_gemm.py                  # both
    python bench/bench_skinny_gemm.py --only step --rows 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.kernels import skinny_gemm  # noqa: E402
from engine.kernels.skinny_gemm import available, skinny_matmul, skinny_matmul_mma  # noqa: E402

SHAPES = {"qo": (4096, 4096), "kv": (1024, 4096), "gate_up": (12288, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
CHAIN = 20
LAYERS = 36
STEPS = 5


def timed(fn, repeat: int = 10, per: int = 1) -> float:
    fn()
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    runs.sort()
    return runs[len(runs) // 2] / per


def rel_err(got: mx.array, ref: mx.array) -> float:
    return (mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()


def per_projection(row_counts: list[int]) -> dict:
    report = {}
    for name, (n, k) in SHAPES.items():
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        mx.eval(w)
        for rows in row_counts:
            xs = [mx.random.normal((rows, k)).astype(mx.bfloat16) for _ in range(CHAIN)]
            mx.eval(xs)
            ref = (xs[0] @ w.T).astype(mx.float32)
            entry = {"mlx_us": round(1e6 * timed(lambda: mx.eval([x @ w.T for x in xs]), per=CHAIN), 1)}
            for kernel, fn in (("cuda", skinny_matmul), ("mma", skinny_matmul_mma)):
                entry[f"{kernel}_err"] = round(rel_err(fn(xs[0], w), ref), 5)
                entry[f"{kernel}_us"] = round(1e6 * timed(lambda: mx.eval([fn(x, w) for x in xs]), per=CHAIN), 1)
            entry["mma_us_by_warps"] = {
                warps: round(1e6 * timed(lambda: mx.eval([skinny_matmul_mma(x, w, warps) for x in xs]), per=CHAIN), 1)
                for warps in (1, 2, 4, 8, 16) if k % (32 * warps) == 0}
            report[f"{name}_R{rows}"] = entry
    return report


def decode_step_chain(row_counts: list[int]) -> dict:
    """ms of one decode step's projections, issued as the model issues them (each
    layer's input is the previous layer's output), for each way of multiplying; and
    the host's share: ms to build one step's graph without running it."""
    weights = {name: (mx.random.normal(shape) * 0.02).astype(mx.bfloat16) for name, shape in SHAPES.items()}
    weights["qkv"] = mx.concatenate([weights["qo"], weights["kv"], weights["kv"]])
    weights["gate_up2"] = mx.concatenate([weights["gate_up"], weights["gate_up"]])
    mx.eval(weights)
    ways = {
        "mlx": lambda x, w: x @ w.T,
        "cuda": lambda x, w: skinny_matmul(x, w),
        "mma": lambda x, w: skinny_matmul_mma(x, w),
    }
    ways["auto"] = _auto

    def step(mm, x):
        outs = []
        for _ in range(LAYERS):
            q, kv = mm(x, weights["qo"]), mm(x, weights["kv"])
            o = mm(q, weights["qo"])
            h = mm(o, weights["gate_up"]) * mm(o, weights["gate_up"])
            x = mm(h, weights["down"])
            outs.append(kv)
        return outs + [mm(x, weights["lm_head"])], x

    def stacked_step(_, x):
        """The default engine path: q|k|v and gate|up each one launch (engine/kernels/skinny_gemm.py _Stack)."""
        outs = []
        for _ in range(LAYERS):
            q, k, v = skinny_matmul_mma(x, weights["qkv"], parts=(4096, 1024, 1024))
            o = skinny_matmul_mma(q, weights["qo"])
            gate, up = skinny_matmul_mma(o, weights["gate_up2"], parts=(12288, 12288))
            x = skinny_matmul_mma(gate * up, weights["down"])
            outs += [k, v]
        return outs + [x @ weights["lm_head"].T], x

    def steps(build, mm, x, count=STEPS):
        # Pipelined as mlx-lm's decode loop is: the next step's graph is built while the
        # GPU runs this one, so host-side cost hides behind the kernels where it can.
        for _ in range(count):
            outs, x = build(mm, x)
            mx.async_eval(outs)
        mx.eval(outs)

    def host_ms(build, mm, x) -> float:
        build(mm, x)
        t0 = time.perf_counter()
        for _ in range(20):
            build(mm, x)
        return 1e3 * (time.perf_counter() - t0) / 20

    report = {}
    for rows in row_counts:
        x = mx.random.normal((rows, 4096)).astype(mx.bfloat16)
        mx.eval(x)
        variants = [(way, step, mm) for way, mm in ways.items()] + [("stacked", stacked_step, None)]
        for way, build, mm in variants:
            if rows == 1 and way != "mlx":
                continue  # one row: MLX's gemv, which the engine keeps
            report[f"{way}_R{rows}_ms"] = round(1e3 * timed(lambda: steps(build, mm, x), repeat=5, per=STEPS), 3)
            report[f"{way}_R{rows}_host_ms"] = round(host_ms(build, mm, x), 3)
        if rows > 1:
            q, k, v = skinny_matmul_mma(x, weights["qkv"], parts=(4096, 1024, 1024))
            errs = [rel_err(got, (x @ w.T).astype(mx.float32))
                    for got, w in ((q, weights["qo"]), (k, weights["kv"]), (v, weights["kv"]))]
            report[f"stacked_R{rows}_max_rel_err"] = round(max(errs), 5)
    base = report.get("mlx_R1_ms")
    if base:
        report["vs_one_row"] = {key[:-3]: round(v / base, 3) for key, v in report.items()
                                if key.endswith("_ms") and not key.endswith("host_ms")}
    return report


def _auto(x: mx.array, w: mx.array) -> mx.array:
    """What SkinnyLinear does (`project`: the kernel that measured fastest, else MLX's matmul)."""
    y = skinny_gemm.project(x, w)
    return x @ w.T if y is None else y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--only", choices=["projections", "step"])
    args = ap.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    if not available():
        sys.exit("needs MLX's CUDA backend with the GPU as default device")
    report = {}
    if args.only != "step":
        report["projections"] = per_projection(row_counts)
        for key, v in report["projections"].items():
            print(key, json.dumps(v))
    if args.only != "projections":
        report["decode_step"] = decode_step_chain(row_counts)
        print("decode_step", json.dumps(report["decode_step"]))
    bad = {key: v for key, v in report.get("projections", {}).items() if max(v["cuda_err"], v["mma_err"]) > 2e-2}
    bad.update({key: v for key, v in report.get("decode_step", {}).items() if key.endswith("_err") and v > 2e-2})
    if bad:
        sys.exit(f"kernel disagrees with x @ W.T: {bad}")


if __name__ == "__main__":
    main()
