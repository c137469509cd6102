"""Restored-prefix prefill (issue 5): suffix prefill after a restored TurboQuant prefix.

    python bench/bench_restored_prefill.py [--prefix 2048] [--suffix 1024] [--chunk 256] [--repeat 3] [--tiny]
    python bench/bench_restored_prefill.py --random qwen3-8b --prefix 16384 --suffix 2048 --chunk 2048   # GPU
    python bench/bench_restored_prefill.py --random qwen3-8b --prefix 8192 --prefix 32768 --suffix 2048 --chunk 2048 --repeat 2

In one run, on the CPU default model (else fixtures/tiny-llama), median of
`--repeat` for each. The default model is loaded as `prefixtrace serve` loads
it: on Linux the bench first re-executes itself with OpenBLAS preloaded
(engine.cpu_runtime.maybe_reexec_with_openblas), so `load_model` dequantizes
SmolLM2 to dense float32 weights. Without that it runs MLX's quantized CPU
matmul (~10 tok/s of prefill instead of ~200 on 2 cores): the reason a
1024 + 1024 run once did not finish in 300 s. The JSON says which path ran
(`blas`, `dense_weights`) and the load average before and after.

* cold TQ: a TurboQuant prefill of prefix + suffix in `--chunk` chunks; the
  time of the suffix's chunks is "cold prefill of the same positions" (what a
  TurboQuant engine does without a cache hit);
* cold dense: the same with plain `KVCache`s (what a dense engine does);
* restored, quantised path: the prefix restored from the prefix cache (disk
  tier, TurboQuant blocks), the suffix prefilled chunk by chunk on the
  `TurboQuantKVCache`s (every chunk decodes the whole prefix again);
* restored, dense path (the scheduler's choice when the copy fits): one dense
  copy of the restored layers, every chunk on `KVCache`, then the suffix
  quantised and appended (`dense_copy` + chunks + `append_suffix`; the JSON
  also gives the median of each part).

Ratio = restored dense path / cold TQ suffix (target <= 1.0; upstream 2.41
before its fix, 0.92 after). Prints JSON; with several `--prefix`, one object per
prefix under "results", on the one model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from bench.bench_cache_tiers import pick_model  # noqa: E402
from engine.prefix_cache import PrefixCache  # noqa: E402
from engine.tq_config import TQConfig, append_suffix, dense_copy  # noqa: E402


def prefill(model, tokens, cache, chunk) -> float:
    t0 = time.perf_counter()
    for start in range(0, len(tokens), chunk):
        model(mx.array(tokens[start : start + chunk])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", type=int, action="append", help="prefix tokens (repeatable; default 2048)")
    parser.add_argument("--suffix", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="use fixtures/tiny-llama")
    parser.add_argument("--random", choices=["qwen3-8b"], help="random-weight model of this shape (GPU figures)")
    args = parser.parse_args()
    if sys.platform == "linux" and not args.tiny and not args.random:
        from engine.cpu_runtime import maybe_reexec_with_openblas

        maybe_reexec_with_openblas()  # as `prefixtrace serve`: OpenBLAS, hence dense float32 weights
    load_start = os.getloadavg()[0]
    model_work = Path(tempfile.mkdtemp(prefix="pt-restored-model-"))
    if args.random:
        from bench.bench_cache_tiers import random_model

        model_dir, loader, label = random_model(model_work)
    else:
        model_dir, loader, label = pick_model(args.tiny)
    model = loader()[0]
    prefixes = args.prefix or [2048]
    results = [measure(model, model_dir, prefix, args.suffix, args.chunk, args.repeat) for prefix in prefixes]
    shutil.rmtree(model_work, ignore_errors=True)
    dense_weights = not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    if not dense_weights and sys.platform == "linux":
        print("warning: quantized weights without OpenBLAS: MLX's slow CPU quantized matmul (~10 tok/s on SmolLM2)",
              file=sys.stderr)
    head = {"model": label, "blas": os.environ.get("LD_PRELOAD") or "bundled reference BLAS",
            "dense_weights": dense_weights, "loadavg_start": round(load_start, 2),
            "loadavg_end": round(os.getloadavg()[0], 2), "device": str(mx.default_device())}
    if len(results) == 1:
        print(json.dumps({**head, **results[0]}, indent=1))
    else:
        print(json.dumps({**head, "results": results}, indent=1))


def measure(model, model_dir, prefix: int, suffix: int, chunk: int, repeat: int) -> dict:
    """The five timings above for one prefix length (medians of `repeat`), and their ratios."""
    vocab = model.args.vocab_size
    tokens = [(i * 7919 + 13) % (vocab - 10) + 5 for i in range(prefix + suffix)]
    head, tail = tokens[:prefix], tokens[prefix:]
    tq = TQConfig()
    work = Path(tempfile.mkdtemp(prefix="pt-restored-"))
    try:
        writer = PrefixCache(model, max_bytes=8 << 30, cache_dir=work, model_dir=model_dir, tq=tq)
        seed = tq.make_cache(model)
        prefill(model, head, seed, chunk)
        writer.store(head, seed)
        writer.close()
        reader = PrefixCache(model, max_bytes=0, cache_dir=work, model_dir=model_dir, tq=tq)  # every hit from disk

        cold_tq, cold_dense, restored_tq, restored_dense, restore_s, parts = [], [], [], [], [], []
        for _ in range(repeat):
            cache = tq.make_cache(model)
            prefill(model, head, cache, chunk)
            cold_tq.append(prefill(model, tail, cache, chunk))
            cache = make_prompt_cache(model)
            prefill(model, head, cache, chunk)
            cold_dense.append(prefill(model, tail, cache, chunk))

            t0 = time.perf_counter()
            hit = reader.lookup(tokens)
            restore_s.append(time.perf_counter() - t0)
            assert hit.num_cached == prefix, hit.num_cached
            restored_tq.append(prefill(model, tail, hit.cache, chunk))

            hit = reader.lookup(tokens)
            t0 = time.perf_counter()
            dense = dense_copy(hit.cache, len(tail))
            t1 = time.perf_counter()
            chunks = prefill(model, tail, dense, chunk)
            t2 = time.perf_counter()
            append_suffix(hit.cache, dense)
            restored_dense.append(time.perf_counter() - t0)
            parts.append((t1 - t0, chunks, time.perf_counter() - t2))
        reader.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {name: statistics.median(v) for name, v in (
        ("cold_tq_suffix_s", cold_tq), ("cold_dense_suffix_s", cold_dense), ("restored_quantised_path_s", restored_tq),
        ("restored_dense_path_s", restored_dense), ("disk_restore_s", restore_s))}
    return {
        "prefix": prefix, "suffix": suffix, "chunk": chunk, "repeat": repeat,
        **{k: round(v, 4) for k, v in med.items()},
        "ratio_dense_path_vs_cold_tq": round(med["restored_dense_path_s"] / med["cold_tq_suffix_s"], 3),
        "ratio_dense_path_vs_cold_dense": round(med["restored_dense_path_s"] / med["cold_dense_suffix_s"], 3),
        "ratio_quantised_path_vs_cold_tq": round(med["restored_quantised_path_s"] / med["cold_tq_suffix_s"], 3),
        "ratio_quantised_path_vs_cold_dense": round(med["restored_quantised_path_s"] / med["cold_dense_suffix_s"], 3),
        "restored_dense_path_parts_s": {name: round(statistics.median(p[i] for p in parts), 4)
                                        for i, name in enumerate(("dense_copy", "suffix_chunks", "append_suffix"))},
        "runs_s": {"cold_tq": runs(cold_tq), "cold_dense": runs(cold_dense), "restored_quantised": runs(restored_tq),
                   "restored_dense": runs(restored_dense)},
    }


def runs(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]


if __name__ == "__main__":
    main()
