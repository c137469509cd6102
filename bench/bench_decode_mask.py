"""What left padding costs one batched decode step of a whole model, and what the start-offset kernel gives back.

B rows of `--context` tokens in a `RowBatchKVCache` (equal lengths), against rows of
lengths context, context - 37, ... (left-padded; a smaller gap for short contexts), per full-model decode step:

* equal: no padding, mask None (MLX's fused SDPA);
* padded, masked: MLX's SDPA with the boolean padding mask (PREFIXTRACE_DECODE_ATTENTION=0);
* padded, kernel: engine/decode_attention.py's split-K kernel taking each row's start
  offset (CUDA only; the attention hook installed as the engine installs it).

Target (issue 17): padded within 10% of equal.

    python bench/bench_decode_mask.py --random qwen3-8b --context 512 --context 4096   # GPU
    python bench/bench_decode_mask.py                                                  # CPU, tiny fixture
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

from mlx_lm.models.cache import KVCache  # noqa: E402

from bench.bench_scheduler import QWEN3_8B, random_loader  # noqa: E402
from engine import decode_attention  # noqa: E402
from engine.batch_cache import RowBatchKVCache  # noqa: E402
from engine.tq_cache import install_attention_hook  # noqa: E402


def step_ms(model, cache, tokens, repeats: int) -> float:
    """Median ms of a full decode step; each step's token is trimmed off again so the
    lengths (and padding) stay as built."""
    times = []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        mx.eval(model(tokens, cache=cache))
        if i >= 3:
            times.append(time.perf_counter() - t0)
        for c in cache:
            c.trim(1)
    times.sort()
    return 1000 * times[len(times) // 2]


def batch_cache(model, lengths: list[int]) -> list:
    args = model.args
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    layers = []
    for _ in model.layers:
        rows = []
        for n in lengths:
            c = KVCache()
            kv = mx.random.normal((1, args.num_key_value_heads, n, dim)).astype(mx.bfloat16)
            c.update_and_fetch(kv, kv)
            rows.append(c)
        layers.append(RowBatchKVCache.merge(rows))
    mx.eval([c.state for c in layers])
    return layers


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random", choices=["qwen3-8b"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, action="append")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.random:
        model, _, _ = random_loader(QWEN3_8B)()
    else:
        from mlx_lm.utils import load

        model, _ = load(str(ROOT / "fixtures" / "tiny-llama"))
        model.set_dtype(mx.bfloat16)
    install_attention_hook(model)
    kernel = decode_attention.available()
    tokens = mx.zeros((args.batch, 1), dtype=mx.int32)
    out = {"device": str(mx.default_device()), "batch": args.batch, "runs": []}
    for context in args.context or [512]:
        row = {"context": context}
        equal = batch_cache(model, [context] * args.batch)
        gap = max(1, min(37, context // (2 * args.batch)))
        padded = batch_cache(model, [context - gap * i for i in range(args.batch)])
        decode_attention.set_mode("off")
        row["equal_ms"] = round(step_ms(model, equal, tokens, args.repeats), 3)
        row["padded_masked_ms"] = round(step_ms(model, padded, tokens, args.repeats), 3)
        row["padded_masked_vs_equal"] = round(row["padded_masked_ms"] / row["equal_ms"], 3)
        if kernel:
            decode_attention.set_mode("on")
            row["padded_kernel_ms"] = round(step_ms(model, padded, tokens, args.repeats), 3)
            row["padded_kernel_vs_equal"] = round(row["padded_kernel_ms"] / row["equal_ms"], 3)
        decode_attention.set_mode("on")
        out["runs"].append(row)
        print(json.dumps(row), flush=True)
        del equal, padded
        mx.clear_cache()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
