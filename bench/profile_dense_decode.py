"""The dense decode kernels alone, no model: one layer's attention of B left-padded rows, timed
per call, for the hardware counters (`ncu -k regex:prefixtrace_decode_dense`) and a quick
bandwidth reading: bytes of K/V each call must read / its time.

    python bench/profile_dense_decode.py --context 32768 --variants v1,mma,sdpa --calls 50   # GPU

Each call rotates over `--sets` K/V sets (together several times the 60 MB L2) so repeated calls
do not read the cache. Rows: context - 37 i (bench/bench_decode_mask.py's padded shape); sdpa
is MLX's fused SDPA on equal rows of the longest length (the figure the padded kernel is held to).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import decode_attention, dense_mma  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, action="append")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--variants", default="v1,mma,sdpa", help="v1, mma, mma-uN, sdpa")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--sets", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not decode_attention.available():
        print("no CUDA device: nothing to time (the kernels are CUDA only)")
        return 0
    out = []
    for context in args.context or [32768]:
        B, H, D = args.rows, args.kv_heads, args.dim
        lp = mx.array([37 * i for i in range(B)], mx.int32)
        sets = []
        for _ in range(args.sets):
            k = mx.random.normal((B, H, context, D)).astype(mx.bfloat16)
            v = mx.random.normal((B, H, context, D)).astype(mx.bfloat16)
            q = mx.random.normal((B, args.q_heads, 1, D)).astype(mx.bfloat16)
            mx.eval(k, v, q)
            sets.append((q, k, v))
        padded_bytes = 2 * H * D * 2 * sum(context - 37 * i for i in range(B))
        row = {"context": context, "rows": B, "padded_kv_mb": round(padded_bytes / 1e6, 1)}
        for spec in args.variants.split(","):
            name, _, u = spec.partition("-u")

            def call(i):
                q, k, v = sets[i % len(sets)]
                if name == "sdpa":
                    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5)
                return decode_attention.dense_attend(q, k, v, lp, D ** -0.5)

            if name != "sdpa":
                decode_attention.set_dense_variant(name)
                dense_mma.set_unroll(int(u) if u else dense_mma.U)
            for i in range(5):  # build + warm up
                mx.eval(call(i))
            times = []
            for i in range(args.calls):
                mx.synchronize()
                t0 = time.perf_counter()
                mx.eval(call(i))
                times.append(time.perf_counter() - t0)
            us = 1e6 * statistics.median(times)
            row[f"{spec}_us"] = round(us, 1)
            row[f"{spec}_tb_s"] = round(padded_bytes / us / 1e6, 2)
        decode_attention.set_dense_variant(decode_attention.DEFAULT_DENSE_VARIANT)
        if "sdpa_us" in row:
            for spec in args.variants.split(","):
                if spec != "sdpa":
                    row[f"{spec}_vs_sdpa"] = round(row[f"{spec}_us"] / row["sdpa_us"], 3)
        out.append(row)
        print(json.dumps(row), flush=True)
        del sets
        mx.clear_cache()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
