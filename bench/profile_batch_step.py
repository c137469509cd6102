"""Where does a batched decode step's time go? (experiment for issue 6)

On the H200, mlx-lm's GenerationBatch alone scaled 1.06x from B=1 to B=2 and
4.12x at B=8: the step time roughly doubles from B=1 to B=2 and then stays
flat. This script times, side by side in one process, on a Qwen3-8B-shaped
random model (fewer layers by default; every layer is identical):

* the full decode step at B = 1, 2, 4, 8 (batched cache, no padding);
* the same B tokens as one row's B-token chunk (what prefill does): same
  weights read, matmuls with M = B but no batch axis;
* the projections alone: x (B, 1, K) @ W.T, x (1, B, K) @ W.T, x (B, K) @ W.T;
* attention alone (fused SDPA, B rows x 1 query over T keys).

    python bench/profile_batch_step.py --layers 8
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

from bench.bench_scheduler import QWEN3_8B  # noqa: E402


def timeit(fn, repeat: int = 30, warm: int = 5) -> float:
    """Median seconds of fn() (fn evaluates its own output)."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()

    from mlx_lm.models import qwen3
    from mlx_lm.models.cache import KVCache

    from engine.batch_cache import RowBatchKVCache

    shape = dict(QWEN3_8B, num_hidden_layers=args.layers)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(shape))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    report = {"device": str(mx.default_device()), "layers": args.layers, "context": args.context}
    batches = (1, 2, 4, 8)

    # Full steps.
    for B in batches:
        caches = []
        for _ in range(B):
            c = [KVCache() for _ in model.layers]
            model(mx.random.randint(0, 1000, (1, args.context)), cache=c)
            mx.eval([x.state for x in c])
            caches.append(c)
        batch = [RowBatchKVCache.merge([c[i] for c in caches]) for i in range(len(model.layers))]
        tokens = mx.random.randint(0, 1000, (B, 1))

        def step():
            out = model(tokens, cache=batch)
            mx.eval(out)
            for c in batch:  # keep the context length fixed
                c.trim(1)

        report[f"step_B{B}_ms"] = 1e3 * timeit(step, args.repeat)

        one = [KVCache() for _ in model.layers]
        model(mx.random.randint(0, 1000, (1, args.context)), cache=one)
        mx.eval([x.state for x in one])
        chunk = mx.random.randint(0, 1000, (1, B))

        def chunk_step():
            out = model(chunk, cache=one)
            mx.eval(out)
            for c in one:
                c.trim(B)

        report[f"chunk_M{B}_ms"] = 1e3 * timeit(chunk_step, args.repeat)

    # Projections alone (the MLP's up projection and the LM head).
    for name, (n, k) in {"up": (12288, 4096), "lm_head": (151936, 4096)}.items():
        w = mx.random.normal((n, k)).astype(mx.bfloat16)
        mx.eval(w)
        for B in batches:
            for layout, xshape in {"B1K": (B, 1, k), "1BK": (1, B, k), "BK": (B, k)}.items():
                x = mx.random.normal(xshape).astype(mx.bfloat16)
                mx.eval(x)
                report[f"mm_{name}_{layout}_B{B}_us"] = 1e6 * timeit(lambda: mx.eval(x @ w.T), repeat=args.repeat)

    # Attention alone.
    for B in batches:
        q = mx.random.normal((B, 32, 1, 128)).astype(mx.bfloat16)
        k = mx.random.normal((B, 8, args.context, 128)).astype(mx.bfloat16)
        v = mx.random.normal((B, 8, args.context, 128)).astype(mx.bfloat16)
        mx.eval(q, k, v)
        report[f"sdpa_B{B}_us"] = 1e6 * timeit(
            lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088)), repeat=args.repeat)

    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
