"""The one explicit hook into mlx-lm's attention: TurboQuant caches attend in their own layout, and on
CUDA a dense batched decode step over left-padded rows goes to the kernels (engine/kernels/selector.py)
instead of MLX's masked path. Everything else reaches mlx-lm's function unchanged.
"""

from __future__ import annotations

import sys

from engine.kernels import selector
from engine.tq_cache import BatchTurboQuantKVCache, TurboQuantKVCache, _returns_unused

__all__ = ["install_attention_hook"]


def _hooked(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, (TurboQuantKVCache, BatchTurboQuantKVCache)):
            if sinks is None:
                # `keys`/`values` (the cache's unrotated K/V) go unused and, MLX being
                # lazy, are never computed.
                return cache.attend(queries, scale, mask)
            if _returns_unused(cache, keys):
                # The step returned only its dense columns (`_returns_unused`); attention
                # sinks need the original function, so build the decoded K/V after all.
                keys, values = cache._fetch(rotated=False)
        if sinks is None:
            # Left-padded dense rows on CUDA: each row's start offset instead of the mask.
            out = selector.select().dense_attend(cache, queries, keys, values, scale, mask)
            if out is not None:
                return out
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.prefixtrace_tq_hook = True
    return scaled_dot_product_attention


def install_attention_hook(model) -> int:
    """Route attention over TurboQuant caches through their own `attend`, and a dense
    batched decode step over left-padded rows on CUDA through the kernels' `dense_attend`
    (each row's start offset, no mask).

    mlx-lm's attention modules call the `scaled_dot_product_attention` their own
    module imported from `mlx_lm.models.base`; there is no per-cache dispatch
    other than its affine-quantised branch. This rebinds that name, in each model
    module `model` is built from, to a wrapper that hands TurboQuant caches to
    their own `attend` and everything else to the original unchanged. Without the
    hook a TurboQuant cache still gives the same attention (its `update_and_fetch`
    returns decoded, unrotated K/V), only slower. Idempotent; returns the number of
    modules rebound."""
    done = 0
    for name in {type(m).__module__ for _, m in model.named_modules()}:
        module = sys.modules.get(name)
        f = getattr(module, "scaled_dot_product_attention", None)
        if f is None or getattr(f, "prefixtrace_tq_hook", False):
            continue
        module.scaled_dot_product_attention = _hooked(f)
        done += 1
    return done
