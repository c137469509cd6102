"""engine/kernels/gemv.py's GEMV against MLX's matmul (float32 reference) on the GPU: every Qwen3-8B
projection shape (q/k/v/o, gate/up, down, the LM head, the q|k|v and gate|up stacks), every (RW, SPLIT)
plan that fits, bf16 and fp16, and the stacked parts. One JSON line per shape, then a summary line.

    python3 bench/check_gemv.py          # needs a CUDA build of MLX
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from engine.kernels import gemv  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (151936, 4096), (6144, 4096), (24576, 4096)]
TOLERANCE = 2e-2  # of the output's scale: bf16 rounding of the result


def main() -> int:
    if not gemv.available():
        print(json.dumps({"ok": None, "why": "no CUDA device: nothing to check"}))
        return 0
    failed = checked = 0
    for n, k in SHAPES:
        for dtype in (mx.bfloat16, mx.float16):
            x = mx.random.normal((1, k)).astype(dtype)
            w = (mx.random.normal((n, k)) * 0.05).astype(dtype)
            want = x.astype(mx.float32) @ w.astype(mx.float32).T
            scale = mx.abs(want).max().item()
            for rw in (2, 4):
                for split in (1, 2, 4, 8):
                    if k % (256 * split) or n % (gemv.WARPS // split * rw):
                        continue
                    err = (mx.abs(gemv.gemv(x, w, rw=rw, split=split).astype(mx.float32) - want).max().item()) / scale
                    ok = err < TOLERANCE
                    checked += 1
                    failed += not ok
                    print(json.dumps({"n": n, "k": k, "dtype": str(dtype), "rw": rw, "split": split,
                                      "error_of_scale": round(err, 5), "ok": ok}), flush=True)
    x = mx.random.normal((1, 4096)).astype(mx.bfloat16)
    w = (mx.random.normal((6144, 4096)) * 0.05).astype(mx.bfloat16)
    parts = gemv.gemv(x, w, parts=(4096, 1024, 1024))
    stacked_ok = all(mx.allclose(p, x @ w[a:a + p.shape[1]].T, atol=2e-2, rtol=2e-2).item()
                     for p, a in zip(parts, (0, 4096, 5120)))
    failed += not stacked_ok
    print(json.dumps({"checked": checked + 1, "failed": failed, "stacked_parts_ok": stacked_ok}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
