"""Experiment: what a left-padding mask costs one batched decode step.

Prediction: with no padding the step takes the fused attention path (mask=None);
an explicit boolean mask (what mlx-lm's BatchKVCache builds) forces a slower
masked kernel; an additive float mask may or may not do better.

    python bench/bench_decode_mask.py --random qwen3-8b     # GPU
    python bench/bench_decode_mask.py                       # CPU, tiny fixture
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
from engine.batch_cache import RowBatchKVCache  # noqa: E402


def step_time(model, cache, tokens, mask_kind: str, repeats: int = 20) -> float:
    def forward():
        if mask_kind == "none":
            return model(tokens, cache=cache)
        # mimic a padded batch: rebuild the mask the model would get
        real = cache[0].make_mask(1) if mask_kind == "bool" else None
        if mask_kind == "additive":
            real = mx.where(cache[0].make_mask(1), 0.0, -1e9).astype(mx.bfloat16)
        # mlx-lm models take the mask from the cache; call layers with it directly
        h = model.model.embed_tokens(tokens)
        for layer, c in zip(model.model.layers, cache):
            h = layer(h, real, c)
        return model.lm_head(model.model.norm(h)) if hasattr(model, "lm_head") else h

    for _ in range(3):
        mx.eval(forward())
        for c in cache:
            c.trim(1)
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(forward())
        for c in cache:
            c.trim(1)
    return (time.perf_counter() - t0) / repeats * 1000


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--random", choices=["qwen3-8b"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    if args.random:
        model, _, _ = random_loader(QWEN3_8B)()
    else:
        from mlx_lm.utils import load

        model, _ = load(str(ROOT / "fixtures" / "tiny-llama"))
    n_layers = len(model.model.layers)
    out = {}
    for padded in (False, True):
        singles = []
        for i in range(args.batch):
            length = args.context - (i * 37 if padded else 0)
            layers = []
            for _ in range(n_layers):
                c = KVCache()
                kv = mx.zeros((1, model.args.num_key_value_heads, length, model.args.head_dim if hasattr(model.args, "head_dim") and model.args.head_dim else model.args.hidden_size // model.args.num_attention_heads), dtype=mx.bfloat16)
                c.update_and_fetch(kv, kv)
                layers.append(c)
            singles.append(layers)
        cache = [RowBatchKVCache.merge([s[layer] for s in singles]) for layer in range(n_layers)]
        tokens = mx.zeros((args.batch, 1), dtype=mx.int32)
        kinds = ["none"] if not padded else ["bool", "additive"]
        for kind in kinds:
            out[f"{'padded' if padded else 'equal'}_{kind}_ms"] = round(step_time(model, cache, tokens, kind), 3)
    out["device"] = str(mx.default_device())
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
