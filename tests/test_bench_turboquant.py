"""The trained-model quality measures of testsupport/tq_quality.py (bench/bench_turboquant.py reports them), on the tiny fixture."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from testsupport.tq_quality import (
    Bfloat16KVCache,
    SplitCache,
    compare_logprobs,
    continuation_logits,
    kv_bytes_per_token,
    load,
    used_nbytes,
)
from engine.tq_cache import TurboQuantKVCache
from engine.tq_config import make_tq_cache
from tests.conftest import TINY_MODEL

TOKENS = [(i * 37 + 11) % 500 for i in range(64 + 128 + 1)]  # prompt 64, continuation 128, one target past it


@pytest.fixture(scope="module")
def tiny():
    return load(TINY_MODEL)[0]


@pytest.fixture(scope="module")
def dense_ref(tiny):
    return continuation_logits(tiny, TOKENS, make_prompt_cache(tiny), 64)


def test_continuation_logits_are_log_probs_of_the_continuation(dense_ref):
    assert dense_ref.shape[0] == 128
    assert mx.allclose(mx.logsumexp(dense_ref, axis=-1), mx.zeros(128), atol=1e-4)


def test_compare_identical_logprobs_agrees_fully(dense_ref):
    r = compare_logprobs(dense_ref, dense_ref, mx.array(TOKENS[65:]))
    assert r["agree"] == 1.0 and abs(r["kl"]) < 1e-6 and r["dnll"] == 0.0 and r["flip_margin"] is None


def test_split_cache_with_dense_halves_is_dense(tiny, dense_ref):
    split = [SplitCache(KVCache(), KVCache()) for _ in tiny.layers]
    assert mx.allclose(continuation_logits(tiny, TOKENS, split, 64), dense_ref, atol=1e-4)


def test_split_cache_takes_keys_from_one_cache_and_values_from_the_other():
    k, v = mx.random.normal((1, 2, 64, 16)), mx.random.normal((1, 2, 64, 16))
    split = SplitCache(TurboQuantKVCache(2), KVCache())
    fk, fv = split.update_and_fetch(k, v)
    ref_k, _ = TurboQuantKVCache(2).update_and_fetch(k, v)
    assert mx.array_equal(fv, v) and mx.array_equal(fk, ref_k) and split.offset == 64


def test_tq_differs_from_dense_but_agrees_mostly_at_8_bits(tiny, dense_ref):
    tq = continuation_logits(tiny, TOKENS, make_tq_cache(tiny, bits=8, dense_layers=()), 64)
    r = compare_logprobs(dense_ref, tq, mx.array(TOKENS[65:]))
    assert r["kl"] > 0 and r["agree"] > 0.8


def test_used_nbytes_counts_tokens_not_allocation(tiny):
    dense, bf16, affine = KVCache(), Bfloat16KVCache(), QuantizedKVCache(32, 4)
    k = mx.random.normal((1, 2, 100, 16))
    for c in (dense, bf16):
        c.update_and_fetch(k, k)
    affine.update_and_fetch(mx.concatenate([k, k], -1), mx.concatenate([k, k], -1))
    assert dense.keys.shape[2] == 256  # mlx-lm allocates in steps of 256
    assert used_nbytes(dense) == 2 * 2 * 100 * 16 * 4
    assert used_nbytes(bf16) == used_nbytes(dense) / 2
    # 4-bit codes (16 B) + float32 scale and bias (8 B) per 32-value vector, K and V
    assert used_nbytes(affine) == 2 * 2 * 100 * (16 + 8)
    tq = TurboQuantKVCache(4)
    tq.update_and_fetch(k[:, :, :64], k[:, :, :64])
    assert used_nbytes(tq) == tq.nbytes
    assert kv_bytes_per_token([dense, dense], 100) == 2 * used_nbytes(dense) / 100
