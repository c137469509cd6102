"""Decode-step attention over a TurboQuant cache: rotated basis vs decoding the cache.

Per decode step of one attention layer holding T cached tokens, side by side:

* dense: a bf16/f32 `KVCache` and the fused SDPA (the floor);
* TQ decoded, session-1 unpack: every step decodes the whole cache (codebook
  lookup x norm, inverse rotation of every vector), codes unpacked with gathers;
* TQ decoded: the same with one table gather per byte of codes (bits dividing 8);
* TQ rotated: the query is rotated once, attention runs over codebook values
  x norms in the rotated basis, the output is rotated back once (the hook).

    python bench/bench_tq_attention.py                 # SmolLM2 and Qwen3-8B layer shapes, T = 1k/4k/16k
    python bench/bench_tq_attention.py --context 4096 --shape qwen3-8b
    python bench/bench_tq_attention.py --model fixtures/tiny-llama     # whole-model decode tok/s
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

from engine.tq_cache import TurboQuantKVCache  # noqa: E402
from engine.turboquant import get_codec  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen3-8b": (32, 8, 128)}  # query heads, KV heads, head dim


def step_time(cache, mode: str, q_heads: int, kv_heads: int, dim: int, dtype, steps: int) -> float:
    times = []
    for _ in range(steps):
        k = mx.random.normal((1, kv_heads, 1, dim)).astype(dtype)
        v = mx.random.normal((1, kv_heads, 1, dim)).astype(dtype)
        q = mx.random.normal((1, q_heads, 1, dim)).astype(dtype)
        mx.eval(k, v, q)
        t0 = time.perf_counter()
        keys, values = cache.update_and_fetch(k, v)
        if mode == "rotated":
            out = cache.attend(q, dim ** -0.5, None)
        else:
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=dim ** -0.5)
        mx.eval(out, *([cache.state] if mode == "dense" else [cache.tail_k, cache.k.codes]))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def measure(shape: str, context: int, bits: int, dtype, steps: int) -> dict:
    from mlx_lm.models.cache import KVCache

    q_heads, kv_heads, dim = SHAPES[shape]
    mx.random.seed(0)
    keys = mx.random.normal((1, kv_heads, context, dim)).astype(dtype)
    values = mx.random.normal((1, kv_heads, context, dim)).astype(dtype)
    dense = KVCache()
    dense.update_and_fetch(keys, values)
    row = {"shape": shape, "context": context, "bits": bits}
    row["dense_ms"] = 1e3 * step_time(dense, "dense", q_heads, kv_heads, dim, dtype, steps)
    codec = get_codec(dim, bits)
    for mode in ("decoded_gather_unpack", "decoded", "rotated"):
        tq = TurboQuantKVCache(kv_bits=bits)
        tq.update_and_fetch(keys, values)
        mx.eval(tq.k.codes, tq.v.codes, tq.tail_k)
        saved = codec._shifts, codec._byte_table
        if mode == "decoded_gather_unpack":  # session 1's decode: gathers to unpack, then to look up
            codec._shifts = codec._byte_table = None
        try:
            row[f"tq_{mode}_ms"] = 1e3 * step_time(tq, "rotated" if mode == "rotated" else "decoded",
                                                   q_heads, kv_heads, dim, dtype, steps)
        finally:
            codec._shifts, codec._byte_table = saved
    for mode in ("decoded_gather_unpack", "decoded", "rotated"):
        row[f"{mode}_vs_dense"] = round(row[f"tq_{mode}_ms"] / row["dense_ms"], 2)
    row["rotated_speedup_vs_session1"] = round(row["tq_decoded_gather_unpack_ms"] / row["tq_rotated_ms"], 2)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def model_decode(model_dir: Path, context: int, tokens: int, bits: int) -> dict:
    """Decode tokens/s of a whole model after a `context`-token prompt: dense cache, TurboQuant
    with the rotated-basis hook, and TurboQuant through the decoded K/V (hook removed)."""
    import importlib

    from mlx_lm.models.cache import make_prompt_cache

    from engine.cpu_runtime import load_model
    from engine.tq_cache import make_tq_cache

    model, _ = load_model(model_dir, None)
    prompt = mx.random.randint(10, 1000, (1, context))

    def rate(cache) -> float:
        model(prompt, cache=cache)
        mx.eval([c.state for c in cache])
        token = mx.array([[11]])
        t0 = time.perf_counter()
        for _ in range(tokens):
            token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
            mx.eval(token)
        return tokens / (time.perf_counter() - t0)

    module = importlib.import_module(type(model).__module__)
    row = {"model": model_dir.name, "context": context, "bits": bits}
    make_tq_cache(model, bits=bits)  # installs the hook
    hooked = module.scaled_dot_product_attention
    from mlx_lm.models.base import scaled_dot_product_attention as plain

    runs = {"dense": [], "tq_rotated": [], "tq_decoded": []}
    for _ in range(3):  # interleaved, medians: the machine is shared
        runs["dense"].append(rate(make_prompt_cache(model)))
        runs["tq_rotated"].append(rate(make_tq_cache(model, bits=bits)))
        module.scaled_dot_product_attention = plain
        try:
            runs["tq_decoded"].append(rate(_unhooked_cache(model, bits)))
        finally:
            module.scaled_dot_product_attention = hooked
    for name, values in runs.items():
        row[f"{name}_tok_s"] = statistics.median(values)
    row["tq_rotated_vs_dense"] = round(row["tq_rotated_tok_s"] / row["dense_tok_s"], 3)
    row["tq_decoded_vs_dense"] = round(row["tq_decoded_tok_s"] / row["dense_tok_s"], 3)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}


def _unhooked_cache(model, bits: int) -> list:
    from mlx_lm.models.cache import KVCache

    n = len(model.layers)
    return [KVCache() if i == n - 1 else TurboQuantKVCache(kv_bits=bits) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), action="append")
    ap.add_argument("--context", type=int, action="append")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--dtype", default="float32" if mx.default_device() == mx.cpu else "bfloat16")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--model", type=Path, help="also time whole-model decode on this mlx-lm directory")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    if args.model:
        for context in args.context or (1024, 4096):
            print(json.dumps(model_decode(args.model, context, args.tokens, args.bits)))
        return
    print(json.dumps({"device": str(mx.default_device()), "dtype": args.dtype}))
    for shape in args.shape or list(SHAPES):
        for context in args.context or (1024, 4096, 16384):
            print(json.dumps(measure(shape, context, args.bits, dtype, args.steps)))


if __name__ == "__main__":
    main()
