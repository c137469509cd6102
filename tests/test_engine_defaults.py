"""Defaults sized per device (issue 17): the prefill chunk and the memory tier's budget."""

from __future__ import annotations

import mlx.core as mx

from engine import memory
from engine.engine import Engine
from engine.prefix_cache import PrefixCache
from tests.conftest import TINY_MODEL


def test_memory_tier_default_is_a_share_of_what_the_weights_leave(monkeypatch):
    monkeypatch.setattr(memory, "machine_memory_bytes", lambda: 100 << 30)
    room = (100 << 30) * memory.DEFAULT_CEILING_FRACTION
    assert memory.default_cache_bytes(0) == int(room * memory.CACHE_FRACTION)
    assert memory.default_cache_bytes(20 << 30) == int((room - (20 << 30)) * memory.CACHE_FRACTION)
    assert memory.default_cache_bytes(200 << 30) == 0  # weights past the ceiling: no tier, never negative


def test_cpu_defaults_and_gpu_only_paths_off():
    assert mx.default_device().type == mx.DeviceType.cpu  # CI and this suite run on the CPU
    assert memory.default_prefill_chunk() == memory.PREFILL_CHUNK_CPU
    engine = Engine(TINY_MODEL, dtype="float32").start()
    try:
        engine.wait_ready(60)
        assert engine.scheduler.prefill_chunk == memory.PREFILL_CHUNK_CPU
        expected = memory.default_cache_bytes(memory.weights_bytes(engine.model))
        assert engine.cache_bytes == expected == engine.prefix_cache.memory.max_bytes > 2 << 30  # was a fixed 2 GB
        assert engine.prefix_cache._stage_copy is False  # disk copies read the blocks as they are on the CPU
    finally:
        engine.shutdown()


def test_gpu_prefill_chunk_default(monkeypatch):
    class Gpu:
        type = mx.DeviceType.gpu

    monkeypatch.setattr(memory.mx, "default_device", lambda: Gpu())
    assert memory.default_prefill_chunk() == memory.PREFILL_CHUNK_ACCELERATOR


def test_no_tier_copies_nothing(tmp_path):
    from engine.model_files import load_model

    model = load_model(TINY_MODEL, "float32")[0]
    pc = PrefixCache(model, max_bytes=0, block_size=16)
    from tests.test_prefix_cache import PROMPT, prefill

    cache = prefill(model, PROMPT)
    assert pc.commit(PROMPT, cache, lazy=True) == []
    pc.store(PROMPT, cache)
    assert len(pc) == 0 and pc.lookup(PROMPT + [1]).num_cached == 0
