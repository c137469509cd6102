"""One TurboQuant decode step per variant against SDPA over the decoded cache, on the GPU: the first
thing a device run checks (a kernel that does not build or is wrong stops the run before its timings).

    python bench/smoke_tq_variant.py --variants v7 --context 5000
Exits 1 on a build error or a mismatch; prints one JSON line per (variant, dtype). No CUDA: nothing to do."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import decode_attention, tq_fused  # noqa: E402
from engine.tq_cache import TurboQuantKVCache  # noqa: E402

TOL = {mx.bfloat16: 2e-2, mx.float16: 4e-3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--variants", default="v7")
    ap.add_argument("--context", type=int, default=5000)
    args = ap.parse_args()
    if not decode_attention.available():
        print("no CUDA device: nothing to check")
        return 0
    bad = 0
    for variant in args.variants.split(","):
        for dtype in (mx.bfloat16, mx.float16):
            decode_attention.set_tq_variant(variant)
            mx.random.seed(1)
            cache = TurboQuantKVCache(kv_bits=4)
            cache.update_and_fetch(mx.random.normal((1, 8, args.context, 128)).astype(dtype),
                                   mx.random.normal((1, 8, args.context, 128)).astype(dtype))
            t0, ran = time.perf_counter(), tq_fused.launches7[0]
            try:
                keys, values = cache.update_and_fetch(mx.random.normal((1, 8, 1, 128)).astype(dtype),
                                                      mx.random.normal((1, 8, 1, 128)).astype(dtype))
                q = mx.random.normal((1, 32, 1, 128)).astype(dtype)
                got = cache.attend(q, 128 ** -0.5, None).astype(mx.float32)
                ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), keys.astype(mx.float32),
                                                           values.astype(mx.float32), scale=128 ** -0.5)
                e, s = mx.abs(got - ref).max().item(), mx.abs(ref).max().item()
                ran = tq_fused.launches7[0] - ran
                ok = e <= TOL[dtype] * max(s, 1.0) and (variant != "v7" or ran == 1)  # v7: its own kernel ran
                row = {"variant": variant, "dtype": str(dtype), "ok": ok, "max_err": e, "scale": s, "v7_launches": ran,
                       "seconds": round(time.perf_counter() - t0, 2)}
            except Exception as exc:  # a build error: report it, stop the run's later steps
                ok, row = False, {"variant": variant, "dtype": str(dtype), "ok": False, "error": repr(exc)[:2000]}
            bad += not ok
            print(json.dumps(row), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
