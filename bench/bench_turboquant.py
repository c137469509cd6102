"""TurboQuant KV quality, size and speed against the dense cache, side by side.

    python bench/bench_turboquant.py            # tiny fixture model (+ the default model if installed)
    python bench/bench_turboquant.py --quick    # fewer samples

Prints, per bit width: D_mse of unit vectors (the paper's per-vector figure),
KV bytes vs bf16 at a 64-dim head, attention-output relative error and
teacher-forced greedy next-token agreement vs dense on fixtures/tiny-llama
(float32), then decode step time dense vs TurboQuant.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.tq_cache import BatchTurboQuantKVCache, TurboQuantKVCache, make_tq_cache, to_turboquant  # noqa: E402
from engine.turboquant import get_codec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "fixtures" / "tiny-llama"
# Lloyd-Max distortion of a unit-variance Gaussian (the large-d limit of D_mse);
# the paper prints these as 0.36, 0.117, 0.03, 0.009.
GAUSSIAN_LLOYD_MAX = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}
PAPER_D_MSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}


def load(path, dtype=mx.float32):
    from mlx_lm.utils import load as mlx_load

    model, tokenizer = mlx_load(str(path))
    if dtype is not None:
        model.set_dtype(dtype, predicate=lambda d: mx.issubdtype(d, mx.floating))
    return model, tokenizer


def load_tiny(dtype=mx.float32):
    return load(TINY_MODEL, dtype)


def distortion(dim: int, bits: int, n: int = 8192, seed: int = 0) -> float:
    """E|x - x_hat|^2 over random unit vectors x (D_mse; per coordinate it is this / dim)."""
    x = mx.random.normal((n, dim), key=mx.random.key(seed))
    x = x / mx.linalg.norm(x, axis=-1, keepdims=True)
    codec = get_codec(dim, bits)
    x_hat = codec.decode(*codec.encode(x))
    return mx.mean(mx.sum((x - x_hat) ** 2, axis=-1)).item()


def kv_bytes_ratio(head_dim: int = 64, bits: int = 4, tokens: int = 4096, kv_heads: int = 8) -> float:
    """Measured bytes of a TurboQuant cache (codes, norms, dense tail) over a bf16 `KVCache`."""
    keys = mx.random.normal((1, kv_heads, tokens, head_dim)).astype(mx.bfloat16)
    dense, tq = KVCache(), TurboQuantKVCache(bits)
    dense.update_and_fetch(keys, keys)
    tq.update_and_fetch(keys, keys)
    mx.eval(tq.state)
    return tq.nbytes / dense.nbytes


def _layer_inputs(model, tokens: mx.array):
    """Hidden state entering each layer, and the dense caches, of a llama-style model."""
    inner = model.model
    h = inner.embed_tokens(tokens)
    caches = make_prompt_cache(model)
    inputs = []
    for layer, cache in zip(inner.layers, caches):
        inputs.append(h)
        h = layer(h, "causal", cache=cache)
    return inputs, caches


def attention_error(model, tokens: mx.array, bits: int, seed: int = 0) -> list[float]:
    """Per layer: |attn_tq - attn_dense| / |attn_dense| for the model's own queries
    over the prompt (causal), with K/V from a TurboQuant copy of the dense cache."""
    inputs, caches = _layer_inputs(model, tokens)
    errors = []
    for layer, h, cache in zip(model.model.layers, inputs, caches):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        B, L, _ = x.shape
        q = attn.rope(attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3))
        k, v = cache.keys[:, :, :L], cache.values[:, :, :L]
        tq = to_turboquant([cache], bits=bits, seed=seed, dense_layers=())[0].to_dense()
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask="causal")
        out = mx.fast.scaled_dot_product_attention(q, tq.keys, tq.values, scale=attn.scale, mask="causal")
        errors.append((mx.linalg.norm(out - ref) / mx.linalg.norm(ref)).item())
    return errors


def next_token_agreement(model, tokens: mx.array, bits: int, dense_layers=(), chunk: int = 64) -> float:
    """Fraction of positions where TurboQuant and dense caches give the same argmax,
    feeding the same tokens in chunks (so later chunks read quantised K/V)."""
    agree = total = 0
    dense, tq = make_prompt_cache(model), make_tq_cache(model, bits=bits, dense_layers=dense_layers)
    for start in range(0, tokens.shape[1], chunk):
        piece = tokens[:, start : start + chunk]
        a = mx.argmax(model(piece, cache=dense), axis=-1)
        b = mx.argmax(model(piece, cache=tq), axis=-1)
        agree += mx.sum(a == b).item()
        total += piece.size
    return agree / total


def decode_step_ms(model, caches, context: int, steps: int = 32, rows: int = 1) -> float:
    """Median ms per batched decode step after `context` tokens per row."""
    prompt = mx.random.randint(0, 500, (1, context))
    per_row = []
    for _ in range(rows):
        row = caches()
        for start in range(0, context, 512):
            model(prompt[:, start : start + 512], cache=row)
        mx.eval([c.state for c in row])
        per_row.append(row)
    batch = [layer.merge([r[i] for r in per_row]) for i, layer in enumerate(per_row[0])]
    token = mx.zeros((rows, 1), dtype=mx.int32)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(token, cache=batch)
        mx.eval(logits)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[steps // 4 :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-tiny-timing", action="store_true")
    args = parser.parse_args()
    n = 2048 if args.quick else 16384

    print("bits  D_mse(d=128)  paper  gaussian-LM  bytes/bf16(d=64)  bytes/bf16(d=128)")
    for bits in (1, 2, 3, 4, 8):
        d = distortion(128, bits, n)
        print(f"{bits:>4}  {d:12.4f}  {PAPER_D_MSE.get(bits, float('nan')):5.3f}  "
              f"{GAUSSIAN_LLOYD_MAX.get(bits, float('nan')):11.4f}  {kv_bytes_ratio(64, bits):16.3f}  "
              f"{kv_bytes_ratio(128, bits):17.3f}")

    model, _ = load_tiny()
    tokens = mx.random.randint(0, 500, (1, 512), key=mx.random.key(3))
    print("\ntiny-llama float32, 512-token prompt")
    print("bits  attn rel err (per layer)  next-token agreement (all TQ / last layer dense)")
    for bits in (2, 3, 4, 8):
        err = attention_error(model, tokens, bits)
        a_all = next_token_agreement(model, tokens, bits)
        a_last = next_token_agreement(model, tokens, bits, dense_layers=(-1,))
        print(f"{bits:>4}  {' '.join(f'{e:.4f}' for e in err):>24}  {a_all:.3f} / {a_last:.3f}")

    def timings(name, model, contexts, rows_list):
        print(f"\ndecode step ms, {name} (dense -> TurboQuant 4-bit, last layer dense)")
        for context in contexts:
            for rows in rows_list:
                dense = decode_step_ms(model, lambda: make_prompt_cache(model), context, rows=rows)
                tq = decode_step_ms(model, lambda: make_tq_cache(model, bits=4), context, rows=rows)
                print(f"  context {context:>5}  rows {rows}: {dense:7.2f} -> {tq:7.2f}  ({tq / dense:.2f}x)")

    contexts = (512, 2048) if args.quick else (512, 2048, 8192)
    if not args.skip_tiny_timing:
        timings("tiny-llama float32", model, contexts, (1, 3))
    try:
        from engine.default_model import default_model_dir

        big, tok = load(default_model_dir(), None)
    except Exception as exc:  # the default model's wheel may not be installed
        print(f"\ndefault model unavailable: {exc}")
        return
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()[:6000]
    tokens = mx.array(tok.encode(text)[:512])[None]
    print(f"\nSmolLM2-135M (default model, as loaded), {tokens.shape[1]}-token prompt of docs/ARCHITECTURE.md")
    print("bits  attn rel err (mean / max over layers)  next-token agreement (all TQ / last layer dense)")
    for bits in (2, 3, 4, 8):
        err = attention_error(big, tokens, bits)
        print(f"{bits:>4}  {statistics.mean(err):.4f} / {max(err):.4f}                      "
              f"{next_token_agreement(big, tokens, bits):.3f} / {next_token_agreement(big, tokens, bits, (-1,)):.3f}")
    timings("SmolLM2-135M (default model)", big, contexts, (1, 3))


if __name__ == "__main__":
    main()
