"""How close a TurboQuant cache comes to the dense one: the measures bench/bench_turboquant.py reports and
tests/test_turboquant.py / test_bench_turboquant.py hold to bounds (distortion against the paper's
D_mse, bytes per token, per-layer attention error, next-token agreement, teacher-forced log-probs), and
the reference caches they compare against (dense K/V rounded through bf16; keys and values from two
different caches). Nothing in the serving path imports this module.
"""

from __future__ import annotations

import statistics

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from engine.tq_cache import TurboQuantKVCache
from engine.tq_config import make_tq_cache, to_turboquant
from engine.turboquant import get_codec

__all__ = ["GAUSSIAN_LLOYD_MAX", "PAPER_D_MSE", "load", "distortion", "kv_bytes_ratio", "attention_error",
           "next_token_agreement", "SplitCache", "Bfloat16KVCache", "used_nbytes", "continuation_logits",
           "compare_logprobs", "kv_bytes_per_token"]


# Lloyd-Max distortion of a unit-variance Gaussian (the large-d limit of D_mse);
# the paper prints these as 0.36, 0.117, 0.03, 0.009.
GAUSSIAN_LLOYD_MAX = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


PAPER_D_MSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}


def load(path, dtype=mx.float32):
    """An mlx-lm model directory's (model, tokenizer), its floating weights cast to `dtype` (None: as stored)."""
    from mlx_lm.utils import load as mlx_load

    model, tokenizer = mlx_load(str(path))
    if dtype is not None:
        model.set_dtype(dtype, predicate=lambda d: mx.issubdtype(d, mx.floating))
    return model, tokenizer


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


def layer_inputs(model, tokens: mx.array):
    """Hidden state entering each layer, and the dense caches, of a llama-style model."""
    inner = model.model
    h = inner.embed_tokens(tokens)
    caches = make_prompt_cache(model)
    inputs = []
    for layer, cache in zip(inner.layers, caches):
        inputs.append(h)
        h = layer(h, "causal", cache=cache)
    return inputs, caches


def attention_error(model, tokens: mx.array, bits: int, seed: int = 0, side: str = "kv", prepared=None) -> list[float]:
    """Per layer: |attn_tq - attn_dense| / |attn_dense| for the model's own queries
    over the prompt (causal), with K/V from a TurboQuant copy of the dense cache.
    `side` "k" or "v" quantises only the keys or only the values (the other stays dense);
    `prepared` is `layer_inputs(model, tokens)`, to reuse across calls."""
    inputs, caches = prepared or layer_inputs(model, tokens)
    errors = []
    for layer, h, cache in zip(model.model.layers, inputs, caches):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        B, L, _ = x.shape
        q = attn.rope(attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3))
        k, v = cache.keys[:, :, :L], cache.values[:, :, :L]
        tq = to_turboquant([cache], bits=bits, seed=seed, dense_layers=())[0].to_dense()
        tk = tq.keys if "k" in side else k
        tv = tq.values if "v" in side else v
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask="causal")
        out = mx.fast.scaled_dot_product_attention(q, tk, tv, scale=attn.scale, mask="causal")
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


class SplitCache:
    """Keys from one cache, values from another: TurboQuant on one side only (a diagnostic,
    to tell whether keys or values carry the error). Both caches see every token."""

    def __init__(self, key_cache, value_cache):
        self.key_cache, self.value_cache = key_cache, value_cache

    @property
    def offset(self):
        return self.key_cache.offset

    def make_mask(self, *args, **kwargs):
        return self.key_cache.make_mask(*args, **kwargs)

    def update_and_fetch(self, keys, values):
        k, _ = self.key_cache.update_and_fetch(keys, values)
        _, v = self.value_cache.update_and_fetch(keys, values)
        return k, v


class Bfloat16KVCache(KVCache):
    """Dense K/V rounded through bfloat16 (what a bf16 engine keeps): the floor a
    near-lossless cache sets for these figures. Held as float32, counted as bf16."""

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(keys.astype(mx.bfloat16).astype(keys.dtype),
                                        values.astype(mx.bfloat16).astype(values.dtype))


def used_nbytes(cache) -> float:
    """Bytes a layer's cache holds for its tokens (mlx-lm's caches allocate in steps of 256)."""
    if isinstance(cache, SplitCache):  # both halves hold K and V alike: half of each
        return (used_nbytes(cache.key_cache) + used_nbytes(cache.value_cache)) / 2
    if isinstance(cache, (KVCache, QuantizedKVCache)) and cache.offset:
        allocated = (cache.keys[0] if isinstance(cache, QuantizedKVCache) else cache.keys).shape[2]
        scale = 0.5 if isinstance(cache, Bfloat16KVCache) and cache.keys.dtype == mx.float32 else 1.0
        return cache.nbytes * cache.offset / allocated * scale
    return cache.nbytes  # TurboQuantKVCache: exactly its codes, norms and dense tail


def continuation_logits(model, tokens: list[int], cache, prompt: int, prefill_chunk: int = 512,
                        step: int = 64) -> mx.array:
    """Log-probs (C, vocab) over the continuation tokens[prompt:-1], teacher-forced.

    The prompt is prefilled in `prefill_chunk` chunks (the engine's default), the
    continuation in `step`-token chunks starting on a multiple of 64 (the TurboQuant
    group): each position then sees the earlier groups decoded and its own group
    dense, which is what a decode step sees (exactly, but for a group's last step)."""
    x = mx.array(tokens)[None]
    for start in range(0, prompt, prefill_chunk):
        mx.eval(model(x[:, start : min(start + prefill_chunk, prompt)], cache=cache))
    out = []
    for start in range(prompt, len(tokens) - 1, step):
        logits = model(x[:, start : min(start + step, len(tokens) - 1)], cache=cache)[0].astype(mx.float32)
        out.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        mx.eval(out[-1])
    return mx.concatenate(out, axis=0)


def compare_logprobs(ref: mx.array, test: mx.array, targets: mx.array) -> dict:
    """Greedy agreement, mean KL(ref || test), mean NLL change on the real next tokens,
    and the reference's top-1 minus top-2 log-prob margin where argmax flips (median)."""
    a, b = mx.argmax(ref, axis=-1), mx.argmax(test, axis=-1)
    kl = mx.sum(mx.exp(ref) * (ref - test), axis=-1)
    nll = lambda lp: -mx.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]  # noqa: E731
    top2 = mx.sort(ref, axis=-1)[:, -2:]
    margin = (top2[:, 1] - top2[:, 0]).tolist()
    flips = [m for m, same in zip(margin, (a == b).tolist()) if not same]
    return {"agree": mx.mean(a == b).item(), "kl": mx.mean(kl).item(),
            "dnll": mx.mean(nll(test) - nll(ref)).item(), "flip_margin": statistics.median(flips) if flips else None,
            "margin": statistics.median(margin)}


def kv_bytes_per_token(cache, tokens: int) -> float:
    return sum(used_nbytes(c) for c in cache) / tokens
