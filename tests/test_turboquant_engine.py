"""The engine with TurboQuant KV: batched rows of different lengths decode as each would alone."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.tq_cache import TurboQuantKVCache
from prefixtrace.common.errors import EngineError
from tests.conftest import TINY_MODEL
from tests.test_batching import PROMPTS, submit, wait


def tq_engine(**kwargs) -> Engine:
    engine = Engine(TINY_MODEL, dtype="float32", kv_quant="turboquant", kv_bits=4, **kwargs).start()
    engine.wait_ready(60)
    return engine


def test_turboquant_rows_decode_batched_as_alone():
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)  # crosses 64-token groups while batched
    alone = []
    for prompt in PROMPTS:  # the same prefill chunks: a call sees its own tokens dense
        engine = tq_engine(prefill_step_size=64)
        seq, events = submit(engine, prompt, params)
        alone.append((seq.output_ids, wait(events)[0]))
        engine.shutdown()
    engine = tq_engine(prefill_step_size=64)
    running = [submit(engine, p, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)) for p in PROMPTS]
    together = [(seq.output_ids, wait(events)[0]) for seq, events in running]
    assert engine.stats["peak_batch"] == 3
    engine.shutdown()
    lengths = [len(seq.prompt_ids) for seq, _ in running]
    assert max(lengths) > 10 * min(lengths)
    for (ids_alone, text_alone), (ids_batched, text_batched) in zip(alone, together):
        assert len(ids_alone) == 80
        assert ids_batched == ids_alone
        assert text_batched == text_alone


def test_turboquant_engine_quantises_all_but_the_last_layer():
    engine = tq_engine()
    try:
        caches = engine.scheduler.adapt_cache(engine.prefix_cache.lookup([1, 2, 3]).cache)
        assert isinstance(caches[0], TurboQuantKVCache) and not isinstance(caches[-1], TurboQuantKVCache)
    finally:
        engine.shutdown()


def test_unknown_kv_quant_is_refused():
    with pytest.raises(EngineError):
        Engine(TINY_MODEL, kv_quant="int4")
    with pytest.raises(EngineError):
        Engine(TINY_MODEL, kv_quant="turboquant", kv_bits=9)


def test_chosen_layers_stay_dense_and_get_their_own_block_format():
    engine = tq_engine(kv_dense_layers=(0,))
    try:
        caches = engine.scheduler.adapt_cache(engine.prefix_cache.lookup([1, 2, 3]).cache)
        assert not isinstance(caches[0], TurboQuantKVCache) and isinstance(caches[-1], TurboQuantKVCache)
        seq, events = submit(engine, PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert wait(events)[1].finish_reason == "length" and len(seq.output_ids) == 8
        fmt = engine.tq.block_format
    finally:
        engine.shutdown()
    assert fmt != tq_engine_format((-1,)) and tq_engine_format(()) != tq_engine_format((-1,))


def tq_engine_format(dense_layers) -> str:
    from engine.tq_config import TQConfig

    return TQConfig(bits=4, dense_layers=dense_layers).block_format
